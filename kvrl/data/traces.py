"""ForesightKV's trace data: reasoning traces generated with the full cache, kept when
correct and long enough, with the full-cache loss and entropy of every generated token.

:func:`kvrl.workers.traces.write_splits` (job ``foresight_traces``, also the first stage of
``job=foresight``, on Ray actors) writes ``output_dir/traces/{train,heldout}/shard-NNNNN.parquet``:
one row per trace with ``task_id``, ``ids`` (prompt + completion token ids, ending with the
stop token), ``prompt_len``, ``loss`` and ``entropy`` (float32 lists, one per generated token,
teacher-forced under the full cache by :meth:`kvrl.engines.hf.HFEngine.score`). This module
is the format: :class:`Trace`, :data:`SCHEMA`, :func:`load_traces`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("ids", pa.list_(pa.int32())),
        ("prompt_len", pa.int32()),
        ("loss", pa.list_(pa.float32())),
        ("entropy", pa.list_(pa.float32())),
    ]
)
SPLIT_SEEDS = {"train": 0, "heldout": 1_000_003}  # added to cfg.seed: disjoint task streams
MAX_BATCHES = 20  # batches a shard may take to keep its traces before the run gives up
# rows x padded length of one scoring forward, whose activations grow with it (GiBs a layer
# for a 4B model at 32K tokens); a longer trace is scored alone
SCORE_TOKENS = 32768


@dataclass
class Trace:
    """One stored trace: ids [T] = prompt + completion; loss/entropy per completion token."""

    task_id: str
    ids: list[int]
    prompt_len: int
    loss: list[float]
    entropy: list[float]


def load_traces(path: str | Path) -> list[Trace]:
    """Every trace of a split folder (shards in order), or of one parquet file."""
    path = Path(path)
    files = sorted(path.glob("shard-*.parquet")) if path.is_dir() else [path]
    if not files or not files[0].exists():
        raise FileNotFoundError(
            f"no trace shards in {path}; run the data step "
            "(`python -m kvrl.run recipe=tiny_foresight job=foresight_traces`)"
        )
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return [Trace(**r) for r in rows]
