"""job=rlkv: train RLKV's per-head gates on the shared Ray controller, then export them.

    python -m kvrl.run recipe=tiny_rlkv

The RL loop is job=rl's (:class:`kvrl.workers.controller.Controller`) with
``rl.algo=rlkv`` (:class:`kvrl.algos.rlkv.RLKV`: gates trained by GRPO plus the adaptive
L1 penalty, pushed to vLLM rollouts after every update). At the end, instead of a copy of
the frozen model, the run leaves in ``output_dir``:

* ``gates.tsv`` / ``gates.safetensors`` (gates + head ranking; :mod:`kvrl.policies.heads`),
  which ``job=eval`` deploys as head reallocation (``eval.settings.NAME: {policy: heads, run: <output_dir>}``);
* ``gates.png`` (the distribution and the [layer, head] map), ``reward_gates.png`` (reward,
  mean and min gate per step, where the penalty was on) and ``reward.png``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvrl.jobs import rl
from kvrl.policies.heads import export_gates
from kvrl.runlog import plot_rewards, pyplot
from kvrl.workers.controller import Controller


class RLKVController(Controller):
    def finish(self) -> None:
        state_ref, _ = self.learners[0].state.remote()
        gates = self.get(state_ref, "learner 0 (state)")["gates"]
        r = self.cfg.rlkv
        files = export_gates(gates, self.out, sink=r.sink, recent=r.recent)
        records = self.runlog.records()
        title = f"{self.cfg.run_name}: rlkv on {self.cfg.env.id} (β={r.l1_coef:g}, τ={r.tau:g})"
        plot_rewards(records, self.out / "reward.png", title)
        plot_gates(gates, self.out / "gates.png", title)
        plot_curve(records, self.out / "reward_gates.png", title)
        print(
            f"gates -> {files['tsv']}, {files['safetensors']}; plots -> {self.out}/gates.png, reward_gates.png\n"
            f"gates (rows = layers, columns = KV heads):\n{np.array2string(gates.numpy(), precision=3)}"
        )


def plot_gates(gates: torch.Tensor, path, title: str) -> None:
    """The gate distribution: a histogram and the [layer, KV head] map."""
    plt = pyplot()
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


def plot_curve(records: list[dict], path, title: str) -> None:
    """Reward and mean gate per step, with the penalty's on/off steps."""
    plt = pyplot()
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


def main(cfg) -> dict:
    return rl.main(cfg, RLKVController)
