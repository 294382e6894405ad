"""ForesightKV's trace data step on Ray actors (the format is :mod:`kvrl.data.traces`).

:func:`write_splits` (job ``foresight_traces``, also the first stage of ``job=foresight``)
writes ``output_dir/traces/{train,heldout}/shard-NNNNN.parquet``: one row per trace with
``task_id``, ``ids`` (prompt + completion token ids, ending with the stop token),
``prompt_len``, ``loss`` and ``entropy`` (float32 lists, one per generated token,
teacher-forced under the full cache by :meth:`kvrl.engines.hf.HFEngine.score`). A shard is
written atomically once full, and a rerun makes only the shards that are missing.

Generation runs on ``workers.rollout`` Ray actors (:class:`TraceWorker`, with a rollout
actor's ``workers.rollout_cpus`` / ``rollout_gpus``), so a cluster run spreads over its
nodes. Each holds the ``workers.engine`` generation engine (``vllm``: the vLLM engine with
the full cache, as ForesightKV; ``hf``: the reference engine), the HF engine that scores,
and the filter: the environment's reward (``correct`` for the counts task) and
``foresight.min_tokens``. This process owns the task streams and the files, as the RL
controller does: it sends each actor the next batch of one shard, writes the shard once
full, and stops the actors at the end. Each shard draws its tasks from its own stream (the
split's, differently seeded for train and held-out, with the shard's own RNG; for a data
set, from a cursor no earlier shard reaches) and generates its batches with seeds
``seed + 1000·shard + batch``: its traces are the same whichever actor made them, however
many there are, and whichever shards an earlier run finished. An actor that dies is
restarted by Ray and its batch redone (``workers.max_restarts``); one whose engine cannot
start fails the run with its own error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch
from ray.exceptions import RayActorError
from tqdm import tqdm

from kvrl.data.traces import MAX_BATCHES, SCHEMA, SCORE_TOKENS, SPLIT_SEEDS
from kvrl.runlog import atomic, setup_process
from kvrl.workers.controller import connect, get, raise_if_start_failed, reserve
from kvrl.workers.inline import INLINE, spawn


def _engine(cfg):
    """The full-cache generation engine of ``workers.engine`` and the scoring (HF) engine."""
    from kvrl.engines import make_engine
    from kvrl.engines.hf import HFEngine
    from kvrl.models.tiny import load_model

    hf = HFEngine(*load_model(cfg.model.path, cfg.model.dtype, cfg.device))
    return (hf if cfg.workers.engine == "hf" else make_engine(cfg, hf.tokenizer)), hf


@ray.remote
class TraceWorker:
    """A rollout actor of the data step: turns a batch of tasks into the rows to keep."""

    def __init__(self, cfg):
        from kvrl.envs import make

        setup_process()  # actors share cores: one thread each (kvrl.runlog)
        self.cfg = cfg
        self.gen, self.hf = _engine(cfg)
        self.env = make(cfg.env.id, **cfg.env.kwargs)  # scores the completions here, beside the engine

    def traces(self, tasks: list, seed: int) -> list[dict]:
        """Generate ``tasks`` with the full cache, keep the correct, long-enough traces that
        stopped, and score them: their rows, in task order."""
        from kvrl.engines.base import Sampling

        cfg = self.cfg
        out = self.gen.generate(
            [t.prompt for t in tasks],
            Sampling(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, seed=seed),
        )
        rows = []
        for t, prompt, completion, text, finish in zip(
            tasks, out.prompt_ids, out.tokens, out.texts, out.finish_reasons
        ):
            ids = prompt + completion
            if finish != "stop" or len(ids) < cfg.foresight.min_tokens or self.env.score(t, text)[0] <= 0:
                continue
            rows.append({"task_id": t.id, "ids": ids, "prompt_len": len(prompt)})
        per = max(1, SCORE_TOKENS // max((len(r["ids"]) for r in rows), default=1))
        for i in range(0, len(rows), per):
            part = rows[i : i + per]
            with torch.no_grad():
                s = self.hf.score([r["ids"] for r in part], [r["prompt_len"] for r in part])
            for j, r in enumerate(part):
                n = int(s.mask[j].sum())
                r["loss"], r["entropy"] = s.losses[j, :n].tolist(), s.entropies[j, :n].tolist()
        return rows


@dataclass
class Shard:
    """One shard to write: where, how many traces, its task stream and what it kept so far."""

    split: str
    index: int
    want: int
    path: Path
    stream: dict | None = None  # the task stream's state before its next batch (None: not started)
    rows: list[dict] = field(default_factory=list)
    batches: int = 0

    def next_batch(self, env, cfg) -> tuple[list, int]:
        """The next batch of this shard's tasks, and the seed that generates it."""
        if self.batches == MAX_BATCHES:
            raise RuntimeError(
                f"shard {self.index} of {self.split}: only {len(self.rows)} of {self.want} traces "
                f"kept after {self.batches} batches; lower foresight.min_tokens or check the "
                "model's accuracy"
            )
        seed = cfg.seed + SPLIT_SEEDS[self.split]
        if self.stream is None:
            env.reset(seed=seed)
            if env.num_tasks is not None:  # a data set: past the tasks the earlier shards can draw
                env.tasks(self.index * MAX_BATCHES * cfg.sampling.batch_size)
            self.stream = {**env.state_dict(), "rng": np.random.default_rng([seed, self.index]).bit_generator.state}
        env.load_state_dict(self.stream)
        tasks = env.tasks(cfg.sampling.batch_size)
        self.stream, self.batches = env.state_dict(), self.batches + 1
        return tasks, cfg.seed + self.index * 1000 + self.batches


