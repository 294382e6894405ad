"""The RL learner and losses without Ray: a skipped or a no-signal update leaves the weights and
the optimizer state, a full disk names the file, collated traces replay the rollouts, the
stop token is trained, RL-Full's KL to the initial model, and TensorBoard's install hint.
"""

import copy

import numpy as np
import pytest
import torch
from batches import rollout_samples
from rl_loop_common import config, same_params

from kvrl.envs.chains import ChainSpec, make_chain_task
from kvrl.models.tiny import load_model
from kvrl.runlog import tensorboard_writer


def learner_and_samples(cfg, model_path):
    """A learner of ``cfg`` without Ray, and ``samples(advantage)``: 4 chain-task rollouts of the model as
    the samples of one step, every one with that advantage."""
    from kvrl.engines.base import Sampling
    from kvrl.engines.hf import HFEngine
    from kvrl.workers.learner import Learner

    learner = Learner.__ray_actor_class__(cfg, 0, 1)
    model, tok = load_model(model_path)
    rng = np.random.default_rng(1)
    prompts = [make_chain_task(rng, ChainSpec(4, 8, 1, 3))["prompt"] for _ in range(4)]
    out = HFEngine(model, tok).generate(prompts, Sampling(max_new_tokens=8, temperature=1.0, seed=0))

    def samples(advantage):
        return rollout_samples(out, [advantage] * 4, ids=[f"0/{b}/0" for b in range(4)])

    return learner, samples, sum(len(t) for t in out.tokens)


