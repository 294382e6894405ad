"""job=pretrain_tiny: train a tiny reasoner from scratch on a procedural task family.

    python -m kvrl.run recipe=tiny_pretrain            # running counts (the shipped "tiny")
    python -m kvrl.run recipe=tiny_multihop_pretrain   # multi-query chains ("tiny-multihop")

Fresh tasks every batch (``env.id``'s reference completions), loss on the chain of thought
only, AdamW with warm-up and a cosine schedule over a fixed number of steps (not wall time,
so a seed reproduces a run). ``pretrain.curriculum`` grows the task sizes from small to
``env.kwargs``'s over that fraction of the steps (environments with a size ``spec``).
A run checkpoints every ``pretrain.checkpoint_every`` steps (model, optimizer, schedule,
task stream and RNG) and ``resume=auto`` continues from the newest intact checkpoint, so a
stopped run loses at most that many steps and ends with the weights it would have had.

Running counts (``kvrl/counts-v0``) was chosen for the first reasoner because it trains in
minutes: a read at a fixed distance was learned in ~100 steps. It was trained with
``pretrain.eviction_dropout=0.5`` (rows whose unneeded tokens an oracle evicts), which made it
robust to exactly the evictions an oracle makes. The multi-query chains
(``kvrl/multihop-v0``) need content-keyed lookups; they are trained without eviction
dropout, so that the model meets compression as a real model does, untrained for it.

It trains on one thread on a CPU: two threads oversubscribed by other processes were up to
10x slower, and one thread makes the run reproducible across machines with a different count.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from kvrl.engines.base import Sampling
from kvrl.engines.hf import HFEngine
from kvrl.envs import make
from kvrl.envs.base import correct
from kvrl.kernels.reference.replay import NEVER, Replay
from kvrl.models.tiny import build_tokenizer, tiny_config
from kvrl.runlog import (
    RunLog,
    flatten,
    intact_checkpoint,
    mark_latest,
    resume_changes,
    save_torch,
    seal,
    setup_process,
    write_json,
)


def cot_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Teacher-forced next-token accuracy on the chain of thought."""
    pred, cur = logits[:, :-1].argmax(-1), labels[:, 1:]
    at = cur != -100
    return float((pred[at] == cur[at]).float().mean())


def eviction_dropout(rng: np.random.Generator, tasks, T: int, layers: int, heads: int, p: float = 0.5) -> torch.Tensor:
    """Running counts only: death pattern [layers, B, heads, T] for a batch; with probability
    p per row, every token the task no longer needs is evicted (each ``d ;`` pair survives
    until the step that copies it, plus BOS and a recent window of 2-24 tokens); other rows
    see the full causal context. Without it the counts model's reads depend diffusely on
    every token, and evicting even unneeded ones broke it (oracle at 50 % of the sequence: 0.01)."""
    k = torch.arange(T)
    rows = []
    for t in tasks:
        if rng.random() >= p:
            rows.append(torch.full((T,), NEVER))
            continue
        n = len(t.meta["digits"])
        d = k + int(rng.integers(2, 25))
        d[0] = NEVER
        j = torch.arange(1, n + 1)
        for pos in (2 * j - 1, 2 * j):  # the digit and its ";" until the copy at 2n + 2j - 1
            d[pos] = torch.maximum(d[pos], 2 * n + 2 * j)
        rows.append(d)
    return torch.stack(rows).to(torch.int32)[None, :, None].expand(layers, -1, heads, -1).contiguous()


def encode_batch(tokenizer, tasks) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on the prompt and padding) of the tasks'
    prompts and reference completions (``meta["completion"]``) ended by EOS."""
    rows, labels = [], []
    for t in tasks:
        prompt = tokenizer(t.prompt)["input_ids"]
        cot = tokenizer(t.meta["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + cot)
        labels.append([-100] * len(prompt) + cot)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, lab


def boxed_accuracy(engine, tasks, max_new_tokens: int) -> float:
    """Greedy accuracy: the completion's last ``\\boxed{}`` holds the answer."""
    out = engine.generate([t.prompt for t in tasks], Sampling(max_new_tokens))
    return float(np.mean([correct(t, text) for t, text in zip(tasks, out.texts)]))


def draw(env, spec, rng: np.random.Generator, n: int, frac: float):
    """n tasks from ``env`` at curriculum fraction ``frac`` (sizes from ``spec.scaled``)."""
    if spec is not None:
        env.spec = spec.scaled(frac)
    return [env.sample_task(rng) for _ in range(n)]


