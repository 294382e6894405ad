"""The reference engine: batched decoding with transformers models on any device.

Contract: ``generate(prompts, sampling, death=None) -> Rollouts`` decodes a left-padded
batch with a KV cache and attention restricted by an eviction pattern ``death`` (see
``kvrl.kernels.replay``); ``death=None`` is the full cache. Every other engine is checked
against this one.

It runs its own decode loop rather than ``model.generate``: generate() refuses extra model
keyword arguments (the replay pattern) and grows a 2-D padding mask that no longer
describes a cache once keys are evicted (reference/stack.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvrl.kernels.replay import NEVER, Replay


@dataclass
class Sampling:
    """Decoding settings: greedy when temperature == 0."""

    max_new_tokens: int = 160
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Rollouts:
    """Per sequence: generated token ids (without padding or EOS), their behaviour
    logprobs, ``"stop"`` (EOS) or ``"length"``, and the decoded text."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    texts: list[str] = field(default_factory=list)


class HFEngine:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        model.set_attn_implementation("kvrl_replay")

    @property
    def device(self):
        return self.model.device

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids [B, P] and true positions [B, P] (-1 at padding)."""
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        mask = enc["attention_mask"].to(self.device)
        return enc["input_ids"].to(self.device), mask.cumsum(-1) * mask - 1

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: Sampling, death: torch.Tensor | None = None) -> Rollouts:
        """death: [layers, B, H_kv, T] (T >= longest prompt + max_new_tokens) or None."""
        ids, pos = self.encode(prompts)
        B, P = ids.shape
        cfg = self.model.config
        T = int(pos.max()) + 1 + sampling.max_new_tokens
        if death is None:
            death = torch.full((cfg.num_hidden_layers, B, cfg.num_key_value_heads, T), NEVER,
                               dtype=torch.int32, device=self.device)
        elif death.shape[-1] < T:
            raise ValueError(f"death covers {death.shape[-1]} positions, decoding needs {T}")
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        eos = self.tokenizer.eos_token_id
        key_pos = pos
        cache = DynamicCache(config=cfg)
        step_ids, step_pos = ids, pos
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        for _ in range(sampling.max_new_tokens):
            logits = self.model(input_ids=step_ids, position_ids=step_pos.clamp(min=0),
                                past_key_values=cache, use_cache=True,
                                kvrl_replay=Replay(death, key_pos)).logits[:, -1].float()
            if sampling.temperature > 0:
                logp = torch.log_softmax(logits / sampling.temperature, -1)
                nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            else:
                logp = torch.log_softmax(logits, -1)
                nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
            tokens.append(nxt)
            logps.append(logp.gather(-1, nxt[:, None]).squeeze(-1))
            done |= nxt == eos
            if bool(done.all()):
                break
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            key_pos = torch.cat([key_pos, step_pos], dim=1)
        return self._collect(torch.stack(tokens, 1), torch.stack(logps, 1))

    def _collect(self, toks: torch.Tensor, logps: torch.Tensor) -> Rollouts:
        eos = self.tokenizer.eos_token_id
        out = Rollouts([], [], [])
        for row, lp in zip(toks.tolist(), logps.tolist()):
            n = row.index(eos) if eos in row else len(row)
            out.tokens.append(row[:n])
            out.logprobs.append(lp[:n])
            out.finish_reasons.append("stop" if n < len(row) else "length")
            out.texts.append(self.tokenizer.decode(row[:n]))
        return out
