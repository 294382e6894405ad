"""job=eval: the evaluation suite on a real architecture (a small random Qwen3 with its chat
template) over a local math file, in both engines, and its resume."""

import json
import re
import sys
from pathlib import Path

import pytest

from kvrl.eval.suite import PolicySpec, error_mode, kv_usage, pass_at_k, repeats
from kvrl.models import shrunk
from kvrl.run import main

ROW_FIELDS = {
    "policy",
    "kind",
    "point",
    "budget",
    "budget_ratio",
    "accuracy",
    "accuracy_se",
    "tasks",
    "samples",
    "pass@1",
    "pass@2",
    "gen_tokens",
    "truncated",
    "mode/correct",
    "mode/wrong",
    "mode/no_answer",
    "mode/repetition",
    "kv_retention",
    "peak_kv_tokens",
    "decode_tokens_per_s",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = shrunk.build("qwen3", root / "qwen3")
    data = root / "gsm.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "question": f"Tom has {a} apples and buys {b} more. How many now?",
                    "answer": f"He has {a} + {b}.\n#### {a + b}",
                }
            )
            + "\n"
            for a, b in [(3, 4), (12, 7), (5, 5), (21, 13), (8, 1)]
        )
    )
    return model, data


def args(setup, out, *extra):
    model, data = setup
    return [
        "recipe=tiny_eval",
        f"model.path={model}",
        "env.id=kvrl/math-v0",
        f"env.kwargs={{path: {data}}}",
        "env.num_eval_tasks=5",
        "eval.policies=[full,streaming,gkv]",
        "eval.budgets=[40]",
        "eval.samples=2",
        "eval.pass_k=[1,2]",
        "sampling.max_new_tokens=32",
        "sampling.temperature=0",
        "kv.interval=8",
        "kv.window=4",
        "kv.sink=2",
        f"output_dir={out}",
        *extra,
    ]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def refused(capsys, pattern: str) -> bool:
    """What kvrl.run printed for a run it refused: one message matching `pattern`, no traceback."""
    err = capsys.readouterr().err
    assert err.startswith("kvrl: error: the run cannot start: ") and "Traceback" not in err, err
    assert re.search(pattern, err), err
    return True


def test_rows_samples_pictures_and_report(setup, tmp_path, capsys):
    ratio = [
        "eval.policies=[full,streaming,gkv,gkv_ratio]",
        "eval.settings={gkv_ratio: {policy: gkv, budget_ratio: 0.75}}",
    ]
    assert main(args(setup, tmp_path, *ratio)) == 0
    rows = read(tmp_path / "rows.jsonl")
    assert [(r["policy"], r["point"]) for r in rows] == [
        ("full", "-"),
        ("streaming", "40"),
        ("gkv", "40"),
        ("gkv_ratio", "40"),
    ]
    for r in rows:
        assert ROW_FIELDS <= r.keys(), ROW_FIELDS - r.keys()
        assert r["tasks"] == 5 and r["samples"] == 10
        # outputs of 32 tokens cannot hold the repetition rule's 120 words: n/a, not 0 %
        assert r["mode/repetition"] is None
        assert sum(r[f"mode/{m}"] for m in ("correct", "wrong", "no_answer")) == pytest.approx(1.0)
    assert rows[0]["kv_retention"] == 1.0 and rows[1]["kv_retention"] < 1.0
    assert rows[1]["peak_kv_tokens"] <= 40 + 8  # the budget plus one interval
    assert [r["budget_ratio"] for r in rows] == [None, None, None, 0.75]
    samples = read(tmp_path / "samples.jsonl")
    assert len(samples) == 40 and {"completion", "reward", "info", "mode", "finish"} <= samples[0].keys()
    # G-KV's ratio mode: the budget grows to 3/4 of the sequence (~34 prompt + 32 new tokens: up to 50)
    longest = max(s["prompt_tokens"] + s["tokens"] for s in samples if s["policy"] == "gkv_ratio")
    assert 40 + 8 < rows[3]["peak_kv_tokens"] <= max(40, 0.75 * longest) + 8
    for name in ("accuracy.png", "error_modes.png", "retention.png"):
        assert (tmp_path / name).stat().st_size > 1000
        assert f"]({name})" in (tmp_path / "report.md").read_text()
    report = (tmp_path / "report.md").read_text()
    assert "| gkv | 40 |" in report and "| gkv_ratio | max(40, 0.75·L) |" in report
    assert "| n/a |" in report and "repetition = not applicable (n/a) here" in report
    # the evaluated model named by its files' checksums
    from kvrl.runlog import sha256_of

    model, _ = setup
    assert f"`model.safetensors` {sha256_of(model / 'model.safetensors')}" in report