def task_streams(cfg):
    """``env.id``'s training environment, its size spec (None: none) and ``pretrain.eval_tasks`` held-out tasks
    (seeded apart from training); a ValueError when ``pretrain.curriculum`` has no spec to grow."""
    pc = cfg.pretrain
    env = make(cfg.env.id, **cfg.env.kwargs)
    spec = getattr(env, "spec", None)
    if pc.curriculum > 0 and not hasattr(spec, "scaled"):
        raise ValueError(
            f"pretrain.curriculum={pc.curriculum}: {cfg.env.id} has no size spec to grow; set pretrain.curriculum=0"
        )
    held_env = make(cfg.env.id, **cfg.env.kwargs)
    held_env.reset(seed=10**6 + cfg.seed)
    held_out = held_env.tasks(pc.eval_tasks)
    return env, spec, held_out


def build_model(cfg, tokenizer, attention: str):
    """A fresh tiny Llama of ``pretrain``'s shape on ``cfg.device`` with ``attention``, its AdamW optimizer
    and its schedule: linear warm-up over ``trainer.warmup_steps``, then cosine down to 5 % at ``trainer.steps``."""
    tr, pc = cfg.trainer, cfg.pretrain
    model = LlamaForCausalLM(
        tiny_config(
            tokenizer,
            layers=pc.layers,
            hidden=pc.hidden,
            kv_heads=pc.kv_heads,
            intermediate=pc.intermediate,
            max_positions=pc.max_positions,
        )
    )
    model = model.to(cfg.device)
    model.set_attn_implementation(attention)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(0.9, 0.95), weight_decay=tr.weight_decay)

    def lr_at(step: int) -> float:
        if step < tr.warmup_steps:
            return (step + 1) / tr.warmup_steps
        p = (step - tr.warmup_steps) / max(1, tr.steps - tr.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    return model, opt, sched


def resume_from(cfg, out_dir: Path, settings: dict, model, opt, sched, rng: np.random.Generator):
    """(checkpoint, step, tokens, elapsed_s) of the run ``cfg.resume`` continues, its state loaded into
    model, opt, sched, rng and torch's RNG; (None, 0, 0, 0.0) for a fresh run. A ValueError, with
    the fix, when the checkpoint's settings differ from ``settings`` beyond ``cfg.RESUMABLE``."""
    start, tokens, elapsed = 0, 0, 0.0
    path = (
        intact_checkpoint(out_dir / "checkpoints")
        if cfg.resume == "auto"
        else (None if cfg.resume == "never" else Path(cfg.resume))
    )
    if path is not None:
        changed = resume_changes(
            json.loads((path / "config.json").read_text()), settings, cfg.RESUMABLE, cfg.resume, path
        )
        if changed:
            raise ValueError(
                f"{out_dir} holds a pretraining run with other settings (checkpoint {path}):\n  "
                + "\n  ".join(changed)
                + "\nrerun with its settings to continue it, or pass "
                "resume=never (or another output_dir) to start afresh"
            )
        state = torch.load(path / "state.pt", weights_only=False, map_location=cfg.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        start, tokens, elapsed = state["step"], state["tokens"], state["elapsed_s"]
        print(f"resumed from {path} at step {start}")
    return path, start, tokens, elapsed


def checkpoint(
    out_dir: Path, settings: dict, model, opt, sched, rng: np.random.Generator, step: int, tokens: int, elapsed_s: float
) -> None:
    """Write, seal and mark as the latest ``<out_dir>/checkpoints/step_<step>``: everything
    :func:`resume_from` restores, and the run's ``settings``."""
    folder = out_dir / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    save_torch(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "rng": rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "tokens": tokens,
            "elapsed_s": elapsed_s,
        },
        folder / "state.pt",
    )
    write_json(folder / "config.json", settings)
    seal(folder)
    mark_latest(folder)


def train_step(cfg, model, opt, sched, tokenizer, tasks, rng: np.random.Generator):
    """One optimizer step on ``tasks`` (loss on the chain of thought, rows under eviction dropout when
    ``pretrain.eviction_dropout`` > 0); returns the model's output, the input ids and the labels."""
    tr, pc = cfg.trainer, cfg.pretrain
    ids, labels = encode_batch(tokenizer, tasks)
    ids, labels = ids.to(cfg.device), labels.to(cfg.device)
    pos = torch.arange(ids.shape[1], device=cfg.device).expand_as(ids)
    extra = {}
    if pc.eviction_dropout > 0:
        death = eviction_dropout(
            rng,
            tasks,
            ids.shape[1],
            model.config.num_hidden_layers,
            model.config.num_key_value_heads,
            pc.eviction_dropout,
        ).to(cfg.device)
        extra = {"kvrl_replay": Replay(death, pos)}
    out = model(input_ids=ids, labels=labels, position_ids=pos, **extra)
    loss = out.loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tr.max_grad_norm or float("inf"))
    opt.step()
    sched.step()
    return out, ids, labels


