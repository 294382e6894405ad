"""KV policies: what to keep in a per-(layer, KV head) cache.

Every policy is a small dataclass with one ``score()``; selection, sampling and the
eviction schedule are shared (:mod:`kvrl.policies.base`). Build one by name::

    from kvrl.policies import make_policy
    policy = make_policy("gkv", budget=2048)

``HeadAllocation`` (RLKV / DuoAttention) and ``Window`` are not token policies: they are
static death patterns (which heads keep sink + recent only).

What the cache does in an engine call is one of four regimes (:mod:`kvrl.policies.regime`):
``Full()``, ``Evicting(policy)``, ``Static(pattern)``, ``Mixed(gates, sink, recent)``;
``as_regime`` builds one from None, a policy, a pattern or a death tensor.
"""

import importlib

from kvrl.policies.base import KVPolicy, Observation, Selection, geometry, plackett_luce_logprob, should_evict
from kvrl.policies.gkv import GKV
from kvrl.policies.h2o import H2O
from kvrl.policies.heads import HeadAllocation, Window
from kvrl.policies.learned import LearnedScorer, ScorerMLP
from kvrl.policies.regime import REGIMES, Evicting, Full, Mixed, Regime, Static, as_regime, checksum
from kvrl.policies.rkv import RKV
from kvrl.policies.snapkv import SnapKV
from kvrl.policies.streaming import StreamingLLM

POLICIES = {"streaming": StreamingLLM, "h2o": H2O, "snapkv": SnapKV, "rkv": RKV, "gkv": GKV, "learned": LearnedScorer}
# the zoo's policies that need no trained artefact (every list of "the rule-based policies" derives from it)
RULE_BASED = tuple(name for name, cls in POLICIES.items() if cls is not LearnedScorer)


def policy_class(name: str) -> type[KVPolicy]:
    """The class of the policy registered as ``name``, or of a dotted path ``pkg.module:Class`` to a
    :class:`KVPolicy` of your own (as ``env.id`` takes one; the config gate checks it first)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr, None)
        if not (isinstance(cls, type) and issubclass(cls, KVPolicy)):
            raise ValueError(f"KV policy {name!r} is not a KVPolicy subclass")
        return cls
    if name not in POLICIES:
        raise ValueError(f"unknown KV policy {name!r}; known policies: {', '.join(POLICIES)}, or pkg.module:Class")
    return POLICIES[name]


def make_policy(name: str, model_config=None, **kwargs) -> KVPolicy:
    """Instantiate the policy ``name`` (:func:`policy_class`) with keyword arguments. Given a
    transformers ``model_config``, the learned scorer's geometry (group, head_dim, layers,
    kv_heads) is read from it unless passed explicitly."""
    cls = policy_class(name)
    if cls is LearnedScorer and model_config is not None:
        kwargs = {**geometry(model_config), **kwargs}
    return cls(**kwargs)


__all__ = [
    "GKV",
    "H2O",
    "POLICIES",
    "REGIMES",
    "RKV",
    "RULE_BASED",
    "Evicting",
    "Full",
    "HeadAllocation",
    "KVPolicy",
    "LearnedScorer",
    "Mixed",
    "Observation",
    "Regime",
    "ScorerMLP",
    "Selection",
    "SnapKV",
    "Static",
    "StreamingLLM",
    "Window",
    "as_regime",
    "checksum",
    "geometry",
    "make_policy",
    "plackett_luce_logprob",
    "policy_class",
    "should_evict",
]