def test_retention_shows_every_evicting_line_and_accuracy_one_x_quantity(setup, tmp_path, monkeypatch, capsys):
    """retention.png has a row of panels per line that evicts (not only the first), and the
    accuracy picture puts every line at its measured peak KV, labelled with its nominal budget."""
    import kvrl.eval.report as job

    shown, points = [], []
    monkeypatch.setattr(job, "plot_retention", lambda lines, path: shown.extend(t for t, *_ in lines))
    real = job.plot_accuracy

    def spy(rows, path, title):
        import matplotlib.axes

        calls = []
        orig = matplotlib.axes.Axes.errorbar
        monkeypatch.setattr(
            matplotlib.axes.Axes,
            "errorbar",
            lambda self, x, y, *a, **k: calls.append(list(x)) or orig(self, x, y, *a, **k),
        )
        real(rows, path, title)
        points.extend(calls)

    monkeypatch.setattr(job, "plot_accuracy", spy)
    assert main(args(setup, tmp_path, "eval.policies=[full,window,streaming,gkv]", "eval.budgets=[24,40]")) == 0
    assert shown == ["window at 40", "streaming at 40", "gkv at 40"]
    rows = read(tmp_path / "rows.jsonl")
    assert points == [
        [r["peak_kv_tokens"] for r in rows if r["policy"] == name] for name in ("window", "streaming", "gkv")
    ]


def test_throughput_leaves_out_a_warm_up_call_per_line(setup, tmp_path, monkeypatch, capsys):
    """Each line's first generate call is an untimed warm-up of one prompt; the timed batches
    are the grid's."""
    from kvrl.engines.hf import HFEngine

    calls = []
    real = HFEngine.generate
    monkeypatch.setattr(
        HFEngine, "generate", lambda self, prompts, *a, **k: calls.append(len(prompts)) or real(self, prompts, *a, **k)
    )
    assert main(args(setup, tmp_path, "sampling.batch_size=4")) == 0
    # 3 lines (full, streaming, gkv), each: 1 warm-up prompt, then 10 samples in batches of 4
    assert calls == [1, 4, 4, 2] * 3


def test_an_interrupted_evaluation_resumes_without_regenerating(setup, tmp_path, monkeypatch, capsys):
    """Sampled at temperature 1 in batches of 2, killed after 13 samples (the 14th line torn):
    the rerun generates only the batches with a sample missing (the 7th batch, half on disk,
    and the 8 after it: 18 prompts) and ends with exactly the samples of an uninterrupted run
    (batches and seeds are a fixed grid); a third run generates nothing."""
    from kvrl.engines.hf import HFEngine

    sampled = ("sampling.temperature=1.0", "sampling.batch_size=2")
    assert main(args(setup, tmp_path / "whole", *sampled)) == 0
    whole = read(tmp_path / "whole" / "samples.jsonl")
    out = tmp_path / "cut"
    out.mkdir()
    lines = (tmp_path / "whole" / "samples.jsonl").read_text().splitlines()
    (out / "samples.jsonl").write_text("\n".join(lines[:13]) + "\n" + lines[13][:40])
    generated = []
    real = HFEngine.generate
    monkeypatch.setattr(
        HFEngine,
        "generate",
        lambda self, prompts, *a, **k: generated.append(len(prompts)) or real(self, prompts, *a, **k),
    )
    assert main(args(setup, out, *sampled)) == 0
    assert sum(generated) == 18 + 2  # and one warm-up prompt for each of the 2 lines that generate

    def strip(rows):
        return sorted(json.dumps({k: v for k, v in r.items() if k != "seconds"}, sort_keys=True) for r in rows)

    assert strip(read(out / "samples.jsonl")) == strip(whole)
    generated.clear()
    assert main(args(setup, out, *sampled)) == 0
    assert generated == []


