"""kvrl.runlog: metrics that survive a crash, checkpoints that verify themselves, one run per directory."""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from kvrl.runlog import (
    OutputLock,
    RunLog,
    atomic,
    config_changes,
    damage,
    intact_checkpoint,
    mark_latest,
    seal,
    trained_model,
)


def test_metrics_trim_and_a_torn_last_line(tmp_path):
    log = RunLog(tmp_path, fresh=True)
    for step in range(1, 5):
        log.log({"step": step, "reward": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')  # the process died mid-write
    assert [r["step"] for r in log.records()] == [1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl").read_text().endswith('"reward": 0.4}\n')  # repaired
    log.trim(lambda r: r["step"] <= 2)
    assert [r["step"] for r in RunLog(tmp_path, fresh=False).records()] == [1, 2]
    assert RunLog(tmp_path, fresh=True).records() == []


def test_non_finite_metrics_are_written_as_null(tmp_path):
    """metrics.jsonl stays standard JSON: other readers (jq, JSON.parse) refuse NaN and Infinity."""
    log = RunLog(tmp_path, fresh=True)
    log.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "reward_mean": 0.5})

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert row == {"step": 1, "loss": None, "grad_norm": None, "reward_mean": 0.5}
    assert log.records() == [row]


def test_a_damaged_line_before_the_last_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not JSON"):
        RunLog(tmp_path, fresh=False).records()


def test_atomic_leaves_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]


def test_a_full_disk_names_the_file(tmp_path):
    with pytest.raises(OSError, match=r"no space left on device while writing .*results\.json"):
        with atomic(tmp_path / "results.json"):
            raise OSError(errno.ENOSPC, "No space left on device")  # what a write on a full disk raises
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("failure", ["dev_full", "basic_ios"])
def test_a_full_disk_under_torch_save_names_the_file(failure, tmp_path, monkeypatch):
    """torch.save's C++ writer reports ENOSPC as a RuntimeError without an errno (before: the run
    ended with `RuntimeError: basic_ios::clear` and no file named)."""
    import torch

    from kvrl.runlog import save_torch

    real = torch.save
    if failure == "dev_full":  # a real full device: torch.save's own report of it
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full")
        writer = lambda obj, f, *a, **k: real(obj, "/dev/full", *a, **k)  # noqa: E731
    else:

        def writer(obj, f, *a, **k):
            raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(torch, "save", writer)
    with pytest.raises(
        OSError,
        match=r"writing .*learner\.pt failed \(torch\.save: .*\), which is how it reports "
        r"a full disk \(\d+ MiB free on .*\): free space there .*resume=auto",
    ) as info:
        save_torch({"w": torch.zeros(4096)}, tmp_path / "learner.pt")
    assert info.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="^a bug$"):  # any other error stays what it is
        save_torch({}, tmp_path / "learner.pt")


def checkpoint(root, step: int, payload: bytes):
    folder = root / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "learner.pt").write_bytes(payload)
    (folder / "sub").mkdir()
    (folder / "sub" / "shard").write_bytes(payload[::-1])
    seal(folder)
    mark_latest(folder)
    return folder


def test_a_flipped_bit_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    first = checkpoint(tmp_path, 1, b"\x00" * 64)
    second = checkpoint(tmp_path, 2, b"\x01" * 64)
    assert intact_checkpoint(tmp_path) == second and damage(second) is None
    data = bytearray((second / "learner.pt").read_bytes())
    data[10] ^= 0x04
    (second / "learner.pt").write_bytes(bytes(data))
    assert intact_checkpoint(tmp_path) == first
    assert f"skipping checkpoint {second}" in capsys.readouterr().err
    (first / "sub" / "shard").write_bytes(b"\x00" * 10)  # truncated
    assert "does not match" in damage(first) and intact_checkpoint(tmp_path) is None


def test_a_sealed_checkpoint_newer_than_latest_is_taken(tmp_path, capsys):
    """A crash between seal() and mark_latest() leaves latest one checkpoint behind: resume (and
    model.path=<run>) take the newest intact one, as the README promises (before: latest's, silently)."""
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        folder = root / f"step_{step:06d}"
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "model.safetensors").write_bytes(bytes([step]) * 4)
        seal(folder / "model")
        seal(folder)
        if step == 1:  # step 2's process died before mark_latest()
            mark_latest(folder)
    assert (root / "latest").read_text() == "step_000001"
    assert intact_checkpoint(root) == root / "step_000002"
    assert trained_model(tmp_path)[0] == root / "step_000002" / "model"
    assert capsys.readouterr().err == ""


def test_unsealed_checkpoints_and_bad_pointers_are_skipped(tmp_path, capsys):
    good = checkpoint(tmp_path, 1, b"a" * 8)
    (tmp_path / "step_000002").mkdir()  # a crash after the files, before the seal
    (tmp_path / "step_000002" / "learner.pt").write_bytes(b"b" * 8)
    (tmp_path / "latest").write_text("step_000009")  # points nowhere
    assert intact_checkpoint(tmp_path) == good
    err = capsys.readouterr().err
    assert "step_000009 does not exist" in err and "no SHA256SUMS" in err


