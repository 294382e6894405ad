"""Head allocation: which KV heads keep the full cache and which keep sink + recent only.

Also the file format of RLKV's gates (:func:`export_gates` / :func:`load_gates`), which
:func:`head_allocation` turns into the allocation both engines deploy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kvrl.kernels import NEVER
from kvrl.runlog import SUMS, damage

GATES_FILE = "gates.safetensors"


@dataclass(kw_only=True)
class HeadAllocation:
    """RLKV / DuoAttention head allocation (RLKV arXiv 2510.08525; DuoAttention arXiv 2410.10819).

    Heads are ranked by their gate α (or any importance score, higher = more important)
    **globally** across layers, as DuoAttention's and RLKV's quantile threshold does; the
    ``round(s·L·H)`` lowest become compressed (sink + recent) heads, the rest keep the full
    cache. Unlike the quantile (plus U(0, 1e-6) noise to break ties), the count is exact
    and ties are broken deterministically: among equal gates, the lower flat index
    ``layer·H + head`` is compressed first. ``round`` is round-half-up. Gates are not
    clipped to [0, 1] (the learner already clamps them), so clipping cannot create ties.

    Parameters
    ----------
    gates : Tensor [layers, kv_heads] (or anything ``torch.as_tensor`` accepts)
    sparsity : float
        s in [0, 1], the fraction of heads compressed.
    layers, kv_heads : int
        The model's geometry; ``gates`` must have this shape.
    sink : int, default 16
    recent : int, default 64
        RLKV's evaluation setting (16 sink + 64 recent).
    """

    gates: Tensor
    sparsity: float
    layers: int
    kv_heads: int
    sink: int = 16
    recent: int = 64

    def __post_init__(self):
        self.gates = torch.as_tensor(self.gates)
        if tuple(self.gates.shape) != (self.layers, self.kv_heads):
            raise ValueError(
                f"gates has shape {tuple(self.gates.shape)}, expected (layers, kv_heads) = "
                f"{(self.layers, self.kv_heads)}: pass one gate per (layer, KV head)"
            )
        if not 0.0 <= self.sparsity <= 1.0:
            raise ValueError(f"sparsity={self.sparsity}: must be in [0, 1] (fraction of heads compressed)")
        if self.sink < 0:
            raise ValueError(f"sink={self.sink}: must be ≥ 0")
        if self.recent < 1:
            raise ValueError(f"recent={self.recent}: must be ≥ 1 (a token must see itself)")

    def compressed_mask(self) -> Tensor:
        """Bool [layers, kv_heads]: True for the round(s·L·H) compressed heads."""
        total = self.layers * self.kv_heads
        count = int(self.sparsity * total + 0.5)
        order = torch.sort(self.gates.flatten().double(), stable=True).indices
        mask = torch.zeros(total, dtype=torch.bool, device=self.gates.device)
        mask[order[:count]] = True
        return mask.view(self.layers, self.kv_heads)

    def death(self, length: int) -> Tensor:
        """Int32 [layers, kv_heads, length] eviction trace (``kvrl.kernels.reference.replay``).

        Full heads: ``NEVER``. Compressed heads: key k < sink is never evicted; key
        k ≥ sink dies at ``k + recent``, so it is seen by the queries k … k+recent−1.
        """
        window = sink_recent_death(length, self.sink, self.recent, self.gates.device)
        return torch.where(self.compressed_mask()[..., None], window, window.new_tensor(NEVER))


@dataclass(kw_only=True)
class Window:
    """Sink + recent on every head (StreamingLLM's pattern as a static mask; RLKV's
    compressed heads, and its mixed attention at α = 0): a pattern for
    :class:`kvrl.policies.Static`.

    Parameters
    ----------
    sink, recent : int
        Key k < sink is never evicted; key k ≥ sink is seen by the queries k … k+recent−1.
    layers, kv_heads : int
        The model's geometry.
    """

    sink: int
    recent: int
    layers: int
    kv_heads: int

    def __post_init__(self):
        if self.sink < 0:
            raise ValueError(f"sink={self.sink}: must be ≥ 0")
        if self.recent < 1:
            raise ValueError(f"recent={self.recent}: must be ≥ 1 (a token must see itself)")

    @classmethod
    def of(cls, model_config, sink: int, recent: int) -> Window:
        """The window for every head of a transformers ``model_config``."""
        return cls(
            sink=sink, recent=recent, layers=model_config.num_hidden_layers, kv_heads=model_config.num_key_value_heads
        )

    def death(self, length: int) -> Tensor:
        """Int32 [layers, kv_heads, length] (:func:`sink_recent_death` on every head)."""
        return sink_recent_death(length, self.sink, self.recent).expand(self.layers, self.kv_heads, length)


def sink_recent_death(length: int, sink: int, recent: int, device=None) -> Tensor:
    """Int32 [length]: the death times of a sink + recent window (StreamingLLM's pattern,
    RLKV's compressed heads): key k < sink is never evicted; key k ≥ sink dies at
    ``k + recent``, so it is seen by the queries k … k+recent−1."""
    k = torch.arange(length, dtype=torch.int64, device=device)
    return torch.where(k < sink, NEVER, (k + recent).clamp(max=NEVER)).to(torch.int32)


# ---- RLKV's gates: the file format and their deployment ------------------------------------


def ranking(gates: Tensor) -> Tensor:
    """Flat head indices ``layer·H + head``, most important first: the reverse of the order
    in which :class:`HeadAllocation` compresses heads (equal gates: the higher index first)."""
    order = torch.sort(torch.as_tensor(gates).flatten().double(), stable=True).indices
    return order.flip(0)


def export_gates(gates: Tensor, out: str | Path, *, sink: int, recent: int) -> dict[str, Path]:
    """Write ``gates.tsv`` (one row per layer, one column per KV head: the layout of RLKV's
    released ``head_dist`` files and DuoAttention's) and ``gates.safetensors`` (``gates``
    [L, H] and ``ranking`` [L·H]) to ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gates = torch.as_tensor(gates, dtype=torch.float32).detach().cpu()
    tsv = out / "gates.tsv"
    np.savetxt(tsv, gates.numpy(), delimiter="\t", fmt="%.6f")
    st = out / GATES_FILE
    save_file(
        {"gates": gates.contiguous(), "ranking": ranking(gates).contiguous()},
        str(st),
        metadata={"method": "rlkv", "train_sink": str(sink), "train_recent": str(recent)},
    )
    return {"tsv": tsv, "safetensors": st}


def load_gates(path: str | Path) -> Tensor:
    """Gates [layers, kv_heads] from a ``gates.safetensors``, a ``gates.tsv``, or the folder
    (an rlkv run's output_dir) that holds one."""
    path = Path(path)
    if path.is_dir():
        path = path / GATES_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no RLKV gates at {path}: point eval.settings.NAME.run at an rlkv run's "
            f"output_dir, or its {GATES_FILE} / gates.tsv (python -m kvrl.run recipe=tiny_rlkv writes them)"
        )
    # a folder sealed by a SHA256SUMS (the shipped tiny_artefacts) vouches for its files: a flipped bit is refused
    why = damage(path.parent, only=path.name) if (path.parent / SUMS).is_file() else None
    if why is not None:
        raise ValueError(
            f"the RLKV gates {path} are damaged: {why}; restore the file (shipped with kvrl: reinstall "
            f"kvrl, or `git checkout -- {path}` in a clone) or regenerate it with the run that wrote it "
            "(python -m kvrl.run recipe=tiny_rlkv writes gates.safetensors)"
        )
    if path.suffix == ".tsv":
        gates = torch.from_numpy(np.loadtxt(path, delimiter="\t", ndmin=2)).float()
    else:
        from safetensors.torch import load_file

        gates = load_file(str(path))["gates"]
    bad = int((~torch.isfinite(gates)).sum())
    if bad:  # NaN gates sort anywhere: the heads compressed would be arbitrary
        raise ValueError(
            f"the RLKV gates {path} hold {bad} of {gates.numel()} values that are not finite; regenerate "
            "the file with the run that wrote it (python -m kvrl.run recipe=tiny_rlkv writes "
            "gates.safetensors)"
        )
    return gates


def head_allocation(
    gates: str | Path | Tensor, sparsity: float, model_config, *, sink: int = 16, recent: int = 64
) -> HeadAllocation:
    """The deployment of RLKV's gates: the round(s·L·H) lowest-gated heads keep sink +
    recent, the others the full cache; ``policy=`` of either engine."""
    if isinstance(gates, Tensor):
        return HeadAllocation(
            gates=gates,
            sparsity=sparsity,
            layers=model_config.num_hidden_layers,
            kv_heads=model_config.num_key_value_heads,
            sink=sink,
            recent=recent,
        )
    g = load_gates(gates)
    shape = (model_config.num_hidden_layers, model_config.num_key_value_heads)
    if tuple(g.shape) != shape:  # gates of another model
        raise ValueError(
            f"the RLKV gates {gates} have shape {tuple(g.shape)}, but the model has (layers, KV heads) = "
            f"{shape}: they were trained on another model; evaluate them with that run's model.path"
        )
    return head_allocation(g, sparsity, model_config, sink=sink, recent=recent)
