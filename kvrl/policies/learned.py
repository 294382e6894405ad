"""ForesightKV's learned scorer: a per-KV-head MLP over keys, values and attention features."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvrl.kernels import window_attention
from kvrl.policies.base import KVPolicy, Observation, gumbel_noise

HIDDEN = 16  # ForesightKV's SelectionModel hidden width
DECAY = 0.9  # ForesightKV's decayed-cumsum factor
N_FEATURES = 8  # attention features per query head


class ScorerMLP(nn.Module):
    """Per-layer, per-KV-head MLP ``[k ‖ v ‖ features] → 16 → GELU → 1`` with biases.

    Weights are batched over (layer, head) and applied with einsum (ForesightKV's
    ``HeadWiseLinear``; its declared LayerNorm is unused, so there is none here).
    Initialised like ``nn.Linear``: U(±1/√fan_in) for weights and biases.

    Parameters
    ----------
    layers, kv_heads, in_features : int
    generator : torch.Generator
    """

    def __init__(self, layers: int, kv_heads: int, in_features: int, generator: torch.Generator):
        super().__init__()

        def uniform(*shape, fan_in):
            bound = 1 / math.sqrt(fan_in)
            return nn.Parameter((torch.rand(*shape, generator=generator) * 2 - 1) * bound)

        self.w1 = uniform(layers, kv_heads, in_features, HIDDEN, fan_in=in_features)
        self.b1 = uniform(layers, kv_heads, HIDDEN, fan_in=in_features)
        self.w2 = uniform(layers, kv_heads, HIDDEN, fan_in=HIDDEN)
        self.b2 = uniform(layers, kv_heads, fan_in=HIDDEN)

    def forward(self, layer: int, x: Tensor) -> Tensor:
        """x [B, H, N, F] → eviction score [B, H, N] (higher = drop)."""
        h = F.gelu(torch.einsum("bhnf,hfo->bhno", x, self.w1[layer]) + self.b1[layer][:, None])
        return torch.einsum("bhno,ho->bhn", h, self.w2[layer]) + self.b2[layer][:, None]


@dataclass(kw_only=True)
class LearnedScorer(KVPolicy):
    """ForesightKV's learned scorer (arXiv 2602.03203; RUCAIBox/ForesightKV@fdb541f).

    Features per query head g of the KV head's group, over the step's queries (the last
    ``interval``, ``observe = interval``), with attention = softmax per query head over all
    visible keys, in ForesightKV's concatenation order (8·G features):
    max, min (over the valid queries), sum, sum of the last 16, of the last 8, of the last
    32 queries, cumulative sum, 0.9-decayed cumulative sum. The last two are per-token state
    (``state_size = 2·G``: [cumsum for g=0..G−1, decayed for g=0..G−1]), NaN → 0, updated as
    ``c ← c + sum`` and ``d ← 0.9·d + sum`` before use. (ForesightKV's evaluation code
    overwrites the decayed sum with the plain one after the first step; its
    training code — and this — decays correctly.)

    The scorer :class:`ScorerMLP` maps ``[k ‖ v ‖ features]`` (2·head_dim + 8·G) to an
    *eviction* score, higher = drop, like ForesightKV's; kvrl's keep-score is its negative,
    so ``select(sample=True)`` evicts by ``softmax(eviction score)`` (Plackett–Luce over all
    candidates). ForesightKV's training action, Top-K multinomial with the exact set
    log-probability, is :meth:`act` (used by ``kvrl.algos.foresight``). Gradients flow to the
    scorer (features and K/V are inputs only).

    Parameters
    ----------
    group : int
        G, query heads per KV head.
    head_dim, layers, kv_heads : int
        Model geometry; the scorer holds one MLP per (layer, KV head).
    seed : int, default 0
        Seeds the scorer's initialisation.
    window : int, default 128
        ForesightKV always keeps the newest chunk (128 tokens at evaluation).
    interval : int, default 128
        ForesightKV's evaluation compresses every 128 tokens (256 in training).

    Attributes
    ----------
    scorer : ScorerMLP
        Built in ``__post_init__`` on the CPU in float32; load trained weights with
        ``scorer.load_state_dict`` and move it with ``scorer.to(device)``.
    """

    group: int
    head_dim: int
    layers: int
    kv_heads: int
    seed: int = 0
    window: int = 128
    scorer: ScorerMLP = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        for name in ("group", "head_dim", "layers", "kv_heads"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value}: must be ≥ 1 (read it from the model config)")
        self.state_size = 2 * self.group  # per instance: depends on the model's GQA group
        in_features = 2 * self.head_dim + N_FEATURES * self.group
        self.scorer = ScorerMLP(self.layers, self.kv_heads, in_features, torch.Generator().manual_seed(self.seed))

    def load_scorer(self, path: str | Path) -> None:
        """Load trained scorer weights from a ``scorer.safetensors``, refused naming the file when they are of
        another geometry (a scorer trained on another model) or hold a value that is not finite."""
        from safetensors.torch import load_file

        state = load_file(str(path))
        bad = [name for name, tensor in state.items() if not torch.isfinite(tensor).all()]
        if bad:  # a NaN weight scores every token NaN: the eviction would be arbitrary
            raise ValueError(
                f"the ForesightKV scorer {path} holds values that are not finite (in {', '.join(bad)}); "
                "regenerate it with the run that wrote it"
            )
        try:
            self.scorer.load_state_dict(state)
        except RuntimeError as err:  # missing keys, or shapes of another model's geometry
            found = "; ".join(line.strip() for line in str(err).splitlines()[1:4])
            raise ValueError(
                f"the ForesightKV scorer {path} does not fit this model ({self.layers} layers x "
                f"{self.kv_heads} KV heads, head_dim {self.head_dim}, group {self.group}): {found}; it "
                "was trained on another model: evaluate it with that run's model.path"
            ) from None

    def at_budget(self, budget: int) -> LearnedScorer:
        """This policy evicting down to ``budget`` tokens with the same scorer (its weights shared, not
        copied): the features and the ranking do not read the budget, only how many slots are kept does."""
        other = replace(self, budget=budget)
        other.scorer = self.scorer
        return other

    @property
    def observe(self) -> int:
        return self.interval

    def trainable(self) -> ScorerMLP:
        return self.scorer

    def score(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """Keep-scores [B, H, N] (= −eviction score) and state [B, H, N, 2G]."""
        x, state = self.features(obs)
        if x.device != self.scorer.w1.device:  # einsum's own error names neither the scorer nor the fix
            raise ValueError(
                f"the scorer is on {self.scorer.w1.device}, the cache on {x.device}: "
                f"move it with policy.scorer.to({str(x.device)!r})"
            )
        return -self.scorer(obs.layer, x.to(self.scorer.w1.dtype)).float(), state

    def features(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """The scorer's input ``[k ‖ v ‖ 8·G attention features]`` [B, H, N, 2D + 8G] and the
        updated state [B, H, N, 2G]. They do not depend on the scorer's weights, so
        ForesightKV's trainers store them once per eviction step and re-score them."""
        b, hq, w, d = obs.queries.shape
        h, n, g = obs.keys.shape[1], obs.keys.shape[2], self.group
        if hq != h * g:
            raise ValueError(f"queries have {hq} heads but kv_heads·group = {h}·{g}; check `group`")
        # Per-query-head attention: fold the group into the query axis (g-major), so the
        # "pool" over a group of one is the identity.
        attn = window_attention(
            obs.queries.reshape(b, h, g * w, d), obs.keys, obs.key_pos, obs.query_pos.repeat(1, g), obs.scaling
        ).view(b, h, g, w, n)
        qvalid = (obs.query_pos >= 0)[:, None, None, :, None]
        total = attn.sum(3)
        state = self.previous_state(obs).nan_to_num(0.0)
        cum = state[..., :g] + total.transpose(-1, -2)
        decayed = DECAY * state[..., g:] + total.transpose(-1, -2)
        low = attn.masked_fill(~qvalid, float("inf")).amin(3)
        low = low.masked_fill(low.isinf(), 0.0)  # a row without any valid query
        feats = [
            attn.amax(3),
            low,
            total,
            attn[:, :, :, -16:].sum(3),
            attn[:, :, :, -8:].sum(3),
            attn[:, :, :, -32:].sum(3),
        ]
        feats = [f.transpose(-1, -2) for f in feats]  # [B, H, N, G] each
        x = torch.cat([obs.keys.float(), obs.values.float(), *feats, cum, decayed], -1)
        return x, torch.cat([cum, decayed], -1)

    def act(
        self, key_pos: Tensor, scores: Tensor, *, sample: bool = True, generator: torch.Generator | list | None = None
    ) -> TopKDraw:
        """ForesightKV's eviction action for slots at ``key_pos`` [B, H, N] with keep-scores
        ``scores`` [B, H, N] (from :meth:`score`; differentiable).

        Among the candidates (valid, not sink/window; as :meth:`KVPolicy.select`), E = valid
        − K slots are evicted. ``sample=True`` (training) is Top-K multinomial: the pool is
        the 2E candidates with the highest eviction scores and E of them are drawn without
        replacement from ``softmax(eviction score)`` over the pool (Gumbel-top-E);
        ``logprob`` is the exact log-probability of the drawn *set*
        (:func:`topk_set_logprob`), where ForesightKV's trainer uses a log-softmax over all
        scores, which is not the probability of what it sampled. ``sample=False``
        (inference, the default of every engine) evicts the E highest — the same slots as
        ``select(obs, scores)`` — with logprob 0.
        """
        if self.budget_ratio is not None:
            raise ValueError(
                f"budget_ratio={self.budget_ratio}: ForesightKV's training action evicts to the fixed "
                "budget of its eviction MDP (EvictionObs.budget); train with budget_ratio=None (the "
                "trained scorer runs in ratio mode through select())"
            )
        valid = key_pos >= 0
        k = min(self.budget, key_pos.shape[-1])
        candidates = valid & ~self.always_kept(key_pos)
        bad = candidates & ~scores.isfinite()
        if bool(bad.any()):  # as evict()'s check_scores: NaN cannot be ranked, and +inf to evict is NaN in the softmax
            b, h, n = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"the ForesightKV scorer returned {int(bad.sum())} non-finite keep-score(s) of eviction candidates, "
                f"first {float(scores[b, h, n])} at row {b}, KV head {h}, key position {int(key_pos[b, h, n])}: "
                "they can be neither drawn nor ranked. Check the scorer's weights (a stage 2 that diverged: lower "
                "trainer.lr) and the scale of its features"
            )
        evict = -scores.float()
        n_evict = (valid.sum(-1) - k).clamp(min=0)  # [B, H]
        if sample:
            pool = topk_pool(evict, candidates, n_evict)
            gumbel = gumbel_noise(evict, key_pos, generator)
            key = torch.where(pool, evict.detach() + gumbel, float("-inf"))
        else:
            pool = candidates
            key = torch.where(candidates, evict.detach(), float("-inf"))
        rank = key.argsort(dim=-1, descending=True, stable=True).argsort(-1)
        drawn = pool & (rank < n_evict[..., None])
        priority = torch.where(drawn | ~valid, float("-inf"), torch.where(candidates, -evict.detach(), float("inf")))
        keep = priority.topk(k, dim=-1).indices
        keep = keep.gather(-1, key_pos.gather(-1, keep).argsort(dim=-1, stable=True))
        logprob = topk_set_logprob(evict, pool, drawn) if sample else evict.new_zeros(n_evict.shape)
        return TopKDraw(keep=keep, pool=pool, drawn=drawn, logprob=logprob)