@pytest.mark.vllm
def test_both_engines_give_the_same_greedy_completions(setup, tmp_path, capsys):
    pytest.importorskip("vllm")
    for engine in ("hf", "vllm"):
        assert main(args(setup, tmp_path / engine, f"workers.engine={engine}", "workers.kv_cache_gib=0.05")) == 0
    key = lambda s: (s["policy"], s["point"], s["task"], s["sample"])  # noqa: E731
    hf, vl = ({key(s): s["completion"] for s in read(tmp_path / e / "samples.jsonl")} for e in ("hf", "vllm"))
    assert hf == vl


def test_the_rules_of_the_metrics():
    loop = "x = 1 + 1 " * 40
    assert repeats(loop) and not repeats(" ".join(str(i) for i in range(200)))
    assert error_mode("so \\boxed{7}", 1.0) == "correct"
    assert error_mode(loop, 0.0) == "repetition"
    assert error_mode("</think> I do not know", 0.0) == "no_answer"
    assert error_mode("<think>\\boxed{7}</think> hmm", 0.0) == "no_answer"  # the box is inside the thinking
    assert error_mode("\\boxed{8}", 0.0) == "wrong"
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 2) == 1.0 and pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(2, 1, 1) == pytest.approx(0.5)


def test_kv_usage_of_a_trace():
    import torch

    from kvrl.cache import EvictionTrace
    from kvrl.kernels import NEVER

    death = torch.full((1, 1, 1, 10), NEVER, dtype=torch.int32)
    death[0, 0, 0, 1], death[0, 0, 0, 2] = 6, 7  # keys 1 and 2 evicted before steps 6 and 7
    retention, peak = kv_usage(EvictionTrace.from_death(death, torch.tensor([10])), prompt_len=4)
    alive = [5, 6, 6, 6, 7, 8]  # steps 4..9: seen q + 1 keys minus the dead ones
    assert peak == 8 and retention == pytest.approx(sum(a / (q + 1) for a, q in zip(alive, range(4, 10))) / 6)


def test_a_line_sets_its_own_window_and_sink():
    """recipes/base/eval_math.yaml runs R-KV at its 8 observation queries and StreamingLLM
    with its 4 sinks beside G-KV's window 16 and no sink: a token policy's own interval,
    window and sink replace kv's for its line."""
    kv = {"interval": 128, "window": 16, "sink": 0, "budget_ratio": None}
    settings = {"rkv": {"window": 8}, "streaming": {"sink": 4}}
    rkv, streaming, gkv = (PolicySpec.of(name, settings).regime(None, 512, kv) for name in ("rkv", "streaming", "gkv"))
    assert (rkv.window, rkv.sink, rkv.interval) == (8, 0, 128)
    assert (streaming.window, streaming.sink) == (16, 4)
    assert (gkv.window, gkv.sink, gkv.budget) == (16, 0, 512)


