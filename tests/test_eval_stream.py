"""job=eval judges tasks no run at the same seed trained on, says which, and warns about a model that did."""

import json
import shutil
from pathlib import Path

import pytest

from kvrl.config import load_config
from kvrl.envs import make
from kvrl.jobs.eval import draw_tasks, stream_warning
from kvrl.models.tiny import resolve_path
from kvrl.run import main
from kvrl.runlog import flatten


def rl_run(folder: Path, recipe: str, *args: str):
    """What an RL run of `recipe` leaves for model.path=<its output_dir> (the untrained reasoner stands in for the
    weights it would have trained: no training runs here): a sealed final model/ and a checkpoint's config.json.
    Returns the run's config."""
    cfg = load_config([f"recipe={recipe}", f"output_dir={folder}", *args])
    shutil.copytree(resolve_path(cfg.model.path), folder / "model")  # the shipped folder, with its SHA256SUMS
    checkpoint = folder / "checkpoints" / f"step_{cfg.trainer.steps:06d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps(flatten(cfg)))
    (checkpoint / "SHA256SUMS").write_text("")
    return cfg


@pytest.mark.parametrize(
    "trained, judged", [("tiny_multihop_sparse", "tiny_multihop_eval"), ("tiny_gkv_sparse", "tiny_eval")]
)
def test_eval_of_an_rl_run_judges_tasks_its_training_never_drew(tmp_path, monkeypatch, trained, judged):
    """job=eval reset the environment at `seed` (0), the stream the RL recipes train on: all 256 tasks of
    tiny_multihop_eval and all 64 of tiny_eval were among those tiny_multihop_sparse / tiny_gkv_sparse train on."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    run = tmp_path / "run"
    train = rl_run(run, trained)
    cfg = load_config([f"recipe={judged}", f"model.path={run}"])
    weights = Path(resolve_path(cfg.model.path))
    assert weights == run / "model"
    # the training stream, as kvrl.workers.controller draws it: reset at the run's seed, then each step's tasks
    env = make(train.env.id, **train.env.kwargs)
    env.reset(seed=train.seed)
    drawn = env.tasks(train.trainer.steps * train.trainer.batch_size // train.rl.group_size)
    _, tasks = draw_tasks(cfg)
    assert len(tasks) == cfg.env.num_eval_tasks
    assert {t.prompt for t in tasks}.isdisjoint({t.prompt for t in drawn})
    assert {t.id for t in tasks}.isdisjoint({t.id for t in drawn})
    assert stream_warning(cfg, weights, data=False) is None


def test_eval_names_its_stream_and_warns_about_a_model_trained_on_it(tmp_path, monkeypatch, capsys):
    """A run trained at seed 9001 drew the tasks job=eval judges at seed 0: it warns, and names the stream on
    the console, in settings.json and in report.md."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    run, out = tmp_path / "run", tmp_path / "eval"
    rl_run(run, "tiny_gkv_sparse", "seed=9001")
    args = ["recipe=tiny_eval", f"model.path={run}", "env.num_eval_tasks=2", "eval.policies=[full]"]
    assert main([*args, f"output_dir={out}"]) == 0
    err = capsys.readouterr().err
    stream = "the first 2 tasks of kvrl/counts-v0's stream at seed 9001 (seed=0 + 9001"
    assert f"kvrl: judging {stream}" in err, err
    assert (
        f"kvrl: warning: the model {run / 'model'} was trained (job=rl) on kvrl/counts-v0's task stream at seed "
        "9001, the stream this evaluation judges (seed=0 + 9001): its accuracy is not on held-out tasks; "
        "set seed=<another value than 0>"
    ) in err, err
    settings = json.loads((out / "settings.json").read_text())["settings"]
    assert [s["tasks.seed"] for s in settings.values()] == [9001]
    assert f"- tasks: {stream}" in (out / "report.md").read_text()
    assert main([*args, "seed=1", f"output_dir={tmp_path / 'eval_1'}"]) == 0  # another stream: no warning
    assert "kvrl: warning: the model" not in capsys.readouterr().err
