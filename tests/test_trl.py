"""kvrl inside TRL (kvrl/integrations/trl.py): GRPOTrainer under a kvrl eviction policy.

* the loss's logprob forward replays the rollouts' traces: it matches the sampling logprobs
  (float32: to a few ulps; float64: to rounding, up to TRL's float32 LM head) where the
  full cache does not;
* rows keep their traces through TRL's shuffle and split (a wrong pairing shows);
* gradients are the same with gradient checkpointing on and off;
* train() runs steps on the num_iterations=2 path (old logprobs scored at generation);
* what cannot be replayed is refused with the fix; a forward that does not replay is an error;
* the private methods it wraps still have the signatures it was written against.
"""

import configparser
import os
import types
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import LlamaForCausalLM, LlavaConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from kvrl.envs import make  # noqa: E402
from kvrl.integrations.trl import (
    MISMATCH,
    TRL_VERSION,
    KVGRPOTrainer,
    TRLChanged,
    _Replaying,  # noqa: E402
    build_policy,
    check_trl_surface,
    refusals,
)
from kvrl.models.tiny import build_tokenizer, tiny_config  # noqa: E402
from kvrl.policies import GKV  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# counts prompts of 18 tokens + 24 generated; budget 16, evicting every 4 tokens, keeps ~70 % of the pairs
KV = dict(kv_policy="gkv", kv_budget=16, kv_interval=4, kv_window=4, kv_sink=2)
TOK = build_tokenizer()
ENV = make("kvrl/counts-v0", n_digits=8)
ENV.reset(seed=0)
TASKS = ENV.tasks(4)


def reward(completions, **_):
    """Any reward that differs within a group, so that the loss has a gradient."""
    return [float(len(c) % 3) for c in completions]


def trainer(dtype=torch.float32, *, model=None, kv=KV, args: dict | None = None, **overrides) -> KVGRPOTrainer:
    """A KVGRPOTrainer over a random-init tiny reasoner (or ``model``) under ``kv``: 4 samples
    per step, 24 new tokens. ``args``: GRPOConfig's arguments, else these tests' with ``overrides``."""
    torch.manual_seed(0)
    if model is None:
        cfg = tiny_config(TOK)
        cfg.initializer_range = 0.05  # peakier attention than the default: evictions change the logprobs
        model = LlamaForCausalLM(cfg).to(dtype)
    settings = args or (
        dict(
            output_dir=str(ROOT / "outputs" / "test_trl"),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=24,
            temperature=1.0,
            learning_rate=1e-2,
            max_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=0,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            gradient_checkpointing=False,
            shuffle_dataset=False,
        )
        | overrides
    )
    data = Dataset.from_list([{"prompt": t.prompt} for t in TASKS])
    return KVGRPOTrainer(
        model=model, reward_funcs=reward, args=GRPOConfig(**settings), train_dataset=data, processing_class=TOK, **kv
    )


def batch(tr: KVGRPOTrainer, prompts: int = 1) -> list[dict]:
    """A generation batch as TRL's sampler yields it: each prompt num_generations times."""
    return [{"prompt": t.prompt} for t in TASKS[:prompts] for _ in range(tr.num_generations)]


