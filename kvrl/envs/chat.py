"""How a task's prompt reaches a chat model, and where its answer starts in the completion.

Contract:

* :class:`Chat` renders prompts through the tokenizer's chat template (one user message,
  an optional system message, Qwen3's ``enable_thinking``) when the tokenizer has one; a
  tokenizer without a template (the tiny reasoner's) gets the raw prompt. The engines
  tokenise a rendered prompt without adding special tokens: the template already wrote the
  BOS that the R1 and Llama tokenizers would add a second time.
* :func:`after_thinking` is what environments score: the text after the thinking block.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Chat:
    """Prompt rendering (``env.chat_template``, ``env.system_prompt``, ``env.thinking``).

    system: a system message ("" = none). thinking: Qwen3's ``enable_thinking`` (templates
    that do not read it ignore it; R1's always opens ``<think>``)."""

    system: str = ""
    thinking: bool = True

    @classmethod
    def of(cls, env) -> Chat | None:
        """The rendering a config's ``env`` section asks for; None for raw prompts."""
        return cls(env.system_prompt, env.thinking) if env.chat_template else None

    def render(self, tokenizer, prompt: str) -> str | None:
        """The prompt as the model's chat template writes it; None when the tokenizer has no template."""
        if not getattr(tokenizer, "chat_template", None):
            return None
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": prompt}
        ]
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=self.thinking
        )


def encode_prompts(tokenizer, prompts: list[str], chat: Chat | None) -> list[list[int]]:
    """Token ids of each prompt: rendered by ``chat`` (special tokens from the template
    only) when given and the tokenizer has a template, else tokenised as they are."""
    rendered = [chat.render(tokenizer, p) for p in prompts] if chat is not None else [None] * len(prompts)
    if prompts and all(r is not None for r in rendered):
        return [list(x) for x in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    return [list(x) for x in tokenizer(list(prompts))["input_ids"]] if prompts else []


def after_thinking(completion: str) -> str:
    """The answer part of a completion: after the last ``</think>``; empty when a ``<think>``
    block was opened and never closed (the model was cut off while thinking); all of it
    when there is no thinking block. (A template that opens ``<think>`` in the prompt, as
    R1's does, leaves only the closing tag in the completion.)"""
    if THINK_CLOSE in completion:
        return completion.rsplit(THINK_CLOSE, 1)[1]
    return "" if THINK_OPEN in completion else completion
