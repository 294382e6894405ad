"""The tiny reasoner: task family, tokenizer, reference decoding, replay, shipped weights."""

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from kvrl.engines.base import Sampling
from kvrl.engines.hf import HFEngine
from kvrl.envs.chains import ChainSpec, make_chain_task
from kvrl.kernels.reference.replay import Replay
from kvrl.models.tiny import TINY_PATH, build_tokenizer, load_model, tiny_config
from kvrl.policies import Static, Window


def needed_prompt_tokens(meta: dict) -> list[int]:
    """Indices (in prompt tokens, without BOS) that the task needs: the statements of the
    query's chain and the query itself."""
    chain = set(meta["chain"])
    idx = []
    for i, (lhs, _) in enumerate(meta["statements"]):
        if lhs in chain:
            idx.extend([3 * i, 3 * i + 1, 3 * i + 2])
    n = 3 * len(meta["statements"])
    idx.extend([n, n + 1, n + 2])  # "? q :"
    return idx


def test_chain_task_is_consistent():
    rng = np.random.default_rng(0)
    for _ in range(50):
        t = make_chain_task(rng)
        defs = dict(t["statements"])
        assert len(defs) == len(t["statements"]), "every variable is defined once"
        seen = set()
        for lhs, rhs in t["statements"]:  # defined before use
            assert rhs.isdigit() or rhs in seen
            seen.add(lhs)

        def value(v):
            return int(defs[v]) if defs[v].isdigit() else (value(defs[v]) + 1) % 10  # noqa: B023 - called in this pass

        assert t["answer"] == str(value(t["chain"][0]))
        assert t["completion"].endswith(f"\\boxed{{ {t['answer']} }}")
        toks = t["prompt"].split()
        needed = [toks[i] for i in needed_prompt_tokens(t)]
        assert needed[-3:] == ["?", t["chain"][0], ":"]
        assert set(needed[:-3:3]) == set(t["chain"])


def test_count_task_is_consistent():
    from kvrl.envs.counts import make_count_task

    t = make_count_task(np.random.default_rng(0), n_digits=5)
    digits = [int(x) for x in t["prompt"].split()[0:-1:2]]
    cot = t["completion"].split()
    assert t["prompt"].split()[1::2][:5] == [";"] * 5 and t["prompt"].endswith("?")
    assert [int(x) for x in cot[0:10:2]] == digits
    assert [int(x) for x in cot[1:10:2]] == [sum(d >= 5 for d in digits[: i + 1]) % 10 for i in range(5)]
    assert cot[10:] == ["\\boxed{", t["answer"], "}"] and t["answer"] == cot[9]


def test_chain_spec_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_depth < min_statements"):
        ChainSpec(min_statements=5, max_statements=10, min_depth=2, max_depth=5)