def logprobs(tr: KVGRPOTrainer, inputs: dict, death=None) -> torch.Tensor:
    """The loss's logprob forward over ``inputs`` (replaying ``death``, default the batch's own)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    tr._kv_rows = inputs["kvrl_death"] if death is None else death
    try:
        with torch.no_grad():
            return tr._get_per_token_logps_and_entropies(tr.model, ids, mask, inputs["completion_ids"].shape[1])[0]
    finally:
        tr._kv_rows = None


@pytest.fixture(scope="module")
def fp32():
    """A trainer whose generation batch (2 prompts x 4) is split in 2 (gradient accumulation 2)."""
    tr = trainer(gradient_accumulation_steps=2)
    tr.model.train()
    splits = [tr._prepare_inputs(batch(tr, 2))]
    tr._step = 1  # the next micro-step takes the second split of the same generation
    splits.append(tr._prepare_inputs(batch(tr, 2)))
    tr._step = 0
    return tr, splits


def test_loss_forward_replays_the_sampling_logprobs_in_float32(fp32):
    tr, splits = fp32
    for inputs in splits:
        on = inputs["completion_mask"].bool()
        sampled = inputs["kvrl_logprobs"]
        delta = (logprobs(tr, inputs) - sampled).abs()[on]
        # float32: a few ulps of each logprob (|logp| ~ 4 here, where one ulp is 4.8e-7)
        assert delta.mean() <= 1e-6
        assert (delta <= 1e-6 + 8 * torch.finfo(torch.float32).eps * sampled.abs()[on]).all(), delta.max()
        full = inputs["kvrl_death"].new_full(inputs["kvrl_death"].shape, torch.iinfo(inputs["kvrl_death"].dtype).max)
        assert (logprobs(tr, inputs, full) - sampled).abs()[on].max() > 1e-3  # the full cache is another policy
    assert tr._metrics["train"]["kv/retention"][-1] < 0.9  # the policy evicted


def test_rows_keep_their_traces_through_shuffle_and_split(fp32):
    """The two splits of one generation hold its 8 rows, shuffled; each row's trace came
    with it (the replay matches), and the same traces dealt to the wrong rows do not."""
    tr, splits = fp32
    assert [s["kvrl_death"].shape[0] for s in splits] == [4, 4]
    rows = torch.cat([torch.cat([s["prompt_ids"], s["completion_ids"]], 1) for s in splits])
    assert len({tuple(r.tolist()) for r in rows}) > 1
    for inputs in splits:
        on = inputs["completion_mask"].bool()
        wrong = inputs["kvrl_death"].roll(1, 0)
        assert not torch.equal(wrong, inputs["kvrl_death"])
        assert (logprobs(tr, inputs, wrong) - inputs["kvrl_logprobs"]).abs()[on].max() > 1e-3


def test_gradients_are_equal_with_gradient_checkpointing_on_and_off(fp32):
    """Checkpointed layers recompute their attention in backward: it replays the same trace."""
    tr, splits = fp32
    tr.current_gradient_accumulation_steps = 1  # set by train(); compute_loss reads it
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            tr.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        tr.model.zero_grad()
        tr.compute_loss(tr.model, splits[0]).backward()
        grads.append([p.grad.clone() for p in tr.model.parameters() if p.grad is not None])
    tr.model.gradient_checkpointing_disable()
    tr.model.zero_grad()
    assert tr.model.model.gradient_checkpointing is False
    assert len(grads[0]) == len(grads[1]) > 0 and sum(float(g.abs().sum()) for g in grads[0]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    mismatch = tr._metrics["train"][f"{MISMATCH}/max"][-2:]
    assert len(mismatch) == 2 and max(mismatch) < 1e-5  # compute_loss measured it, on-policy


def test_loss_forward_replays_exactly_in_float64():
    """In float64 the replayed forward gives the sampling logprobs to rounding: through the
    decoder as the loss runs it (the same hook), with the softmax in float64. TRL's fused LM
    head keeps its softmax statistics in float32 (trl/kernels/chunked_logprob.py), so the
    loss's own logprobs are exact to float32 rounding only."""
    tr = trainer(torch.float64)
    tr.model.train()
    inputs = tr._prepare_inputs(batch(tr))
    on, C = inputs["completion_mask"].bool(), inputs["completion_ids"].shape[1]
    sampled = inputs["kvrl_logprobs"]
    assert sampled.dtype == torch.float64  # TRL's sampling_per_token_logps is float32
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    tr._kv_active = _Replaying(ids, inputs["kvrl_death"])  # as during the loss's logprob forward
    try:
        with torch.no_grad():
            hidden = tr.model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        tr._kv_active = None
    logp = torch.log_softmax(tr.model.lm_head(hidden[:, -C - 1 : -1]) / tr.temperature, -1)
    exact = logp.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    assert (exact - sampled).abs()[on].max() <= 1e-12
    assert (logprobs(tr, inputs) - sampled).abs()[on].max() <= 1e-5  # TRL's float32 head


