"""job=self_distill's section and rules (the job: :mod:`kvrl.jobs.self_distill`).

RLKV §3.3, App. B: tasks the model solves greedily with the full cache, bucketed by output length.
Light on purpose (no torch): the config gate imports it.
"""

from dataclasses import dataclass, field
from typing import Any

from kvrl.section import checked, register_section


@dataclass
class SelfDistillConfig:
    # the candidates' environment: in an RL recipe env.id is the selected set (SelfDistilledEnv), so the
    # data step has its own source (e.g. kvrl/math-v0 with {path: deepscaler.jsonl})
    source: str = checked("kvrl/counts-v0", kwargs="source_kwargs")
    source_kwargs: dict[str, Any] = field(default_factory=dict)
    # tasks drawn from the source and decoded (a finite dataset: at most all of it)
    candidates: int = checked(4096, ge=1)
    # output-length bucket edges
    edges: list[int] = checked(
        [0, 2048, 4096, 6144, 8192],
        lambda v: len(v) >= 2 and all(a < b for a, b in zip(v, v[1:])) and v[0] >= 0,
        "must be >= 2 increasing token counts (bucket b is edges[b] <= output length < edges[b+1])",
    )
    # solved tasks kept per bucket
    counts: list[int] = checked(
        [600, 600, 1000, 800], lambda v: all(c >= 0 for c in v), "must be task counts >= 0, one per bucket"
    )


def problems(cfg) -> list[str]:
    from kvrl.preflight.names import env_problems  # the source resolves and its kwargs fit, as env.id's

    sd = cfg.self_distill
    found = env_problems("self_distill.source", sd.source, "self_distill.source_kwargs", sd.source_kwargs)
    if len(sd.counts) != len(sd.edges) - 1:
        found.append(
            f"self_distill.counts has {len(sd.counts)} entries for {len(sd.edges) - 1} buckets "
            "(self_distill.edges); give one count per bucket"
        )
    return found


register_section("self_distill", SelfDistillConfig, problems)
