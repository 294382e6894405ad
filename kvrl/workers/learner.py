"""Learner: a Ray actor that owns the trainable model and its optimizer.

With ``workers.learners > 1`` the learners are data parallel: each takes a contiguous part
of the step's samples, divides its loss by the *whole* step's normaliser
(``Batch.num_items``), and the gradients are summed over one process group (gloo on CPU,
NCCL on GPU), so N learners compute exactly the gradient one learner would. This is DDP's
arithmetic without its module wrapper: the engine and the algorithm call the bare model
(``engine.score``), which a ``DistributedDataParallel`` wrapper would hide. With
``workers.backend=deepspeed`` DeepSpeed ZeRO (stage 1 or 2) owns the optimizer instead.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from kvrl.algos import make_algo
from kvrl.algos.base import Sample, micro_batches
from kvrl.algos.push import Push
from kvrl.engines.hf import HFEngine
from kvrl.models.tiny import load_model
from kvrl.policies.regime import checksum
from kvrl.runlog import SUMS, disk_full_names, seal, setup_process

ADAM_BETAS = (0.9, 0.99)  # the learner's AdamW moments (ZeRO steps this same optimizer)

# metrics that add up over micro-batches (each is already divided by the whole step's count)
SUMMED = ("tokens", "pg_loss", "penalty")


def merge_metrics(results: list[tuple[dict, int]]) -> dict:
    """The share's metrics from its micro-batches' (metrics, scored tokens): sums for
    :data:`SUMMED`, extremes for ``*_max`` / ``*_min``, token-weighted means otherwise."""
    if len(results) == 1:
        return dict(results[0][0])
    weight = sum(n for _, n in results) or 1
    merged = {}
    for key, value in results[0][0].items():
        values = [m[key] for m, _ in results]
        if not isinstance(value, (int, float)) or key.startswith("gate"):  # gates: the same in every part
            merged[key] = value
        elif key in SUMMED:
            merged[key] = sum(values)
        elif key.endswith("_max"):
            merged[key] = max(values)
        elif key.endswith("_min"):
            merged[key] = min(values)
        else:
            merged[key] = sum(v * n for v, (_, n) in zip(values, results)) / weight
    return merged


# ZeRO holds the reduced gradients and clips inside its step: an update cannot be skipped there
DEEPSPEED_STOPS = (
    "; workers.backend=deepspeed cannot skip an update, so the run stops here (resume=auto continues "
    "from the last checkpoint): lower trainer.lr, or use workers.backend=ddp, which skips such updates "
    "(up to trainer.max_nonfinite_steps in a row)"
)


@ray.remote
class Learner:
    def __init__(self, cfg, rank: int, world: int):
        setup_process(cfg.seed)  # one thread (actors share cores), denormals flushed (fp32 Adam on CPU)
        self.cfg, self.rank, self.world = cfg, rank, world
        model, tokenizer = load_model(cfg.model.path, cfg.model.dtype, cfg.device)
        self.algo = make_algo(cfg)
        self.params = self.algo.setup(model, tokenizer)
        model.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)
        model.train()
        if cfg.trainer.gradient_checkpointing:  # activations of one layer at a time, recomputed in backward
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine, self.tokenizer = HFEngine(model, tokenizer), tokenizer
        tr = cfg.trainer
        self.opt = torch.optim.AdamW(self.params, lr=tr.lr, betas=ADAM_BETAS, weight_decay=tr.weight_decay)
        self.ds = None  # the DeepSpeed engine, backend=deepspeed
        self.version = 0  # number of updates applied = the policy version of the weights

    # ---- process group --------------------------------------------------------------------

    def endpoint(self) -> str:
        """host:port for the process group's rendezvous (called on rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, endpoint: str) -> None:
        """Join the learners' process group (every rank calls this at once)."""
        backend = "nccl" if torch.device(self.cfg.device).type == "cuda" else "gloo"
        host, port = endpoint.rsplit(":", 1)
        os.environ.update(
            MASTER_ADDR=host, MASTER_PORT=port, RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(self.world)
        )
        timeout = timedelta(seconds=self.cfg.workers.timeout_s)
        if self.cfg.workers.backend == "ddp":
            dist.init_process_group(backend, rank=self.rank, world_size=self.world, timeout=timeout)
            return
        import deepspeed  # only here: importing it costs seconds and prints an accelerator warning

        # The first init_distributed JIT-compiles DeepSpeed's shared-memory op with g++ for
        # 35-45 s; gloo does not need it.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.cfg.trainer.max_grad_norm,
            "zero_optimization": {"stage": self.cfg.workers.zero_stage},
            "zero_allow_untested_optimizer": True,
        }
        self.ds, self.opt, _, _ = deepspeed.initialize(
            model=self.engine.model, optimizer=self.opt, model_parameters=self.params, config=ds_config
        )

    # ---- the update ------------------------------------------------------------------------

    def step(self, samples: list[Sample], num_items: float, update: bool = True) -> dict:
        """One optimizer step on this learner's samples; returns its metrics.

        The share is scored in micro-batches of at most ``trainer.micro_batch_tokens`` padded
        tokens (ForesightKV: decisions x candidates; :func:`kvrl.algos.base.micro_batches`); each
        loss is divided by the whole step's ``num_items``, so the summed gradients are the whole
        share's. With ``update`` False (a step without reward signal, ``rl.no_signal=skip``) the
        share is only scored, for its metrics: no backward, no optimizer step, the weights and the
        optimizer's state as they were (``no_signal`` 1)."""
        tr = self.cfg.trainer
        parts = micro_batches(samples, tr.micro_batch_tokens, self.algo.size)
        rewards = torch.tensor([s.reward for s in samples], device=self.cfg.device)
        lr = tr.lr * min(1.0, (self.version + 1) / max(1, tr.warmup_steps))
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.ds is None:
            self.opt.zero_grad(set_to_none=True)
        total, results = 0.0, []
        for i, part in enumerate(parts):
            batch = self.algo.collate(part, num_items, self.cfg.device)
            batch.rewards, batch.first = rewards, i == 0
            with torch.set_grad_enabled(update):
                loss, scores, metrics = self.algo.loss(self.engine, batch)
            with torch.no_grad():
                # train/inference mismatch before the update: |behaviour − recomputed| per token
                on = batch.mask.bool()
                gap = (scores.logprobs.detach() - batch.old_logprobs).abs()[on]
                metrics.update(
                    mismatch_max=gap.max().item() if on.any() else 0.0,
                    mismatch_mean=gap.mean().item() if on.any() else 0.0,
                    entropy=scores.entropies.detach()[on].mean().item() if on.any() else 0.0,
                )
            if update and self.ds is not None:
                # DeepSpeed averages gradients over ranks; the loss already divides by the whole
                # step's count, so scale by the world size to get the sum back. Reduce and step
                # only after the last micro-batch.
                self.ds.set_gradient_accumulation_boundary(i == len(parts) - 1)
                self.ds.backward(loss * self.world)
            elif update:
                loss.backward()
            total += loss.item()
            results.append((metrics, int(on.sum())))
        # each rank's loss is its share: the step is bad when any share is not finite, decided alike on every rank
        bad = torch.tensor([float(not math.isfinite(total))], device=self.cfg.device)
        if self.world > 1:
            dist.all_reduce(bad)
        if not update:
            grad_norm, skipped = 0.0, False
        elif self.ds is not None:
            grad_norm, skipped = self.deepspeed_update(total, bool(bad.item())), False
        else:
            grad_norm, skipped = self.ddp_update(bool(bad.item()))
        self.version += 1  # a skipped update still counts: versions stay the controller's step count
        metrics = merge_metrics(results)
        metrics.update(
            loss=total,
            grad_norm=grad_norm,
            lr=lr,
            version=self.version,
            micro_batches=len(parts),
            skipped=float(skipped),
            no_signal=float(not update),
            ids=[s.id for s in samples],
        )
        if self.world > 1:  # the controller checks that data-parallel learners stay identical
            metrics["checksum"] = checksum(self.algo.state(self.engine.model))
        return metrics

    def deepspeed_update(self, total: float, bad: bool) -> float:
        """ZeRO's step on the reduced gradients (it clips inside); its gradient norm. A non-finite loss
        (``bad`` on any rank) or norm stops the run: ZeRO cannot skip an update."""
        if bad:
            raise FloatingPointError(f"the loss is not finite ({total}) at update {self.version + 1}" + DEEPSPEED_STOPS)
        self.ds.step()
        grad_norm = float(self.ds.get_global_grad_norm() or 0.0)
        if not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"the gradient norm is not finite ({grad_norm}) at update {self.version + 1}" + DEEPSPEED_STOPS
            )
        return grad_norm

    def ddp_update(self, bad: bool) -> tuple[float, bool]:
        """Sum the ranks' gradients, clip, and step; (the gradient norm, whether the update was skipped: a
        non-finite loss on any rank, ``bad``, or a non-finite norm)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.world > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per step
            dist.all_reduce(flat)
            offset = 0
            for p, g in zip(self.params, grads):
                p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
                offset += g.numel()
        max_norm = self.cfg.trainer.max_grad_norm if self.cfg.trainer.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm).item()
        # the reduced gradients' norm is the same on every rank, so the ranks skip together
        skipped = bad or not math.isfinite(grad_norm)
        if skipped:  # Adam would write the NaN into every weight and both moments for good
            self.opt.zero_grad(set_to_none=True)
        else:
            self.opt.step()
        return grad_norm, skipped

    # ---- weights out, checkpoints -------------------------------------------------------------

    @ray.method(num_returns=2)
    def state(self) -> tuple[Push, dict[str, str]]:
        """(the trainable state to push, :class:`kvrl.algos.push.Push`; the checksums of its
        parts, ``Push.digest``, which every rollout worker compares with what it holds)."""
        state = self.algo.state(self.engine.model)
        return state, state.digest()

    def save(self, path: str) -> None:
        """This learner's part of a checkpoint (the controller seals the folder when all are written);
        rank 0 adds the weights as a transformers folder, ``model/``, when the algorithm trains them."""
        path = Path(path)
        bad = [
            name
            for name, t in self.algo.state(self.engine.model).items()
            if t.is_floating_point() and not torch.isfinite(t).all()
        ]
        bad += [
            f"optimizer state {key} of parameter {i}"
            for i, group in enumerate(self.opt.state.values())
            for key, t in group.items()
            if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()
        ]
        if bad:  # a sealed checkpoint is what resume trusts: never seal NaN weights as a good state
            raise FloatingPointError(
                f"not saving the checkpoint {path}: non-finite values in {', '.join(bad[:5])}"
                f"{' ...' if len(bad) > 5 else ''}; the previous checkpoint stays the newest "
                "(resume=auto continues from it): lower trainer.lr or trainer.max_grad_norm"
            )
        if self.ds is not None:
            with disk_full_names(path / "deepspeed"):
                self.ds.save_checkpoint(str(path), tag="deepspeed")
        elif self.rank == 0:
            with disk_full_names(path / "learner.pt"):
                torch.save(
                    {
                        "trainables": self.algo.state(self.engine.model),
                        "optimizer": self.opt.state_dict(),
                        "torch_rng": torch.get_rng_state(),
                    },
                    path / "learner.pt",
                )
        if self.rank == 0 and self.algo.trains_weights:
            with disk_full_names(path / "model"):  # a folder of files: the error's own file name, if it has one
                self.export(str(path / "model"))

    def load(self, path: str, version: int) -> None:
        path = Path(path)
        self.version = version
        if self.ds is not None:
            self.ds.load_checkpoint(str(path), tag="deepspeed")
            return
        ckpt = torch.load(path / "learner.pt", weights_only=False)
        self.algo.load(self.engine.model, ckpt["trainables"])
        self.opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["torch_rng"])

    def export(self, path: str) -> None:
        """The model as a transformers folder (``load_model(path)`` / ``from_pretrained`` it), sealed:
        its SHA256SUMS, written last, is what says the export is whole (:func:`kvrl.runlog.trained_model`)."""
        (Path(path) / SUMS).unlink(missing_ok=True)  # a folder being rewritten is not whole
        self.engine.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        seal(path)