def test_train_steps_with_num_iterations_2():
    """train() runs; with num_iterations=2 TRL scores the old policy right after generating
    (the mismatch comes from that forward) and takes two steps on one generation. (The
    on-policy path, num_iterations=1, measures it in compute_loss: the checkpointing test.)"""
    tr = trainer(num_iterations=2, max_steps=2)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert tr._kv_rollouts == 1  # one generation for both steps
    first, second = tr.state.log_history[:2]
    assert first[f"{MISMATCH}/max"] < 1e-5 and first["kv/retention"] < 0.9, first
    assert f"{MISMATCH}/max" not in second and second["step"] == 2 and second["entropy"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_trains_in_bfloat16_under_grpoconfig_defaults():
    """GRPOConfig's defaults but the sizes, use_cpu and output: bf16 (autocast over the float32 model, in
    the rollouts as in the loss) and gradient checkpointing. The policy scores in float32 under
    autocast (kvrl.cache.KVCache.evict); the replay is then off by bfloat16 rounding only."""
    sizes = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=24)
    out = dict(output_dir=str(ROOT / "outputs" / "test_trl"), save_strategy="no", logging_steps=1)  # no checkpoint
    args = dict(use_cpu=True, max_steps=2) | sizes | out
    tr = trainer(args=args)
    assert tr.args.bf16 and tr.args.gradient_checkpointing and not tr.args.use_vllm
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    steps = [h for h in tr.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["kv/retention"] < 0.9, h  # the policy evicted
        # measured 2e-3 mean, 8e-3 max (float32: 1e-7); the max is bfloat16's rounding of a logit
        assert h[f"{MISMATCH}/mean"] <= 1e-2 and h[f"{MISMATCH}/max"] <= 2e-2, h
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


def test_a_second_trainer_on_the_same_model_takes_it_over():
    """Built one after the other on one model (a re-run notebook cell), the second trains; the
    first takes the model back when it generates."""
    first = trainer()
    second = trainer(model=first.model, kv=dict(kv_policy="h2o", kv_budget=12, kv_interval=4, kv_window=4))
    second.train()
    assert second.state.log_history[0][f"{MISMATCH}/max"] < 1e-5
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(RuntimeError, match=r"not under H2O\(budget=12"):  # the hook is the second's alone
        first.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    first.model.train()
    inputs = first._prepare_inputs(batch(first))
    on = inputs["completion_mask"].bool()
    assert (logprobs(first, inputs) - inputs["kvrl_logprobs"]).abs()[on].max() < 1e-5


def test_full_cache_baseline():
    """kv_policy="full": the rollouts keep every key, and the loss replays that (no key dies)."""
    tr = trainer(kv=dict(kv_policy="full"))
    tr.model.train()
    inputs = tr._prepare_inputs(batch(tr))
    assert tr._metrics["train"]["kv/retention"][-1] == 1.0
    on = inputs["completion_mask"].bool()
    assert (logprobs(tr, inputs) - inputs["kvrl_logprobs"]).abs()[on].max() < 1e-5
    with pytest.raises(ValueError, match="'full' keeps every key and takes no settings; drop kv_budget"):
        build_policy("full", tiny_config(TOK), budget=16)


def test_settings_the_policy_does_not_take_are_refused_naming_those_it_takes():
    with pytest.raises(ValueError, match=r"kv_kwargs \['alpha'\] are not settings of H2O.*are budget_ratio \("):
        trainer(kv=dict(kv_policy="h2o", kv_budget=16, kv_kwargs={"alpha": 0.8}))
    with pytest.raises(ValueError, match=r"\['alpah'\] are not settings of GKV.*mix_lambda, alpha, mode"):
        build_policy(GKV, tiny_config(TOK), budget=16, kwargs={"alpah": 0.8})


# GRPOConfig's defaults of what refusals() reads
DEFAULTS = dict(
    use_vllm=False,
    use_transformers_continuous_batching=False,
    top_k=0,
    min_p=None,
    repetition_penalty=1.0,
    generation_kwargs=None,
    cache_implementation=None,
    parallelism_config=None,
    top_p=1.0,
)


@pytest.mark.parametrize(
    "key, value, fix",
    [
        ("use_vllm", True, "use_vllm=False"),
        ("top_k", 5, "top_k=0"),
        ("min_p", 0.1, "min_p=None"),
        ("repetition_penalty", 1.1, "repetition_penalty=1.0"),
        ("generation_kwargs", {"num_beams": 2}, "generation_kwargs=None"),
        ("use_transformers_continuous_batching", True, "use_transformers_continuous_batching=False"),
    ],
)
def test_samplers_the_engine_cannot_replay_are_refused(key, value, fix):
    args = types.SimpleNamespace(**{**DEFAULTS, key: value})
    with pytest.raises(ValueError, match=f"cannot replay {key}=.*set {fix}"):
        refusals(args, tiny_config(TOK), TOK, None, None, None)


def test_the_constructor_refuses_before_trl_loads_anything():
    """use_vllm=True: kvrl's refusal, not TRL's ImportError for the missing vLLM."""
    with pytest.raises(ValueError, match="use_vllm=False"):
        trainer(use_vllm=True)


def test_tools_environments_vision_and_packed_sequences_are_refused():
    args = types.SimpleNamespace(**DEFAULTS)
    config = tiny_config(TOK)
    with pytest.raises(ValueError, match="got tools.*drop `tools`"):
        refusals(args, config, TOK, [len], None, None)
    with pytest.raises(ValueError, match="environment_factory.*drop `environment_factory`"):
        refusals(args, config, TOK, None, None, object)
    with pytest.raises(ValueError, match="rollout_func.*drop `rollout_func`"):
        refusals(args, config, TOK, None, len, None)
    with pytest.raises(ValueError, match="vision-language model \\(LlavaConfig\\).*text-only model"):
        refusals(args, LlavaConfig(), TOK, None, None, None)
    split = types.SimpleNamespace(**{**DEFAULTS, "parallelism_config": types.SimpleNamespace(cp_size=2, sp_size=1)})
    with pytest.raises(ValueError, match="parallelism_config.*cp_size=sp_size=1"):
        refusals(split, config, TOK, None, None, None)
    with pytest.warns(UserWarning, match="top_p=0.9.*set top_p=1.0"):
        refusals(types.SimpleNamespace(**{**DEFAULTS, "top_p": 0.9}), config, TOK, None, None, None)


def test_a_forward_that_does_not_replay_is_an_error(fp32):
    tr, splits = fp32
    ids = torch.cat([splits[0]["prompt_ids"], splits[0]["completion_ids"]], 1)
    mask = torch.ones_like(ids)
    with pytest.raises(RuntimeError, match="would attend over the full cache"):
        tr.model(input_ids=ids, attention_mask=mask)
    with pytest.raises(RuntimeError, match="no eviction traces at hand"):
        tr._get_per_token_logps_and_entropies(tr.model, ids, mask, 4)
    tr._kv_active = _Replaying(ids, splits[0]["kvrl_death"])  # as during a logprob forward of the loss
    try:
        with pytest.raises(ValueError, match="position_ids.*padding-free"):
            tr.model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(1) - 1)
    finally:
        tr._kv_active = None


