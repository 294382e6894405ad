"""rl.algo=distill's section and rules (the algorithm: :mod:`kvrl.algos.distill`).

G-KV Appendix C: T^2 KL(full-cache teacher || sparse student), both at temperature T, over
RL-Sparse's rollouts (whose rules apply too). Light on purpose (no torch): the config gate imports it.
"""

from dataclasses import dataclass

from kvrl.algos import rl_sparse_config
from kvrl.section import checked, register_section


@dataclass
class DistillConfig:
    # soft-target temperature T of the distillation loss
    temperature: float = checked(1.0, lambda v: v > 0, "must be > 0 (the soft-target temperature T)")


def problems(cfg) -> list[str]:
    found = rl_sparse_config.problems(cfg)
    if cfg.rl.kl_coef > 0:
        found.append(
            f"rl.kl_coef={cfg.rl.kl_coef}: distill's loss is a KL to the full-cache teacher already; set rl.kl_coef=0"
        )
    return found


register_section("distill", DistillConfig, problems, uses=("kv",))
