"""job=eval's section and rules (the job: :mod:`kvrl.jobs.eval`).

Light on purpose (no torch at import): the config gate imports it to check a config before anything
starts; the rules import the policy kinds (:data:`kvrl.eval.suite.KINDS`) and the policies' constructors (the
keys an eval.settings entry may hold) only when job=eval is checked.
"""

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any

from kvrl.budget import budget_evicts, least_budget
from kvrl.section import POLICY_NAMES, checked, cli_value, register_section


@dataclass
class EvalConfig:
    # job=eval's lines: zoo names (full streaming h2o snapkv rkv gkv learned), window, or eval.settings entries
    # (a policy of your own: eval.settings.NAME.policy=pkg.module:Class)
    policies: list[str] = checked(
        [n for n in POLICY_NAMES if n != "learned"], lambda v: len(v) > 0, "must name at least one policy"
    )
    # per-line settings {name: {policy: KIND, run: DIR, sparsities: [...], <the policy's own arguments>}};
    # a token policy's own interval / window / sink replace kv's for its line
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    # KV budgets: <= 1 a fraction of the full cache's mean sequence length, > 1 a number of tokens
    budgets: list[float] = checked(
        [0.25, 0.5], lambda v: len(v) > 0 and all(b > 0 for b in v), "must be fractions in (0, 1] or token counts > 1"
    )
    samples: int = checked(1, ge=1)  # samples per task; accuracy is their mean (pass@1)
    pass_k: list[int] = checked([1], lambda v: all(k >= 1 for k in v), "must be >= 1")  # pass@k for k <= samples
    # also measure the task's properties on the model's attention (kvrl.eval.properties; the env's tasks must
    # carry their reference chain of thought in meta["completion"]) and set them beside the papers' orderings
    properties: bool = False


# the kinds with no ratio mode, as a message names them
NO_RATIO = {"window": "a fixed sink + recent window", "heads": "RLKV's head reallocation", "full": "the full cache"}


def problems(cfg) -> list[str]:
    """The eval job's budgets are eval.budgets, not kv.budget; every line names a known kind, and its
    eval.settings entry holds only the keys that kind reads (a typo would be ignored: the papers' line
    would run at kv's settings)."""
    found = ignored_kv_problems(cfg) + budget_problems(cfg)
    lines, classes = line_problems(cfg)
    return found + lines + setting_key_problems(cfg.eval, classes) + pass_k_problems(cfg.eval) + value_problems(cfg)


def ignored_kv_problems(cfg) -> list[str]:
    """A kv.policy or kv.kwargs other than the kv section's defaults, which job=eval ignores, named with the
    eval.policies / eval.settings lines that would compare it."""
    ev, found = cfg.eval, []
    if cfg.kv.policy != "full" or cfg.kv.kwargs:  # the kv section's defaults: eval's lines are eval.policies
        policy, own = cfg.kv.policy, cfg.kv.kwargs
        given = " ".join(
            [
                *([f"kv.policy={policy}"] if policy != "full" else []),
                *(f"kv.kwargs.{k}={cli_value(v)}" for k, v in own.items()),
            ]
        )
        name = policy.rpartition(":")[2].lower() if ":" in policy else policy
        line = [
            *([f"eval.policies={cli_value([*ev.policies, name])}"] if name not in ev.policies else []),
            *([f"eval.settings.{name}.policy={policy}"] if ":" in policy else []),
            *(f"eval.settings.{name}.{k}={cli_value(v)}" for k, v in own.items()),
        ]
        found.append(
            f"{given} would be ignored: job={cfg.job} runs the lines of eval.policies "
            f"({cli_value(ev.policies)}), each at every eval.budgets; drop it"
            + (
                " and give a line its arguments as eval.settings.NAME.ARG=VALUE"
                if policy == "full"
                else f" and compare the policy as a line: {' '.join(line)}"
                if line
                else f" (eval.policies already runs {name})"
            )
        )
    return found


