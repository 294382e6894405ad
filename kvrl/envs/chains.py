"""Variable chains: the tiny reasoner's procedural task family.

A prompt defines K variables, one statement each, in an interleaved order where every
variable is defined before it is used; a statement ``F R ;`` means F = R + 1 (mod 10) and
``F 7 ;`` means F = 7. The prompt ends with one query ``? q :``. The chain of thought walks
down the query's chain, copying each needed statement from the prompt, then walks back up
computing values, and answers in ``\\boxed{}``::

    prompt:      X 0 ; k 3 ; H X ; ... a H ; ... ? a :
    completion:  a H ; H X ; X 0 ; X = 0 ; H = 1 ; a = 2 ; \\boxed{ 2 }

Why this shape (what a model of this size learned in our pretraining trials): every lookup
is keyed on a single token, and a query depth of 6-11 makes the chain of thought about 40 % of the
sequence. The walk-up reads statements the walk-down copied up to ~80 tokens earlier, and
the walk-down reads prompt statements that only become relevant mid-generation, so
*decode-time* eviction decides the outcome, not only prompt compression.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

from kvrl.envs.base import Reward, Task, TextEnv, correct, exact_cot

NAMES = list(string.ascii_lowercase + string.ascii_uppercase)  # 52 single-token names
DIGITS = [str(d) for d in range(10)]
PUNCT = [";", "?", "=", ":", "\\boxed{", "}"]
SPECIALS = ["<pad>", "<bos>", "<eos>"]
VOCAB = SPECIALS + NAMES + DIGITS + PUNCT


@dataclass(frozen=True)
class ChainSpec:
    """Size of the generated tasks: K statements, query depth D (D+1 statements on its chain)."""

    min_statements: int = 28
    max_statements: int = 40
    min_depth: int = 6
    max_depth: int = 11

    def __post_init__(self):
        if not 2 <= self.min_statements <= self.max_statements <= len(NAMES):
            raise ValueError(f"need 2 <= min_statements <= max_statements <= {len(NAMES)}, got {self}")
        if not 1 <= self.min_depth <= self.max_depth < self.min_statements:
            raise ValueError(f"need 1 <= min_depth <= max_depth < min_statements, got {self}")


def make_chain_task(rng: np.random.Generator, spec: ChainSpec = ChainSpec()) -> dict:
    """One task as a dict: ``prompt``, ``completion``, ``answer`` (a digit string),
    ``chain`` (the query's variables, query first) and ``statements`` (the prompt's
    statements as (lhs, rhs) in prompt order)."""
    k = int(rng.integers(spec.min_statements, spec.max_statements + 1))
    depth = int(rng.integers(spec.min_depth, spec.max_depth + 1))
    names = list(rng.permutation(NAMES)[:k])
    # Chains as lists of names, base first: the query chain, then distractor chains of
    # depth 1..8 until K names are used.
    chains = [names[: depth + 1]]
    rest = names[depth + 1 :]
    while rest:
        n = min(len(rest), int(rng.integers(2, 10)))
        chains.append(rest[:n])
        rest = rest[n:]
    values, defs = {}, {}
    for chain in chains:
        base = int(rng.integers(0, 10))
        defs[chain[0]] = str(base)
        values[chain[0]] = base
        for prev, cur in zip(chain, chain[1:]):
            defs[cur] = prev
            values[cur] = (values[prev] + 1) % 10
    # Interleave: repeatedly emit the next statement of a random unfinished chain, so
    # every variable is defined before it is used.
    cursors = [0] * len(chains)
    statements = []
    while len(statements) < k:
        open_ = [i for i, ch in enumerate(chains) if cursors[i] < len(ch)]
        i = open_[int(rng.integers(len(open_)))]
        name = chains[i][cursors[i]]
        statements.append((name, defs[name]))
        cursors[i] += 1
    walk = chains[0][::-1]  # query first, down to the literal base
    query = walk[0]
    prompt = " ".join(f"{a} {b} ;" for a, b in statements) + f" ? {query} :"
    down = " ".join(f"{v} {defs[v]} ;" for v in walk)
    up = " ".join(f"{v} = {values[v]} ;" for v in walk[::-1])
    answer = str(values[query])
    completion = f"{down} {up} \\boxed{{ {answer} }}"
    return {"prompt": prompt, "completion": completion, "answer": answer, "chain": walk, "statements": statements}


class ChainsEnv(TextEnv):
    """The tiny reasoner's task family as a text environment (``kvrl/chains-v0``).

    Tasks are drawn from ``np_random``, so ``reset(seed=s)`` fixes the stream. ``meta``
    holds the reference completion, the query chain and the statements (for oracles).
    """

    # one statement a name (ChainSpec says how they relate)
    arg_bounds = {
        "min_statements": (2, len(NAMES)),
        "max_statements": (2, len(NAMES)),
        "min_depth": (1, len(NAMES) - 1),
        "max_depth": (1, len(NAMES) - 1),
    }

    def __init__(self, min_statements: int = 28, max_statements: int = 40, min_depth: int = 6, max_depth: int = 11):
        super().__init__(rewards=[Reward(correct, 1.0, "correct"), Reward(exact_cot, 0.0, "exact_cot")])
        self.spec = ChainSpec(min_statements, max_statements, min_depth, max_depth)

    def sample_task(self, rng: np.random.Generator) -> Task:
        t = make_chain_task(rng, self.spec)
        uid = f"chains-{int(rng.integers(2**62)):x}"
        return Task(
            id=uid,
            prompt=t["prompt"],
            answer=t["answer"],
            meta={k: t[k] for k in ("completion", "chain", "statements")},
        )