def test_a_skipped_update_leaves_the_weights_and_a_nan_weight_is_never_saved(random_model, tmp_path):
    """The learner itself, without Ray: a NaN loss skips the optimizer step (Adam would spread the
    NaN into every weight and both moments), and save() refuses non-finite state."""
    learner, samples, n = learner_and_samples(config(tmp_path, random_model), random_model)
    before = {k: v.clone() for k, v in learner.engine.model.state_dict().items()}
    metrics = learner.step(samples(float("nan")), n)
    assert metrics["skipped"] == 1.0 and not np.isfinite(metrics["loss"])
    same_params(learner.engine.model.state_dict(), before, atol=0, mean_atol=0)
    assert not learner.opt.state  # no moments were written
    metrics = learner.step(samples(1.0), n)
    assert metrics["skipped"] == 0.0 and np.isfinite(metrics["grad_norm"])
    with torch.no_grad():
        learner.params[0].view(-1)[0] = float("inf")
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FloatingPointError, match=r"not saving the checkpoint .*ckpt: non-finite values in "):
        learner.save(str(tmp_path / "ckpt"))
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_tensorboard_missing_says_how_to_install(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tensorboard"):
            tensorboard_writer(tmp_path)
    else:
        tensorboard_writer(tmp_path).close()


def test_collated_traces_replay_the_rollouts(random_model):
    """Per-sample traces from two generate calls of different lengths, stacked by
    collate(), make engine.score reproduce the behaviour logprobs (what G-KV needs)."""
    from kvrl.algos.base import collate
    from kvrl.engines.base import Sampling
    from kvrl.engines.hf import HFEngine
    from kvrl.models.tiny import load_model
    from kvrl.policies import make_policy

    model, tok = load_model(random_model)
    engine = HFEngine(model, tok)
    policy = make_policy("snapkv", budget=12, interval=4, window=4, sink=2)
    rng = np.random.default_rng(0)
    samples = []
    for call, new in enumerate((10, 16)):
        prompts = [make_chain_task(rng, ChainSpec(4, 8, 1, 3))["prompt"] for _ in range(3)]
        out = engine.generate(prompts, Sampling(max_new_tokens=new, temperature=1.0, seed=call), policy=policy)
        samples += rollout_samples(out, [0.0] * 3, ids=[f"{call}/{b}" for b in range(3)])
    batch = collate(samples, 1.0, "cpu")
    assert batch.trace is not None and (batch.trace.retention() < 1).any()
    with torch.no_grad():
        scores = engine.score(batch.sequences, batch.prompt_lens, trace=batch.trace)
    assert torch.allclose(scores.logprobs, batch.old_logprobs, atol=1e-4)
    assert torch.equal(scores.mask, batch.mask.bool())


def test_the_learner_trains_the_stop_token(random_model, tmp_path):
    """A stopped sample ends with its stop token: the learner scores it like any other action
    (its recomputed logprob equals the behaviour one) and the loss's gradient reaches the
    position that predicted it (which predicts nothing else)."""
    from kvrl.algos import make_algo
    from kvrl.algos.base import collate
    from kvrl.engines.base import Sampling
    from kvrl.engines.hf import HFEngine
    from kvrl.models.tiny import load_model

    model, tok = load_model(random_model)
    rng = np.random.default_rng(1)
    prompts = [make_chain_task(rng, ChainSpec(4, 8, 1, 3))["prompt"] for _ in range(4)]
    free = HFEngine(model, tok).generate(prompts, Sampling(max_new_tokens=12, ignore_eos=True))
    stop = free.tokens[0][4]  # a token the model emits: rows that emit it stop there
    out = HFEngine(model, tok, stop_ids=[stop]).generate(prompts, Sampling(max_new_tokens=12))
    stopped = [b for b, r in enumerate(out.finish_reasons) if r == "stop"]
    assert stopped and all(out.tokens[b][-1] == stop for b in stopped)
    samples = rollout_samples(out, [1.0] * 4, ids=[f"0/{b}/0" for b in range(4)])
    algo = make_algo(config(tmp_path, random_model, "sampling.temperature=1.0"))  # greedy logprobs are at T=1
    model.train()
    engine = HFEngine(model, tok)
    algo.setup(model, tok)
    batch = collate(samples, sum(len(s.tokens) for s in samples), "cpu")
    hidden = []

    def keep(module, inputs, output):  # returns None: the output is left as it is
        output.retain_grad()
        hidden.append(output)

    hook = model.model.norm.register_forward_hook(keep)
    try:
        loss, scores, _ = algo.loss(engine, batch)
    finally:
        hook.remove()
    loss.backward()
    S = hidden[0].shape[1]
    for b in stopped:
        n = len(out.tokens[b])
        assert abs(scores.logprobs[b, n - 1].item() - out.logprobs[b][-1]) < 1e-4
        assert scores.mask[b, n - 1], "the stop token is scored"
        assert hidden[0].grad[b, S - 2].abs().sum() > 0, "the gradient reaches the logit of the stop token"


def test_rl_full_kl_to_the_initial_model(random_model, tmp_path):
    """rl.kl_coef > 0: the reference is a frozen copy of the initial weights; KL is 0 until
    the model moves, and positive after."""
    from kvrl.algos.base import collate
    from kvrl.algos.rl_full import RLFull
    from kvrl.engines.base import Sampling
    from kvrl.engines.hf import HFEngine
    from kvrl.models.tiny import load_model

    algo = RLFull(config(tmp_path, random_model, "rl.kl_coef=0.1"))
    model, tok = load_model(random_model)
    params = algo.setup(model, tok)
    assert len(params) == len(list(model.parameters())) and algo.ref.model is not model
    engine = HFEngine(model, tok)
    out = engine.generate(["1 ; 2 ; ?", "3 ; ?"], Sampling(max_new_tokens=6, temperature=1.0))
    samples = rollout_samples(out, [1.0] * 2)
    batch = collate(samples, 12.0, "cpu")
    _, _, metrics = algo.loss(engine, batch)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    loss, _, metrics = algo.loss(engine, batch)
    assert metrics["kl"] > 1e-3 and loss.requires_grad


def test_a_no_signal_step_leaves_the_weights_and_the_optimizer_state(random_model, tmp_path):
    """A step whose advantages are all 0 (rl.no_signal=skip) is scored, not taken: the weights and Adam's
    moments and step count stay as they were. Taken anyway, the momentum of an earlier step moves the weights
    with no signal behind them, which is why it is skipped."""
    learner, samples, n = learner_and_samples(config(tmp_path, random_model), random_model)
    learner.step(samples(1.0), n)  # an update with signal: Adam now has moments
    weights = {k: v.clone() for k, v in learner.engine.model.state_dict().items()}
    moments = copy.deepcopy(learner.opt.state_dict())
    metrics = learner.step(samples(0.0), n, update=False)
    assert metrics["no_signal"] == 1.0 and metrics["grad_norm"] == 0.0 and metrics["skipped"] == 0.0
    assert metrics["mismatch_max"] > 0  # still measured (the weights moved since these samples were drawn)
    same_params(learner.engine.model.state_dict(), weights, atol=0, mean_atol=0)
    after = learner.opt.state_dict()
    assert after["state"].keys() == moments["state"].keys()
    for i, state in moments["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    metrics = learner.step(samples(0.0), n)  # the step taken: zero gradient, the weights move all the same
    assert metrics["no_signal"] == 0.0 and metrics["grad_norm"] == 0.0
    moved = max((v - weights[k]).abs().max().item() for k, v in learner.engine.model.state_dict().items())
    assert moved > 0


def test_a_full_disk_during_a_checkpoint_names_the_file(random_model, tmp_path, monkeypatch):
    """A full disk while the learner wrote its part of a checkpoint named the checkpoint folder, not the file."""
    import errno

    from kvrl.workers.learner import Learner

    learner = Learner.__ray_actor_class__(config(tmp_path, random_model), 0, 1)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("basic_ios::clear")))
    with pytest.raises(OSError, match=rf"writing {folder / 'learner.pt'} failed \(torch.save: basic_ios::clear\)"):
        learner.save(str(folder))
    monkeypatch.setattr(torch, "save", real)
    weights = folder / "model" / "model.safetensors"  # save_pretrained's write: the error names its file

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(weights))

    monkeypatch.setattr(learner, "export", full)
    with pytest.raises(OSError, match=rf"no space left on device while writing {weights}: free space there"):
        learner.save(str(folder))
