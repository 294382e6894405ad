"""ForesightKV's trace data: reasoning traces generated with the full cache, kept when
correct and long enough, with the full-cache loss and entropy of every generated token.

:func:`write_splits` (job ``foresight_traces``, also the first stage of ``job=foresight``)
writes ``output_dir/traces/{train,heldout}/shard-NNNNN.parquet``: one row per trace with
``task_id``, ``ids`` (prompt + completion token ids, ending with the stop token), ``prompt_len``, ``loss`` and
``entropy`` (float32 lists, one per generated token, teacher-forced under the full cache
by :meth:`kvrl.engines.hf.HFEngine.score`). A shard is written atomically once full, so an
interrupted run resumes after its last complete shard (the task stream is replayed from
``seed``, and the kept traces of each shard are a deterministic function of it). The two
splits draw their prompts from differently seeded task streams.

Generation runs on ``workers.engine`` (``vllm``: the vLLM engine with the full cache, as
ForesightKV; ``hf``: the reference engine); the filter is the environment's reward
(``correct`` for the counts task) and ``foresight.min_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from kvrl.runlog import atomic

SCHEMA = pa.schema([("task_id", pa.string()), ("ids", pa.list_(pa.int32())), ("prompt_len", pa.int32()),
                    ("loss", pa.list_(pa.float32())), ("entropy", pa.list_(pa.float32()))])
SPLIT_SEEDS = {"train": 0, "heldout": 1_000_003}  # added to cfg.seed: disjoint task streams


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
        raise FileNotFoundError(f"no trace shards in {path}; run the data step "
                                "(`python -m kvrl.run recipe=tiny_foresight job=foresight_traces`)")
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return [Trace(**r) for r in rows]


def _engine(cfg):
    """The full-cache generation engine of ``workers.engine`` and the scoring (HF) engine."""
    from kvrl.engines import make_engine
    from kvrl.engines.hf import HFEngine
    from kvrl.models.tiny import load_model

    hf = HFEngine(*load_model(cfg.model.path, cfg.model.dtype, cfg.device))
    return (hf if cfg.workers.engine == "hf" else make_engine(cfg, hf.tokenizer)), hf


def _shard(gen, hf, env, tasks, cfg, seed: int) -> list[dict]:
    """Generate, filter and score one shard's tasks; the rows to write."""
    from kvrl.engines.hf import Sampling

    out = gen.generate([t.prompt for t in tasks], Sampling(cfg.sampling.max_new_tokens, cfg.sampling.temperature,
                                                          seed=seed))
    rows = []
    for t, prompt, completion, text, finish in zip(tasks, out.prompt_ids, out.tokens, out.texts, out.finish_reasons):
        ids = prompt + completion
        if finish != "stop" or len(ids) < cfg.foresight.min_tokens or env.score(t, text)[0] <= 0:
            continue
        rows.append({"task_id": t.id, "ids": ids, "prompt_len": len(prompt)})
    for i in range(0, len(rows), cfg.sampling.batch_size):
        part = rows[i:i + cfg.sampling.batch_size]
        with torch.no_grad():
            s = hf.score([r["ids"] for r in part], [r["prompt_len"] for r in part])
        for j, r in enumerate(part):
            n = int(s.mask[j].sum())
            r["loss"], r["entropy"] = s.losses[j, :n].tolist(), s.entropies[j, :n].tolist()
    return rows


def split_done(cfg, split: str, count: int) -> bool:
    folder = Path(cfg.output_dir) / "traces" / split
    return all((folder / f"shard-{i:05d}.parquet").exists() for i in range(-(-count // cfg.foresight.shard_size)))


def write_splits(cfg) -> dict[str, Path]:
    """The train and held-out splits under output_dir/traces (resumes; the generation
    engine starts only when a shard is missing)."""
    counts = {"train": cfg.foresight.traces, "heldout": cfg.foresight.heldout}
    engines = None if all(split_done(cfg, s, n) for s, n in counts.items()) else _engine(cfg)
    return {split: write_split(cfg, split, n, engines) for split, n in counts.items()}


def write_split(cfg, split: str, count: int, engines) -> Path:
    """Generate ``count`` kept traces for ``split`` under output_dir/traces/split (resumes)."""
    from kvrl.envs import make

    folder = Path(cfg.output_dir) / "traces" / split
    folder.mkdir(parents=True, exist_ok=True)
    size = cfg.foresight.shard_size
    n_shards = -(-count // size)
    if split_done(cfg, split, count):
        return folder
    gen, hf = engines
    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=cfg.seed + SPLIT_SEEDS[split])
    bar = tqdm(total=count, desc=f"traces ({split})", unit="trace")
    for shard in range(n_shards):
        want = min(size, count - shard * size)
        path = folder / f"shard-{shard:05d}.parquet"
        if path.exists():  # finished by a previous run
            bar.update(want)
            continue
        rows, attempts = [], 0
        # Each shard draws from its own seeded task stream, so a resumed run skips the
        # finished shards and writes exactly the shards an uninterrupted run would have.
        env.load_state_dict({**env.state_dict(), "rng": _shard_rng(cfg.seed + SPLIT_SEEDS[split], shard)})
        while len(rows) < want:
            attempts += 1
            if attempts > 20:
                raise RuntimeError(f"shard {shard} of {split}: only {len(rows)} of {want} traces kept after "
                                   f"{attempts - 1} batches; lower foresight.min_tokens or check the model's accuracy")
            tasks = env.tasks(cfg.sampling.batch_size)
            rows += _shard(gen, hf, env, tasks, cfg, seed=cfg.seed + shard * 1000 + attempts)
        rows = rows[:want]
        with atomic(path) as tmp:
            pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp)
        bar.update(want)
    bar.close()
    return folder


def _shard_rng(seed: int, shard: int) -> dict:
    """The task-stream RNG state that starts ``shard`` (independent of the other shards)."""
    import numpy as np

    return np.random.default_rng([seed, shard]).bit_generator.state