def test_the_policy_is_a_name_a_class_or_an_instance():
    config = tiny_config(TOK)
    settings = dict(budget=16, interval=4, window=4, sink=2, kwargs={"alpha": 0.5})
    by_name, by_class = build_policy("gkv", config, **settings), build_policy(GKV, config, **settings)
    assert by_name == by_class == GKV(budget=16, interval=4, window=4, sink=2, alpha=0.5)
    assert build_policy(by_name, config) is by_name
    with pytest.raises(ValueError, match="carries its own settings; pass kv_budget"):
        build_policy(by_name, config, budget=8)
    with pytest.raises(ValueError, match="needs kv_budget"):
        build_policy("gkv", config)
    with pytest.raises(TypeError, match="pass a policy name"):
        build_policy(3, config)


def test_the_signature_guard_names_what_trl_changed():
    check_trl_surface()  # the installed TRL is the one this adapter is written for

    class Moved(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, config=None):
            pass

    with pytest.raises(
        TRLChanged,
        match=r"GRPOTrainer\._get_per_token_logps_and_entropies\(self, model, "
        r"input_ids, attention_mask, logits_to_keep, config\) was .*"
        rf"trl=={TRL_VERSION}",
    ):
        check_trl_surface(Moved)

    class Gone(GRPOTrainer):
        _tokenize_prompts = None

    with pytest.raises(TRLChanged, match=r"GRPOTrainer\._tokenize_prompts\(missing\)"):
        check_trl_surface(Gone)


def test_the_trl_extra_pins_the_version_the_guard_is_written_for():
    import trl

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert f"trl=={TRL_VERSION}" in cfg["options.extras_require"]["trl"].split()
    assert trl.__version__ == TRL_VERSION
