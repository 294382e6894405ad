"""The whole schema: the shared sections plus every registered algorithm's and job's section.

Contract: `schema()` is the `Config` dataclass that `load_config` fills: `Shared`'s keys
(`kvrl.config.shared`), then one field per section registered with a schema (`kvrl.section`), named
as registered, in registration order. Importing this module imports `kvrl.algos` and `kvrl.jobs`,
whose packages import their light `*_config` modules, so every shipped section is registered first.
A section registered later (a plug-in, a test's toy algorithm) gives a new class, built on demand;
`kvrl.config.Config` is the shipped one. `schema_keys()` lists every leaf key: `--help`, the "did
you mean" hints and the merge's type errors read it. `kwargs_of()` pairs each key that names what it
constructs with the key of the constructor's arguments, as the sections declare them (`checked(...,
kwargs=FIELD)`: env.id -> env.kwargs).
"""

from dataclasses import MISSING as NO_DEFAULT
from dataclasses import field, fields, is_dataclass, make_dataclass
from typing import Any

import kvrl.algos  # noqa: F401  (registers the algorithms' sections)
import kvrl.jobs  # noqa: F401  (registers the jobs' sections)
from kvrl.config.shared import Shared
from kvrl.section import SECTIONS

_BUILT: dict[tuple, type] = {}  # the registered (name, schema) pairs -> the Config built from them


def schema() -> type:
    """The Config dataclass of the sections registered now."""
    own = tuple((s.name, s.schema) for s in SECTIONS.values() if s.schema is not None)
    if own not in _BUILT:
        clash = [name for name, _ in own if name in {f.name for f in fields(Shared)}]
        if clash:  # a registered section would hide a shared key
            raise TypeError(f"registered section(s) {', '.join(clash)} clash with shared keys of kvrl.config")
        cls = make_dataclass("Config", [(name, cls, field(default_factory=cls)) for name, cls in own], bases=(Shared,))
        # pickled by reference (Ray sends configs to actors): importing kvrl.config builds the same class
        cls.__module__ = "kvrl.config"
        cls.__doc__ = "The typed config: the shared keys, then each registered section's."
        _BUILT[own] = cls
    return _BUILT[own]


def schema_keys(cls: type | None = None, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Every leaf key of the schema as a dotted path -> (type, default); `???` = required."""
    keys: dict[str, tuple[Any, Any]] = {}
    for f in fields(cls or schema()):
        if is_dataclass(f.type):
            keys.update(schema_keys(f.type, f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if f.default is NO_DEFAULT else f.default
            keys[prefix + f.name] = (f.type, default)
    return keys


def kwargs_of(cls: type | None = None, prefix: str = "") -> dict[str, str]:
    """Each key that names what it constructs -> the key of the constructor's arguments (env.id -> env.kwargs)."""
    pairs: dict[str, str] = {}
    for f in fields(cls or schema()):
        if is_dataclass(f.type):
            pairs.update(kwargs_of(f.type, f"{prefix}{f.name}."))
        elif "kwargs" in f.metadata:
            pairs[prefix + f.name] = prefix + f.metadata["kwargs"]
    return pairs
