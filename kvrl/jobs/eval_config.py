"""job=eval's section and rules (the job: :mod:`kvrl.jobs.eval`).

Light on purpose (no torch at import): the config gate imports it to check a config before anything
starts; the rules import the policy kinds (:data:`kvrl.eval.suite.KINDS`) only when job=eval is checked.
"""

import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, List

from kvrl.section import POLICY_NAMES, checked, cli_value, register_section


@dataclass
class EvalConfig:
    # job=eval's lines: zoo names (full streaming h2o snapkv rkv gkv learned), window, or eval.settings entries
    policies: List[str] = checked([n for n in POLICY_NAMES if n != "learned"], lambda v: len(v) > 0,
                                  "must name at least one policy")
    # per-line settings {name: {policy: KIND, run: DIR, sparsities: [...], <the policy's own arguments>}};
    # a token policy's own interval / window / sink replace kv's for its line
    settings: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # KV budgets: <= 1 a fraction of the full cache's mean sequence length, > 1 a number of tokens
    budgets: List[float] = checked([0.25, 0.5], lambda v: len(v) > 0 and all(b > 0 for b in v),
                                   "must be fractions in (0, 1] or token counts > 1")
    samples: int = checked(1, ge=1)  # samples per task; accuracy is their mean (pass@1)
    pass_k: List[int] = checked([1], lambda v: all(k >= 1 for k in v), "must be >= 1")  # pass@k for k <= samples
    # also measure the task's properties on the model's attention (kvrl.eval.properties; the env's tasks must
    # carry their reference chain of thought in meta["completion"]) and set them beside the papers' orderings
    properties: bool = False


def problems(cfg) -> list[str]:
    """The eval job's budgets are eval.budgets, not kv.budget; every line names a known kind."""
    from kvrl.eval.suite import KINDS

    ev, found = cfg.eval, []
    if cfg.kv.budget > 0:
        found.append(f"kv.budget={cfg.kv.budget} would be ignored: job={cfg.job} evaluates the budgets of "
                     f"eval.budgets ({cli_value(ev.budgets)}: fractions of the mean sequence length or "
                     "tokens); set kv.budget=0 (and eval.budgets to what to evaluate)")
    no_ratio = {"window": "a fixed sink + recent window", "heads": "RLKV's head reallocation",
                "full": "the full cache"}
    for name in ev.policies:
        kind = ev.settings.get(name, {}).get("policy", name)
        if kind in no_ratio and "budget_ratio" in ev.settings.get(name, {}):
            found.append(f"eval.policies entry {name!r} is {no_ratio[kind]}, which has no ratio mode, but "
                         f"eval.settings.{name}.budget_ratio is set; drop it")
        elif kind == "window" and cfg.kv.budget_ratio is not None:
            found.append(f"eval.policies entry {name!r} is {no_ratio[kind]}, which has no ratio mode, but "
                         f"kv.budget_ratio is set; drop {name} from eval.policies, or give the ratio to the "
                         "token-policy lines only (eval.settings.NAME.budget_ratio)")
        if kind not in KINDS:
            near = difflib.get_close_matches(str(kind), KINDS, n=1)
            found.append(f"eval.policies entry {name!r} is {kind!r}, not one of {', '.join(KINDS)} and no "
                         f"eval.settings.{name}.policy says which; "
                         + (f"set it to {near[0]}" if near else f"add eval.settings.{name}.policy=KIND"))
    return found


register_section("eval", EvalConfig, problems)
