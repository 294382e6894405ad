"""kvrl.bench.record: the commit a results file names, and standard JSON."""

import json
import subprocess

import pytest

from kvrl import bench


def git(root, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True, capture_output=True
    )


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A committed tree as kvrl's checkout (``bench.ROOT``): a package, a benchmark, a recorded result."""
    for path, text in {
        ".gitignore": "__pycache__/\n",
        "kvrl/__init__.py": "",
        "benchmarks/learning/" + "run.py": "",  # split: tests/test_docs.py checks every whole path exists
        "benchmarks/results/old.json": "{}\n",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "base")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    return tmp_path


def strict(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not standard JSON")

    return json.loads(text, parse_constant=refuse)


def written(root, name):
    return strict((root / "benchmarks" / "results" / f"{name}.json").read_text())


def test_an_untracked_module_makes_the_tree_dirty(checkout):
    """A module the benchmark may have imported, not yet added to git, is code the commit does not hold."""
    (checkout / "benchmarks" / "results" / "kept.json").write_text("{}\n")
    git(checkout, "add", ".")
    git(checkout, "commit", "-q", "-m", "a recorded result")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    (checkout / "benchmarks" / "results" / "kept.json").write_text('{"acc": 1}\n')  # a tracked result, rewritten
    (checkout / "kvrl" / "__pycache__").mkdir()
    (checkout / "kvrl" / "__pycache__" / "x.pyc").write_text("")  # ignored: not code that differs
    (checkout / "benchmarks" / "results" / "new.json").write_text("{}\n")  # another run's output
    bench.record("first", {"acc": 0.5})
    bench.record("second", {"acc": 0.5})  # the first's own file is an output too
    assert written(checkout, "second")["commit"] == head and "dirty_files" not in written(checkout, "second")
    (checkout / "kvrl" / "helper.py").write_text("X = 1\n")
    (checkout / "benchmarks" / "learning" / "common.py").write_text("")
    bench.record("third", {"acc": 0.5})
    line = written(checkout, "third")
    assert line["commit"] == head + "-dirty"
    assert sorted(line["dirty_files"]) == ["benchmarks/learning/" + "common.py", "kvrl/helper.py"]


def test_non_finite_values_are_written_as_null_and_named(checkout, capsys):
    bench.record(
        "x", {"acc": float("nan"), "ci95": [0.25, float("inf")], "training": {"mismatch_max": -float("inf")}, "n": 3}
    )
    line = written(checkout, "x")
    assert line["acc"] is None and line["ci95"] == [0.25, None] and line["training"]["mismatch_max"] is None
    assert line["n"] == 3
    assert line["non_finite"] == {"acc": "nan", "ci95[1]": "inf", "training.mismatch_max": "-inf"}
    assert strict(capsys.readouterr().out) == line  # the emitted line is the same


def test_mean_interval_is_over_the_repeats_not_their_pooled_tasks():
    """Six random head sets judged on 256 tasks each: the spread between sets decides the interval
    (pooling 1,536 tasks gave [0.04, 0.06]); sets that all score 0 still get the pooled tasks' width."""
    over = bench.mean_interval([0.2969, 0.0, 0.0, 0.0039, 0.0, 0.0], 256)
    assert over["n"] == 6 and over["mean"] == pytest.approx(0.0501, abs=1e-4)
    assert over["ci95"][0] == 0.0 and over["ci95"][1] == pytest.approx(0.0501 + 2.571 * over["sd"] / 6**0.5, abs=1e-3)
    zeros = bench.mean_interval([0.0] * 7, 256)
    assert zeros["ci95"][0] == 0.0 and 0.001 < zeros["ci95"][1] < 0.003  # Wilson's upper bound at 0 of 1,792


def test_a_run_folder_notes_the_commit_of_each_start(tmp_path):
    """Results name the commits that trained a run (train_commits), not only the one that judged it."""
    from kvrl.runlog import COMMITS, RunLog, kvrl_commit

    assert bench.train_commits(tmp_path) == ["unknown"]  # a run trained before runs noted it
    RunLog(tmp_path, fresh=True)
    RunLog(tmp_path, fresh=False)  # a resume: its start is noted too
    assert (tmp_path / COMMITS).read_text().splitlines() == [kvrl_commit()] * 2
    assert bench.train_commits(tmp_path) == [kvrl_commit()]
    (tmp_path / COMMITS).write_text("abc\ndef\nabc\n")
    assert bench.train_commits(tmp_path) == ["abc", "def"]
    RunLog(tmp_path, fresh=True)  # a run that starts over forgets what trained the old one
    assert bench.train_commits(tmp_path) == [kvrl_commit()]
