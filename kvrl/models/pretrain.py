"""Train the tiny reasoner from scratch on the chains task (``recipe=tiny_pretrain``).

Fresh tasks every batch, loss on the chain of thought only, AdamW with warm-up and a
cosine schedule over a fixed number of steps (not wall time, so a seed reproduces a run),
and a curriculum that grows the number of statements and the query depth over the first
40 % of training: tiny_reasoner.md found that lookups are learned abruptly on small tasks
and not at all when the full-size task comes first.
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

from kvrl.envs.chains import ChainSpec, make_chain_task
from kvrl.models.tiny import build_tokenizer, tiny_config

EVAL_SPEC = ChainSpec()


def curriculum(progress: float) -> ChainSpec:
    """Task sizes at a point of training; at the end slightly wider than ``EVAL_SPEC``."""
    p = min(1.0, progress / 0.4)
    kmax = round(12 + p * (42 - 12))
    dmax = round(2 + p * (12 - 2))
    return ChainSpec(min_statements=max(dmax + 2, kmax - 16), max_statements=kmax,
                     min_depth=max(1, dmax - 8), max_depth=dmax)


def encode_batch(tokenizer, tasks: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels (-100 on the prompt and padding)."""
    rows, labels = [], []
    for t in tasks:
        prompt = tokenizer(t["prompt"])["input_ids"]
        cot = tokenizer(t["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + cot)
        labels.append([-100] * len(prompt) + cot)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, lab


def boxed_accuracy(engine, tasks: list[dict], max_new_tokens: int = 160, death=None) -> float:
    """Greedy accuracy: the completion's ``\\boxed{ d }`` equals the answer."""
    from kvrl.engines.hf import Sampling

    out = engine.generate([t["prompt"] for t in tasks], Sampling(max_new_tokens), death=death)
    return float(np.mean([f"\\boxed{{ {t['answer']} }}" in text for t, text in zip(tasks, out.texts)]))


def main(cfg) -> dict:
    from kvrl.engines.hf import HFEngine

    tr = cfg.trainer
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    held_out = [make_chain_task(np.random.default_rng(10**6 + cfg.seed + i)) for i in range(64)]
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(tiny_config(tokenizer)).to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(0.9, 0.95), weight_decay=tr.weight_decay)

    def lr_at(step: int) -> float:
        if step < tr.warmup_steps:
            return (step + 1) / tr.warmup_steps
        p = (step - tr.warmup_steps) / max(1, tr.steps - tr.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "metrics.jsonl", "w")
    t0, tokens = time.time(), 0
    bar = tqdm(range(tr.steps), desc="pretrain tiny reasoner", mininterval=5)
    for step in bar:
        # ---- one step on fresh tasks
        model.train()
        spec = curriculum(step / tr.steps)
        ids, labels = encode_batch(tokenizer, [make_chain_task(rng, spec) for _ in range(tr.batch_size)])
        ids, labels = ids.to(cfg.device), labels.to(cfg.device)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens += ids.numel()
        # ---- logging; greedy held-out accuracy a few times per run
        if step % tr.log_every == 0 or step == tr.steps - 1:
            rec = {"step": step, "loss": loss.item(), "lr": sched.get_last_lr()[0],
                   "max_statements": spec.max_statements, "max_depth": spec.max_depth,
                   "tokens_per_s": tokens / (time.time() - t0), "elapsed_s": time.time() - t0}
            if step % (tr.log_every * 10) == 0 or step == tr.steps - 1:
                model.eval()
                rec["held_out_acc"] = boxed_accuracy(HFEngine(model, tokenizer), held_out)
                model.set_attn_implementation("sdpa")
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{rec['loss']:.3g}", acc=rec.get("held_out_acc", "-"))
    model.eval()
    model.save_pretrained(out_dir / "model")
    tokenizer.save_pretrained(out_dir / "model")
    print(f"saved {out_dir / 'model'}; ship it with: cp -r {out_dir / 'model'}/. kvrl/models/weights/tiny_reasoner/")
    return rec