def test_a_rerun_with_other_settings_or_another_model_is_refused_with_what_differs(
    setup, tmp_path, monkeypatch, capsys
):
    """Samples are keyed by what determines them. Before: a rerun at another temperature, or with
    other weights at the same path, reused the old samples silently. The refusal is a config error:
    exit 2, the message, no traceback."""
    import shutil

    from kvrl.engines.hf import HFEngine

    model, _ = setup
    out = tmp_path / "out"
    assert main(args(setup, out, "eval.policies=[full]")) == 0
    capsys.readouterr()
    assert main(args(setup, out, "eval.policies=[full]", "sampling.temperature=1.0")) == 2
    assert refused(
        capsys,
        r"(?s)holds samples of line full from another setting than this evaluation's:\n  "
        r"sampling.temperature: 0.0 -> 1.0\nrerun with those settings to reuse them, or give this "
        r"evaluation its own output_dir=",
    )
    flipped = shutil.copytree(model, tmp_path / "flipped")
    weights = bytearray((flipped / "model.safetensors").read_bytes())
    weights[-3] ^= 0x40
    (flipped / "model.safetensors").write_bytes(bytes(weights))
    assert main(args(setup, out, "eval.policies=[full]", f"model.path={flipped}")) == 2
    assert refused(capsys, r"model.files.model.safetensors: '[0-9a-f]{64}' -> '[0-9a-f]{64}'")
    generated = []
    real = HFEngine.generate
    monkeypatch.setattr(
        HFEngine,
        "generate",
        lambda self, prompts, *a, **k: generated.append(len(prompts)) or real(self, prompts, *a, **k),
    )
    same = shutil.copytree(model, tmp_path / "same")  # the same weights elsewhere: the same samples
    assert main(args(setup, out, "eval.policies=[full]", f"model.path={same}")) == 0
    assert generated == []
    settings = json.loads((out / "settings.json").read_text())["settings"]
    assert {s["setting"] for s in read(out / "samples.jsonl")} <= settings.keys()


def test_duplicate_task_ids_are_an_error_naming_the_rows(setup, tmp_path, capsys):
    """Before: 20 rows sharing one id were reported as 1 task."""
    data = tmp_path / "dup.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": "same", "question": f"What is {a} + 1?", "answer": str(a + 1)}) + "\n" for a in range(20)
        )
    )
    assert main(args(setup, tmp_path / "out", f"env.kwargs={{path: {data}}}", "env.num_eval_tasks=20")) == 2
    assert refused(
        capsys,
        r"kvrl/math-v0: task ids must be unique, but 1 are shared: 'same' by .*dup.jsonl:1, "
        r".*dup.jsonl:2, .*dup.jsonl:5 \.\.\. \(20 tasks\); give every task its own id",
    )


def test_a_task_whose_content_changed_is_refused(setup, tmp_path, capsys):
    data = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t{a}", "question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    own = [f"env.kwargs={{path: {data}}}", "env.num_eval_tasks=3", "eval.policies=[full]"]
    assert main(args(setup, tmp_path / "out", *own)) == 0
    rows[1]["question"] = "What is 40 + 1?"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(args(setup, tmp_path / "out", *own)) == 2
    assert refused(capsys, r"holds samples of 1 task\(s\) whose content has changed since \(t1\)")


def test_a_value_read_from_the_environment_is_never_written_nor_shown(setup, tmp_path, monkeypatch, capsys):
    """`env.system_prompt='${oc.env:NAME}'` (or a token in env.kwargs): settings.json held the value, and a
    rerun with another value printed both. The samples are keyed by the value; what is written and shown is
    the reference."""
    _, data = setup
    out = tmp_path / "out"
    secret = [
        "env.system_prompt=${oc.env:KVRL_TEST_SECRET}",
        "env.kwargs.path=${oc.env:KVRL_TEST_DATA}",
        "eval.policies=[full]",
    ]
    monkeypatch.setenv("KVRL_TEST_SECRET", "first-secret-7f3a")
    monkeypatch.setenv("KVRL_TEST_DATA", str(data))
    assert main(args(setup, out, *secret)) == 0
    settings = (out / "settings.json").read_text()
    assert "${oc.env:KVRL_TEST_SECRET}" in settings and "${oc.env:KVRL_TEST_DATA}" in settings
    written = "".join(p.read_text() for p in out.iterdir() if p.suffix in (".json", ".jsonl", ".md"))
    assert "first-secret" not in written + capsys.readouterr().out and str(data) not in settings
    monkeypatch.setenv("KVRL_TEST_SECRET", "second-secret-9c1b")
    assert main(args(setup, out, *secret)) == 2
    err = capsys.readouterr().err
    assert "env.kwargs, env.system_prompt: read from the environment, which gives another value than then" in err
    assert "first-secret" not in err and "second-secret" not in err