@dataclass
class TopKDraw:
    """One eviction action of :meth:`LearnedScorer.act`.

    keep [B, H, K] int64 kept slots (sorted by position); pool [B, H, N] bool the top-2E
    candidates the draw came from; drawn [B, H, N] bool the evicted slots; logprob [B, H]
    the log-probability of the drawn set (0 where nothing was evicted).
    """

    keep: Tensor
    pool: Tensor
    drawn: Tensor
    logprob: Tensor


def topk_pool(evict: Tensor, candidates: Tensor, n_evict: Tensor) -> Tensor:
    """Bool [B, H, N]: the min(2E, candidates) candidates with the highest eviction scores
    ``evict`` [B, H, N], E = ``n_evict`` [B, H] (ForesightKV's top-2W candidates)."""
    key = torch.where(candidates, evict.detach().float(), float("-inf"))
    rank = key.argsort(dim=-1, descending=True, stable=True).argsort(-1)
    return candidates & (rank < 2 * n_evict[..., None])


QUADRATURE_POINTS = 256  # trapezoid nodes on log t; the tests check 1e-6 agreement with enumeration


def topk_set_logprob(evict: Tensor, pool: Tensor, drawn: Tensor) -> Tensor:
    """log P(the draw's set = ``drawn``) for E draws without replacement from
    ``softmax(evict)`` restricted to ``pool`` (Kool, van Hoof & Welling 2020, eq. 5).

    With φ_i = exp(evict_i), S the drawn set and R = pool \\ S, and the draws seen as a race
    of exponential clocks of rates φ (the first E to ring are the draw, in draw order):

        P(S) = ∫_0^∞ φ_R e^{−φ_R t} Π_{i∈S} (1 − e^{−φ_i t}) dt,   φ_R = Σ_{j∈R} φ_j,

    i.e. Kool's ∫_0^1 Π_{i∈S}(1 − u^{φ_i/φ_R}) du with u = e^{−φ_R t}. It sums the
    Plackett–Luce probabilities of all E! orders in O(E) per node. Computed in float64 in
    log space on t = e^s with the trapezoid rule over s ∈ [−10 − log φ_max, 4 − log φ_R],
    outside of which the integrand is below e^{−20}·peak (each factor 1 − e^{−φt} ≈ φt for
    small t; e^{−φ_R t} for large t). Differentiable in ``evict``. When R is empty (the
    pool is the set) P = 1; rows that draw nothing get 0.

    evict, pool, drawn: [..., N]; returns [...] float32.

    The quadrature holds [rows, E, Q] float64 terms for backward, E the largest drawn set among the rows: rows
    are taken in groups of like E (E up to each power of two), so one large set (an episode's first eviction
    down to a tight budget: ~100 where the others draw the interval's 16) does not pad every row to its size.
    """
    counts = drawn.sum(-1)
    groups = counts.clamp(min=1).double().log2().ceil()
    kinds = groups.unique().tolist()
    if counts.dim() == 0 or len(kinds) == 1:
        return _set_logprob(evict, pool, drawn)
    logp = evict.new_zeros(counts.shape, dtype=torch.float32)
    for group in kinds:
        rows = (groups == group).nonzero(as_tuple=True)
        logp = logp.index_put(rows, _set_logprob(evict[rows], pool[rows], drawn[rows]))
    return logp


