"""job=foresight_traces: ForesightKV's trace data alone (the first stage of job=foresight).

    python -m kvrl.run recipe=tiny_foresight job=foresight_traces

Full-cache reasoning traces, kept when correct and at least ``foresight.min_tokens`` long,
with the full-cache loss and entropy of every generated token, in resumable parquet shards
under ``output_dir/traces/{train,heldout}``, generated on ``workers.rollout`` Ray actors
(:mod:`kvrl.workers.traces`).
"""

from __future__ import annotations

from pathlib import Path

from kvrl.data.traces import load_traces
from kvrl.runlog import setup_process
from kvrl.workers.traces import write_splits


def main(cfg) -> dict[str, Path]:
    setup_process()
    paths = write_splits(cfg)
    for split, path in paths.items():
        lengths = [len(t.ids) for t in load_traces(path)]
        print(f"{split}: {len(lengths)} traces in {path}, {min(lengths)}-{max(lengths)} tokens")
    return paths