def test_the_weights_a_run_trained(tmp_path, capsys):
    """The final model when sealed and whole; else the newest checkpoint whose model/ is (a
    damaged one skipped with a warning); a checkpoint that was not sealed does not count."""

    def model(folder, weights: bytes):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(weights)
        seal(folder)

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        checkpoint(root, step, bytes([step]) * 8)
        model(root / f"step_{step:06d}" / "model", bytes([step]) * 4)
        seal(root / f"step_{step:06d}")
    (root / "step_000004").mkdir()  # a crash before the seal
    model(root / "step_000004" / "model", b"\x04" * 4)
    (root / "step_000003" / "model" / "model.safetensors").write_bytes(b"\x00" * 4)  # damaged after the seal
    folder, note = trained_model(tmp_path)
    assert folder == root / "step_000002" / "model"
    assert note.startswith(f"its newest complete checkpoint's model {folder} (no final model")
    assert f"skipping checkpoint {root / 'step_000003'}" in capsys.readouterr().err
    assert trained_model(tmp_path, verify=False)[0] == root / "step_000003" / "model"  # the gate reads no file
    model(tmp_path / "model", b"\x09" * 4)
    assert trained_model(tmp_path) == (tmp_path / "model", f"its final model {tmp_path / 'model'}")
    assert trained_model(tmp_path / "checkpoints") is None  # no run directory


def test_config_changes_name_the_keys_but_the_allowed():
    saved = {"trainer.lr": 0.01, "trainer.steps": 3, "logging.tensorboard": False, "seed": 0}
    now = {"trainer.lr": 0.02, "trainer.steps": 6, "logging.tensorboard": True, "seed": 0}
    assert config_changes(saved, now, ("trainer.steps", "logging.")) == ["trainer.lr: 0.01 -> 0.02"]


LOCK_HOLDER = "import sys, time; from kvrl.runlog import OutputLock; lock = OutputLock(sys.argv[1]); print('held', flush=True); time.sleep(60)"


def test_one_run_per_output_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"in use by another run \\(pid {holder.pid} on"):
            OutputLock(tmp_path)
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a run that dies without cleaning up
        holder.wait()
    lock = OutputLock(tmp_path)  # the dead run's lock is not stale
    with pytest.raises(RuntimeError, match="in use"):
        OutputLock(tmp_path)
    lock.release()
    OutputLock(tmp_path).release()


def test_wandb_offline_writes_a_local_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLog(tmp_path, fresh=True, wandb=True, name="t", config={"trainer.lr": 0.1})
    log.log({"step": 1, "reward_mean": 0.25, "note": "text"})
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and b"reward_mean" in runs[0].read_bytes()
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert runs[0].name == f"run-{run_id}.wandb"
    RunLog(tmp_path, fresh=False, wandb=True, name="t").close()  # a resumed run continues the same W&B run
    assert (tmp_path / "wandb" / "run_id").read_text() == run_id


def test_a_process_set_up_for_kvrl_prints_no_numpy_subnormal_warning():
    """Flushing denormals made numpy warn "the smallest subnormal ... is zero" in
    every process that later asked for a float type's limits (pandas, matplotlib do)."""
    code = (
        "import warnings, numpy as np\nwarnings.simplefilter('error')\nfrom kvrl.runlog import setup_process\n"
        "setup_process(0)\nprint(np.finfo(np.float32), np.finfo(np.float64), np.finfo(np.float16))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]  # a warning is an error here


def test_the_reward_picture_leaves_a_gap_for_a_step_without_a_reward(tmp_path):
    """Before: a resumed run whose earlier steps logged reward_mean null (an older kvrl's Distill) crashed
    drawing reward.png after training, and exited 1."""
    from kvrl.runlog import plot_rewards

    records = [{"step": s + 1, "reward_mean": 0.1 * s, "reward_std": 0.2, "samples": 16} for s in range(8)]
    for r in records[:3]:
        r["reward_mean"] = r["reward_std"] = None
    plot_rewards(records, tmp_path / "reward.png", "run")
    assert (tmp_path / "reward.png").stat().st_size > 1000


@pytest.mark.parametrize("steps, average", [(2, None), (5, None), (7, 3)])
def test_the_reward_picture_draws_its_moving_average_only_with_two_points(tmp_path, monkeypatch, steps, average):
    """Before: a 2-step run's reward.png had a "2-step moving average" legend entry and no line to see."""
    import matplotlib.figure

    from kvrl.runlog import plot_rewards

    figures, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k)
    )
    records = [{"step": s + 1, "reward_mean": 0.1 * s, "reward_std": 0.2, "samples": 16} for s in range(steps)]
    plot_rewards(records, tmp_path / "reward.png", "run")
    ax = figures[0].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    lines = {line.get_label(): len(line.get_xdata()) for line in ax.get_lines()}
    if average is None:
        assert not any("moving average" in label for label in labels), labels
    else:
        assert "5-step moving average" in labels and lines["5-step moving average"] == average
    assert (tmp_path / "reward.png").stat().st_size > 1000
