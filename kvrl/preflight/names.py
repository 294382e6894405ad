"""The config's checks of what it names outside itself: a model (a shipped name, a folder, a run that
trained one, a known architecture or a hub id) and the positions it holds, an environment (a registered
id or pkg.module:Class) and whether its kwargs fit its constructor, a KV policy class given by path.

The config's sections call these from their `problems(cfg)` (`kvrl.config.shared`, the jobs'
`<job>_config.py`); `kvrl.preflight.machine` checks what a run needs beyond them. Each returns messages in the
config's style ("KEY must be ... (got VALUE); set KEY=VALUE"). Nothing here imports torch or Ray: an
environment's (or a kv.policy class's) module is imported only to read its constructor's signature
(nothing is built: building may need data files), and a model's config is read as JSON.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

from kvrl.models import SHIPPED
from kvrl.runlog import trained_model
from kvrl.section import cli_value

ARCHITECTURES = Path(__file__).parents[1] / "models" / "architectures.json"  # the dry runs' known hub ids
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")  # org/name

# rules on an environment's arguments that its signature cannot say: class path -> argument ->
# (ok, rule); the fix is the constructor's default
ENV_ARG_RULES: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "kvrl.envs.math:MathEnv": {
        "timeout": (
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
            "must be > 0 seconds (at 0 every answer's check times out and scores 0)",
        ),
    },
}


def model_problems(path: str) -> list[str]:
    """model.path: a shipped model ("tiny", "tiny-multihop"), a folder with a config.json, the output_dir of a run that trained model
    weights (:func:`kvrl.runlog.trained_model`, without reading them), a known architecture, or a
    hub id org/name."""
    fix = (
        "pass a local folder with a config.json (save_pretrained writes one), the output_dir of an RL run "
        f"(the weights it trained), a hub id such as Qwen/Qwen3-4B, or set model.path=tiny (shipped: "
        f"{' | '.join(SHIPPED)})"
    )
    if path in SHIPPED or path in json.loads(ARCHITECTURES.read_text()):
        return []
    local = Path(path).expanduser()
    if local.exists():
        if (local / "config.json").is_file():
            return []
        if local.is_dir():
            try:
                if trained_model(local, verify=False) is not None:
                    return []
            except ValueError as err:
                return [f"model.path={path!r}: {err}"]
        what = "a folder without a config.json" if local.is_dir() else "a file, not a model folder"
        return [f"model.path={path!r} is {what}; {fix}"]
    if HUB_ID.match(path):
        return []  # fetched from the hub when the job loads it
    return [f"model.path={path!r} is neither a folder here nor a hub id (org/name: letters, digits, - _ .); {fix}"]


def model_positions(path: str) -> int | None:
    """The positions model.path holds (its max_position_embeddings), read from JSON without transformers: a
    known architecture's, a shipped model's, a local folder's config.json, a run directory's trained model's;
    None when the config is not here (a hub id fetched when the job loads it)."""
    known = json.loads(ARCHITECTURES.read_text())
    if path in known:
        config = known[path]
    else:
        folder = SHIPPED[path][0] if path in SHIPPED else Path(path).expanduser()
        if folder.is_dir() and not (folder / "config.json").is_file():
            try:
                found = trained_model(folder, verify=False)
            except ValueError:  # model_problems says what the run is
                return None
            folder = found[0] if found else folder
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return positions if isinstance(positions, int) and positions > 0 else None


def cache_limit(cfg) -> tuple[float, str]:
    """The most tokens a sequence of this config can hold, and why: model.max_model_len when set, else the
    model's positions (:func:`model_positions`); inf when neither is known here (a hub id)."""
    positions = model_positions(cfg.model.path) or float("inf")
    if cfg.model.max_model_len and cfg.model.max_model_len <= positions:
        return cfg.model.max_model_len, "model.max_model_len"
    return positions, f"the max_position_embeddings of model.path={cfg.model.path}"