def save_model(model, tokenizer, out_dir: Path) -> None:
    """The model (default sdpa attention, on the CPU) and tokenizer, sealed, in ``<out_dir>/model``: the shipped layout."""
    model.eval()
    model.set_attn_implementation("sdpa")  # the saved config's default attention
    model.cpu().save_pretrained(out_dir / "model")
    tokenizer.save_pretrained(out_dir / "model")
    seal(out_dir / "model")  # whole: model.path=<output_dir> loads it (kvrl.runlog.trained_model)
    print(f"saved {out_dir / 'model'}; ship it with: cp -r {out_dir / 'model'}/. kvrl/models/weights/<name>/")


def main(cfg) -> dict:
    """Pretrain the tiny reasoner on ``env.id`` for ``trainer.steps`` steps (continuing a run per ``resume``),
    save it to ``<output_dir>/model`` and return the last logged row."""
    # ---- one thread on a CPU: reproducible, and robust to other processes on the cores
    tr, pc = cfg.trainer, cfg.pretrain
    setup_process(cfg.seed, threads=1 if cfg.device == "cpu" else None)
    out_dir = Path(cfg.output_dir)
    env, spec, held_out = task_streams(cfg)
    tokenizer = build_tokenizer()
    new_tokens = max(len(tokenizer(t.meta["completion"], add_special_tokens=False)["input_ids"]) for t in held_out) + 8
    attention = "kvrl_replay" if pc.eviction_dropout > 0 else "sdpa"
    model, opt, sched = build_model(cfg, tokenizer, attention)
    rng = np.random.default_rng(cfg.seed)

    # ---- resume: the newest intact checkpoint of this output_dir, if its settings are this run's
    settings = json.loads(json.dumps(flatten(cfg)))
    path, start, tokens, elapsed = resume_from(cfg, out_dir, settings, model, opt, sched, rng)
    log = RunLog(out_dir, fresh=path is None)
    log.trim(lambda row: row["step"] < start)

    t0 = time.time()
    rec: dict = {}
    bar = tqdm(range(start, tr.steps), desc=f"pretrain on {cfg.env.id}", mininterval=5, initial=start, total=tr.steps)
    for step in bar:
        # ---- one step on fresh tasks (sizes grown by the curriculum)
        model.train()
        frac = step / (pc.curriculum * tr.steps) if pc.curriculum > 0 else 1.0
        tasks = draw(env, spec, rng, tr.batch_size, frac)
        out, ids, labels = train_step(cfg, model, opt, sched, tokenizer, tasks, rng)
        tokens += ids.numel()
        # ---- logging; greedy held-out accuracy a few times per run
        last = step == tr.steps - 1
        if step % tr.log_every == 0 or last:
            now = elapsed + time.time() - t0
            rec = {
                "step": step,
                "loss": out.loss.item(),
                "lr": sched.get_last_lr()[0],
                "frac": min(frac, 1.0),
                "cot_acc": cot_accuracy(out.logits.detach(), labels),
                "tokens": tokens,
                "tokens_per_s": tokens / max(now, 1e-9),
                "elapsed_s": now,
            }
            if step % (tr.log_every * 10) == 0 or last:
                model.eval()
                rec["held_out_acc"] = boxed_accuracy(HFEngine(model, tokenizer), held_out, new_tokens)
                model.set_attn_implementation(attention)
            log.log(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3g}", cot=f"{rec['cot_acc']:.3f}", acc=rec.get("held_out_acc", "-"))
        if pc.checkpoint_every and (step + 1) % pc.checkpoint_every == 0 and not last:
            checkpoint(out_dir, settings, model, opt, sched, rng, step + 1, tokens, elapsed + time.time() - t0)
    log.close()
    save_model(model, tokenizer, out_dir)
    return rec
