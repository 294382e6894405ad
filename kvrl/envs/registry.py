"""Versioned environment ids: ``register`` / ``make`` / ``registered``.

Ids look like ``namespace/name-vN`` (``kvrl/math-v0``); bump ``N`` whenever the tasks or the
reward change, so that numbers from different versions are never compared. Entry points
are given as strings ``"pkg.module:Class"`` and imported only by :func:`make`, so
registering an environment costs nothing.

A recipe may also name an unregistered class directly: ``env.id=my_pkg.envs:MyEnv``.

An id registered outside kvrl is found from the command line, in the driver and in every Ray
worker, without importing anything by hand, in one of two ways (:func:`discover`):

* the id's namespace is the package that registers it: ``env.id=my_pkg/sum-v0`` imports
  ``my_pkg`` (whose ``__init__`` calls :func:`register`) — a package on ``PYTHONPATH`` or
  shipped to a Ray job as a ``py_module`` is enough, nothing needs installing;
* an installed distribution declares it in its metadata, under the entry-point group
  ``kvrl.envs`` (the name is the id, the value ``pkg.module:Class``), the way vLLM finds its
  plugins: ``[project.entry-points."kvrl.envs"] "my_lab/sum-v0" = "my_pkg.envs:SumEnv"``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvrl.envs.base import Env

ID_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-]+-v\d+$")
ID_FORMAT = "namespace/name-vN (e.g. 'kvrl/math-v0', 'my_lab/needle-v2')"
ENTRY_POINTS = "kvrl.envs"  # the entry-point group of installed packages' environment ids


class EnvNotFoundError(KeyError):
    """Unknown environment id; ``str()`` gives the plain message (KeyError would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass
class EnvSpec:
    id: str
    entry_point: str | Callable[..., Env]
    kwargs: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, EnvSpec] = {}


def register(id: str, entry_point: str | Callable[..., Env], **default_kwargs: Any) -> None:
    """Register ``entry_point`` (``"pkg.mod:Class"`` or a callable) under ``id``.

    ``default_kwargs`` are passed to the constructor; ``make(id, **kw)`` overrides them.
    Re-registering an id with the same entry point replaces it; with a different one it is
    an error (publish a new version instead).
    """
    if not isinstance(id, str) or not ID_PATTERN.match(id):
        raise ValueError(f"invalid environment id {id!r}: ids must look like {ID_FORMAT}")
    if isinstance(entry_point, str) and ":" not in entry_point:
        raise ValueError(f"entry point {entry_point!r} must look like 'pkg.module:Class'")
    old = _REGISTRY.get(id)
    if old is not None and old.entry_point != entry_point:
        raise ValueError(
            f"{id!r} is already registered to {old.entry_point!r}; register {entry_point!r} under a new id or version"
        )
    _REGISTRY[id] = EnvSpec(id, entry_point, dict(default_kwargs))


def registered() -> list[str]:
    """All registered ids, sorted."""
    return sorted(_REGISTRY)


def load_entry_point(path: str) -> Callable[..., Any]:
    """Import ``"pkg.module:Attr"`` and return the attribute."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"dotted path {path!r} must look like 'pkg.module:Class'")
    module = importlib.import_module(module_name)
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj


def discover(id: str) -> None:
    """Register ``id`` from outside kvrl if it can be found (module docstring): an installed
    distribution's ``kvrl.envs`` entry point, else the package its namespace names."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.name == id:
            register(id, ep.value)
            return
    namespace = id.partition("/")[0]
    if not ID_PATTERN.match(id) or not namespace.isidentifier():
        return
    if importlib.util.find_spec(namespace) is not None:
        importlib.import_module(namespace)  # its register() calls, if any, run now


def resolve(id_or_path: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """What ``make(id_or_path)`` calls and the registered default keyword arguments, without
    building anything (the config gate inspects the constructor's signature). A dotted path must name
    an :class:`Env` subclass (TypeError otherwise, before anything is called); a registered id may name
    any factory."""
    if id_or_path not in _REGISTRY and ":" not in id_or_path:
        discover(id_or_path)
    if id_or_path in _REGISTRY:
        spec = _REGISTRY[id_or_path]
        factory = spec.entry_point
        return (load_entry_point(factory) if isinstance(factory, str) else factory), dict(spec.kwargs)
    if ":" in id_or_path:  # a path to anything importable: only an Env class may be called (os:system must not)
        cls = load_entry_point(id_or_path)
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise TypeError(
                f"{id_or_path!r} is a {type(cls).__name__}, not a kvrl.envs.Env class: a dotted path names "
                "a subclass of kvrl.envs.TextEnv or kvrl.envs.TraceEnv (a factory function is registered "
                "under an id: kvrl.envs.register('my_lab/name-v0', factory))"
            )
        return cls, {}
    near = difflib.get_close_matches(id_or_path, registered(), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    namespace = id_or_path.partition("/")[0]
    raise EnvNotFoundError(
        f"no environment registered as {id_or_path!r}.{hint} Registered: {registered()}. To register "
        f"your own: make the package {namespace!r} importable (on PYTHONPATH, or a py_module of the Ray job) and "
        f"call kvrl.envs.register({id_or_path!r}, 'pkg.module:Class') in its __init__, or declare it in an "
        f"installed package's metadata under the entry-point group {ENTRY_POINTS!r}; a dotted path to a class "
        "also works, e.g. env.id=my_pkg.envs:MyEnv."
    )


def make(id_or_path: str, **kwargs: Any) -> Env:
    """Build an environment from a registered id or a dotted path ``pkg.mod:Class``.

    Keyword arguments override the registered defaults. The instance's ``id`` attribute is
    set to the registered id (or to the dotted path when the class declares none).
    """
    factory, defaults = resolve(id_or_path)
    env = factory(**{**defaults, **kwargs})
    if not isinstance(env, Env):
        raise TypeError(
            f"{id_or_path!r} built a {type(env).__name__}, not a kvrl.envs.Env: subclass "
            "kvrl.envs.TextEnv or kvrl.envs.TraceEnv"
        )
    if id_or_path in _REGISTRY or getattr(env, "id", None) is None:
        env.id = id_or_path
    return env