def test_a_sample_written_twice_is_refused_naming_both_lines(setup, tmp_path, capsys):
    """A duplicated line of samples.jsonl was reused: its row said 17 samples of 16 and counted the sample
    twice in the accuracy."""
    out = tmp_path / "out"
    assert main(args(setup, out, "eval.policies=[full]")) == 0
    path = out / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines + lines[2:3]))
    capsys.readouterr()
    assert main(args(setup, out, "eval.policies=[full]")) == 2
    assert refused(
        capsys,
        rf"{path}:{len(lines) + 1} holds the sample of {path}:3 again \(policy full, point -, "
        r"task '.*', sample \d\): the file was edited or joined with another; delete line "
        rf"{len(lines) + 1}",
    )
    assert len(path.read_text().splitlines()) == len(lines) + 1  # nothing rewritten


@pytest.mark.parametrize(
    "row, message",
    [
        (
            '{"question": "What is \\ud800 + 1?", "answer": "2"}',
            r"bad.jsonl:2: the question holds a lone surrogate '\\ud800' at character 9 .*; fix the escape or drop the row",
        ),
        (
            json.dumps({"question": " ".join(["apples"] * 60), "answer": "3"}),
            r"bad.jsonl:2: the prompt has \d+ tokens, the model holds 48 positions; drop or shorten that row",
        ),
    ],
    ids=["lone_surrogate", "overlong"],
)
def test_a_row_the_model_cannot_take_is_refused_by_file_and_line(setup, tmp_path, capsys, row, message):
    """A lone surrogate ended in a tokenizer TypeError naming no row; an overlong prompt said "prompt 1 has
    2002 tokens" (an index in a batch) with exit 1, where RL names file:line with exit 2."""
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n" + row + "\n")
    out = tmp_path / "out"
    assert (
        main(
            args(
                setup,
                out,
                f"env.kwargs={{path: {data}}}",
                "env.num_eval_tasks=2",
                "eval.policies=[full]",
                "model.max_model_len=48",
            )
        )
        == 2
    )
    assert refused(capsys, message)
    assert not (out / "samples.jsonl").exists()


def test_a_full_disk_names_the_file_eval_was_writing(setup, tmp_path, monkeypatch):
    """A full disk while eval appended its samples was a bare `OSError: [Errno 28]`."""
    import errno
    from pathlib import Path

    real = Path.open

    class Full:  # a file on a full disk: the write fails
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(
        Path,
        "open",
        lambda self, mode="r", *a, **k: (
            Full(real(self, mode, *a, **k))
            if self.name == "samples.jsonl" and "a" in mode
            else real(self, mode, *a, **k)
        ),
    )
    out = tmp_path / "out"
    with pytest.raises(OSError, match=rf"no space left on device while writing {out / 'samples.jsonl'}: free space"):
        main(args(setup, out, "eval.policies=[full]"))


KNORM = '''"""KNorm (Devoto et al. 2024): keep the keys of smallest L2 norm."""
from dataclasses import dataclass
from typing import ClassVar

from kvrl.policies import KVPolicy


@dataclass(kw_only=True)
class KNorm(KVPolicy):
    reads: ClassVar[frozenset[str]] = frozenset({"keys"})

    def score(self, obs):
        return -obs.keys.float().norm(dim=-1), None


class NotAPolicy:
    def __init__(self, budget=0):
        self.budget = budget
'''


@pytest.fixture
def own_policy(tmp_path, monkeypatch):
    """A package `evalpol` outside kvrl holding the KNorm of docs/policies.md, on sys.path."""
    (tmp_path / "src" / "evalpol").mkdir(parents=True)
    (tmp_path / "src" / "evalpol" / "__init__.py").write_text("")
    (tmp_path / "src" / "evalpol" / "policies.py").write_text(KNORM)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    for name in ("evalpol", "evalpol.policies"):  # another test's copy, imported from its own folder
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path / "src" / "evalpol" / "policies.py"


