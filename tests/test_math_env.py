"""MathEnv layouts and errors, the math-verify worker (threads, timeouts), and rewards."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest

from kvrl.envs import check_env, make, verify
from kvrl.envs.math import MathEnv
from kvrl.envs.verify import check_answer, extract_boxed, math_equal


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---- loading ---------------------------------------------------------------------------


def test_fixture_passes_check_env():
    env = make("kvrl/math-v0")
    assert env.num_tasks == 12
    check_env(env)


LAYOUTS = {
    "generic": ([{"id": "g1", "question": "1+1?", "answer": "2"}], "g1", "1+1?", "2"),
    "gsm8k": ([{"question": "Eggs?", "answer": "16 - 3 - 4 = 9\n9 * 2 = 18\n#### 1,018"}], "gsm8k-0", "Eggs?", "1018"),
    "math500": (
        [
            {
                "problem": "Half?",
                "solution": "It is $\\boxed{\\frac{1}{2}}$.",
                "answer": "\\frac{1}{2}",
                "unique_id": "test/algebra/1.json",
                "level": 2,
            }
        ],
        "test/algebra/1.json",
        "Half?",
        "\\frac{1}{2}",
    ),
    "math_solution_only": (
        [{"problem": "Half?", "solution": "So $\\boxed{\\frac{1}{2}}$."}],
        "math_solution_only-0",
        "Half?",
        "\\frac{1}{2}",
    ),
    "aime": (
        [{"ID": "2024-I-1", "Problem": "Find x.", "Answer": 204, "Solution": "..."}],
        "2024-I-1",
        "Find x.",
        "204",
    ),
    "deepscaler": ([{"problem": "Sum?", "answer": "7", "solution": "3+4=\\boxed{7}"}], "deepscaler-0", "Sum?", "7"),
}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_load(tmp_path, layout, fmt):
    rows, task_id, question, answer = LAYOUTS[layout]
    path = tmp_path / f"{layout}.{fmt}"
    if fmt == "jsonl":
        _jsonl(path, rows)
    else:
        pd.DataFrame(rows).to_parquet(path)
    task = MathEnv(path, template="Q: {question} {no braces replaced}").tasks(1)[0]
    assert (task.id, task.answer) == (task_id, answer)
    assert task.prompt == f"Q: {question} {{no braces replaced}}"
    assert task.meta["source"] == f"{path}:1"
    if layout == "math500":
        assert task.meta["level"] == 2


def test_default_prompt():
    task = MathEnv().reset(seed=0)[0]
    assert task.prompt.endswith("\nPut the final answer in \\boxed{}.")


@pytest.mark.parametrize(
    "rows, match",
    [
        (
            [{"question": "a", "answer": "1"}, "", '{"question": "b", "answer": 2', {"question": "c", "answer": "3"}],
            r"bad\.jsonl:3: invalid JSON",
        ),
        ([{"question": "a", "answer": "1"}, {"question": "b"}], r"bad\.jsonl:2: missing answer field.*'answer'"),
        ([{"text": "a", "answer": "1"}], r"bad\.jsonl:1: missing question field.*'question'.*'problem'"),
        ([{"problem": "a", "solution": "no box here"}], r"bad\.jsonl:1: missing answer field and no \\boxed"),
    ],
    ids=["bad_json", "no_answer", "no_question", "solution_without_box"],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, rows, match):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        MathEnv(path)


def test_missing_file_and_bad_template(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        MathEnv(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="{question}"):
        MathEnv(template="no placeholder")


@pytest.mark.parametrize("answer", [[1, 2], {"a": 1}, True, float("nan")], ids=["list", "dict", "bool", "nan"])
def test_a_non_text_answer_is_refused_with_file_line(tmp_path, answer):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"question": "a", "answer": "1"}) + "\n" + json.dumps({"question": "b", "answer": answer}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: the answer is .*it must be text or a number"):
        MathEnv(path)


def test_encodings_directories_and_timeouts(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + json.dumps({"question": "q", "answer": 7}).encode() + b"\n")
    assert MathEnv(bom).tasks(1)[0].answer == "7"  # a byte-order mark is fine; a number is an answer
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(
        json.dumps({"question": "a", "answer": "1"}).encode() + b"\n" + b'{"question": "caf\xe9", "answer": "1"}\n'
    )
    with pytest.raises(ValueError, match=r"latin\.jsonl:2: not UTF-8 \(byte 0xe9 at column 18\)"):
        MathEnv(latin)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        MathEnv(tmp_path)
    with pytest.raises(ValueError, match="timeout=0.*must be > 0"):
        MathEnv(bom, timeout=0)


# ---- rewards ---------------------------------------------------------------------------


def test_rewards_correct_incorrect_unboxed():
    env = MathEnv()
    task = next(t for t in env.data if t.answer == "\\frac{3}{4}")
    r, info = env.score(task, "6/8 reduces to $\\boxed{0.75}$.")
    assert r == 1.0 and info == {"verify_timeout": False, "correct": 1.0, "has_boxed": 1.0, "reward": 1.0}
    r, info = env.score(task, "\\boxed{\\frac{2}{3}}")
    assert r == 0.0 and info["has_boxed"] == 1.0
    r, info = env.score(task, "the answer is 3/4")  # right, but not boxed
    assert r == 0.0 and info["has_boxed"] == 0.0 and info["correct"] == 0.0


def test_extract_boxed():
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert extract_boxed("so \\boxed 5$.") == "5"
    assert extract_boxed("\\fbox{7}") == "7"
    assert extract_boxed("\\boxed{3} then \\boxed{4") is None  # truncated
    assert extract_boxed("no box") is None


def test_math_equal():
    assert math_equal("\\frac{1}{2}", "0.5")
    assert math_equal("2\\sqrt{2}", "\\sqrt8")
    assert not math_equal("41", "42")


def test_verify_from_threads():
    pairs = [("\\frac{1}{2}", "\\dfrac{2}{4}", True), ("12", "12", True), ("3", "4", False), ("(1,2]", "(1,2]", True)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: math_equal(p[0], p[1]), pairs * 2))
    assert got == [p[2] for p in pairs] * 2


def test_pathological_answer_returns_within_timeout():
    nested = "(" * 5000 + "x+1" + ")^2" * 5000  # ~20k characters
    start = time.monotonic()
    verdict = check_answer("1", nested, timeout=1.0)
    assert time.monotonic() - start < 3.0 and verdict == verify.Verdict(False, timed_out=True)


@pytest.fixture
def hanging_worker(monkeypatch):
    """A worker that starts, then never answers."""
    code = "import sys, time; sys.stdout.write('{\"ready\": true}\\n'); sys.stdout.flush(); time.sleep(60)"
    verify.shutdown()
    monkeypatch.setattr(verify, "_worker_argv", lambda: [sys.executable, "-c", code])
    yield
    verify.shutdown()  # the next call starts a real worker again


def test_hard_timeout_kills_a_hanging_worker(hanging_worker):
    start = time.monotonic()
    assert check_answer("1", "1", timeout=1.0) == verify.Verdict(False, timed_out=True)
    assert time.monotonic() - start < 3.0
    env = MathEnv(timeout=0.5)
    reward, info = env.score(env.data[0], f"\\boxed{{{env.data[0].answer}}}")
    assert reward == 0.0 and info["verify_timeout"] is True


def test_worker_restarts_after_a_timeout(hanging_worker, monkeypatch):
    check_answer("1", "1", timeout=0.5)
    monkeypatch.undo()
    assert math_equal("1", "1.0")


def test_state_dict_resume_same_next_task():
    env = MathEnv()
    env.reset(seed=5)
    env.tasks(14)  # into the second epoch
    state = json.loads(json.dumps(env.state_dict()))  # survives a JSON checkpoint
    expected = env.reset()[0]
    other = MathEnv()
    other.load_state_dict(state)
    assert other.reset()[0] == expected


def test_worker_recovers_after_a_crash():
    assert math_equal("2", "2")
    verify._WORKER._proc.kill()  # e.g. the OOM killer
    verify._WORKER._proc.wait()
    assert math_equal("2", "2")


def test_a_prompt_the_model_cannot_hold_names_its_row(tmp_path):
    from kvrl.engines.base import check_prompts
    from kvrl.models.tiny import build_tokenizer

    path = tmp_path / "long.jsonl"
    rows = [{"question": "3 ; 4", "answer": "1"}, {"question": " ".join(["3"] * 40), "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = MathEnv(path, template="{question}")
    check_prompts(env.data[:1], build_tokenizer(), 32)
    with pytest.raises(ValueError, match=r"long\.jsonl:2: the prompt has 41 tokens, the model holds 32 positions"):
        check_prompts(env.data, build_tokenizer(), 32)


# ---- large files: read when drawn (a 200 MB file held whole costs the driver 4.2 GB) ------------------


def _big(path, rows=3000, group=None):
    # ~1 KB a row: 3 MB, enough to tell rows held from offsets held; parquet in row groups of `group` rows
    rows = [{"id": f"r{i}", "question": f"{i} + {i}? " + "words " * 150, "answer": str(2 * i)} for i in range(rows)]
    if path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path, row_group_size=group, compression=None)
        return path
    return _jsonl(path, rows)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_large_file_is_read_when_drawn_not_held(tmp_path, fmt):
    import tracemalloc

    import pyarrow

    from kvrl.envs.base import TextEnv
    from kvrl.envs.math import load_math_tasks

    path = _big(tmp_path / f"big.{fmt}", group=700)  # parquet: 5 row groups, the last one short
    arrow = pyarrow.total_allocated_bytes()  # Arrow's buffers are not Python's: tracemalloc misses them
    tracemalloc.start()
    try:
        env = MathEnv(path)
        held = tracemalloc.get_traced_memory()[0] + pyarrow.total_allocated_bytes() - arrow
    finally:
        tracemalloc.stop()
    assert held < path.stat().st_size / 20, f"{held} bytes held for a {path.stat().st_size}-byte file"
    # the same tasks, the same order for a seed, the same resume digest as the whole list gives
    whole = TextEnv(load_math_tasks(path))
    for e in (env, whole):
        e.reset(seed=7)
    assert env.tasks(20) == whole.tasks(20) and env.num_tasks == 3000
    assert env.state_dict()["data_sha256"] == whole.state_dict()["data_sha256"]


def test_the_prompt_check_tokenises_a_chunk_at_a_time(tmp_path):
    from kvrl.engines.base import check_prompts
    from kvrl.models.tiny import build_tokenizer

    tok, batches = build_tokenizer(), []

    class Counting:  # the tokenizer, counting the texts of each call
        def __call__(self, texts, **kw):
            batches.append(len(texts))
            return tok(texts, **kw)

        def __getattr__(self, name):
            return getattr(tok, name)

    env = MathEnv(
        _jsonl(tmp_path / "rows.jsonl", [{"question": f"{i} ; 4", "answer": "1"} for i in range(600)]),
        template="{question}",
    )
    assert check_prompts(env.data, Counting(), 32) == check_prompts(env.data[:5], tok, 32)
    assert sum(batches) == 2 * 600 and max(batches) <= 256  # prompts and answers, never every row's at once


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_resume_refuses_a_line_edited_in_a_lazily_read_file(tmp_path, fmt):
    path = _big(tmp_path / f"big.{fmt}", rows=50)
    env = MathEnv(path)
    env.reset(seed=3)
    env.tasks(4)
    state = env.state_dict()
    if fmt == "jsonl":
        lines = path.read_text().splitlines(keepends=True)
        lines[10] = lines[10].replace('"answer": "20"', '"answer": "twenty"')  # another size: mtime may not tick
        path.write_text("".join(lines))
    else:
        rows = pd.read_parquet(path)
        rows.loc[10, "answer"] = "twenty"
        rows.to_parquet(path, compression=None)
    with pytest.raises(ValueError, match=f"big.{fmt} changed while this run reads it"):
        env.tasks(1)  # its offsets no longer point at its rows
    with pytest.raises(ValueError, match="data set differs from the one this state was saved with"):
        MathEnv(path).load_state_dict(state)
