"""rl.algo=rlkv's section and rules (the algorithm: :mod:`kvrl.algos.rlkv`, the job: job=rlkv).

RLKV (arXiv 2510.08525): one gate per (layer, KV head) trained with GRPO, and head
reallocation from the exported gates (job=eval with eval.settings.NAME: {policy: heads, run: DIR}).
Defaults: the paper's Table 3. Light on purpose (no torch): the config gate imports it.
"""

from dataclasses import dataclass

from kvrl.section import checked, register_section


@dataclass
class RLKVConfig:
    # β of the adaptive L1 penalty 1(r̄ > τ)·β·(exp(r̄) − 1)·mean|α| (Qwen3-4B: 2.5e-3)
    l1_coef: float = checked(1.0e-3, lambda v: v >= 0, "must be >= 0 (the L1 penalty weight)")
    tau: float = 0.5  # τ: no penalty while the batch's mean reward r̄ ≤ τ (Qwen-2.5-7B-R1: 0.55)
    sink: int = checked(128, ge=0)  # training window of the compressed branch: sink tokens ...
    recent: int = checked(256, lambda v: v >= 1, "must be >= 1 (a token must see itself)")  # ... and recent tokens
    # fraction of (layer, KV head) pairs compressed at deployment, lowest gates first
    sparsity: float = checked(0.5, lambda v: 0 <= v <= 1, "must be a fraction in [0, 1] (of the heads compressed)")
    # deployment window of a compressed head (the paper's 16 sink + 64 recent)
    eval_sink: int = checked(16, ge=0)
    eval_recent: int = checked(64, lambda v: v >= 1, "must be >= 1 (a token must see itself)")


def problems(cfg) -> list[str]:
    """Cross-field checks of RLKV training (job=rlkv, rl.algo=rlkv)."""
    found = []
    if cfg.workers.engine != "vllm":
        found.append(
            f"workers.engine={cfg.workers.engine!r}: RLKV's rollouts use the vLLM engine's "
            "mixed-gate attention; set workers.engine=vllm"
        )
    if cfg.kv.policy != "full":
        found.append(
            f"kv.policy={cfg.kv.policy!r}: RLKV's rollouts mix full and rlkv.sink + rlkv.recent "
            "attention per head, not a token policy; set kv.policy=full"
        )
    if cfg.rl.kl_coef != 0:
        found.append(
            f"rl.kl_coef={cfg.rl.kl_coef}: RLKV trains without the KL term (and the LLM is frozen); set rl.kl_coef=0"
        )
    return found


register_section("rlkv", RLKVConfig, problems)