def _set_logprob(evict: Tensor, pool: Tensor, drawn: Tensor) -> Tensor:
    """:func:`topk_set_logprob` over rows padded to their largest drawn set."""
    x = torch.where(pool, evict.double(), float("-inf"))
    x = x - x.amax(-1, keepdim=True).detach().clamp(min=-1e300)  # φ_max = 1 on the pool
    rest = pool & ~drawn
    # −1e4 rather than −inf keeps every gradient finite (exp(−1e4) is 0 in float64)
    log_phi_r = torch.where(rest, x, -1e4).logsumexp(-1)  # [...]
    some_rest = rest.any(-1)
    lo = torch.full_like(log_phi_r, -10.0)
    hi = torch.where(some_rest, 4.0 - log_phi_r, torch.zeros_like(log_phi_r)).detach()
    hi = torch.maximum(hi, lo + 1.0)
    nodes = torch.linspace(0, 1, QUADRATURE_POINTS, dtype=torch.float64, device=x.device)
    s = lo[..., None] + (hi - lo)[..., None] * nodes  # [..., Q]
    # only the E drawn slots enter the product: gather them first ([..., E, Q], not [..., N, Q])
    first = drawn.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., : max(1, int(drawn.sum(-1).max()))]
    in_s = drawn.gather(-1, first)
    y = (torch.where(in_s, x.gather(-1, first), 0.0)[..., :, None] + s[..., None, :]).exp()  # φ_i t (finite off S)
    # log(1 − e^{−y}), stable for small and large y
    log1m = torch.where(y < 0.693, torch.log(-torch.expm1(-y.clamp(min=1e-300))), torch.log1p(-torch.exp(-y)))
    prod = torch.where(in_s[..., None], log1m, 0.0).sum(-2)  # Σ_{i∈S} [..., Q]
    lr = torch.where(some_rest, log_phi_r, torch.zeros_like(log_phi_r))[..., None]
    integrand = lr + s - lr.exp() * s.exp() + prod  # log of φ_R e^{−φ_R t} Π(...) · t (dt = t ds)
    ds = ((hi - lo) / (QUADRATURE_POINTS - 1))[..., None]
    w = torch.full_like(s, 1.0)
    w[..., 0] = w[..., -1] = 0.5
    logp = (integrand + (w * ds).log()).logsumexp(-1)
    logp = torch.where(some_rest, logp, torch.zeros_like(logp))  # R empty: the whole pool is drawn
    return torch.where(drawn.any(-1), logp, torch.zeros_like(logp)).float()
