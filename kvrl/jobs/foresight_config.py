"""job=foresight's section and rules (the job: :mod:`kvrl.jobs.foresight`; stage 2's algorithm:
:class:`kvrl.algos.foresight.ForesightRL`).

ForesightKV: trace data -> Golden Eviction -> stage 1 SFT -> stage 2 RL. The eviction setting is
kv.budget / kv.interval / kv.window / kv.sink (kv.policy=learned; the job checks the kv section's
rules too); stage 2 uses trainer.* (steps, lr, batch_size = traces x rl.group_size) and rl.*
(kl_coef = KL to stage 1). Light on purpose (no torch): the config gate imports it.
"""

from dataclasses import dataclass

from kvrl.section import checked, cli_value, register_section


@dataclass
class ForesightConfig:
    # training traces to keep (correct, at least min_tokens long), generated with the full cache
    traces: int = checked(256, ge=1)
    heldout: int = checked(64, ge=1)  # held-out traces (other prompts) for the loss-ratio evaluation
    min_tokens: int = checked(0, ge=0)  # keep only traces of at least this many tokens (prompt + completion)
    shard_size: int = checked(64, ge=1)  # traces per parquet shard: the unit the data step resumes from
    sft_steps: int = checked(1000, ge=0)  # stage 1 optimizer steps (Adam, 10 warm-up steps, cosine decay)
    sft_batch_size: int = checked(8, ge=1)  # traces per stage 1 step
    sft_lr: float = checked(
        1.0e-2, lambda v: 0 < v <= 1, "must be in (0, 1] (Adam moves each weight by about lr per step)"
    )  # stage 1 peak learning rate
    margin: float = checked(0.01, ge=0)  # stage 1 pairwise ranking hinge margin
    # stage 1's pairs: "uniform" (ForesightKV's: every pair the oracle orders weighs alike) or "gap" (a pair weighs
    # the oracle's keep-score difference: kvrl.algos.foresight.ranking_loss)
    pairs: str = checked("uniform", lambda v: v in ("uniform", "gap"), "must be 'uniform' or 'gap'")
    eta: float = checked(1.5, ge=0)  # stage 2 reward: a token counts when its loss rose by more than eta
    # stage 2 reward: only this fraction of tokens, lowest full-cache entropy first
    low_entropy: float = checked(0.8, lambda v: 0 < v <= 1, "must be a fraction in (0, 1]")
    # one scorer for every budget: [lo, hi] fractions of each trace's length; each Golden replay (stage 1) and
    # each GRPO group (stage 2) draws its budget from them. null: all at kv.budget (the held-out judging stays there)
    budgets: list[float] | None = None


def problems(cfg) -> list[str]:
    """Cross-field checks of the ForesightKV pipeline."""
    found, kv = [], cfg.kv
    if kv.policy != "learned":
        found.append(f"kv.policy is {kv.policy!r}; ForesightKV trains the learned scorer: set kv.policy=learned")
    if kv.budget_ratio is not None:
        found.append(
            f"kv.budget_ratio={kv.budget_ratio}: ForesightKV's eviction MDP and Golden Eviction keep "
            "the fixed kv.budget; set kv.budget_ratio=null (job=eval runs a trained scorer in ratio "
            "mode: eval.settings.NAME: {policy: learned, run: DIR, budget_ratio: R})"
        )
    found += budget_range_problems(cfg.foresight.budgets)
    g, n = cfg.rl.group_size, cfg.trainer.batch_size
    if n % g or n < g:
        found.append(
            f"trainer.batch_size ({n}) must be a multiple of rl.group_size ({g}): stage 2 draws "
            f"rl.group_size eviction trajectories per trace; set trainer.batch_size="
            f"{max(1, round(n / g)) * g}"
        )
    return found


def budget_range_problems(budgets) -> list[str]:
    """foresight.budgets is null or [lo, hi] with 0 < lo <= hi < 1: fractions of a trace's length (at 1 the
    cache holds the whole trace and nothing is evicted), not token counts."""
    if budgets is None:
        return []
    values = list(budgets)
    if len(values) == 2 and 0 < values[0] <= values[1] < 1:
        return []
    if len(values) == 2 and all(0 < v < 1 for v in values):
        fix = sorted(values)
    else:
        fix = [0.25, 0.75]
    return [
        f"foresight.budgets={cli_value(values)}: the range of budgets to train over is two fractions of each trace's "
        f"length, 0 < lo <= hi < 1 (a fraction of 1 evicts nothing; token counts are kv.budget's unit, not this "
        f"key's); set foresight.budgets={cli_value(fix)} (or foresight.budgets=null: train at kv.budget)"
    ]


register_section("foresight", ForesightConfig, problems)
