"""What the RL-loop tests share: ``DigitsEnv`` (its reward, the fraction of digits in the
completion, a random model learns in a few steps), a run's config on a random tiny Llama,
``train()`` and the comparisons of two runs.
"""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kvrl.config import load_config
from kvrl.envs.base import Reward, Task, TextEnv
from kvrl.envs.chains import ChainSpec, make_chain_task
from kvrl.workers.controller import TIMINGS, Controller

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def digits(task, completion):
    words = completion.split()
    return sum(w.isdigit() for w in words) / max(1, len(words))


class DigitsEnv(TextEnv):
    """Short chains prompts; reward = fraction of digit tokens in the completion."""

    def __init__(self, **ignored):  # the recipe's chains kwargs do not apply here
        super().__init__(rewards=[Reward(digits, 1.0, "digits")])

    def sample_task(self, rng):
        t = make_chain_task(rng, ChainSpec(4, 8, 1, 3))
        return Task(id=f"digits-{int(rng.integers(2**62)):x}", prompt=t["prompt"], answer=t["answer"])


def config(out, model, *overrides):
    return load_config(
        [
            "recipe=tiny_rl_full",
            f"model.path={model}",
            f"env.id={__name__}:DigitsEnv",
            f"output_dir={out}",
            "sampling.max_new_tokens=12",
            "sampling.batch_size=8",
            f"trainer.steps={STEPS}",
            "trainer.batch_size=16",
            "trainer.lr=1e-2",
            "rl.group_size=4",
            "rl.truncated=keep",
            "rl.checkpoint_every=0",
            "workers.timeout_s=300",
            *overrides,
        ]
    )


def train(cfg, controller_cls=Controller, **kwargs):
    controller = controller_cls(cfg, **kwargs)
    try:
        controller.run()
    finally:
        controller.close()
    out = Path(cfg.output_dir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, load_file(str(out / "model" / "model.safetensors"))


def same_metrics(a, b, tol=1e-6, skip=()):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra.keys() - set(TIMINGS) - set(skip):
            assert ra[key] == pytest.approx(rb[key], rel=tol, abs=tol), (ra["step"], key)


def assert_steps_cover_their_parts(records):
    """A step's step_s counts its own rollout and its update (inline, the rollouts run one at a time
    between the updates: step_s once left out its own and counted the next step's). 1e-9: the sum's
    floating-point rounding."""
    for r in records:
        assert r["rollout_s"] + r["learn_s"] <= r["step_s"] + 1e-9, r


def same_params(a, b, atol=1e-6, mean_atol=1e-8):
    assert a.keys() == b.keys()
    for k in a:
        gap = (a[k] - b[k]).abs()
        assert gap.max() <= atol and gap.mean() <= mean_atol, (k, gap.max().item(), gap.mean().item())
