"""Multi-query variable chains with a long chain of thought (``kvrl/multihop-v0``): the task
family of the second tiny reasoner, made to have the properties of real reasoning traces that
KV-compression methods exploit.

The prompt defines K variables over 52 single-token names, one statement each, in an order
where every variable is defined before it is used: ``F R ;`` means F = R + 1 (mod 10) and
``F 7 ;`` means F = 7. The variables form a few trees (a statement's right-hand side is its
parent), so many variables share ancestors. The prompt ends with Q queries ``? a b c :``.
The chain of thought answers the queries in order; each query is one *segment* that walks
down the query's chain, copying each statement from the prompt, then walks back up computing
the values; the answer lists the queries' values::

    prompt:      X 0 ; k 3 ; H X ; a H ; m k ; b H ; ... ? a b :
    completion:  a H ; H X ; X 0 ; X = 0 ; H = 1 ; a = 2 ;
                 b H ; H X ; X 0 ; X = 0 ; H = 1 ; b = 2 ;  \\boxed{ 2 2 }

What the methods see in such a trace (measured by ``benchmarks/learning/testbed_properties.py``):

* a long chain of thought (Q segments of 7 tokens per chain link: ~70 % of the sequence,
  ~300+ tokens at the default size) that re-reads its own conclusions at long range: the
  answer reads every segment's final value, up to the whole chain of thought back, keyed
  on the query's name;
* redundancy: queries on one tree re-derive their shared ancestors, so whole runs of
  statements and values recur, as the re-checks of a real trace do (R-KV's observation);
* content-keyed lookups whose future use is partly visible in the attention so far: a prompt
  statement that an earlier segment walked through has been attended to and is likely to
  be walked again (a shared ancestor), but a statement that only a later query needs has
  had no attention until that query starts;
* a verifiable answer: the boxed digits, one per query, compared exactly.

Every lookup is keyed on a single token (multi-token keys were not learned by a model of
this size in our pretraining trials). Segments are separated by nothing but the next
query's name: where one segment ends and which query comes next is read from the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from kvrl.envs.base import Reward, Task, TextEnv, correct, exact_cot
from kvrl.envs.chains import NAMES
from kvrl.envs.verify import extract_boxed


@dataclass(frozen=True)
class MultiHopSpec:
    """Size of the generated tasks: K statements, Q queries, each of depth D (the query's chain
    has D + 1 statements, the last a literal), and up to ``max_trees`` trees of variables."""

    min_statements: int = 36
    max_statements: int = 48
    min_queries: int = 5
    max_queries: int = 7
    min_depth: int = 5
    max_depth: int = 9
    max_trees: int = 3

    def __post_init__(self):
        if not 2 <= self.min_statements <= self.max_statements <= len(NAMES):
            raise ValueError(f"need 2 <= min_statements <= max_statements <= {len(NAMES)}, got {self}")
        if not 1 <= self.min_queries <= self.max_queries:
            raise ValueError(f"need 1 <= min_queries <= max_queries, got {self}")
        if not 1 <= self.min_depth <= self.max_depth < self.min_statements:
            raise ValueError(f"need 1 <= min_depth <= max_depth < min_statements, got {self}")
        if self.max_queries > self.min_statements - self.max_depth:
            raise ValueError(
                f"max_queries={self.max_queries} distinct queries of depth >= {self.min_depth} do not "
                f"fit {self.min_statements} statements: lower max_queries or raise min_statements"
            )
        if self.max_trees < 1:
            raise ValueError(f"max_trees must be >= 1, got {self.max_trees}")

    def scaled(self, frac: float) -> MultiHopSpec:
        """The spec at ``frac`` ∈ [0, 1] of a curriculum that grows every size from its
        smallest sensible value (2 statements per query link, one query of depth 1) to this
        spec's; ``frac >= 1`` is this spec."""
        if frac >= 1:
            return self
        small = {
            "min_statements": 8,
            "max_statements": 12,
            "min_queries": 1,
            "max_queries": 1,
            "min_depth": 1,
            "max_depth": 2,
        }

        def lerp(name: str) -> int:
            lo, hi = min(small[name], getattr(self, name)), getattr(self, name)
            return int(round(lo + (hi - lo) * max(frac, 0.0)))

        sizes = {f.name: lerp(f.name) for f in fields(self) if f.name in small}
        sizes["max_statements"] = max(sizes["max_statements"], sizes["min_statements"])
        sizes["max_queries"] = max(sizes["max_queries"], sizes["min_queries"])
        sizes["max_depth"] = max(sizes["max_depth"], sizes["min_depth"])
        sizes["max_queries"] = min(sizes["max_queries"], sizes["min_statements"] - sizes["max_depth"])
        sizes["min_queries"] = min(sizes["min_queries"], sizes["max_queries"])
        return replace(self, **sizes)


