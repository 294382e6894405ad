"""Golden Eviction with O(T) memory (queries, keys, log-sum-exps) gives the same scores and
the same eviction traces as the dense implementation it replaced (full T×T attention maps
of every layer, reduced to a [layers, H, n_blocks, T] table), copied here as the reference."""

from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import repeat_kv

from kvrl.envs.eviction import run_policy
from kvrl.policies.base import KVPolicy, Observation
from kvrl.policies.golden import GoldenEviction, block_bounds, future_attention, record_attention

# ---- the dense reference (kvrl.policies.golden before the O(T) rewrite) ------------------------


@torch.no_grad()
def block_attention(model, ids: Tensor, prompt_len: int, interval: int, impl: str = "eager") -> tuple[Tensor, Tensor]:
    cfg = model.config
    T = ids.shape[-1]
    ends = block_bounds(T, prompt_len, interval)
    starts = torch.tensor([0, *ends[:-1]])
    previous = model.config._attn_implementation
    model.set_attn_implementation(impl)  # the only implementation that returns the weights
    try:
        out = model(input_ids=ids.view(1, T).to(model.device), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    dt = torch.promote_types(model.dtype, torch.float32)  # (was .float(): float64 kept for the 1e-12 check)
    block_of = torch.bucketize(torch.arange(T), torch.tensor(ends), right=True)  # query -> block
    counts = torch.bincount(block_of, minlength=len(ends)).clamp(min=1).to(dt)
    blocks = []
    for attn in out.attentions:  # [1, Hq, T, T]
        a = attn[0].to(dt).view(cfg.num_key_value_heads, g, T, T).mean(1)  # [H, T(q), T(k)]
        summed = torch.zeros(a.shape[0], len(ends), T, dtype=dt).index_add_(1, block_of.to(a.device), a.cpu())
        blocks.append(summed / counts[None, :, None])
    return torch.stack(blocks), starts


@dataclass(kw_only=True)
class DenseGolden(KVPolicy):
    blocks: Tensor = field(repr=False)
    starts: Tensor = field(repr=False)

    def score(self, obs: Observation) -> tuple[Tensor, None]:
        end = int(obs.query_pos[0, -1]) + 1
        future = self.blocks[obs.layer][:, self.starts >= end]  # [H, F, T]
        best = future.amax(1) if future.shape[1] else torch.zeros_like(self.blocks[obs.layer][:, 0])
        pos = obs.key_pos[0].clamp(min=0).cpu()
        return best.gather(-1, pos)[None].to(obs.keys.device), None


def exact_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention with the softmax in the model's dtype (eager's is
    float32 always), so that a float64 reference is float64 throughout."""
    k, v = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    w = query @ k.transpose(2, 3) * scaling
    if attention_mask is not None:
        w = w + attention_mask
    w = torch.softmax(w, -1)
    return (w @ v).transpose(1, 2).contiguous(), w


AttentionInterface.register("test_exact_eager", exact_eager)
AttentionMaskInterface.register("test_exact_eager", eager_mask)  # the causal mask eager gets

# ---- the tests ------------------------------------------------------------------------------------

T, PROMPT, INTERVAL = 150, 30, 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.1,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(97, (T,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_scores_equal_the_dense_blocks(model, ids, dtype, tol):
    """Every key position before every eviction boundary, every layer: the max over future
    blocks equals the dense table's. float32 against transformers' eager attention; float64
    against eager with a float64 softmax (eager's own softmax is float32)."""
    m = model.to(dtype)
    try:
        blocks, starts = block_attention(
            m, ids, PROMPT, INTERVAL, "eager" if dtype == torch.float32 else "test_exact_eager"
        )
        att = record_attention(m, ids, PROMPT, INTERVAL, chunk=37)  # chunks that straddle blocks
    finally:
        model.float()
    assert att.starts.tolist() == starts.tolist() and len(att.queries) == 2
    H = blocks.shape[1]
    for layer in range(2):
        for end in [*block_bounds(T, PROMPT, INTERVAL)[:-1], 45, T]:
            pos = torch.arange(end).expand(H, -1)
            future = blocks[layer][:, starts >= end]
            want = future.amax(1)[:, :end] if future.shape[1] else torch.zeros(H, end)
            for chunk in (1, 7, 1024):
                got = future_attention(att, layer, pos, end, chunk=chunk)
                assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
                assert (got.double() - want.double()).abs().max() <= tol, (layer, end, chunk)
    assert blocks.abs().max() > 0.05  # attention is far from uniform: the comparison means something


def test_the_forward_is_the_models(model, ids):
    """The recording attention computes what eager attention does (same next-token logits)."""
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids[None]).logits
        model.set_attn_implementation("sdpa")
        from kvrl.policies.golden import FullAttention

        record_attention(model, ids, PROMPT, INTERVAL)  # registers kvrl_golden
        model.set_attn_implementation("kvrl_golden")
        try:
            got = model(input_ids=ids[None], kvrl_golden=FullAttention(chunk=10)).logits
        finally:
            model.set_attn_implementation("sdpa")
    assert (got - eager).abs().max() < 1e-5 and (got - want).abs().max() < 1e-5


def test_same_eviction_trace_as_dense(model, ids):
    """Replayed through the chunked pass, the O(T) oracle evicts exactly what the dense one
    did, with the same scores at every step."""
    kv = dict(budget=24, interval=INTERVAL, window=4, sink=2)
    blocks, starts = block_attention(model, ids, PROMPT, INTERVAL)
    dense = DenseGolden(**kv, blocks=blocks, starts=starts)
    new = GoldenEviction(**kv, attention=record_attention(model, ids, PROMPT, INTERVAL), chunk=20)
    diffs = []

    class Both(GoldenEviction):
        def score(self, obs):
            got = new.score(obs)[0]
            diffs.append(float((got - dense.score(obs)[0]).abs().max()))
            return got, None

    both = Both(**kv, attention=new.attention)
    runs = {name: run_policy(model, ids, PROMPT, p) for name, p in [("dense", dense), ("new", both)]}
    assert len(diffs) >= 2 * 5 and max(diffs) < 1e-6
    death = {n: r.cache.trace(torch.tensor([T])).death for n, r in runs.items()}
    assert torch.equal(death["dense"], death["new"])
    assert (death["new"] < T).any()  # something was evicted
    assert torch.equal(runs["dense"].scores()[0], runs["new"].scores()[0])


def test_refuses_what_it_does_not_record(model, ids):
    with pytest.raises(ValueError, match="prompt_len"):
        record_attention(model, ids, 0, INTERVAL)
    att = record_attention(model, ids, PROMPT, INTERVAL)
    policy = GoldenEviction(budget=24, interval=INTERVAL, window=4, attention=att)
    obs = Observation(
        keys=torch.zeros(2, 2, 3, 16),
        values=None,
        queries=None,
        key_pos=torch.zeros(2, 2, 3).long(),
        query_pos=torch.zeros(2, 1).long(),
        state=None,
        layer=0,
        scaling=0.25,
    )
    with pytest.raises(ValueError, match="one trace"):
        policy.score(obs)
