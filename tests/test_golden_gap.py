"""How benchmarks/learning/multihop_golden_gap.py reads a multihop trace: which token belongs to which prompt
statement, where the chain of thought copies a statement, and when a later copy still needs a statement."""

import importlib.util
from pathlib import Path

import pytest

from kvrl.envs import make

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "learning" / "multihop_golden_gap.py"


@pytest.fixture(scope="module")
def gap():
    spec = importlib.util.spec_from_file_location("multihop_golden_gap", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [3, 11])
def test_every_copy_line_copies_its_prompt_statement(gap, seed):
    env = make("kvrl/multihop-v0")
    env.reset(seed=seed)
    task = env.tasks(1)[0]
    prompt = ["<bos>", *task.prompt.split()]
    tokens = [*prompt, *task.meta["completion"].split(), "<eos>"]
    role, var, copies = gap.roles(tokens, len(prompt))

    statements = {}  # name -> right-hand side, as the prompt defines it
    for p in range(1, tokens.index("?")):
        if role[p] == "stmt" and var[p] == tokens[p]:
            statements[tokens[p]] = tokens[p + 1]
            assert role[p + 1] == "stmt" and var[p + 1] == tokens[p] and role[p + 2] == "stmt_sep"
    queries = tokens[tokens.index("?") + 1 : len(prompt) - 1]
    assert set(queries) <= set(copies), "every query's walk starts with a copy of its statement"
    for name, starts in copies.items():
        for s in starts:
            assert tokens[s + 1] == statements[name] and role[s] == "cot_copy"
    assert all(role[p] == "cot_value" for p in range(len(prompt), len(tokens)) if tokens[p] == "=")
    assert role[-1] == "answer"

    # before the chain of thought every statement a copy reads is needed and unseen; after it none is needed
    kinds = {gap.statement_kind(p, len(prompt), role, var, copies) for p in range(1, len(prompt))} - {None}
    assert kinds <= {"stmt_needed_unseen", "stmt_never"} and "stmt_needed_unseen" in kinds
    unread = [p for p in range(1, len(prompt)) if role[p] == "stmt" and var[p] not in copies]
    assert all(gap.statement_kind(p, len(prompt), role, var, copies) == "stmt_never" for p in unread)
    assert {gap.statement_kind(p, len(tokens), role, var, copies) for p in range(1, len(prompt))} <= {
        None,
        "stmt_never",
    }
    twice = [n for n, starts in copies.items() if len(starts) > 1]
    if twice:  # between its first and its last copy a statement is needed and has been walked once
        n = twice[0]
        p = tokens.index(n, 1)
        while role[p] != "stmt" or var[p] != n:
            p = tokens.index(n, p + 1)
        assert gap.statement_kind(p, copies[n][0] + 1, role, var, copies) == "stmt_needed_seen"
