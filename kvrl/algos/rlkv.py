"""RLKV: RL-guided per-head gates, from training to head-reallocated inference (job=rlkv).

"Which Heads Matter for Reasoning? RL-Guided KV Cache Compression" (seed 000; the
reference code's choices in ``reference/methods.md`` §3)::

    python -m kvrl.run recipe=tiny_rlkv        # train, then export gates + plots to output_dir

Contract:

* **Gates** α [layers, kv_heads], one raw scalar per (layer, KV head), init 1.0, no
  sigmoid: hard-clamped to [0, 1] before every update (the reference's
  ``clamp_adapter_weight``) and in what is pushed, so learner and rollouts hold the same
  values. The LLM is frozen; the optimizer holds only the gates.
* **Attention** of every head, in rollouts and in the learner, is
  ``α·full + (1−α)·(sink+recent)`` (:mod:`kvrl.kernels.mixed`, one definition for both):
  rollouts run on the vLLM engine with the gates pushed after every update
  (``pushes = "gates"``), the learner recomputes logprobs with
  ``HFEngine.score(policy=MixedGates)``; the loop logs the train/inference mismatch.
  The training window is ``rlkv.sink`` + ``rlkv.recent`` (exact windows; the reference
  trains with 128-token blocks and deploys exact windows).
* **Objective**: the GRPO core without KL plus the adaptive L1 penalty
  :func:`adaptive_penalty` on the mean reward r̄ of the learner's batch.
* **Export** (:func:`export_gates`): ``gates.tsv`` (one row per layer, one column per KV
  head: the layout of RLKV's released ``head_dist`` files and DuoAttention's) and
  ``gates.safetensors`` (``gates`` [L, H] and ``ranking`` [L·H]: flat indices
  ``layer·H + head``, most important first), plus a gate-distribution plot and the
  reward / mean-gate curve. :func:`head_allocation` turns exported gates and a sparsity
  into the :class:`kvrl.policies.HeadAllocation` that both engines deploy (top heads
  full, the rest ``rlkv.eval_sink`` + ``rlkv.eval_recent``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kvrl.algos.grpo import grpo_loss
from kvrl.kernels.mixed import MixedGates
from kvrl.policies.heads import HeadAllocation
from kvrl.workers.controller import Controller, plot_rewards
from kvrl.workers.controller import main as controller_main

GATES_FILE = "gates.safetensors"


def adaptive_penalty(gates: Tensor, mean_reward: float | Tensor, beta: float, tau: float) -> Tensor:
    """RLKV's adaptive L1 penalty (Eq. 4; ``areal/mixed_attn/loss.py``):

        𝟙(r̄ > τ) · β · (exp(r̄) − 1) · mean|α|

    gates [layers, kv_heads] (differentiable); mean_reward r̄: the raw mean reward of the
    batch (not the advantages). Zero — with zero gradient — while r̄ ≤ τ, so a policy whose
    reasoning broke down is no longer pushed further towards compression.
    """
    r = float(mean_reward)
    weight = beta * math.expm1(r) if r > tau else 0.0
    return weight * gates.abs().mean()


class RLKV:
    """The algorithm of ``rl.algo=rlkv``: gates α [layers, kv_heads] trained with GRPO
    (no KL) plus :func:`adaptive_penalty`; see the module docstring."""

    pushes = "gates"

    def __init__(self, cfg):
        if cfg.kv.policy != "full":
            raise ValueError(f"rlkv mixes full and sink+recent attention per head, but kv.policy={cfg.kv.policy!r}; "
                             "set kv.policy=full (the window is rlkv.sink / rlkv.recent)")
        if cfg.rl.beta != 0:
            raise ValueError(f"rl.beta={cfg.rl.beta}: RLKV trains without the KL term (and the LLM is frozen); "
                             "set rl.beta=0")
        self.rl, self.rlkv, self.temperature = cfg.rl, cfg.rlkv, cfg.sampling.temperature
        self.gates: torch.nn.Parameter | None = None  # on learners, after setup()

    def mixed(self, gates: Tensor) -> MixedGates:
        return MixedGates(gates, sink=self.rlkv.sink, recent=self.rlkv.recent)

    def rollout_policy(self, model) -> MixedGates:
        cfg = model.config  # the architecture only: rollout workers may hold a meta-device model
        return self.mixed(torch.ones(cfg.num_hidden_layers, cfg.num_key_value_heads))

    def setup(self, model, tokenizer) -> list[torch.nn.Parameter]:
        cfg = model.config
        # float32 whatever the model's dtype: Adam steps of 1e-2 on a bf16 value near 1 would round away
        self.gates = torch.nn.Parameter(torch.ones(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                   device=model.device))
        return [self.gates]

    def loss(self, engine, batch):
        with torch.no_grad():  # the reference clamps before every micro-batch; no sigmoid
            self.gates.clamp_(0.0, 1.0)
        scores = engine.score(batch.sequences, batch.prompt_lens, policy=self.mixed(self.gates),
                              temperature=self.temperature)
        rl = self.rl
        pg, metrics = grpo_loss(scores.logprobs, batch.old_logprobs, batch.advantages, scores.mask,
                                eps_low=rl.eps_low, eps_high=rl.eps_high, aggregation=rl.aggregation,
                                num_items=batch.num_items)
        # r̄ of this learner's part: the reference's micro-batch mean (the whole step with one learner)
        mean_reward = batch.rewards.float().mean().item()
        penalty = adaptive_penalty(self.gates, mean_reward, self.rlkv.beta, self.rlkv.tau)
        g = self.gates.detach()
        metrics.update(pg_loss=pg.item(), penalty=penalty.item(), gate_mean=g.mean().item(),
                       gate_min=g.min().item(), gate_max=g.max().item(),
                       **{f"gate/{l}.{h}": g[l, h].item() for l in range(g.shape[0]) for h in range(g.shape[1])})
        return pg + penalty, scores, metrics

    def state(self, model) -> dict[str, Tensor]:
        # clamped, so the rollouts' gates are the values the next loss() computes with
        return {"gates": self.gates.detach().clamp(0.0, 1.0).cpu()}

    def load(self, model, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            self.gates.copy_(state["gates"])


# ---- export and deployment ----------------------------------------------------------------


def ranking(gates: Tensor) -> Tensor:
    """Flat head indices ``layer·H + head``, most important first: the reverse of the order
    in which :class:`HeadAllocation` compresses heads (equal gates: the higher index first)."""
    order = torch.sort(torch.as_tensor(gates).flatten().double(), stable=True).indices
    return order.flip(0)


def export_gates(gates: Tensor, out: str | Path, *, sink: int, recent: int) -> dict[str, Path]:
    """Write ``gates.tsv`` and ``gates.safetensors`` (gates + ranking) to ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gates = torch.as_tensor(gates, dtype=torch.float32).detach().cpu()
    tsv = out / "gates.tsv"
    np.savetxt(tsv, gates.numpy(), delimiter="\t", fmt="%.6f")
    st = out / GATES_FILE
    save_file({"gates": gates.contiguous(), "ranking": ranking(gates).contiguous()}, str(st),
              metadata={"method": "rlkv", "train_sink": str(sink), "train_recent": str(recent)})
    return {"tsv": tsv, "safetensors": st}


