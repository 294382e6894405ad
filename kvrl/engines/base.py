"""The engine contract: what every rollout engine takes, returns and refuses.

An engine implements :class:`Engine`: ``generate(prompts, Sampling, policy=None) ->
Rollouts`` and ``push_weights(weights)``. ``policy`` is a cache regime
(:mod:`kvrl.policies.regime`: Full, Evicting, Static, Mixed) or anything
:func:`kvrl.policies.as_regime` takes. Both engines (:class:`kvrl.engines.hf.HFEngine`, the
reference, and :class:`kvrl.engines.vllm.VLLMEngine`) refuse the same requests
(:func:`check_request`), stop on the same ids (:func:`default_stop_ids`), cut sequences the
same way (:func:`finish`) and draw from the same nucleus (:func:`nucleus`); the parity tests
hold them to equal tokens and logprobs. Only the reference engine scores (``score``: the
learner's teacher-forced replay).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from kvrl.budget import budget_evicts
from kvrl.cache import EvictionTrace
from kvrl.envs.chat import Chat, encode_prompts
from kvrl.envs.check import unreadable
from kvrl.policies.regime import Evicting


@runtime_checkable
class Engine(Protocol):
    """What the rollout workers and the eval job call on an engine."""

    def generate(self, prompts: list[str], sampling: Sampling, policy=None) -> Rollouts: ...

    def push_weights(self, weights) -> dict: ...


@dataclass
class Sampling:
    """Decoding settings: greedy when temperature == 0.

    top_p: sample from the nucleus of ``softmax(logits / temperature)`` (:func:`nucleus`),
    renormalised; 1 = every token; no effect when greedy. sample_evictions: draw evictions
    (``policy.select(sample=True)``) and record their logprobs in the trace. ignore_eos:
    keep decoding after EOS (benchmarks).
    """

    max_new_tokens: int = 160
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    sample_evictions: bool = False
    ignore_eos: bool = False


@dataclass
class Rollouts:
    """Per sequence: generated token ids (without padding; a stopped sequence ends with
    its stop token, which is an action the policy took and is trained like any other),
    their behaviour logprobs (of the distribution each token was drawn from: greedy,
    ``log_softmax(logits)``; sampled, ``log_softmax(logits / temperature)`` over the top-p
    nucleus, renormalised, which is vLLM's ``processed_logprobs`` and equals what
    :meth:`HFEngine.score` recomputes only at top_p = 1), ``"stop"`` (a stop id was generated) or ``"length"`` (cut at
    ``max_new_tokens`` or at the model's length limit), the decoded text (without the stop
    token), and the prompt ids; for the batch: the eviction trace (None with the full cache)
    and timings in seconds (``decode``: the whole loop, ``evict``: scoring, selection and
    compaction)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    texts: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    traces: EvictionTrace | None = None
    timing: dict = field(default_factory=dict)

    def append(self, tokens: list[int], logprobs: list[float], finish_reason: str, text: str) -> None:
        for part, value in zip(
            (self.tokens, self.logprobs, self.finish_reasons, self.texts), (tokens, logprobs, finish_reason, text)
        ):
            part.append(value)

    def trace(self, b: int) -> EvictionTrace:
        """Sequence b's trace, trimmed to its length (:meth:`EvictionTrace.for_sequence`)."""
        if self.traces is None:
            raise ValueError("these rollouts used the full cache; they have no trace")
        return self.traces.for_sequence(b)


