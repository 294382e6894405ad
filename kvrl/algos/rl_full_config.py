"""rl.algo=rl_full's rule (the algorithm: :mod:`kvrl.algos.rl_full`): it trains with the full cache.

Light on purpose (no torch): the config gate imports it to check a config before anything starts.
"""

from kvrl.section import register_section


def problems(cfg) -> list[str]:
    if cfg.kv.policy != "full":
        return [
            f"rl_full trains with the full KV cache, but kv.policy={cfg.kv.policy!r}; set kv.policy=full "
            "(a compressed-cache algorithm trains under its policy)"
        ]
    return []


register_section("rl_full", problems=problems)
