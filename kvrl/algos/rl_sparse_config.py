"""rl.algo=rl_sparse's rules (the algorithm: :mod:`kvrl.algos.rl_sparse`): rollouts under eviction.

It has no keys of its own: the eviction is the kv section's (kv.budget, kv.interval, kv.window,
kv.sink, kv.budget_ratio, kv.kwargs), whose rules (`uses=("kv",)`: a bounded budget that leaves
room for one token chosen by score) run with these. Light on purpose (no torch): the config gate
imports it.
"""

from kvrl.section import register_section


def problems(cfg) -> list[str]:
    """Also Distill's (:mod:`kvrl.algos.distill_config`), whose rollouts are RL-Sparse's."""
    # any token policy of the zoo or of your own (kv.policy=pkg.module:Class) evicts; these two do not
    why = {"full": "keeps every token", "learned": "is the scorer job=foresight trains, untrained here"}
    if cfg.kv.policy in why:
        return [
            f"{cfg.rl.algo} trains under the eviction it is served with (G-KV's: gkv), but kv.policy="
            f"{cfg.kv.policy!r} {why[cfg.kv.policy]}; set kv.policy=gkv with kv.budget > 0 (rl.algo=rl_full "
            "trains with the full cache)"
        ]
    return []


register_section("rl_sparse", problems=problems, uses=("kv",))