def _forest(rng: np.random.Generator, names: list[str], trees: int) -> tuple[dict[str, str | None], dict[str, int]]:
    """Parents (None for a tree's root) and depths. Each new variable extends the newest
    variable of a random tree with probability 0.7 (long chains), else branches off a
    random variable of that tree (shared ancestors)."""
    parent: dict[str, str | None] = {}
    depth: dict[str, int] = {}
    members: list[list[str]] = [[] for _ in range(trees)]
    for i, name in enumerate(names):
        t = i if i < trees else int(rng.integers(trees))
        tree = members[t]
        if not tree:
            parent[name], depth[name] = None, 0
        else:
            p = tree[-1] if rng.random() < 0.7 else tree[int(rng.integers(len(tree)))]
            parent[name], depth[name] = p, depth[p] + 1
        tree.append(name)
    return parent, depth


def make_multihop_task(rng: np.random.Generator, spec: MultiHopSpec = MultiHopSpec()) -> dict:
    """One task as a dict: ``prompt``, ``completion``, ``answer`` (the queries' values, space
    separated), ``queries``, ``chains`` (each query's chain, query first), ``statements`` (the
    prompt's (lhs, rhs) in prompt order) and ``segments`` (each segment's token count)."""
    while True:  # redraw the (rare) forest without enough deep variables
        k = int(rng.integers(spec.min_statements, spec.max_statements + 1))
        q = int(rng.integers(spec.min_queries, spec.max_queries + 1))
        names = [str(n) for n in rng.permutation(NAMES)[:k]]
        trees = int(rng.integers(1, spec.max_trees + 1))
        parent, depth = _forest(rng, names, trees)
        eligible = [n for n in names if spec.min_depth <= depth[n] <= spec.max_depth]
        if len(eligible) >= q:
            break
    queries = [eligible[i] for i in rng.permutation(len(eligible))[:q]]
    value: dict[str, int] = {}
    rhs: dict[str, str] = {}
    for n in names:  # parents come first in `names`
        if parent[n] is None:
            value[n] = int(rng.integers(10))
            rhs[n] = str(value[n])
        else:
            value[n] = (value[parent[n]] + 1) % 10
            rhs[n] = parent[n]
    # prompt order: repeatedly the next variable of a random tree, so each is defined before use
    by_tree: dict[str, list[str]] = {}
    for n in names:
        root = n
        while parent[root] is not None:
            root = parent[root]
        by_tree.setdefault(root, []).append(n)
    pending = list(by_tree.values())
    statements = []
    while pending:
        i = int(rng.integers(len(pending)))
        statements.append((pending[i][0], rhs[pending[i][0]]))
        pending[i] = pending[i][1:]
        pending = [p for p in pending if p]
    chains, parts = [], []
    for v in queries:
        chain = [v]
        while parent[chain[-1]] is not None:
            chain.append(parent[chain[-1]])
        chains.append(chain)
        down = " ".join(f"{n} {rhs[n]} ;" for n in chain)
        up = " ".join(f"{n} = {value[n]} ;" for n in reversed(chain))
        parts.append(f"{down} {up}")
    answer = " ".join(str(value[v]) for v in queries)
    prompt = " ".join(f"{a} {b} ;" for a, b in statements) + " ? " + " ".join(queries) + " :"
    completion = " ".join(parts) + f" \\boxed{{ {answer} }}"
    return {
        "prompt": prompt,
        "completion": completion,
        "answer": answer,
        "queries": queries,
        "chains": chains,
        "statements": statements,
        "segments": [7 * len(c) for c in chains],
    }


def oracle_need(meta: dict) -> tuple[int, int]:
    """(peak tokens an oracle must hold, sequence length) for a task's reference trace, in
    word-level tokens (BOS and EOS included): at the start of each segment and of the answer,
    the statements of the queries not yet answered (3 tokens each), the query list, the
    conclusions (``q = v ;``) already written, and the whole current segment, which its
    walk-up reads back. What no policy can go below without losing information."""
    lhs = [a for a, _ in meta["statements"]]
    q = len(meta["queries"])
    prompt = 1 + 3 * len(lhs) + 2 + q
    segments = [7 * len(c) for c in meta["chains"]]
    peak = 0
    for i in range(q + 1):  # before segment i (i == q: the answer)
        needed = {n for chain in meta["chains"][i:] for n in chain}
        current = segments[i] if i < q else q + 2
        peak = max(peak, 1 + 3 * len(needed) + 2 + q + 4 * i + current)
    return peak, prompt + sum(segments) + q + 3


