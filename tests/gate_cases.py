"""What the config-gate tests share: the repository's folder and a finished run to resume."""

import json
from pathlib import Path

from kvrl.config import load_config
from kvrl.runlog import flatten

REPO = Path(__file__).resolve().parent.parent
# the tiny pretraining recipe at its smallest: a run of a few steps in seconds
SMALL_PRETRAIN = [
    "recipe=tiny_pretrain",
    "trainer.batch_size=2",
    "trainer.log_every=1",
    "pretrain.eval_tasks=1",
    "pretrain.checkpoint_every=1",
    "pretrain.layers=1",
    "pretrain.hidden=32",
    "pretrain.kv_heads=1",
    "pretrain.intermediate=32",
]


def earlier_run(out: Path, *args: str) -> None:
    """What an RL run in `out` leaves for resume=auto: a sealed checkpoint with its config (no weights: the gate
    reads none)."""
    checkpoint = out / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    cfg = load_config(["recipe=tiny_rl_full", f"output_dir={out}", *args])
    (checkpoint / "config.json").write_text(json.dumps(flatten(cfg)))
    (checkpoint / "SHA256SUMS").write_text("")