def write_splits(cfg) -> dict[str, Path]:
    """The train and held-out splits under output_dir/traces; the missing shards are
    generated on trace actors (none start when every shard is there)."""
    counts = {"train": cfg.foresight.traces, "heldout": cfg.foresight.heldout}
    folders = {split: Path(cfg.output_dir) / "traces" / split for split in counts}
    size = cfg.foresight.shard_size
    shards = [
        Shard(split, k, min(size, n - k * size), folders[split] / f"shard-{k:05d}.parquet")
        for split, n in counts.items()
        for k in range(-(-n // size))
    ]
    missing = [s for s in shards if not s.path.exists()]  # the others a previous run finished
    if missing:
        generate(cfg, missing, done=sum(s.want for s in shards if s.path.exists()))
    return folders


def generate(cfg, shards: list[Shard], done: int = 0) -> None:
    """Fill and write ``shards`` on ``workers.rollout`` trace actors: each round, every actor
    generates the next batch of its shard; a full shard is written and the actor takes the
    next one."""
    from kvrl.envs import make

    w, n = cfg.workers, min(cfg.workers.rollout, len(shards))
    env = make(cfg.env.id, **cfg.env.kwargs)  # the task streams; the actors score with their own copies
    queue, active = list(shards), {}  # active: actor -> the shard it generates
    own_ray, actors, inline = connect(cfg), [], w.address == INLINE
    try:
        reserve(cfg, rollout=n, learners=0)
        # a batch is a pure function of its arguments: Ray redoes it on a restarted actor
        options = dict(
            num_cpus=w.rollout_cpus,
            num_gpus=w.rollout_gpus,
            max_restarts=w.max_restarts,
            max_task_retries=w.max_restarts,
        )
        actors = [spawn(TraceWorker, options, cfg, inline=inline) for _ in range(n)]
        bar = tqdm(total=done + sum(s.want for s in queue), initial=done, desc="traces", unit="trace")
        while queue or active:
            for i in range(len(actors)):
                if i not in active and queue:
                    active[i] = queue.pop(0)
            refs = {i: actors[i].traces.remote(*shard.next_batch(env, cfg)) for i, shard in active.items()}
            for i, ref in refs.items():
                try:
                    active[i].rows += get(ref, f"trace worker {i}", w.timeout_s)
                except RayActorError as err:
                    raise_if_start_failed(err, f"trace worker {i}")
                    raise RuntimeError(
                        f"trace worker {i} died more than workers.max_restarts={w.max_restarts} times: {err}"
                    ) from None
                shard = active[i]
                if len(shard.rows) >= shard.want:
                    with atomic(shard.path) as tmp:
                        pq.write_table(pa.Table.from_pylist(shard.rows[: shard.want], schema=SCHEMA), tmp)
                    bar.update(shard.want)
                    del active[i]
        bar.close()
    finally:
        for actor in [] if inline else actors:
            ray.kill(actor, no_restart=True)
        if own_ray:
            ray.shutdown()