def queries_right(task: Task, completion: str) -> list[bool]:
    """For each query, whether the boxed answer gets its value right (a missing value is wrong)."""
    boxed = extract_boxed(completion)
    got = boxed.split() if boxed is not None else []
    return [i < len(got) and got[i] == v for i, v in enumerate(task.answer.split())]


def conclusion_ends(queries: list[str], words: list[str], stop: int) -> list[int]:
    """Where each query's conclusion ``q = v ;`` ends (the index after its ``;``), the queries in order,
    each searched for after the previous one's and before ``stop``; the list stops at the first query
    without one. Query i's value as concluded is ``words[ends[i] - 2]``."""
    ends, pos = [], 0
    for q in queries:
        k = next(
            (k for k in range(pos, stop - 3) if words[k] == q and words[k + 1] == "=" and words[k + 3] == ";"), None
        )
        if k is None:
            break
        ends.append(pos := k + 4)
    return ends


def query_accuracy(task: Task, completion: str) -> float:
    """The share of the queries whose value the boxed answer gets right (a metric: partial
    credit that moves before the exact answer does)."""
    right = queries_right(task, completion)
    return sum(right) / len(right)


class MultiHopEnv(TextEnv):
    """Multi-query variable chains as a text environment (``kvrl/multihop-v0``).

    Tasks are drawn from ``np_random``, so ``reset(seed=s)`` fixes the stream. The reward is
    the exact boxed answer (1 or 0) plus ``partial_credit`` times the share of queries right
    (``query_acc``); ``partial_credit=0`` (the default) makes ``query_acc`` a metric only, as
    ``exact_cot`` is. Partial credit is a training signal: under a compressed cache the exact
    answer over 5–7 queries can be so rare that every group of samples scores 0 and GRPO's
    advantages vanish, while the share of queries right still differs within groups
    (``benchmarks/learning/multihop_signal.py`` measures both). ``correct`` in ``info`` stays
    the exact answer whatever the weight. ``meta`` holds the reference completion, the
    queries, their chains and the statements (for oracles and the property measurements).
    """

    # one statement a name (MultiHopSpec says how they relate)
    arg_bounds = {
        "min_statements": (2, len(NAMES)),
        "max_statements": (2, len(NAMES)),
        "min_queries": (1, len(NAMES) - 1),
        "max_queries": (1, len(NAMES) - 1),
        "min_depth": (1, len(NAMES) - 1),
        "max_depth": (1, len(NAMES) - 1),
        "max_trees": (1, len(NAMES)),
        "partial_credit": (0, float("inf")),
    }

    def __init__(
        self,
        min_statements: int = 36,
        max_statements: int = 48,
        min_queries: int = 5,
        max_queries: int = 7,
        min_depth: int = 5,
        max_depth: int = 9,
        max_trees: int = 3,
        partial_credit: float = 0.0,
    ):
        if not (np.isfinite(partial_credit) and partial_credit >= 0):
            raise ValueError(f"partial_credit must be a finite number >= 0, got {partial_credit}")
        super().__init__(
            rewards=[
                Reward(correct, 1.0, "correct"),
                Reward(query_accuracy, float(partial_credit), "query_acc"),
                Reward(exact_cot, 0.0, "exact_cot"),
            ]
        )
        self.spec = MultiHopSpec(
            min_statements, max_statements, min_queries, max_queries, min_depth, max_depth, max_trees
        )

    def segments(self, task: Task, completion: str, pieces: list[str]) -> tuple[list[int], list[float]]:
        """A segment per query, rewarded 1 when the boxed answer gets that query's value right: query i's
        chain of thought (from where the previous query's ends to its own conclusion ``q = v ;``) and its
        digit in the box. Where a conclusion never comes, query i's segment runs to the box and the later
        queries have only their digits. The box's brackets and what follows the last conclusion belong to
        no segment."""
        words = [p.strip() for p in pieces]
        queries = task.meta["queries"]
        box = next((k for k, w in enumerate(words) if w == "\\boxed{"), len(words))
        seg, pos = [-1] * len(words), 0
        ends = conclusion_ends(queries, words, box)
        for i, end in enumerate(ends):
            seg[pos:end] = [i] * (end - pos)
            pos = end
        if len(ends) < len(queries):  # the first query without a conclusion runs to the box
            seg[pos:box] = [len(ends)] * (box - pos)
        for i in range(len(queries)):
            k = box + 1 + i
            if k >= len(words) or words[k] == "}":
                break
            seg[k] = i
        return seg, [float(r) for r in queries_right(task, completion)]

    def sample_task(self, rng: np.random.Generator) -> Task:
        t = make_multihop_task(rng, self.spec)
        uid = f"multihop-{int(rng.integers(2**62)):x}"
        return Task(
            id=uid,
            prompt=t["prompt"],
            answer=t["answer"],
            meta={k: t[k] for k in ("completion", "queries", "chains", "statements")},
        )