def test_tokenizer_roundtrip_is_lossless():
    tok = build_tokenizer()
    t = make_chain_task(np.random.default_rng(1))
    ids = tok(t["prompt"] + " " + t["completion"])["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids[1:]
    assert tok.decode(ids[1:]) == t["prompt"] + " " + t["completion"]


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    tok = build_tokenizer()
    return LlamaForCausalLM(tiny_config(tok)).eval(), tok


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    spec = ChainSpec(min_statements=4, max_statements=12, min_depth=1, max_depth=3)
    return [make_chain_task(rng, spec)["prompt"] for _ in range(n)]


def test_engine_full_cache_equals_transformers_generate(random_model):
    model, tok = random_model
    prompts = _prompts(5)
    out = HFEngine(model, tok).generate(prompts, Sampling(max_new_tokens=12))
    model.set_attn_implementation("sdpa")
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert len(set(enc["attention_mask"].sum(-1).tolist())) > 1, "prompts of different lengths"
    ref = model.generate(
        **enc, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )[:, enc["input_ids"].shape[1] :]
    assert out.tokens == ref.tolist()
    assert out.finish_reasons == ["length"] * 5


def test_decode_under_a_window_is_replayed_by_one_forward(random_model):
    """Logprobs of an evicting decode == a teacher-forced forward under the same pattern."""
    model, tok = random_model
    prompts = _prompts(4, seed=3)
    engine = HFEngine(model, tok)
    n_new = 20
    ids, pos = engine.pad(engine.encode(prompts))
    T = int(pos.max()) + 1 + n_new
    death = Static(Window.of(model.config, sink=2, recent=6)).death(T, len(prompts))
    out = engine.generate(prompts, Sampling(max_new_tokens=n_new, temperature=1.0, seed=7), policy=Static(death))
    full = torch.cat([ids, torch.tensor(out.tokens)], 1)
    fpos = torch.cat([pos, pos[:, -1:] + torch.arange(1, n_new + 1)], 1)
    attention = model.config._attn_implementation
    model.set_attn_implementation("kvrl_replay")  # the engine leaves the model's own attention
    try:
        with torch.no_grad():
            logits = model(input_ids=full, position_ids=fpos.clamp(min=0), kvrl_replay=Replay(death, fpos)).logits
            # the full-cache forward, which must disagree: the window really bites
            dense = model(
                input_ids=full,
                position_ids=fpos.clamp(min=0),
                kvrl_replay=Replay(Static(Window.of(model.config, 2, 10**6)).death(T, len(prompts)), fpos),
            ).logits
    finally:
        model.set_attn_implementation(attention)
    logp = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1].float(), -1)
    replayed = logp.gather(-1, torch.tensor(out.tokens)[..., None]).squeeze(-1)
    torch.testing.assert_close(replayed, torch.tensor(out.logprobs), atol=1e-5, rtol=0)
    assert (dense - logits).abs().max() > 1e-2


@pytest.mark.skipif(not (TINY_PATH / "config.json").exists(), reason="shipped weights missing")
def test_shipped_tiny_reasoner_solves_its_tasks():
    from kvrl.envs import make
    from kvrl.eval.budgets import evaluate

    model, tok = load_model("tiny")
    env = make("kvrl/counts-v0")
    env.reset(seed=99)
    tasks = env.tasks(32)
    full = evaluate(HFEngine(model, tok), env, tasks, 160)
    assert full["acc"] >= 0.9
    small = evaluate(HFEngine(model, tok), env, tasks, 160, policy=Static(Window.of(model.config, 4, 40)))
    assert small["acc"] <= 0.5 * full["acc"], "a 44-token window cannot see the digits 48 tokens back"


def test_pretraining_loss_falls(tmp_path):
    """recipe=tiny_pretrain (running counts, oracle-eviction dropout), shrunk: the loss falls."""
    from kvrl.config import load_config
    from kvrl.jobs.pretrain_tiny import main

    shrunk = [
        "recipe=tiny_pretrain",
        "trainer.batch_size=8",
        "trainer.warmup_steps=5",
        "trainer.log_every=39",
        "pretrain.eval_tasks=4",
        f"output_dir={tmp_path}",
        "resume=never",
    ]
    first = main(load_config([*shrunk, "trainer.steps=1"]))["loss"]
    last = main(load_config([*shrunk, "trainer.steps=40"]))["loss"]
    assert last < 0.7 * first
    assert (tmp_path / "model" / "model.safetensors").exists()