def load_gates(path: str | Path) -> Tensor:
    """Gates [layers, kv_heads] from a ``gates.safetensors``, a ``gates.tsv``, or the folder
    (an rlkv run's output_dir) that holds one."""
    path = Path(path)
    if path.is_dir():
        path = path / GATES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no RLKV gates at {path}: pass rlkv.gates=<an rlkv run's output_dir, "
                                f"or its {GATES_FILE} / gates.tsv> (python -m kvrl.run recipe=tiny_rlkv writes them)")
    if path.suffix == ".tsv":
        return torch.from_numpy(np.loadtxt(path, delimiter="\t", ndmin=2)).float()
    from safetensors.torch import load_file

    return load_file(str(path))["gates"]


def head_allocation(gates: str | Path | Tensor, sparsity: float, model_config, *, sink: int = 16,
                    recent: int = 64) -> HeadAllocation:
    """The deployment of RLKV's gates: the round(s·L·H) lowest-gated heads keep sink +
    recent, the others the full cache; ``policy=`` of either engine."""
    g = gates if isinstance(gates, Tensor) else load_gates(gates)
    return HeadAllocation(gates=g, sparsity=sparsity, layers=model_config.num_hidden_layers,
                          kv_heads=model_config.num_key_value_heads, sink=sink, recent=recent)


def plot_gates(gates: Tensor, path: Path, title: str) -> None:
    """The gate distribution: a histogram and the [layer, KV head] map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = gates.float().numpy()
    fig, (hist, grid) = plt.subplots(1, 2, figsize=(8, 3.5))
    hist.hist(g.flatten(), bins=np.linspace(0, 1, 21), color="C0", edgecolor="k")
    hist.set_xlabel("gate α")
    hist.set_ylabel("heads")
    im = grid.imshow(g, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    grid.set_xticks(range(g.shape[1]) if g.shape[1] <= 16 else [])
    grid.set_yticks(range(g.shape[0]) if g.shape[0] <= 48 else [])
    grid.set_xlabel("KV head")
    grid.set_ylabel("layer")
    if g.size <= 64:
        for (l, h), v in np.ndenumerate(g):
            grid.text(h, l, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
    fig.colorbar(im, ax=grid, label="α")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curve(records: list[dict], path: Path, title: str) -> None:
    """Reward and mean gate per step, with the penalty's on/off steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward_mean"] for r in records], color="C0", marker="o", ms=3, label="reward (mean)")
    ax.plot(steps, [r["gate_mean"] for r in records], color="C1", lw=2, label="gate α (mean over heads)")
    ax.plot(steps, [r["gate_min"] for r in records], color="C1", lw=0.8, ls="--", label="gate α (min)")
    on = [s for s, r in zip(steps, records) if r["penalty"] > 0]
    ax.scatter(on, [0.0] * len(on), marker="|", color="C3", label="L1 penalty active (r̄ > τ)")
    ax.set_xlabel("step")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class RLKVController(Controller):
    """The RL loop of :mod:`kvrl.workers.controller`; at the end it exports the gates and
    their plots instead of a copy of the (frozen) model."""

    def finish(self) -> None:
        state_ref, _ = self.learners[0].state.remote()
        gates = self.get(state_ref, "learner 0 (state)")["gates"]
        r = self.cfg.rlkv
        files = export_gates(gates, self.out, sink=r.sink, recent=r.recent)
        records = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]
        title = f"{self.cfg.run_name}: rlkv on {self.cfg.env.id} (β={r.beta:g}, τ={r.tau:g})"
        plot_rewards(records, self.out / "reward.png", title)
        plot_gates(gates, self.out / "gates.png", title)
        plot_curve(records, self.out / "reward_gates.png", title)
        print(f"gates -> {files['tsv']}, {files['safetensors']}; plots -> {self.out}/gates.png, reward_gates.png\n"
              f"gates (rows = layers, columns = KV heads):\n{np.array2string(gates.numpy(), precision=3)}")
        if self.writer is not None:
            self.writer.close()


def main(cfg) -> dict:
    return controller_main(cfg, RLKVController)
