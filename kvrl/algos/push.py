"""What a learner sends the rollout workers after an update: :class:`Push`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from torch import Tensor

from kvrl.policies.regime import checksum


@dataclass(eq=False)
class Push(Mapping):
    """The trainable state of an algorithm (``algo.state(model)``): pushed to every rollout
    worker after each update and saved in checkpoints.

    Attributes
    ----------
    weights : dict[str, Tensor] or None
        A model state dict (full-model training): the rollout engine loads it
        (``engine.push_weights``).
    cache : dict[str, Tensor] or None
        The rollout regime's trainable state (``regime.state()``: RLKV's ``{"gates"}``, a
        learned scorer's state dict): the rollout worker loads it with
        ``regime.load_state``, and the engine runs the new regime from the next ``generate``.

    As a mapping it is the union of both parts (their names must differ), so ``push["gates"]``
    and :func:`kvrl.policies.checksum` read it like the plain state dicts it replaces.
    """

    weights: dict[str, Tensor] | None = None
    cache: dict[str, Tensor] | None = None

    def __post_init__(self):
        both = set(self.weights or ()) & set(self.cache or ())
        if both:
            raise ValueError(f"a push names {sorted(both)} both as weights and as cache state")

    def _parts(self) -> list[dict[str, Tensor]]:
        return [p for p in (self.weights, self.cache) if p]

    def __getitem__(self, name: str) -> Tensor:
        for part in self._parts():
            if name in part:
                return part[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        for part in self._parts():
            yield from part

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts())

    def digest(self) -> dict[str, str]:
        """Checksums of the parts present (``{"weights": ..., "cache": ...}``): what a rollout
        worker compares with what it holds after the push."""
        return {
            name: checksum(part)
            for name, part in (("weights", self.weights), ("cache", self.cache))
            if part is not None
        }
