"""benchmarks/gpu/gpu_checks.py, the one command a session that draws a GPU runs for the open
issues' GPU checks, runs here on shrunk shapes and checks what it measures against its
references: the Triton compaction against its torch reference (inside the script, which
raises), the replay of each policy's recorded trace against the rollout's logprobs, and the
flex-attention replay against dense masks (float32: both within 1e-4, the project's float32
tolerance; measured ≤ 2.3e-6)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu" / "gpu_checks.py"),
            "--device",
            "cpu",
            "--small",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {line["setting"]: line for line in lines}


def test_eviction_ops_of_every_policy(results):
    ops = results["ops"]
    from kvrl.policies import RULE_BASED

    assert set(ops["policies"]) == set(RULE_BASED) and len(RULE_BASED) >= 5
    for name, row in ops["policies"].items():
        assert row["eviction_ms"] >= row["compact_ms"] > 0, name
    assert "first_score_ms" in ops["policies"]["rkv"] and "first_score_ms" in ops["policies"]["gkv"]


def test_replay_of_every_policy_gives_the_rollout_logprobs(results):
    regimes = results["replay"]["regimes"]
    assert regimes["full"]["evicted_keys"] == 0
    for name, row in regimes.items():
        assert row["max_abs_dlogprob"] <= 1e-4, (name, row)
        if name != "full":
            assert row["evicted_keys"] > 0, name


def test_flex_replay_equals_dense_masks(results):
    lengths = results["flex"]["lengths"]
    assert set(lengths) == {"512", "1024"}
    for t, row in lengths.items():
        assert row["logits_max_abs_diff"] <= 1e-4, (t, row)