@dataclass
class Scores:
    """Teacher-forced scores of the generated tokens, [B, G] float32, left-aligned
    (column j = generated token j) and zero beyond each sequence (``mask``)."""

    logprobs: torch.Tensor
    losses: torch.Tensor
    entropies: torch.Tensor
    mask: torch.Tensor
    # score(..., distributions=True): the whole next-token log-distribution [B, G, V] of
    # each generated position (distillation's soft targets), zero beyond each sequence
    distributions: torch.Tensor | None = None


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` [..., V] with the tokens outside the top-p nucleus at -inf: a token is cut
    when it and every less likely token hold at most ``1 - top_p`` of the probability
    together, so the nucleus is the smallest set of most likely tokens whose mass reaches
    ``top_p``; the most likely token always stays. This is vLLM's rule
    (``apply_top_k_top_p``), so both engines draw from the same nucleus."""
    if top_p >= 1:
        return logits
    ordered, order = logits.sort(-1)  # ascending, as vLLM
    cut = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
    cut[..., -1] = False
    return logits.scatter(-1, order, ordered.masked_fill(cut, float("-inf")))


def check_request(prompt_lens: list[int], sampling: Sampling, regime, positions: int | None) -> None:
    """What both engines refuse, or warn about, before decoding: an empty batch, nothing to
    generate, a prompt the model's ``positions`` cannot hold (quadratic memory and
    meaningless positions in HF, an error deep inside vLLM), and a budget no sequence reaches."""
    if not prompt_lens:
        raise ValueError("generate() got no prompts: pass at least one")
    if sampling.max_new_tokens < 1:
        raise ValueError(
            f"max_new_tokens={sampling.max_new_tokens}: there is nothing to generate; set sampling.max_new_tokens >= 1"
        )
    longest = max(prompt_lens)
    if positions is not None and longest >= positions:
        raise ValueError(
            f"prompt {prompt_lens.index(longest)} has {longest} tokens, the model holds "
            f"{positions} positions: shorten it (or filter such tasks from the data set)"
        )
    end = longest + sampling.max_new_tokens
    # budget_ratio=1 never evicts either
    if isinstance(regime, Evicting) and not budget_evicts(regime.policy.budget_at(end), end):
        warnings.warn(
            f"kv budget {regime.policy.budget_at(end)} >= the longest sequence ({longest} prompt + "
            f"{sampling.max_new_tokens} new tokens): the policy will never evict",
            stacklevel=3,
        )


def check_prompts(tasks, tokenizer, positions: int | None, chat: Chat | None = None, chunk: int = 256) -> int:
    """Refuse a data set with a prompt the model cannot hold, or a prompt or answer its tokenizer
    cannot read (:func:`kvrl.envs.check.unreadable`), naming the row (``file:line`` of a loaded data
    set, else the task id) before a run starts rather than when a rollout reaches it.
    Returns the longest prompt's length in tokens (rendered by ``chat`` as the engines do).

    ``chunk`` rows at a time: the whole data set's tokens at once made the driver of a 200 MB
    file hold gigabytes; a lazily read data set is read ``chunk`` rows at a time."""
    longest = 0
    for start in range(0, len(tasks), chunk):
        part = tasks[start : start + chunk]
        answers = [t.answer or "" for t in part]
        answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"] if any(answers) else [[]] * len(part)
        for task, ids, answer in zip(part, encode_prompts(tokenizer, [t.prompt for t in part], chat), answer_ids):
            where = task.meta.get("source", f"task {task.id!r}")
            if positions is not None and len(ids) >= positions:
                raise ValueError(
                    f"{where}: the prompt has {len(ids)} tokens, the model "
                    f"holds {positions} positions; drop or shorten that row"
                )
            why = unreadable(tokenizer, ids, task.prompt, "prompt") or unreadable(
                tokenizer, answer, task.answer, "answer"
            )
            if why is not None:
                raise ValueError(f"{where}: {why}")
            longest = max(longest, len(ids))
    return longest


def default_stop_ids(generation_config, tokenizer) -> list[int]:
    """Every id that ends a generation: the generation config's ``eos_token_id`` (an id or a
    list: Qwen3 stops on ``<|im_end|>`` and ``<|endoftext|>``, Llama-3 instruct on three)
    and the tokenizer's EOS. Both engines stop on exactly this set unless told otherwise."""
    ids = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(
            "the model has no EOS id in its generation config or tokenizer: pass stop ids "
            "(model.stop_ids=[...]) so that generation can end"
        )
    return ids


def finish(tokenizer, row: list[int], logps: list[float], stops, limit: int) -> tuple[list[int], list[float], str, str]:
    """One sequence's (tokens, logprobs, finish reason, text) from its raw decode: it ends
    at its first stop id, kept (``"stop"``), or at ``limit`` tokens (``"length"``)."""
    row = row[:limit]
    n = next((i + 1 for i, t in enumerate(row) if t in stops), None)
    if n is None:
        return row, logps[: len(row)], "length", tokenizer.decode(row)
    return row[:n], logps[:n], "stop", tokenizer.decode(row[: n - 1])
