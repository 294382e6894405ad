"""job=pretrain_tiny: train the tiny reasoner from scratch on running counts.

    python -m kvrl.run recipe=tiny_pretrain


Fresh tasks every batch, loss on the chain of thought only, AdamW with warm-up and a cosine
schedule over a fixed number of steps (not wall time, so a seed reproduces a run).

Why running counts (``kvrl/counts-v0``), measured on this stack while designing it:
variable chains (``kvrl/chains-v0``, tiny_reasoner.md's attempt 4) kept their
content-keyed prompt lookup at chance for 1,400 steps with sparse- and dense-lookup
curricula, and plain key-value recall among 12 pairs stayed at chance for 400 steps, while
a read at a fixed distance was learned in ~100 steps. A running sum mod 10 stalled at
chance too (one operand says nothing about the sum); a count has partial signal (below 5
the count is copied). Counts reach ~0.9 teacher-forced accuracy in ~200 steps.
It trains on one thread: two threads oversubscribed by other processes were up to 10x
slower, and one thread makes the run reproducible across machines with a different count.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM

from kvrl.engines.hf import HFEngine, Sampling
from kvrl.envs.counts import make_count_task
from kvrl.kernels.replay import NEVER, Replay
from kvrl.models.tiny import build_tokenizer, tiny_config
from kvrl.runlog import RunLog, seal, setup_process

def cot_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Teacher-forced next-token accuracy on the chain of thought."""
    pred, cur = logits[:, :-1].argmax(-1), labels[:, 1:]
    at = cur != -100
    return float((pred[at] == cur[at]).float().mean())


def eviction_dropout(rng: np.random.Generator, tasks: list[dict], T: int, layers: int, heads: int,
                     p: float = 0.5) -> torch.Tensor:
    """Death pattern [layers, B, heads, T] for a batch: with probability p per row, every
    token the task no longer needs is evicted (each ``d ;`` pair survives until the step
    that copies it, plus BOS and a recent window of 2-24 tokens); other rows see the full
    causal context. Without it the model's reads depend diffusely on every token, and
    evicting even unneeded ones broke it (oracle at 50 % of the sequence: 0.01)."""
    k = torch.arange(T)
    rows = []
    for t in tasks:
        if rng.random() >= p:
            rows.append(torch.full((T,), NEVER))
            continue
        n = len(t["digits"])
        d = k + int(rng.integers(2, 25))
        d[0] = NEVER
        j = torch.arange(1, n + 1)
        for pos in (2 * j - 1, 2 * j):  # the digit and its ";" until the copy at 2n + 2j - 1
            d[pos] = torch.maximum(d[pos], 2 * n + 2 * j)
        rows.append(d)
    return torch.stack(rows).to(torch.int32)[None, :, None].expand(layers, -1, heads, -1).contiguous()


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


def boxed_accuracy(engine, tasks: list[dict], max_new_tokens: int = 160) -> float:
    """Greedy accuracy: the completion's ``\\boxed{ d }`` equals the answer."""
    out = engine.generate([t["prompt"] for t in tasks], Sampling(max_new_tokens))
    return float(np.mean([f"\\boxed{{ {t['answer']} }}" in text for t, text in zip(tasks, out.texts)]))


def main(cfg) -> dict:
    # ---- one thread: reproducible, and robust to other processes on the cores
    tr = cfg.trainer
    setup_process(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    held_out = [make_count_task(np.random.default_rng(10**6 + cfg.seed + i)) for i in range(64)]
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(tiny_config(tokenizer)).to(cfg.device)
    model.set_attn_implementation("kvrl_replay")
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(0.9, 0.95), weight_decay=tr.weight_decay)

    def lr_at(step: int) -> float:
        if step < tr.warmup_steps:
            return (step + 1) / tr.warmup_steps
        p = (step - tr.warmup_steps) / max(1, tr.steps - tr.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * p))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    out_dir = Path(cfg.output_dir)
    log = RunLog(out_dir, fresh=True)
    t0, tokens = time.time(), 0
    bar = tqdm(range(tr.steps), desc="pretrain tiny reasoner", mininterval=5)
    for step in bar:
        # ---- one step on fresh tasks
        model.train()
        tasks = [make_count_task(rng) for _ in range(tr.batch_size)]
        ids, labels = encode_batch(tokenizer, tasks)
        ids, labels = ids.to(cfg.device), labels.to(cfg.device)
        death = eviction_dropout(rng, tasks, ids.shape[1], model.config.num_hidden_layers,
                                 model.config.num_key_value_heads).to(cfg.device)
        pos = torch.arange(ids.shape[1], device=cfg.device).expand_as(ids)
        out = model(input_ids=ids, labels=labels, position_ids=pos, kvrl_replay=Replay(death, pos))
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens += ids.numel()
        # ---- logging; greedy held-out accuracy a few times per run
        if step % tr.log_every == 0 or step == tr.steps - 1:
            rec = {"step": step, "loss": loss.item(), "lr": sched.get_last_lr()[0],
                   "cot_acc": cot_accuracy(out.logits.detach(), labels),
                   "tokens_per_s": tokens / (time.time() - t0), "elapsed_s": time.time() - t0}
            if step % (tr.log_every * 10) == 0 or step == tr.steps - 1:
                model.eval()
                rec["held_out_acc"] = boxed_accuracy(HFEngine(model, tokenizer), held_out)
                model.set_attn_implementation("kvrl_replay")
            log.log(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3g}", cot=f"{rec['cot_acc']:.3f}", acc=rec.get("held_out_acc", "-"))
    # ---- save in the shipped layout
    log.close()
    model.eval()
    model.set_attn_implementation("sdpa")  # the saved config's default attention
    model.save_pretrained(out_dir / "model")
    tokenizer.save_pretrained(out_dir / "model")
    seal(out_dir / "model")  # whole: model.path=<output_dir> loads it (kvrl.runlog.trained_model)
    print(f"saved {out_dir / 'model'}; ship it with: cp -r {out_dir / 'model'}/. kvrl/models/weights/tiny_reasoner/")
    return rec
