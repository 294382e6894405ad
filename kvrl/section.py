"""What a config section is, for the code that owns one: a checked field, ConfigError, the registry.

Contract:

* An algorithm or a job that has keys or rules of its own declares them beside its code, in a
  light module (`kvrl/algos/<algo>_config.py`, `kvrl/jobs/<job>_config.py`: no torch, no Ray, so
  a config is checked in well under a second), and registers them with `register_section(name,
  schema, problems, uses=...)`; the package's `__init__` imports that module (`kvrl.algos.ALGOS` names it
  beside the algorithm's class). An algorithm outside kvrl (`rl.algo=pkg.module:Class`) registers its
  section in its own module, which the config loader imports first, and names it (`Algorithm.section`).
  `kvrl.config` builds the schema from the shared sections plus every registered one:
  the section's keys are then `name.key` on the command line, in recipes and in `--help`.
* `schema` is a dataclass whose fields may be `checked` (a range rule beside the field); `None`
  for an algorithm without keys of its own (`rl_sparse`: rules only).
* `problems(cfg) -> list[str]` is the section's cross-field rules; each message names the key, the
  value given, and a value that works ("...; set KEY=VALUE"). It runs when the job's sections, or
  its `rl.algo`, include `name` (`kvrl.jobs.JOBS`); `uses` names the shared sections it relies on
  whose rules must run with it ("kv": the algorithm evicts with a token policy built from kv.*).
* Nothing here imports anything but the standard library: every layer of kvrl may import it.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message says what is wrong and how to fix it."""


# kv.policy's names: "full" and kvrl.policies.POLICIES, which imports torch, so the config cannot read it
# (tests/test_config_gate.py holds the two equal)
POLICY_NAMES = ("full", "streaming", "h2o", "snapkv", "rkv", "gkv", "learned")


def checked(
    default: Any,
    ok: Callable[[Any], bool] | None = None,
    rule: str = "",
    *,
    ge: float | None = None,
    names: tuple[str, ...] = (),
    kwargs: str = "",
) -> Any:
    """A schema field whose value must pass `ok` (None: any value), else `validate` reports "KEY RULE (got
    VALUE); set KEY=DEFAULT", or the nearest of `names` to the value when one is near (a mistyped name).
    `ge=LOW` is short for `v >= LOW` with the rule "must be >= LOW". `kwargs=FIELD`: the value names what
    the section's dict field FIELD holds the constructor arguments of (env.id and env.kwargs): when the
    command line changes the value, the recipe's arguments are dropped (`kvrl.config.load`)."""
    if ge is not None:
        ok, rule = (lambda v: v >= ge), f"must be >= {ge}"
    metadata = {"names": names, **({"check": (ok, rule)} if ok else {}), **({"kwargs": kwargs} if kwargs else {})}
    if isinstance(default, (list, dict)):  # a mutable default: a fresh copy per instance
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def cli_value(value: Any) -> str:
    """`value` as it would be typed after `key=` on the command line."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Section:
    name: str  # the config key of its fields (`rlkv.l1_coef`), and the rl.algo or section a job names
    schema: type | None = None  # a dataclass of the section's keys; None = rules only
    problems: Callable[[Any], list[str]] | None = None  # cross-field rules over the whole typed config
    uses: tuple[str, ...] = ()  # shared sections whose rules apply with this one ("kv")


# name -> Section, in registration order (the order of the keys in `--help` and print_config)
SECTIONS: dict[str, Section] = {}


def register_section(
    name: str,
    schema: type | None = None,
    problems: Callable[[Any], list[str]] | None = None,
    *,
    uses: tuple[str, ...] = (),
) -> None:
    """Declare the keys (`schema`) and rules (`problems`) of the algorithm or job section `name`."""
    if schema is not None and not is_dataclass(schema):
        raise TypeError(f"section {name!r}: schema must be a dataclass, got {schema!r}")
    SECTIONS[name] = Section(name, schema, problems, tuple(uses))