def env_problems(id_key: str, env_id: str, kwargs_key: str, kwargs: dict) -> list[str]:
    """`env_id` names an environment (registered id or pkg.mod:Class) and `kwargs` fit its constructor."""
    import kvrl.envs  # noqa: F401  (registers the built-in ids)
    from kvrl.envs.registry import ENTRY_POINTS, ID_PATTERN, EnvNotFoundError, registered, resolve

    try:
        factory, defaults = resolve(env_id)
    except EnvNotFoundError:
        near = difflib.get_close_matches(env_id, registered(), n=1, cutoff=0.5)
        namespace = env_id.partition("/")[0]
        if ID_PATTERN.match(env_id) and not any(i.startswith(namespace + "/") for i in registered()):
            # a namespace nothing registered: a typo among kvrl's ids is not the likely fix
            return [
                f"{id_key}={env_id!r} is not registered: nothing importable named {namespace!r} registers it, "
                f"and no installed package declares it under the entry-point group {ENTRY_POINTS!r}; put the "
                f"package {namespace!r} on PYTHONPATH (a Ray job: launch/ray_submit.sh --py-module "
                f"path/to/{namespace}) with kvrl.envs.register({env_id!r}, 'pkg.module:Class') in its "
                f"__init__, or set {id_key}=pkg.module:Class"
            ]
        near = near or registered()[:1]
        return [
            f"{id_key}={env_id!r} is neither a registered environment ({', '.join(registered())}) nor a "
            f"dotted path pkg.module:Class; set {id_key}={near[0]}"
        ]
    except TypeError as err:  # imported, but not an environment class: nothing of it is called
        return [
            f"{id_key}={env_id!r} cannot be used: {err}; set {id_key} to a registered id or a pkg.module:Class "
            "of your own environment"
        ]
    except (ImportError, AttributeError, ValueError) as err:
        return [
            f"{id_key}={env_id!r} cannot be imported ({' '.join(str(err).split())}); set {id_key} to a "
            "registered id or an importable pkg.module:Class"
        ]
    return argument_problems(factory, defaults, kwargs_key, kwargs)


def policy_problems(policy: str, kwargs: dict) -> list[str]:
    """kv.policy as a dotted path `pkg.module:Class` (as env.id takes one): it imports, is a KVPolicy,
    and kv.kwargs fit its constructor (the kv section's budget, interval, window, sink and budget_ratio
    come from their own keys). A policy name is the zoo's: `make_policy` names the known ones."""
    if ":" not in policy:  # a name: importing the zoo to list them would import torch here
        return []
    from kvrl.policies import policy_class  # what make_policy resolves; the user's module imports torch anyway

    try:
        cls = policy_class(policy)
    except (ImportError, ValueError) as err:
        return [
            f"kv.policy={policy!r} cannot be used ({' '.join(str(err).split())}); set kv.policy to a policy "
            "name (gkv, h2o, snapkv, ...) or an importable pkg.module:Class of your own KVPolicy"
        ]
    from_kv = {"budget": 0, "interval": 0, "window": 0, "sink": 0, "budget_ratio": None}  # given by kv.*
    return argument_problems(cls, from_kv, "kv.kwargs", kwargs)


