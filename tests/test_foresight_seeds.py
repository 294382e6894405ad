"""ForesightKV's stage 2 repeats: from its seed, whichever actors play its episodes; in micro-batches, the whole share's step."""

import json
from dataclasses import replace

import pytest
from safetensors.torch import load_file, save_file

from kvrl.algos.foresight import make_scorer, scorer_state
from kvrl.config import load_config
from kvrl.jobs.foresight import ForesightController
from kvrl.models.tiny import load_model
from kvrl.workers.traces import write_splits

SHRUNK = [
    "recipe=tiny_foresight",
    "workers.engine=hf",
    "foresight.traces=8",
    "foresight.heldout=4",
    "foresight.shard_size=4",
    "sampling.batch_size=8",
    "trainer.batch_size=8",
    "rl.group_size=4",
    "trainer.steps=3",
]


def stage2(run, name: str, *overrides) -> tuple[list[dict], dict]:
    """Stage 2 of the shrunk recipe into ``run/name`` (ForesightRL reads the traces and the stage-1
    scorer beside it, in ``run``): its per-step records and its final scorer."""
    cfg = load_config([*SHRUNK, *overrides, f"output_dir={run}"])
    cfg = replace(cfg, output_dir=str(run / name), rl=replace(cfg.rl, algo="foresight"), resume="never")
    controller = ForesightController(cfg)
    try:
        controller.run()
    finally:
        controller.close()
    records = [json.loads(line) for line in (run / name / "metrics.jsonl").read_text().splitlines()]
    return records, load_file(run / name / "scorer.safetensors")


@pytest.mark.slow  # 78 s on two loaded cores: Ray's start and two runs of three steps
def test_stage2_repeats_from_its_seed_whichever_actors_play_it(tmp_path):
    """The same traces, stage-1 scorer and seed, once on Ray with two rollout actors and once inline
    with one: every step's rewards, loss and gradient norm, and the final scorer, are bit for bit the
    same (an episode's evictions are drawn from the run's seed and the sample's id, not from the
    shard that carries it and its place there)."""
    write_splits(load_config([*SHRUNK, f"output_dir={tmp_path}", "workers.address=inline"]))
    model, _ = load_model("tiny")
    cfg = load_config(SHRUNK)
    start = scorer_state(make_scorer(model, cfg.kv))  # the untrained scorer stands in for stage 1's
    (tmp_path / "sft").mkdir()
    save_file(start, tmp_path / "sft" / "scorer.safetensors")

    ray_records, ray_scorer = stage2(tmp_path, "ray", "workers.rollout=2", "workers.num_cpus=2")
    inline_records, inline_scorer = stage2(tmp_path, "inline", "workers.rollout=1", "workers.address=inline")

    keys = ("reward_mean", "reward_std", "adv_abs_mean", "loss", "grad_norm", "kl", "mismatch_max")
    assert [[r[k] for k in keys] for r in ray_records] == [[r[k] for k in keys] for r in inline_records]
    assert all(r["reward_std"] > 0 for r in ray_records)  # the draws differ within a step: there is something to repeat
    assert ray_scorer.keys() == inline_scorer.keys()
    assert all((ray_scorer[k] == inline_scorer[k]).all() for k in ray_scorer)
    assert any((ray_scorer[k] != start[k]).any() for k in start)  # stage 2 moved the scorer


def test_stage2_in_micro_batches_takes_the_whole_shares_step(tmp_path):
    """``trainer.micro_batch_tokens`` splits a stage-2 share by its padded decisions x candidates (an episode
    per micro-batch at 1): the same step as the whole share, up to float32 summation order."""
    write_splits(load_config([*SHRUNK, f"output_dir={tmp_path}", "workers.address=inline"]))
    model, _ = load_model("tiny")
    start = scorer_state(make_scorer(model, load_config(SHRUNK).kv))
    (tmp_path / "sft").mkdir()
    save_file(start, tmp_path / "sft" / "scorer.safetensors")
    inline = ("workers.rollout=1", "workers.address=inline", "trainer.steps=1")
    whole, whole_scorer = stage2(tmp_path, "whole", *inline)
    split, split_scorer = stage2(tmp_path, "split", *inline, "trainer.micro_batch_tokens=1")

    assert whole[0]["micro_batches"] == 1 and split[0]["micro_batches"] == 8
    assert split[0]["reward_mean"] == whole[0]["reward_mean"]  # the same episodes
    assert split[0]["grad_norm"] == pytest.approx(whole[0]["grad_norm"], rel=1e-5)
    # the loss is a sum of advantage-weighted ratios that cancels to ~0 at the first step: compared absolutely
    assert split[0]["loss"] == pytest.approx(whole[0]["loss"], abs=1e-4)
    for k in start:
        step = (whole_scorer[k] - start[k]).abs().max()
        assert step > 0 and (split_scorer[k] - whole_scorer[k]).abs().max() <= 1e-3 * step, k