def budget_problems(cfg) -> list[str]:
    """A kv.budget (job=eval evaluates eval.budgets instead), and token budgets of eval.budgets that never
    evict at the model's cache limit."""
    from kvrl.preflight.names import cache_limit

    ev, found = cfg.eval, []
    if cfg.kv.budget > 0:
        found.append(
            f"kv.budget={cfg.kv.budget} would be ignored: job={cfg.job} evaluates the budgets of "
            f"eval.budgets ({cli_value(ev.budgets)}: fractions of the mean sequence length or "
            "tokens); set kv.budget=0 (and eval.budgets to what to evaluate)"
        )
    limit, why = cache_limit(cfg)
    # > 1: tokens (<= 1: a fraction of the sequence)
    full = [b for b in ev.budgets if b > 1 and not budget_evicts(b, limit)]
    if full:
        kept = [b for b in ev.budgets if b not in full] or [limit // 2]
        found.append(
            f"eval.budgets {', '.join(f'{b:g}' for b in full)} never evict: a sequence holds at most "
            f"{limit} tokens ({why}), so those lines would repeat the full cache; set eval.budgets="
            f"[{','.join(f'{b:g}' for b in kept)}]"
        )
    return found


def line_problems(cfg) -> tuple[list[str], dict[str, type]]:
    """Per eval.policies line: a ratio where its kind has none, a kind that is neither known nor an importable
    class, a learned or heads line without its run; and the policies of the user's own, by path, that imported
    and type-checked."""
    from kvrl.eval.suite import KINDS
    from kvrl.policies import policy_class

    ev, found = cfg.eval, []
    classes = {}  # the policies of the user's own, by path: imported and type-checked before anything runs
    for name in ev.policies:
        kind = ev.settings.get(name, {}).get("policy", name)
        if kind in NO_RATIO and "budget_ratio" in ev.settings.get(name, {}):
            found.append(
                f"eval.policies entry {name!r} is {NO_RATIO[kind]}, which has no ratio mode, but "
                f"eval.settings.{name}.budget_ratio is set; drop it"
            )
        elif kind == "window" and cfg.kv.budget_ratio is not None:
            found.append(
                f"eval.policies entry {name!r} is {NO_RATIO[kind]}, which has no ratio mode, but "
                f"kv.budget_ratio is set; drop {name} from eval.policies, or give the ratio to the "
                "token-policy lines only (eval.settings.NAME.budget_ratio)"
            )
        if ":" in str(kind):
            try:
                classes[kind] = policy_class(kind)
            except (ImportError, AttributeError, SyntaxError, ValueError) as err:
                found.append(
                    f"eval.settings.{name}.policy={kind!r} cannot be used ({' '.join(str(err).split())}); "
                    "set it to a zoo name or an importable pkg.module:Class of your own KVPolicy"
                )
        elif kind not in KINDS:
            near = difflib.get_close_matches(str(kind), KINDS, n=1)
            which = (
                f"eval.settings.{name}.policy={kind!r} is neither one of {', '.join(KINDS)} nor"
                if "policy" in ev.settings.get(name, {})
                else f"eval.policies entry {name!r} is not one of {', '.join(KINDS)}, and no eval.settings.{name}"
                ".policy names one or"
            )
            found.append(
                f"{which} a pkg.module:Class of your own KVPolicy; "
                + (
                    f"set eval.settings.{name}.policy={near[0]}"
                    if near
                    else f"set eval.settings.{name}.policy to one of them or to pkg.module:Class"
                )
            )
        elif kind in ("learned", "heads") and "run" not in ev.settings.get(name, {}):
            found.append(
                f"eval.policies entry {name!r} is a {kind} line, which loads what a run trained, but "
                f"eval.settings.{name}.run is not set; set eval.settings.{name}.run=<output_dir of that run>"
            )
    return found, classes


def line_keys(kind: str, classes: dict[str, type]) -> tuple[str, ...]:
    """The keys an eval.settings entry of `kind` (a known kind or one of `classes`) may hold."""
    from kvrl.policies import POLICIES
    from kvrl.policies.heads import head_allocation

    # what kvrl.eval.suite.PolicySpec reads: a token policy's constructor arguments but its budget (the
    # sweep's point), which replace kv's for its line; a heads line's run, sparsities and window
    if kind == "heads":
        return (
            "policy",
            "run",
            "sparsities",
            *(p.name for p in inspect.signature(head_allocation).parameters.values() if p.kind is p.KEYWORD_ONLY),
        )
    if kind in POLICIES or kind in classes:
        return (
            "policy",
            *(p for p in inspect.signature(classes.get(kind) or POLICIES[kind]).parameters if p != "budget"),
            *(("run",) if kind == "learned" else ()),
        )
    return ("policy",)  # full, window: kv's settings only


def setting_key_problems(ev: EvalConfig, classes: dict[str, type]) -> list[str]:
    """Each eval.settings key its line's kind does not read, with the near key or the fix (a line of an unknown
    kind is named by `line_problems`)."""
    from kvrl.eval.suite import KINDS

    found = []
    for name, own in ev.settings.items():
        kind = own.get("policy", name)
        if kind not in KINDS and kind not in classes:
            continue  # named by line_problems
        keys = line_keys(kind, classes)
        for key, value in own.items():
            if key in keys or (key == "budget_ratio" and kind in NO_RATIO):  # a ratio where none is: line_problems
                continue
            near = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
            fix = (
                f"drop it (every line runs at eval.budgets={cli_value(ev.budgets)})"
                if key == "budget"
                else f"set eval.settings.{name}.{near[0]}={cli_value(value)}"
                if near
                else "drop it"
            )
            found.append(
                f"eval.settings.{name}.{key} is not a setting of a line of kind {kind} (got "
                f"{cli_value(value)}); {fix}; its settings: {', '.join(keys)}"
            )
    return found


def pass_k_problems(ev: EvalConfig) -> list[str]:
    """An eval.pass_k whose k exceeds eval.samples."""
    too_many = [k for k in ev.pass_k if k > ev.samples]
    if not too_many:
        return []
    # pass@k of fewer than k samples is not defined: summarise would leave the column out
    return [
        f"eval.pass_k={cli_value(ev.pass_k)} asks for pass@{too_many[0]} but eval.samples={ev.samples} "
        f"draws fewer samples per task; set eval.samples={max(ev.pass_k)} (or eval.pass_k="
        f"{cli_value([k for k in ev.pass_k if k <= ev.samples] or [1])})"
    ]


def kind_of(default: Any) -> tuple[type, ...]:
    """The types a setting whose constructor default is `default` takes (a float also takes an int; no default,
    None or another kind of default: any)."""
    if not isinstance(default, (bool, int, float, str)):
        return (object,)
    return (float, int) if isinstance(default, float) else (type(default),)


def value_problems(cfg) -> list[str]:
    """Each evaluated line's settings hold values its policy accepts: the line's policy (a rule-based one;
    RLKV's head allocation with every sparsity) is built from them at the gate as the job would, on a
    nominal budget, so that a value out of range (eval.settings.gkv.alpha=nan, sparsities=[1.5]) is refused
    before the model loads. The learned scorer's are checked only for being finite (building it needs the
    model's geometry); a setting that is not the kind's is named by `problems`."""
    import math

    import torch

    from kvrl.eval.suite import KINDS
    from kvrl.policies import POLICIES, LearnedScorer
    from kvrl.policies.heads import HeadAllocation

    ev, kv, found = cfg.eval, cfg.kv, []
    for name in dict.fromkeys(ev.policies):
        own = dict(ev.settings.get(name, {}))
        kind = own.pop("policy", name)
        if kind not in KINDS:
            continue  # named by problems
        bad = [k for k, v in own.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            found += [
                f"eval.settings.{name}.{k} must be a finite number (got {own[k]}); set it or drop it" for k in bad
            ]
            continue
        if kind == "heads":
            cls, fixed = HeadAllocation, {"gates": torch.zeros(1, 1), "layers": 1, "kv_heads": 1}
            sparsities = own.pop("sparsities", [0.5])
            if not (
                isinstance(sparsities, list)
                and sparsities
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in sparsities)
            ):
                found.append(
                    f"eval.settings.{name}.sparsities must be a list of fractions in [0, 1] (the share of "
                    f"KV heads compressed; got {cli_value(sparsities)}); set eval.settings.{name}.sparsities="
                    "[0.5]"
                )
                continue
            fixed["sparsity"] = sparsities[0]
        elif kind in POLICIES and POLICIES[kind] is not LearnedScorer:
            cls = POLICIES[kind]
            fixed = {"interval": kv.interval, "window": kv.window, "sink": kv.sink, "budget_ratio": kv.budget_ratio}
        else:
            continue
        params = inspect.signature(cls).parameters
        given = {k: v for k, v in own.items() if k in params}  # the others are named by problems
        mistyped = [k for k, v in given.items() if not isinstance(v, kind_of(params[k].default))]
        if mistyped:
            found += [
                f"eval.settings.{name}.{k} expects {kind_of(params[k].default)[0].__name__}, got "
                f"{given[k]!r}; set eval.settings.{name}.{k}={cli_value(params[k].default)}"
                for k in mistyped
            ]
            continue
        args = {**fixed, **given}
        if cls is not HeadAllocation:
            window, sink = args["window"], args["sink"]
            args["budget"] = least_budget(window, sink) if isinstance(window, int) and isinstance(sink, int) else 0
        try:
            cls(**args)
        except (ValueError, TypeError) as err:
            key = str(err).partition("=")[0]
            default = params[key].default if key in given else inspect.Parameter.empty
            fix = (
                f"set eval.settings.{name}.{key}={cli_value(default)}"
                if default is not inspect.Parameter.empty
                else "fix the line's settings (or the kv.* it takes)"
            )
            found.append(f"eval.settings.{name}: {kind} refuses its settings: {' '.join(str(err).split())}; {fix}")
    return found


register_section("eval", EvalConfig, problems)
