"""job=pretrain_tiny's section (`pretrain.*`) and rules (the job: :mod:`kvrl.jobs.pretrain_tiny`).

The tiny reasoner trained from scratch on env.id's reference completions. Its shape: query heads of
size 32 (hidden / 32 of them) in kv_heads groups, tied embeddings. Light on purpose (no torch): the
config gate imports it.
"""

from dataclasses import dataclass

from kvrl.section import checked, register_section


@dataclass
class PretrainConfig:
    layers: int = checked(4, ge=1)
    hidden: int = checked(128, lambda v: v >= 32 and v % 32 == 0, "must be a multiple of 32 (query heads of size 32)")
    kv_heads: int = checked(2, ge=1)
    intermediate: int = checked(384, ge=1)  # MLP width
    max_positions: int = checked(1024, ge=64)
    # grow the task sizes from small to env.kwargs's over this fraction of trainer.steps (0 = full size from
    # the start; environments with a size spec, e.g. kvrl/multihop-v0)
    curriculum: float = checked(0.0, lambda v: 0 <= v <= 1, "must be a fraction in [0, 1]")
    # kvrl/counts-v0 only: the share of rows whose unneeded tokens an oracle evicts (the shipped counts
    # reasoner's 0.5); 0 = the full causal context, as a real model is trained
    eviction_dropout: float = checked(0.0, lambda v: 0 <= v < 1, "must be in [0, 1)")
    checkpoint_every: int = checked(0, ge=0)  # steps between resumable checkpoints (0 = none)
    eval_tasks: int = checked(64, ge=1)  # held-out tasks of the greedy accuracy in the log


def problems(cfg) -> list[str]:
    p = cfg.pretrain
    if (p.hidden // 32) % p.kv_heads:
        return [
            f"pretrain.kv_heads={p.kv_heads} must divide the {p.hidden // 32} query heads of "
            f"pretrain.hidden={p.hidden}; set pretrain.kv_heads to a divisor of {p.hidden // 32}"
        ]
    if p.eviction_dropout > 0 and cfg.env.id != "kvrl/counts-v0":
        return [
            f"pretrain.eviction_dropout={p.eviction_dropout} is the counts task's oracle eviction, but "
            f"env.id={cfg.env.id}; set pretrain.eviction_dropout=0"
        ]
    return []


register_section("pretrain", PretrainConfig, problems)
