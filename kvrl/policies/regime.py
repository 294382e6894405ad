"""What a KV cache does while decoding: one closed type of four regimes.

Every engine call (``generate``, ``score``) runs under exactly one of

* :class:`Full` — every key is kept;
* :class:`Evicting` — a :class:`kvrl.policies.KVPolicy` evicts tokens every ``interval``;
* :class:`Static` — a fixed death pattern masks keys (head allocation, sink + recent);
* :class:`Mixed` — RLKV's per-head mix ``α·full + (1−α)·(sink+recent)`` of two attentions.

:func:`as_regime` turns what callers pass (None, a policy, a pattern, a death tensor, a
regime) into one of these; it is the only place that asks what kind of object it was given.
Engines call it once at the top of ``generate``/``score`` and dispatch on the four classes.

Each regime's trainable state (the learned scorer's weights, RLKV's gates) travels to the
rollout workers as a ``dict[str, Tensor]``: :meth:`state` gives it, :meth:`load_state`
takes it (raising on a name or shape mismatch), and a push is verified by comparing the
:func:`checksum` of the state held with the one sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from kvrl.policies.base import KVPolicy


def checksum(state: Mapping[str, Tensor]) -> str:
    """A digest of the exact bytes of a state dict: the sender's and every receiver's must
    match after a push (the "weights equal after sync" check users ask for)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_state(regime, held: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> None:
    """Raise ValueError unless ``state`` has exactly the names and shapes of ``held``."""
    what = type(regime).__name__
    if set(state) != set(held):
        raise ValueError(
            f"a pushed {what} state holds {sorted(state)}, the regime trains {sorted(held)}: "
            "push the state of the rollout regime (algorithm.state(model).cache)"
        )
    for name, value in state.items():
        if tuple(value.shape) != tuple(held[name].shape):
            raise ValueError(
                f"pushed {what} tensor {name!r} has shape {tuple(value.shape)}, "
                f"the regime holds {tuple(held[name].shape)}"
            )


class Untrained:
    """A regime with nothing to train: ``state() == {}``, and only ``{}`` loads."""

    def state(self) -> dict[str, Tensor]:
        return {}

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        check_state(self, {}, state)


@dataclass
class Full(Untrained):
    """The full cache: every key is kept, attention is plain causal attention over it.
    Nothing is trained; rollouts carry no eviction trace."""


@dataclass
class Evicting:
    """Per-token eviction: ``policy`` scores the cached tokens of every (layer, KV head)
    and keeps ``budget`` of them (``budget_at`` the sequence's length, in ratio mode) every
    ``interval`` generated tokens (:func:`kvrl.policies.should_evict`). Rollouts carry the recorded
    :class:`kvrl.cache.EvictionTrace` (death [layers, B, kv_heads, T]); sampled evictions
    are ``Sampling.sample_evictions``. The trainable state is the policy's
    :meth:`~kvrl.policies.KVPolicy.trainable` module's state dict (ForesightKV's scorer),
    ``{}`` for the hand-written policies."""

    policy: KVPolicy

    def state(self) -> dict[str, Tensor]:
        module = self.policy.trainable()
        return {} if module is None else {k: v.detach() for k, v in module.state_dict().items()}

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        check_state(self, self.state(), state)
        module = self.policy.trainable()
        if module is not None:
            module.load_state_dict(dict(state))


@dataclass
class Static(Untrained):
    """A fixed death pattern: query q sees key k iff ``k ≤ q < death[k]`` per (layer, KV
    head), whatever was decoded; keys no later query sees can be dropped.

    ``pattern`` is an object with ``death(T) -> int [layers, kv_heads, T]`` or
    ``[layers, B, kv_heads, T]`` (:class:`kvrl.policies.HeadAllocation`,
    :class:`kvrl.policies.Window`), or an int death tensor [layers, B, kv_heads, T]
    (T ≥ longest prompt + max new tokens). Nothing is trained; rollouts carry the pattern
    as their trace.
    """

    pattern: object

    def death(self, length: int, batch: int | None = None) -> Tensor:
        """Int32 [layers, B, kv_heads, T ≥ length]: the pattern for a batch of ``batch``
        rows (a 3-D pattern is shared by all rows; None = the pattern's own batch)."""
        death = self.pattern if isinstance(self.pattern, Tensor) else self.pattern.death(length)
        if death.dim() == 3:
            death = death[:, None].expand(-1, 1 if batch is None else batch, -1, -1)
        if death.dim() != 4:
            raise ValueError(
                f"a static death pattern has shape {tuple(death.shape)}: it must be "
                "[layers, kv_heads, T] or [layers, B, kv_heads, T]"
            )
        if batch is not None and death.shape[1] != batch:
            raise ValueError(f"the death pattern holds {death.shape[1]} sequences, the batch {batch}")
        if death.shape[-1] < length:
            raise ValueError(f"death covers {death.shape[-1]} positions, decoding needs {length}")
        return death.to(torch.int32)

    def row(self, b: int, length: int) -> Tensor:
        """Int32 [layers, kv_heads, T ≥ length]: sequence b's pattern (a pattern of one row,
        or a 3-D one, is every sequence's)."""
        death = self.death(length)
        return death[:, b if death.shape[1] > 1 else 0]


@dataclass
class Mixed:
    """RLKV's mixed-gate attention over the full cache: per (layer, KV head),
    ``α·attention(causal) + (1−α)·attention(sink+recent)``, where the sink+recent branch
    lets query q see key k iff ``k < sink`` or ``q < k + recent`` (the window of
    :class:`kvrl.policies.Window`). ``gates`` α [layers, kv_heads] (1 = full attention,
    0 = sink+recent only) is the trainable state ``{"gates"}``; the attention itself is
    :func:`kvrl.kernels.reference.mixed.mixed_gate_attention`. Rollouts carry no trace."""

    gates: Tensor
    sink: int = 16
    recent: int = 64

    def __post_init__(self):
        self.gates = torch.as_tensor(self.gates, dtype=torch.float32)
        if self.gates.dim() != 2:
            raise ValueError(f"gates has shape {tuple(self.gates.shape)}: pass one gate per (layer, KV head)")
        if self.sink < 0 or self.recent < 1:
            raise ValueError(f"sink={self.sink}, recent={self.recent}: need sink ≥ 0 and recent ≥ 1")

    def state(self) -> dict[str, Tensor]:
        return {"gates": self.gates.detach()}

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        check_state(self, self.state(), state)
        self.gates = torch.as_tensor(state["gates"]).detach().clone().to(torch.float32)


Regime = Full | Evicting | Static | Mixed
REGIMES = (Full, Evicting, Static, Mixed)


def as_regime(x=None) -> Regime:
    """The regime of what an engine was passed: None → :class:`Full`; a KVPolicy →
    :class:`Evicting`; an object with ``death(T)`` or a death tensor → :class:`Static`;
    a regime → itself."""
    if x is None:
        return Full()
    if isinstance(x, REGIMES):
        return x
    if isinstance(x, KVPolicy):
        return Evicting(x)
    if isinstance(x, Tensor) or callable(getattr(x, "death", None)):
        return Static(x)
    raise TypeError(
        f"unsupported cache regime {type(x).__name__}: pass None (full cache), a KVPolicy, "
        "a static pattern with death(T) (HeadAllocation, Window) or a death tensor, or a "
        "regime (Full, Evicting, Static, Mixed)"
    )


__all__ = ["REGIMES", "Evicting", "Full", "Mixed", "Regime", "Static", "as_regime", "check_state", "checksum"]