def argument_problems(factory: Callable[..., Any], defaults: dict, kwargs_key: str, kwargs: dict) -> list[str]:
    """`kwargs` (given as `kwargs_key`) fit `factory`'s signature, with `defaults` given besides: no
    unknown argument, each of the type its annotation names (int, float, bool, str, a path, None, or a union
    of them; other annotations are not checked), no float that is not finite, each within the inclusive range
    `factory.arg_bounds` gives it (an environment's sizes: `kvrl.envs.base.Env.arg_bounds`), every required
    one given, and the rules of `ENV_ARG_RULES`. A value of the wrong type would be a TypeError deep in the
    constructor; a size out of range, the memory of a task no model holds."""
    name = f"{factory.__module__}:{getattr(factory, '__qualname__', factory)}"
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: the constructor will say
        return []
    try:  # annotations written as strings (`from __future__ import annotations`) read as types
        annotations = {k: p.annotation for k, p in inspect.signature(factory, eval_str=True).parameters.items()}
    except Exception:  # noqa: BLE001 (a name the module cannot resolve: its types go unchecked)
        annotations = {}
    named = {
        p: v
        for p, v in params.items()
        if v.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    listing = f"its arguments: {', '.join(named) or '(none)'}"
    bounds = getattr(factory, "arg_bounds", {})
    problems = []
    if not any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values()):
        for key in kwargs:
            if key not in named:
                near = difflib.get_close_matches(key, named, n=1, cutoff=0.6)
                hint = f" (did you mean {kwargs_key}.{near[0]}?)" if near else ""
                problems.append(f"{kwargs_key}.{key} is not an argument of {name}{hint}; {listing}")
    for key, value in kwargs.items():
        default = named[key].default if key in named else inspect.Parameter.empty
        kinds = accepted(annotations.get(key))
        if kinds is not None and not fits(value, kinds):
            fix = integral(value, kinds, bounds.get(key), default)
            problems.append(
                f"{kwargs_key}.{key} must be {kinds[0]} ({name} takes {key}: {kinds[1]}; got {value!r})"
                + (f"; set {kwargs_key}.{key}={cli_value(fix)}" if fix is not inspect.Parameter.empty else "")
            )
            continue
        fix = f"; set {kwargs_key}.{key}={default}" if default is not inspect.Parameter.empty else ""
        if isinstance(value, float) and not math.isfinite(value):  # a NaN passes every range check a constructor states
            problems.append(f"{kwargs_key}.{key} must be a finite number (got {value}){fix}")
        elif key in bounds and isinstance(value, (int, float)) and not bounds[key][0] <= value <= bounds[key][1]:
            low, high = bounds[key]
            within = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
            problems.append(f"{kwargs_key}.{key} must be {within} for {name} (got {value!r}){fix}")
    given = {**defaults, **kwargs}
    for key, p in named.items():
        if p.default is inspect.Parameter.empty and key not in given:
            problems.append(f"{kwargs_key}.{key} is required by {name} ({listing}); set {kwargs_key}.{key}=...")
    for key, (ok, rule) in ENV_ARG_RULES.get(name, {}).items():
        if key in given and not ok(given[key]):
            default = named[key].default if key in named else inspect.Parameter.empty
            fix = f"; set {kwargs_key}.{key}={default}" if default is not inspect.Parameter.empty else ""
            problems.append(f"{kwargs_key}.{key} {rule} (got {given[key]!r}){fix}")
    return problems


# what a value from a config may be for a simple annotation: (its Python types, what the message calls it)
SIMPLE_TYPES: dict[Any, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"),
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
    Path: ((str, PurePath), "a path"),
    type(None): ((type(None),), "null"),
}


def accepted(annotation: Any) -> tuple[str, str, tuple[type, ...]] | None:
    """(what a value must be, the annotation as written, the types that fit) for an annotation made of
    `SIMPLE_TYPES` (one, or a union of them); None for any other (not checked)."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    members = members or (annotation,)
    if not all(m in SIMPLE_TYPES for m in members):
        return None
    types_ = tuple(t for m in members for t in SIMPLE_TYPES[m][0])
    written = " | ".join("None" if m is type(None) else m.__name__ for m in members)
    return " or ".join(SIMPLE_TYPES[m][1] for m in members), written, types_


def fits(value: Any, kinds: tuple[str, str, tuple[type, ...]]) -> bool:
    """`value` is of one of the types `kinds` (:func:`accepted`) allows; a bool is no number here (YAML's
    `true` given for a size)."""
    if isinstance(value, bool):
        return bool in kinds[2]
    return isinstance(value, kinds[2])


def integral(value: Any, kinds: tuple[str, str, tuple[type, ...]], bounds: tuple[float, float] | None, default: Any):
    """The fix to suggest for `value`, not of the types `kinds` allows: the integer a whole float (`1e3`)
    means, for an integer argument and within `bounds`; else the constructor's `default`."""
    whole = int in kinds[2] and isinstance(value, float) and value.is_integer()
    if whole and (bounds is None or bounds[0] <= value <= bounds[1]):
        return int(value)
    return default
