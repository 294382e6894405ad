"""The KV budget's rules, stated once. A token policy keeps its ``sink`` first and ``window`` newest
tokens and chooses at least one more by score, so a budget holds at least :func:`least_budget`; and it
evicts only what outgrows the budget, so a budget a sequence never outgrows runs the full cache
(:func:`budget_evicts`).

Every check of a budget calls these: a policy built in Python (``kvrl.policies.base.KVPolicy``), the
kv section on the config path (``kvrl.config.shared.KVConfig``), job=eval's lines (``kvrl.jobs.eval_config``),
the controller once the data is read (``kvrl.workers.controller``) and the engines' warning before a
batch (``kvrl.engines.base.check_request``). Standard library only: the config path imports no torch.
"""


def least_budget(window: int, sink: int) -> int:
    """The smallest budget a token policy with this ``window`` and ``sink`` can evict to."""
    return window + sink + 1


def budget_evicts(budget: float, longest: float) -> bool:
    """A sequence of ``longest`` tokens outgrows ``budget``: below it, the policy evicts; at or above it,
    the cache never outgrows the budget (``longest`` inf: not known, so it may)."""
    return budget < longest
