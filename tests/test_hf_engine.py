"""The reference HF engine: generation under every KV policy, and exact replay of it."""

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from kvrl.cache import EvictionTrace, KVCache, generating
from kvrl.engines.base import Sampling, nucleus
from kvrl.engines.hf import HFEngine
from kvrl.envs import make
from kvrl.envs.chains import ChainSpec, make_chain_task
from kvrl.kernels.reference.replay import NEVER
from kvrl.models.tiny import build_tokenizer, load_model, tiny_config
from kvrl.policies import POLICIES, HeadAllocation, Mixed, Static, Window, make_policy

BUDGET, INTERVAL, WINDOW, SINK, NEW = 24, 4, 4, 2, 28


def prompts(n, seed=0):
    """Chains prompts of 16-40 tokens; the first has more than BUDGET tokens."""
    rng = np.random.default_rng(seed)
    spec = ChainSpec(min_statements=4, max_statements=12, min_depth=1, max_depth=3)
    out = [make_chain_task(rng, spec)["prompt"] for _ in range(n)]
    return sorted(out, key=len, reverse=True)


def policies(model):
    cfg = model.config
    common = dict(budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    out = {name: make_policy(name, cfg, **common) for name in POLICIES}
    gates = torch.rand(cfg.num_hidden_layers, cfg.num_key_value_heads, generator=torch.Generator().manual_seed(0))
    for s in (0.25, 0.75):
        out[f"heads{s}"] = HeadAllocation(
            gates=gates, sparsity=s, layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, sink=SINK, recent=8
        )
    return out


def test_unlimited_budget_equals_transformers_generate(engine):
    model, tok = engine.model, engine.tokenizer
    batch = prompts(5, seed=1)
    for name in ("gkv", "snapkv"):
        policy = make_policy(name, budget=10_000, interval=INTERVAL, window=WINDOW, sink=SINK)
        out = engine.generate(batch, Sampling(max_new_tokens=NEW), policy=policy)
        assert (out.traces.full() == NEVER).all(), "nothing evicted"
    enc = tok(batch, return_tensors="pt", padding=True)
    assert len(set(enc["attention_mask"].sum(-1).tolist())) > 1, "prompts of different lengths"
    ref = model.generate(  # the engine left the model's own attention
        **enc, max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )[:, enc["input_ids"].shape[1] :]
    eos = tok.eos_token_id  # generate() pads after EOS; the engine keeps EOS and stops there
    assert out.tokens == [row[: row.index(eos) + 1] if eos in row else row for row in ref.tolist()]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_score_replays_generate_for_every_policy(engine, temperature):
    """score() under the recorded trace reproduces the behaviour logprobs (fp32, CPU)."""
    batch = prompts(5)
    n_prompt = [len(p) for p in engine.tokenizer(batch)["input_ids"]]
    assert max(n_prompt) > BUDGET and len(set(n_prompt)) > 2
    worst = {}
    for name, policy in policies(engine.model).items():
        out = engine.generate(batch, Sampling(max_new_tokens=NEW, temperature=temperature, seed=3), policy=policy)
        with torch.no_grad():
            scores = engine.score(out, trace=out.traces, temperature=max(temperature, 1.0))
            full = engine.score(out, temperature=max(temperature, 1.0))
        behaviour = torch.zeros_like(scores.logprobs)
        for b, lp in enumerate(out.logprobs):
            behaviour[b, : len(lp)] = torch.tensor(lp)
        assert scores.mask.sum() == sum(len(t) for t in out.tokens) > 0
        worst[name] = float((scores.logprobs - behaviour).abs().max())
        # the eviction really bites: full attention scores the same tokens differently
        assert (full.logprobs - behaviour).abs().max() > 1e-3, name
        assert torch.equal(scores.losses, -scores.logprobs) and (scores.entropies[scores.mask] > 0).all()
        if isinstance(policy, HeadAllocation):  # a static pattern replays without its trace too
            with torch.no_grad():
                static = engine.score(out, policy=policy, temperature=max(temperature, 1.0))
            torch.testing.assert_close(static.logprobs, scores.logprobs, atol=1e-6, rtol=0)
    assert max(worst.values()) < 1e-5, worst


@pytest.mark.parametrize("name", ["h2o", "snapkv", "rkv", "gkv", "learned"])
def test_replay_is_exact_in_float64(name):
    """The recorded trace replays decoding exactly, on the contexts where float32 does not
    show it: the shipped reasoner sampled at temperature 2 under tiny_gkv_sparse's budget.
    There float32 decoding and replay differ by up to ~1e-4 on rare tokens, each being
    that far from the exact value (benchmarks/micro/replay_precision.py); in float64 they agree to
    float64 rounding, compared in float64 (the engine keeps a float64 model's logprobs and
    norms in float64: test_float64_norms_stay_float64)."""
    model, tok = load_model("tiny")
    engine = HFEngine(model.double().eval(), tok)
    env = make("kvrl/counts-v0")
    env.reset(seed=5)
    policy = make_policy(name, model.config, budget=76, interval=16, window=8, sink=4)
    out = engine.generate(
        [t.prompt for t in env.tasks(24)], Sampling(max_new_tokens=64, temperature=2.0, seed=1), policy=policy
    )
    death = out.traces.full()
    assert (death < NEVER).any()  # it evicted
    late = EvictionTrace.from_death(torch.where(death < NEVER, death + 1, death), out.traces.lengths)
    diffs = []
    for trace in (out.traces, late):
        with torch.no_grad():
            scores = engine.score(out, trace=trace, temperature=2.0)
        assert scores.logprobs.dtype == torch.float64
        diffs.append(
            max(
                float((scores.logprobs[b, : len(lp)] - torch.tensor(lp, dtype=torch.float64)).abs().max())
                for b, lp in enumerate(out.logprobs)
            )
        )
    print(f"float64 replay: {diffs[0]:.1e}")
    # float64 rounding of two computation orders; float32 noise (≥ 1e-8 at these logprobs) fails it
    assert diffs[0] <= 1e-12, diffs
    assert diffs[1] > 1e-5, diffs  # a replay that evicts one step late is caught


def test_float64_norms_stay_float64():
    """transformers' RMSNorm rounds its input to float32 inside a float64 model. A relative
    input change d = 1e-10, far below float32's resolution (6e-8), then moves most values not
    at all and a few by a whole float32 step, which the layers amplify: the logprobs move by
    2.4e-6 (measured on the tiny reasoner), not by ~d. These steps are the float64 replay
    gaps seen before (up to 7.6e-8: decoding and replay differ by ~1e-16 before the norms). With
    the norms kept in float64, as HFEngine does for a float64 model, the change propagates in
    proportion (measured 1.0e-9 = 10 d). Same weights, first without the patch."""
    from kvrl.engines.vllm.patches import keep_norms_in_float64

    model, _ = load_model("tiny")
    model = model.double().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    d = 1e-10

    def response(m):
        with torch.no_grad():
            e = m.get_input_embeddings()(ids)
            a, b = (torch.log_softmax(m(inputs_embeds=x).logits, -1) for x in (e, e * (1 + d)))
        return float((a - b).abs().max())

    rounded = response(model)
    assert keep_norms_in_float64(model) == 2 * model.config.num_hidden_layers + 1  # 2 per layer + the final
    kept = response(model)
    print(f"logprob change from a {d:g} input change: {rounded:.1e} (float32 norms), {kept:.1e} (float64 norms)")
    # margins of ~20x (rounded) and 10x (kept) on the measured values; the two differ by 2,400x
    assert rounded > 1000 * d  # whole float32 steps: the old norms
    assert kept < 100 * d  # proportional: float64 throughout
    assert keep_norms_in_float64(model.float()) == 0  # float32 and bf16 models are left alone


def test_sampled_evictions_record_their_logprobs(engine):
    batch = prompts(4, seed=2)
    policy = policies(engine.model)["learned"]
    out = engine.generate(batch, Sampling(max_new_tokens=NEW, temperature=1.0, sample_evictions=True), policy=policy)
    lp = out.traces.logprob
    L, H = engine.model.config.num_hidden_layers, engine.model.config.num_key_value_heads
    assert lp is not None and lp.shape[1:] == (L, len(batch), H) and lp.shape[0] >= 3
    assert (lp <= 0).all() and (lp < 0).any()
    with torch.no_grad():
        scores = engine.score(out, trace=out.traces)
    for b, row in enumerate(out.logprobs):
        torch.testing.assert_close(scores.logprobs[b, : len(row)], torch.tensor(row), atol=1e-5, rtol=0)
    # a different eviction seed draws different actions
    other = engine.generate(
        batch, Sampling(max_new_tokens=NEW, temperature=1.0, seed=5, sample_evictions=True), policy=policy
    )
    assert not torch.equal(other.traces.death, out.traces.death)


def assert_rows_match_alone(engine, batch, policy):
    """Per row, the batch gives the tokens, logprobs and trace of decoding that row alone."""
    out = engine.generate(batch, Sampling(max_new_tokens=NEW), policy=policy)
    for b, prompt in enumerate(batch):
        alone = engine.generate([prompt], Sampling(max_new_tokens=NEW), policy=policy)
        assert alone.tokens[0] == out.tokens[b]
        np.testing.assert_allclose(alone.logprobs[0], out.logprobs[b], atol=1e-5)
        assert torch.equal(alone.trace(0).death, out.trace(b).death), b


@pytest.mark.parametrize("name", list(POLICIES))
def test_batch_rows_are_independent(engine, name):
    """Per row, the batch gives the tokens and trace of decoding that row alone."""
    batch = prompts(4, seed=4)
    policy = policies(engine.model)[name]
    assert_rows_match_alone(engine, batch, policy)


def test_dynamic_policy_needs_its_trace(engine):
    with pytest.raises(ValueError, match="trace"):
        engine.score([[1, 5, 6]], [2], policy=make_policy("h2o", budget=16, window=4))


@pytest.mark.parametrize("name", ["h2o", "gkv", "learned"])
def test_row_within_budget_keeps_its_state_in_a_batch(engine, name):
    """The batch evicts when its longest row is over budget; a shorter row within budget
    must not be scored (its state would change), or it diverges from decoding alone."""
    rng = np.random.default_rng(5)
    words = [w for w in engine.tokenizer.get_vocab() if not w.startswith("<")]
    batch = [" ".join(rng.choice(words, n - 1)) for n in (22, 19)]  # + BOS: 22 and 19 tokens
    policy = policies(engine.model)[name]
    assert_rows_match_alone(engine, batch, policy)


def max_lp_diff(a, b):
    return max((max(abs(x - y) for x, y in zip(la, lb)) if la else 0.0) for la, lb in zip(a, b))


def test_generate_under_mixed_gates(engine):
    """Mixed (RLKV's mixed-gate attention) in generate(): all gates 1 is the full cache, all
    gates 0 the sink+recent window of Static(Window) with the same sink/recent, and with
    gates in between score(policy=Mixed) reproduces the behaviour logprobs."""
    batch = prompts(5)
    cfg = engine.model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    sampling = Sampling(max_new_tokens=NEW)
    full = engine.generate(batch, sampling)
    ones = engine.generate(batch, sampling, policy=Mixed(torch.ones(L, H), sink=SINK, recent=8))
    assert ones.tokens == full.tokens and ones.traces is None
    assert max_lp_diff(ones.logprobs, full.logprobs) < 1e-5
    window = engine.generate(batch, sampling, policy=Static(Window(sink=SINK, recent=8, layers=L, kv_heads=H)))
    zeros = engine.generate(batch, sampling, policy=Mixed(torch.zeros(L, H), sink=SINK, recent=8))
    assert zeros.tokens == window.tokens and max_lp_diff(zeros.logprobs, window.logprobs) < 1e-5
    assert zeros.tokens != full.tokens or max_lp_diff(zeros.logprobs, full.logprobs) > 1e-3  # the window bites
    mixed = Mixed(torch.rand(L, H, generator=torch.Generator().manual_seed(1)) * 0.8 + 0.1, sink=SINK, recent=8)
    out = engine.generate(batch, Sampling(max_new_tokens=NEW, temperature=1.0, seed=2), policy=mixed)
    with torch.no_grad():
        scores = engine.score(out, policy=mixed)
    for b, row in enumerate(out.logprobs):
        torch.testing.assert_close(scores.logprobs[b, : len(row)], torch.tensor(row), atol=1e-5, rtol=0)


def test_requests_the_engine_cannot_serve_are_refused(engine):
    """An empty batch, nothing to generate and a prompt beyond the model's positions fail
    before decoding, naming the fix; a budget no sequence reaches warns."""
    limit = engine.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="no prompts"):
        engine.generate([], Sampling(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_new_tokens=0.*sampling.max_new_tokens >= 1"):
        engine.generate(["3 ; 4 ; ?"], Sampling(max_new_tokens=0))
    with pytest.raises(ValueError, match=f"prompt 1 has {limit + 1} tokens, the model holds {limit} positions"):
        engine.generate(["3 ; ?", " ".join(["3"] * limit)], Sampling(max_new_tokens=4))
    with pytest.warns(UserWarning, match="will never evict"):
        engine.generate(
            ["3 ; 4 ; ?"],
            Sampling(max_new_tokens=4),
            policy=make_policy("streaming", budget=500, interval=4, window=2, sink=1),
        )


def test_prompts_given_as_token_ids_decode_as_their_texts(engine):
    """A trainer that tokenised its prompts itself (TRL) passes ids: the same rollouts and
    trace as from the texts; a batch mixing texts and ids is refused."""
    texts = prompts(3)
    policy = make_policy("gkv", engine.model.config, budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    sampling = Sampling(max_new_tokens=NEW, temperature=1.0, seed=3)
    a = engine.generate(texts, sampling, policy=policy)
    b = engine.generate(engine.encode(texts), sampling, policy=policy)
    assert (a.tokens, a.logprobs, a.prompt_ids) == (b.tokens, b.logprobs, b.prompt_ids)
    assert torch.equal(a.traces.death, b.traces.death)
    with pytest.raises(TypeError, match="mix texts and token ids"):
        engine.generate([texts[0], engine.encode(texts[1:2])[0]], sampling)


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    """Probabilities 0.5, 0.2, 0.15, 0.1, 0.05 (shuffled): at top_p 0.8 the nucleus is the
    first three (0.85 >= 0.8; the first two hold 0.7), renormalised to 0.5/0.85, 0.2/0.85,
    0.15/0.85; at 0.4 the most likely alone; at 1 all five, unchanged."""
    probs = torch.tensor([0.1, 0.5, 0.05, 0.15, 0.2])
    logits = probs.log() + 3.0  # a shift changes no probability
    kept = torch.softmax(nucleus(logits, 0.8), -1)
    torch.testing.assert_close(kept, torch.tensor([0.0, 0.5, 0.0, 0.15, 0.2]) / 0.85)
    assert torch.equal(torch.softmax(nucleus(logits, 0.4), -1), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(nucleus(logits, 1.0), logits)
    # a flat row of 4 keeps 3 at 0.7 (0.75 >= 0.7 > 0.5); rows are cut independently
    flat = torch.zeros(2, 4)
    assert (torch.softmax(nucleus(flat, 0.7), -1) > 0).sum(-1).tolist() == [3, 3]
    both = nucleus(torch.stack([logits, logits.flip(0)]), 0.8)
    assert torch.equal(both[1], nucleus(logits.flip(0), 0.8))


@pytest.fixture(scope="module")
def reasoner():
    """The shipped tiny reasoner, its counts prompts (of different lengths: left padding) and
    the SnapKV policy they overflow."""
    model, tok = load_model("tiny")
    env = make("kvrl/counts-v0", n_digits=24)
    env.reset(seed=0)
    batch = sorted((t.prompt for t in env.tasks(4)), key=len, reverse=True)
    policy = make_policy("snapkv", model.config, budget=48, interval=8, window=8, sink=4)
    return model.eval(), tok, batch, policy


def generate_with_transformers(model, tok, batch, policy, new, **kwargs):
    """model.generate under ``policy`` through :func:`kvrl.cache.generating`: (generated ids
    [B, G] with generate's padding after EOS, the output, the cache)."""
    enc = tok(batch, return_tensors="pt", padding=True)
    P = enc["input_ids"].shape[1]
    cache = KVCache.for_model(model, len(batch), P + new, policy)
    with generating(model):
        out = model.generate(
            **enc,
            past_key_values=cache,
            max_new_tokens=new,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences[:, P:], out, cache, enc["attention_mask"].sum(-1)


def test_model_generate_under_a_policy_gives_the_engines_tokens_and_trace(reasoner):
    model, tok, batch, policy = reasoner
    engine = HFEngine(model, tok)
    ref = engine.generate(batch, Sampling(max_new_tokens=40), policy=policy)
    attention = model.config._attn_implementation
    gen, _, cache, prompt_lens = generate_with_transformers(model, tok, batch, policy, 40, do_sample=False)
    eos = tok.eos_token_id  # generate() pads after EOS; the engine keeps EOS and stops there
    assert [row[: row.index(eos) + 1] if eos in row else row for row in gen.tolist()] == ref.tokens
    assert model.config._attn_implementation == attention, "generating() restores the attention"
    with generating(model):  # an engine that drives the cache itself is left alone
        assert engine.generate(batch, Sampling(max_new_tokens=40), policy=policy).tokens == ref.tokens
    lengths = prompt_lens + torch.tensor([len(t) for t in ref.tokens])
    trace = cache.trace(lengths)
    assert (ref.traces.full() != NEVER).any(), "the policy evicted"
    for b in range(len(batch)):  # rows stop at different steps; the engine stops when all have
        n = int(lengths[b])
        assert torch.equal(trace.for_sequence(b).death, ref.traces.for_sequence(b).death), b
        assert n == len(ref.prompt_ids[b]) + len(ref.tokens[b])


def test_sampled_model_generate_is_replayed_by_its_trace(reasoner):
    """Sampling under model.generate: the recorded trace, replayed by the learner's score(),
    gives the logprobs of the logits generate sampled from."""
    model, tok, batch, policy = reasoner
    torch.manual_seed(0)
    gen, out, cache, prompt_lens = generate_with_transformers(
        model, tok, batch, policy, 40, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, output_logits=True
    )
    n_gen = torch.tensor(
        [row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row) for row in gen.tolist()]
    )
    trace = cache.trace(prompt_lens + n_gen)
    assert (trace.full() != NEVER).any(), "the policy evicted"
    enc = tok(batch)["input_ids"]
    sequences = [p + row[:n] for p, row, n in zip(enc, gen.tolist(), n_gen.tolist())]
    with torch.no_grad():
        scores = HFEngine(model, tok).score(sequences, [len(p) for p in enc], trace=trace)
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, gen[..., None]).squeeze(-1)
    mask = torch.arange(gen.shape[1]) < n_gen[:, None]
    assert torch.allclose(scores.logprobs[mask], logp[:, : scores.logprobs.shape[1]][mask], atol=1e-4)


def test_a_kvcache_forward_without_positions_names_the_fix(reasoner):
    model, tok, batch, policy = reasoner
    ids = tok(batch[:1], return_tensors="pt")["input_ids"]
    cache = KVCache.for_model(model, 1, ids.shape[1] + 4, policy)
    attention = model.config._attn_implementation
    model.set_attn_implementation("kvrl_evict")
    try:
        with pytest.raises(ValueError, match="generating"):
            model(input_ids=ids, past_key_values=cache, kvrl_cache=cache)
    finally:
        model.set_attn_implementation(attention)


def fresh_tiny():
    """A random tiny model of its own (the module's engine is shared) and its tokenizer."""
    torch.manual_seed(0)
    tok = build_tokenizer()
    return LlamaForCausalLM(tiny_config(tok)).eval(), tok


def test_the_engine_leaves_the_model_as_it_found_it():
    """After generate and score (no grad, and under grad without checkpointing: nothing
    recomputes later), model(...) and model.generate(...) give what they gave before."""
    model, tok = fresh_tiny()
    attention = model.config._attn_implementation
    batch = prompts(3)
    enc = tok(batch, return_tensors="pt", padding=True)

    @torch.no_grad()
    def plain():
        logits = model(**enc).logits
        return logits, model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)

    before = plain()
    engine = HFEngine(model, tok)
    policy = make_policy("snapkv", budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    out = engine.generate(batch, Sampling(max_new_tokens=8), policy=policy)
    assert (out.traces.full() < NEVER).any(), "the policy evicted"
    with torch.no_grad():
        engine.score(out, trace=out.traces)
    engine.score(out, trace=out.traces, distributions=True).logprobs.sum().backward()
    assert model.config._attn_implementation == attention
    after = plain()
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


def test_checkpointed_training_scores_replay_in_backward_and_then_name_the_way_back():
    """score() under grad on a gradient-checkpointed model: backward recomputes every layer
    under the replayed trace (the gradient equals the plain one), so the model stays on
    "kvrl_replay"; a plain forward then names the engine and how to set the attention back."""
    model, tok = fresh_tiny()
    attention = model.config._attn_implementation
    engine = HFEngine(model, tok)
    batch = prompts(3)
    policy = make_policy("snapkv", budget=BUDGET, interval=INTERVAL, window=WINDOW, sink=SINK)
    out = engine.generate(batch, Sampling(max_new_tokens=8), policy=policy)
    grads = []
    model.train()
    for checkpointed in (False, True):
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        engine.score(out, trace=out.traces).logprobs.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0])
    enc = tok(batch, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match=r"HFEngine\.score.*model\.set_attn_implementation\('sdpa'\)"):
        model(**enc)
    model.set_attn_implementation(attention)
    model(**enc)
