"""One eviction step, for both engines: score, select, and which cached tokens die.

The HF cache (:class:`kvrl.cache.KVCache`) and the vLLM worker
(:mod:`kvrl.engines.vllm.evicting`) both call :func:`evict` on an :class:`Observation` of the
rows they evict (batch rows for HF, layer·request rows for vLLM) and act on the
:class:`Eviction` it returns: compact to ``keep``, record a death for each of ``dead``. Engine
parity then rests on one copy of this bookkeeping. What differs between the engines stays
theirs: where K/V live, how the rows are gathered, when the schedule fires. A policy's
non-finite scores stop both engines here, named (:func:`check_scores`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvrl.policies.base import KVPolicy, Observation


@dataclass
class Eviction:
    """What one eviction step does to rows of N slots.

    keep : Tensor [R, H, K] int64
        Slots kept; row r keeps ``keep[r, :, :count[r]]``.
    count : Tensor [R] int64 or None
        Slots each row keeps; None when every row keeps all K (below K only in ratio mode).
    mine : Tensor [R, H, K] bool or None
        ``keep``'s columns a row really keeps (None: all); the rest become padding.
    dead : tuple of three Tensors [E] int64
        (row, head, slot) of every valid slot (position ≥ 0) that is not kept.
    state : Tensor [R, H, N, S] or None
        The policy's per-slot state after scoring (before compaction).
    logprob : Tensor [R, H] or None
        Sampled evictions only: the draw's log-probability.
    """

    keep: Tensor
    count: Tensor | None
    mine: Tensor | None
    dead: tuple[Tensor, Tensor, Tensor]
    state: Tensor | None = None
    logprob: Tensor | None = None

    @classmethod
    def of(
        cls,
        keep: Tensor,
        count: Tensor | None,
        key_pos: Tensor,
        state: Tensor | None = None,
        logprob: Tensor | None = None,
    ) -> Eviction:
        """The eviction that keeps ``keep`` (``count`` per row, None = all) of slots at
        positions ``key_pos`` [R, H, N] (−1 = empty): also an action chosen outside a policy
        (ForesightKV's MDP, Golden Eviction)."""
        if count is not None and bool((count == keep.shape[-1]).all()):
            count = None  # the common case spares itself the masks
        mine = (
            None
            if count is None
            else (torch.arange(keep.shape[-1], device=keep.device) < count.to(keep.device)[:, None, None]).expand_as(
                keep
            )
        )
        kept = torch.zeros(key_pos.shape, dtype=torch.bool, device=keep.device)
        kept.scatter_(-1, keep, True if mine is None else mine)
        dead = (~kept & (key_pos >= 0)).nonzero(as_tuple=True)
        return cls(keep, count, mine, dead, state, logprob)


def check_scores(policy: KVPolicy, obs: Observation, scores: Tensor, layers: list[int] | None = None) -> None:
    """Raise ValueError, naming the policy, the layer, the row, the KV head and the positions,
    if a candidate's keep-score (a valid slot outside the sink and window, the slots
    :meth:`KVPolicy.select` ranks) is NaN or ±inf. ``layers``: the layers of ``obs``'s rows,
    in equal consecutive blocks (default ``[obs.layer]``).

    ``torch.topk`` ranks NaN and ties of ±inf anywhere, so such scores would evict arbitrary
    tokens and the run would go on, its accuracy and rewards those of a broken policy."""
    bad = ~scores.isfinite() & (obs.key_pos >= 0) & ~policy.always_kept(obs.key_pos)
    if not bool(bad.any()):  # the one device sync of the check, once per eviction call
        return
    r, h, n = (int(i) for i in bad.nonzero()[0])
    layers = layers or [obs.layer]
    per = obs.key_pos.shape[0] // len(layers)
    raise ValueError(
        f"{type(policy).__name__}.score() returned {int(bad.sum())} non-finite keep-score(s) of cached tokens "
        f"that select() ranks, first {float(scores[r, h, n])} at layer {layers[r // per]}, batch row {r % per}, "
        f"KV head {h}, key position {int(obs.key_pos[r, h, n])}, in the eviction after position "
        f"{int(obs.key_pos[r].max())}: NaN or ±inf cannot be ranked, so the cache would keep arbitrary tokens. "
        "Make score() return finite values (a learned scorer: check its weights and the scale of its outputs)"
    )


def evict(
    policy: KVPolicy,
    obs: Observation,
    *,
    sample: bool = False,
    generator: torch.Generator | list | None = None,
    score_rows: int = 0,
    layers: list[int] | None = None,
) -> Eviction:
    """Score every row of ``obs``, select what each keeps (drawn when ``sample``), and find
    what dies. ``score_rows`` > 0 scores that many rows at a time (rows are independent, so
    the scores are the same; the vLLM worker keeps each group's temporaries in the CPU's
    caches). Non-finite scores stop here (:func:`check_scores`; ``layers`` as there)."""
    if score_rows <= 0 or score_rows >= obs.key_pos.shape[0]:
        scores, state = policy.score(obs)
    else:
        fields = (obs.keys, obs.values, obs.queries, obs.key_pos, obs.query_pos, obs.state)
        parts = [
            policy.score(
                Observation(*(x if x is None else x[i : i + score_rows] for x in fields), obs.layer, obs.scaling)
            )
            for i in range(0, obs.key_pos.shape[0], score_rows)
        ]
        scores = torch.cat([p[0] for p in parts])
        state = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
    check_scores(policy, obs, scores, layers)
    sel = policy.select(obs, scores, sample=sample, generator=generator)
    return Eviction.of(sel.keep, sel.count, obs.key_pos, state, sel.logprob)