def test_a_policy_of_your_own_is_a_line(setup, tmp_path, own_policy, capsys):
    """docs/policies.md's comparison with the zoo. Before: eval.settings.knorm.policy=pkg.module:Class
    was refused with a fix that named what was given."""
    from kvrl.runlog import sha256_of

    out = tmp_path / "out"
    line = [
        "eval.policies=[full,snapkv,knorm]",
        "eval.settings.knorm.policy=evalpol.policies:KNorm",
        "eval.settings.knorm.window=2",
    ]
    assert main(args(setup, out, *line)) == 0
    rows = {r["policy"]: r for r in read(out / "rows.jsonl")}
    assert rows.keys() == {"full", "snapkv", "knorm"}
    assert rows["knorm"]["kind"] == "evalpol.policies:KNorm" and rows["knorm"]["point"] == "40"
    assert rows["knorm"]["kv_retention"] < 1.0 and rows["knorm"]["peak_kv_tokens"] <= 40 + 8  # it evicted
    report = (out / "report.md").read_text()
    assert "| knorm | 40 |" in report and f"`{own_policy}` {sha256_of(own_policy)}" in report
    # the policy's source is part of its line's setting: an edited policy's samples are not the old ones
    own_policy.write_text(KNORM.replace("return -obs", "return obs"))
    capsys.readouterr()
    assert main(args(setup, out, *line)) == 2
    assert refused(
        capsys,
        r"holds samples of line knorm from another setting(?s:.*)"
        r"eval.settings.knorm.artefact_sha256: '[0-9a-f]{64}' -> '[0-9a-f]{64}'",
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        # before: exit 0, the zoo's rows only, the policy never ran
        (
            ["kv.policy=evalpol.policies:KNorm", "eval.policies=[full,snapkv]"],
            "kv.policy=evalpol.policies:KNorm would be ignored: job=eval runs the lines of eval.policies ([full,snapkv]), "
            "each at every eval.budgets; drop it and compare the policy as a line: eval.policies=[full,snapkv,knorm] "
            "eval.settings.knorm.policy=evalpol.policies:KNorm",
        ),
        (
            ["kv.policy=gkv", "kv.kwargs.alpha=0.9"],
            "kv.policy=gkv kv.kwargs.alpha=0.9 would be ignored: job=eval runs the lines of eval.policies "
            "([full,streaming,gkv]), each at every eval.budgets; drop it and compare the policy as a line: "
            "eval.settings.gkv.alpha=0.9",
        ),
        (
            ["eval.policies=[knorm]", "eval.settings.knorm.policy=evalpol.policies:NotAPolicy"],
            "eval.settings.knorm.policy='evalpol.policies:NotAPolicy' cannot be used (KV policy "
            "'evalpol.policies:NotAPolicy' is not a KVPolicy subclass)",
        ),
        (
            ["eval.policies=[knorm]", "eval.settings.knorm.policy=os:system"],
            "eval.settings.knorm.policy='os:system' cannot be used",
        ),
        (
            ["eval.policies=[knorm]", "eval.settings.knorm.policy=evalpol.nothere:KNorm"],
            "eval.settings.knorm.policy='evalpol.nothere:KNorm' cannot be used (No module named 'evalpol.nothere')",
        ),
        (
            [
                "eval.policies=[knorm]",
                "eval.settings.knorm.policy=evalpol.policies:KNorm",
                "eval.settings.knorm.windw=2",
            ],
            "eval.settings.knorm.windw is not a setting of a line of kind evalpol.policies:KNorm (got 2); set "
            "eval.settings.knorm.window=2",
        ),
    ],
)
def test_a_policy_eval_cannot_run_is_refused_before_anything_runs(setup, tmp_path, own_policy, capsys, extra, message):
    assert main(args(setup, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_the_console_table_and_report_say_what_they_show(setup, tmp_path, capsys):
    """Before: the console rows had no header and a "±" that was the standard error, and report.md left
    KV retention and the environment's own metrics unexplained and named no kvrl commit."""
    import re

    from kvrl.eval.suite import wilson

    assert main(args(setup, tmp_path, "eval.policies=[full,streaming]")) == 0
    out = capsys.readouterr().out
    rows = read(tmp_path / "rows.jsonl")
    lines = [line for line in out.splitlines() if line.startswith(("policy ", "full ", "streaming "))]
    assert re.match(r"policy +budget +accuracy \[95 % CI\] +has_boxed +gen len +KV kept +tokens/s$", lines[0]), lines
    for row, line in zip(rows, lines[1:]):
        lo, hi = wilson(row["accuracy"], row["tasks"])
        assert line.startswith(f"{row['policy']:<12}{row['point']:>8}  {row['accuracy']:.3f} [{lo:.2f}, {hi:.2f}]")
    assert "±" not in out
    report = (tmp_path / "report.md").read_text()
    assert (
        "- accuracy: the share of samples with reward > 0 (pass@1), with its 95 % Wilson score interval over "
        "the 5 tasks" in report
    )
    assert (
        "- has_boxed (the environment's own metric, mean over samples): 1.0 when the completion contains a complete `\\boxed{...}`."
        in report
    )
    assert "- KV retention: the share of the sequence so far still in the cache" in report
    commit = re.search(r"- kvrl \d+\.\d+\.\d+, commit (\S+)", report).group(1)
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", commit), commit


def test_the_kvrl_commit_is_unknown_outside_its_own_checkout(tmp_path, monkeypatch):
    import subprocess

    import kvrl
    from kvrl import runlog
    from kvrl.runlog import kvrl_commit

    here = kvrl_commit()
    top = subprocess.run(
        ["git", "-C", str(Path(kvrl.__file__).parent), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if top.returncode == 0:  # a clone: its HEAD
        assert here.split()[0] == top.stdout.strip()
    (tmp_path / "plain" / "kvrl").mkdir(parents=True)  # an installed copy, no repository around it
    monkeypatch.setattr(runlog, "__file__", str(tmp_path / "plain" / "kvrl" / "runlog.py"))
    assert kvrl_commit() == "unknown (kvrl is not a git checkout)"
    venv = tmp_path / "project" / "venv" / "site-packages" / "kvrl"  # inside a user's repository: not kvrl's
    venv.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    monkeypatch.setattr(runlog, "__file__", str(venv / "runlog.py"))
    assert kvrl_commit() == "unknown (kvrl is not a git checkout of its own)"


def test_the_accuracy_picture_draws_95_percent_intervals_side_by_side(tmp_path, monkeypatch):
    """Before: bars of ±1 standard error, none for a line at 16/16, and lines at one budget on one x."""
    import matplotlib.figure

    from kvrl.eval.report import plot_accuracy
    from kvrl.eval.suite import wilson

    figures, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k)
    )
    row = dict(point="40", accuracy_se=0.0, tasks=16, peak_kv_tokens=48.0)
    rows = [
        dict(row, policy="full", kind="full", point="-", accuracy=1.0, peak_kv_tokens=90.0),
        dict(row, policy="streaming", kind="streaming", accuracy=1.0),  # 16/16
        dict(row, policy="gkv", kind="gkv", accuracy=0.5),
    ]  # the same x
    plot_accuracy(rows, tmp_path / "accuracy.png", "one budget")
    ax = figures[0].axes[0]
    centres = []
    for container, accuracy in zip(ax.containers, (1.0, 0.5)):
        (bar,) = container.lines[2]
        ((low, high),) = [sorted(seg[:, 1]) for seg in bar.get_segments()]
        assert (low, high) == pytest.approx(wilson(accuracy, 16))
        point = container.lines[0]
        centres.append(point.get_transform().transform(point.get_xydata())[0, 0])
    assert wilson(1.0, 16)[0] == pytest.approx(0.806, abs=1e-3)  # a bar at 16/16: [0.81, 1]
    assert abs(centres[0] - centres[1]) > 3  # pixels apart, not stacked
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "95 % Wilson interval over 16 tasks" in texts