@pytest.mark.skipif(not (TINY_PATH / "config.json").exists(), reason="shipped weights missing")
def test_eval_job_prints_the_budget_table(tmp_path, capsys):
    """recipe=tiny_eval with its shipped artefacts (ForesightKV scorer, RLKV gates), shrunk:
    every line prints, and a quarter-length window loses what the full cache solves."""
    from kvrl.run import main

    assert (
        main(
            [
                "recipe=tiny_eval",
                "env.num_eval_tasks=16",
                "eval.policies=[window,foresight,rlkv]",
                "eval.budgets=[0.25]",
                "eval.settings.rlkv.sparsities=[0.5]",
                f"output_dir={tmp_path}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert all(name in out for name in ("full", "window", "foresight", "rlkv"))
    import json

    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["policy"], r["point"]) for r in rows] == [
        ("full", "-"),
        ("window", "26"),
        ("foresight", "26"),
        ("rlkv", "s=0.5"),
    ]
    assert rows[0]["accuracy"] > rows[1]["accuracy"]
    assert (tmp_path / "report.md").exists()


def flipped_copy(folder, tmp_path, name):
    """A copy of a shipped folder with one byte of ``name`` flipped (an exponent byte of a weight
    in a safetensors file); the shipped files are never touched."""
    import shutil

    copy = shutil.copytree(folder, tmp_path / folder.name)
    data = bytearray((copy / name).read_bytes())
    data[-3] ^= 0x40  # inside the last float32 tensor: its exponent byte
    (copy / name).write_bytes(bytes(data))
    return copy


@pytest.mark.parametrize("name", ["tiny", "tiny-multihop"])
def test_a_flipped_byte_in_the_shipped_weights_is_refused(name, tmp_path, monkeypatch):
    """Before: the flipped model loaded and scored 0.000 with exit status 0."""
    from kvrl.models import SHIPPED
    from kvrl.models.tiny import resolve_path
    from kvrl.runlog import damage

    folder, recipe = SHIPPED[name]
    assert damage(folder) is None  # the real shipped folder is whole
    monkeypatch.setitem(SHIPPED, name, (flipped_copy(folder, tmp_path, "model.safetensors"), recipe))
    resolve_path.cache_clear()  # once per process: forget the real folder
    try:
        with pytest.raises(
            ValueError,
            match=rf"(?s)the shipped {name} reasoner is damaged: .*model.safetensors does "
            r"not match its checksum in .*SHA256SUMS; restore it: reinstall kvrl.*"
            rf"git checkout -- .*recipe={recipe}",
        ):
            load_model(name)
    finally:
        resolve_path.cache_clear()


def test_a_flipped_byte_in_the_shipped_scorer_or_gates_is_refused(tmp_path):
    from kvrl.eval.suite import PolicySpec
    from kvrl.models import WEIGHTS
    from kvrl.policies.heads import load_gates

    config = tiny_config(build_tokenizer())
    kv = {"interval": 8, "window": 8, "sink": 4, "budget_ratio": None}
    shipped = WEIGHTS / "tiny_artefacts"
    PolicySpec("foresight", "learned", {"run": str(shipped / "foresight_scorer.safetensors")}).regime(config, 32, kv)
    assert load_gates(shipped / "rlkv_gates.safetensors").shape == (4, 2)
    scorer = flipped_copy(shipped, tmp_path / "a", "foresight_scorer.safetensors") / "foresight_scorer.safetensors"
    with pytest.raises(
        ValueError,
        match=r"(?s)the ForesightKV scorer .*foresight_scorer.safetensors is damaged: .*"
        r"does not match its checksum in .*SHA256SUMS; restore the file",
    ):
        PolicySpec("foresight", "learned", {"run": str(scorer)}).regime(config, 32, kv)
    gates = flipped_copy(shipped, tmp_path / "b", "rlkv_gates.safetensors") / "rlkv_gates.safetensors"
    with pytest.raises(
        ValueError,
        match=r"(?s)the RLKV gates .*rlkv_gates.safetensors are damaged: .*does not match "
        r"its checksum in .*SHA256SUMS; restore the file",
    ):
        load_gates(gates)
    with pytest.raises(ValueError, match="damaged"):
        PolicySpec("rlkv", "heads", {"run": str(gates)}).regime(config, 0.5, kv)


@pytest.mark.parametrize("where", ["copy", "model", "checkpoints/step_000002/model"])
@pytest.mark.parametrize("recipe", ["tiny_eval", "tiny_rl_full"])
def test_a_flipped_byte_in_a_sealed_model_folder_is_refused_before_the_job(
    where, recipe, tmp_path, monkeypatch, capsys
):
    """A copy of the shipped reasoner with its SHA256SUMS, a run's model/ or a checkpoint's model/, given as
    model.path with one byte flipped, trained and evaluated with exit 0: a sealed folder is checked first."""
    from kvrl.models import SHIPPED
    from kvrl.run import main

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    copy = flipped_copy(SHIPPED["tiny"][0], tmp_path, "model.safetensors")
    folder = copy if where == "copy" else tmp_path / "run" / where
    if where != "copy":
        folder.parent.mkdir(parents=True)
        copy.rename(folder)
    out = tmp_path / "out"
    assert main([f"recipe={recipe}", f"model.path={folder}", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrl: error: the run cannot start: ") and "Traceback" not in err, err
    assert (
        f"model.path={folder} is damaged: {folder / 'model.safetensors'} does not match its checksum in "
        f"{folder / 'SHA256SUMS'}; copy the folder again" in err
    ), err
    assert not out.exists()
    with pytest.raises(ValueError, match="does not match its checksum"):  # Python callers: the same check
        load_model(str(folder))


def test_a_scorer_or_gates_that_are_not_finite_or_of_another_model_are_refused_naming_the_file(tmp_path, capsys):
    """A scorer with a NaN weight, or all-NaN gates, evaluated with exit 0 (foresight accuracy 0.25 instead of
    1.0); a scorer of another shape failed with a torch error naming no file."""
    from safetensors.torch import load_file, save_file

    from kvrl.models import WEIGHTS
    from kvrl.policies import LearnedScorer
    from kvrl.run import main

    shipped = WEIGHTS / "tiny_artefacts"
    state = load_file(str(shipped / "foresight_scorer.safetensors"))
    name = sorted(state)[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(tmp_path / "nan_scorer.safetensors"))
    other = LearnedScorer(budget=32, interval=8, window=8, sink=4, group=2, head_dim=16, layers=2, kv_heads=1)
    save_file({k: v.contiguous() for k, v in other.scorer.state_dict().items()}, str(tmp_path / "other.safetensors"))
    save_file({"gates": torch.full((4, 2), float("nan"))}, str(tmp_path / "nan_gates.safetensors"))
    save_file({"gates": torch.zeros(3, 3)}, str(tmp_path / "other_gates.safetensors"))
    cases = {
        "nan_scorer": (
            "foresight",
            f"the ForesightKV scorer {tmp_path / 'nan_scorer.safetensors'} holds values "
            f"that are not finite (in {name})",
        ),
        "other": (
            "foresight",
            f"the ForesightKV scorer {tmp_path / 'other.safetensors'} does not fit this model "
            "(4 layers x 2 KV heads, head_dim 32, group 2): size mismatch for",
        ),
        "nan_gates": (
            "rlkv",
            f"the RLKV gates {tmp_path / 'nan_gates.safetensors'} hold 8 of 8 values that are not finite",
        ),
        "other_gates": (
            "rlkv",
            f"the RLKV gates {tmp_path / 'other_gates.safetensors'} have shape (3, 3), but "
            "the model has (layers, KV heads) = (4, 2)",
        ),
    }
    for file, (line, message) in cases.items():
        out = tmp_path / f"out_{file}"
        argv = [
            "recipe=tiny_eval",
            "env.num_eval_tasks=4",
            f"eval.policies=[{line}]",
            f"eval.settings.{line}.run={tmp_path / file}.safetensors",
            f"output_dir={out}",
        ]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"kvrl: error: the run cannot start: eval.settings.{line}: {message}" in err, err
        assert "Traceback" not in err and not (out / "samples.jsonl").exists()
