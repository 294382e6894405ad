"""rl.algo=rl_sparse's rules (the algorithm: :mod:`kvrl.algos.rl_sparse`): rollouts under G-KV.

It has no keys of its own: the eviction is the kv section's (kv.budget, kv.interval, kv.window,
kv.sink, kv.budget_ratio, kv.kwargs), whose rules (`uses=("kv",)`: a bounded budget that leaves
room for one token chosen by score) run with these. Light on purpose (no torch): the config gate
imports it.
"""

from kvrl.section import register_section


def problems(cfg) -> list[str]:
    """Also Distill's (:mod:`kvrl.algos.distill_config`), whose rollouts are RL-Sparse's."""
    if cfg.kv.policy != "gkv":
        return [f"{cfg.rl.algo} trains under G-KV eviction, but kv.policy={cfg.kv.policy!r}; set kv.policy=gkv "
                "with kv.budget > 0 (rl.algo=rl_full trains with the full cache)"]
    return []


register_section("rl_sparse", problems=problems, uses=("kv",))
