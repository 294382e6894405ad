"""The config gate: whatever can be known before Ray starts exits 2 with the key and the fix.

Every case runs through `kvrl.run.main` in one fresh interpreter, which must not have imported
Ray when the case is refused (that the gate comes before Ray is what makes it fast). What the
gate lets through is in test_config_gate_passes.py, what is refused at run start in
test_config_gate_run_start.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gate_cases import REPO, earlier_run

from kvrl.config import available_recipes
from kvrl.run import main
from kvrl.runlog import OutputLock

CORES = os.cpu_count() or 1
MANY = 2 * CORES + 2  # rollout actors at 0.5 CPU each that no machine of CORES cores hosts


# (id, arguments, recipes folder: None = the repository's | "tmp" = the one the fixture writes, what stderr says)
CASES = [
    (
        "lr_inf",
        ["recipe=tiny_rl_full", "trainer.lr=inf"],
        None,
        ["trainer.lr must be a finite number (got inf); set trainer.lr=0.003"],
    ),
    (
        "temperature_inf",
        ["recipe=tiny_rl_full", "sampling.temperature=inf"],
        None,
        ["sampling.temperature must be a finite number (got inf); set sampling.temperature=1.0"],
    ),
    (
        "eps_high_inf",
        ["recipe=tiny_rl_full", "rl.eps_high=inf"],
        None,
        ["rl.eps_high must be a finite number (got inf); set rl.eps_high=0.2"],
    ),
    (
        "niceness_over_19",
        ["recipe=tiny_rl_full", "workers.niceness=20"],
        None,
        ["workers.niceness must be 0..19 (0 = the driver's priority) (got 20); set workers.niceness=0"],
    ),
    ("seed_negative", ["recipe=tiny_rl_full", "seed=-1"], None, ["seed must be in [0, 2**32) (got -1); set seed=0"]),
    (
        "window_over_budget",
        ["recipe=tiny_gkv_sparse", "kv.window=80"],
        None,
        ["kv.budget must be >= kv.window + kv.sink + 1 = 85 (got 76)", "set kv.budget=85"],
    ),
    (
        "sink_over_budget_foresight",
        ["recipe=tiny_foresight", "kv.sink=60"],
        None,
        ["kv.budget must be >= kv.window + kv.sink + 1 = 69 (got 48)"],
    ),
    (
        "budget_zero",
        ["recipe=tiny_gkv_distill", "kv.budget=0"],
        None,
        ["kv.budget=0 keeps every token, but job=rl rl.algo=distill evicts with kv.policy=gkv", "set kv.budget=64"],
    ),
    (
        "eval_ignores_budget",
        ["recipe=tiny_eval", "kv.budget=64"],
        None,
        ["kv.budget=64 would be ignored: job=eval evaluates the budgets of eval.budgets", "set kv.budget=0"],
    ),
    (
        "model_path_malformed",
        ["recipe=tiny_rl_full", "model.path=/no/such/model"],
        None,
        ["model.path='/no/such/model' is neither a folder here nor a hub id", "pass a local folder with a config.json"],
    ),
    (
        "model_path_no_config",
        ["recipe=tiny_rl_full", "model.path={tmp}"],
        None,
        ["is a folder without a config.json", "set model.path=tiny"],
    ),
    ("cuda_missing", ["recipe=tiny_pretrain", "device=cuda:99"], None, ["device=cuda:99 but", "set device="]),
    (
        "cpus_num_cpus",
        ["recipe=tiny_rl_full", "workers.num_cpus=1"],
        None,
        [
            "the Ray actors reserve 1.5 CPUs (workers.rollout=2 x workers.rollout_cpus=0.5 + workers.learners=1",
            "the local Ray has 1 (workers.num_cpus)",
            "set workers.rollout_cpus=0.33",
        ],
    ),
    (
        "cpus_machine",
        ["recipe=tiny_rl_full", f"workers.rollout={MANY}", f"trainer.batch_size={8 * MANY}"],
        None,
        [f"the Ray actors reserve {MANY * 0.5 + 0.5:g} CPUs", f"the local Ray has {CORES} (the cores of this machine)"],
    ),
    (
        "interpolation_open",
        ["recipe=tiny_rl_full", "run_name=${oops"],
        None,
        ["command line: run_name is malformed: an interpolation is ${other.key}, closed by a brace (got '${oops')"],
    ),
    (
        "interpolation_unknown",
        ["recipe=tiny_rl_full", "run_name=${nope}"],
        None,
        ["cannot resolve run_name: Interpolation key 'nope' not found"],
    ),
    (
        "list_open",
        ["recipe=tiny_eval", "eval.budgets=[0.25,"],
        None,
        ["command line: eval.budgets is malformed: a list", "set e.g. eval.budgets=[0.25,0.5]"],
    ),
    (
        "mapping_open",
        ["recipe=tiny_rl_full", "env.kwargs={a:"],
        None,
        ["command line: env.kwargs is malformed: a mapping is {name: value, ...}"],
    ),
    ("recipe_not_utf8", ["recipe=latin1"], "tmp", ["latin1.yaml: not UTF-8 (byte 0xe9 at offset 5, line 1)"]),
    (
        "env_kwarg_typo",
        ["recipe=tiny_rl_full", "env.kwargs.n_digts=3"],
        None,
        [
            "env.kwargs.n_digts is not an argument of kvrl.envs.counts:CountsEnv (did you mean env.kwargs.n_digits?); "
            "its arguments: n_digits"
        ],
    ),
    (
        "source_kwarg_typo",
        ["recipe=tiny_self_distill", "self_distill.source_kwargs.n_digts=3"],
        None,
        [
            "self_distill.source_kwargs.n_digts is not an argument of kvrl.envs.counts:CountsEnv (did you mean "
            "self_distill.source_kwargs.n_digits?)"
        ],
    ),
    (
        "policy_unknown",
        ["recipe=tiny_gkv_sparse", "kv.policy=snapkb"],
        None,
        ["kv.policy must be one of full, streaming", "(got 'snapkb'); set kv.policy=snapkv"],
    ),
    (
        "env_unknown",
        ["recipe=tiny_rl_full", "env.id=kvrl/mth-v0"],
        None,
        ["env.id='kvrl/mth-v0' is neither a registered environment", "set env.id=kvrl/math-v0"],
    ),
    (
        "math_timeout_zero",
        ["recipe=tiny_rl_full", "env.id=kvrl/math-v0", "env.kwargs.timeout=0"],
        None,
        ["env.kwargs.timeout must be > 0 seconds", "(got 0); set env.kwargs.timeout=5.0"],
    ),
    (
        "type_hint_recipe_value",
        ["recipe=tiny_rl_full", "trainer.steps=abc"],
        None,
        ["trainer.steps expects int, got 'abc'; set e.g. trainer.steps=40"],
    ),
    (
        "type_hint_valid_for_rl",
        ["recipe=bare_rl", "trainer.steps=abc"],
        "tmp",
        ["trainer.steps expects int, got 'abc'; set e.g. trainer.steps=20"],
    ),
    (
        "top_p_rl",
        ["recipe=tiny_rl_full", "sampling.top_p=0.95"],
        None,
        [
            "sampling.top_p=0.95: a rollout records each token's logprob in the renormalised nucleus",
            "the learner scores the token under the whole softmax",
            "set sampling.top_p=1.0",
        ],
    ),
    (
        "top_p_range",
        ["recipe=tiny_eval", "sampling.top_p=0"],
        None,
        ["sampling.top_p must be in (0, 1] (1 = no nucleus cut) (got 0.0); set sampling.top_p=1.0"],
    ),
    ("unknown_recipe", ["recipe=tiny_rl_ful"], None, ["did you mean recipe=tiny_rl_full?", "available recipes: "]),
    (
        "algo_path_unimportable",
        ["recipe=tiny_rl_full", "rl.algo=my_lab.algos:RLFul"],
        None,
        [
            "rl.algo='my_lab.algos:RLFul' cannot be imported (No module named 'my_lab'); set rl.algo=rl_full",
            "launch/ray_submit.sh --py-module path/to/pkg",
        ],
    ),
    (
        "eval_setting_typo",
        ["recipe=tiny_eval", "eval.settings.rlkv.recnt=16"],
        None,
        [
            "eval.settings.rlkv.recnt is not a setting of a line of kind heads (got 16); set "
            "eval.settings.rlkv.recent=16; its settings: policy, run, sparsities, sink, recent"
        ],
    ),
    (
        "eval_setting_policy_argument_typo",
        ["recipe=tiny_eval", "eval.settings.gkv.alpah=0.8"],
        None,
        ["eval.settings.gkv.alpah is not a setting of a line of kind gkv (got 0.8); set eval.settings.gkv.alpha=0.8"],
    ),
    (
        "eval_setting_a_window_ignores",
        ["recipe=tiny_eval", "eval.settings.window.sink=2"],
        None,
        ["eval.settings.window.sink is not a setting of a line of kind window (got 2); drop it"],
    ),
    (
        "eval_setting_budget",
        ["recipe=tiny_eval", "eval.settings.rkv.budget=64"],
        None,
        [
            "eval.settings.rkv.budget is not a setting of a line of kind rkv (got 64); drop it (every line runs at "
            "eval.budgets=[0.25,0.5,0.75])"
        ],
    ),
    (
        "budget_over_positions",
        ["recipe=tiny_gkv_sparse", "kv.budget=2000"],
        None,
        [
            "kv.budget=2000 never evicts: a sequence holds at most 1024 tokens (the max_position_embeddings of "
            "model.path=tiny)",
            "set kv.budget=512 (below 1024)",
        ],
    ),
    (
        "budget_and_window_over_positions",
        ["recipe=tiny_multihop_sparse", "kv.window=100000", "kv.budget=100020"],
        None,
        [
            "no kv.budget can evict with kv.window=100000 kv.sink=4: the policy always keeps kv.window + kv.sink + 1 "
            "= 100005 tokens, at least as many as a sequence holds, so lower kv.window; set kv.window=256 "
            "kv.budget=512 (below 1024)"
        ],
    ),
    (
        "budget_over_max_model_len",
        ["recipe=tiny_foresight", "kv.budget=300", "model.max_model_len=256"],
        None,
        ["kv.budget=300 never evicts: a sequence holds at most 256 tokens (model.max_model_len)", "set kv.budget=128"],
    ),
    (
        "eval_budget_over_positions",
        ["recipe=tiny_eval", "eval.budgets=[0.5,64,1024]"],
        None,
        [
            "eval.budgets 1024 never evict: a sequence holds at most 1024 tokens (the max_position_embeddings of "
            "model.path=tiny)",
            "set eval.budgets=[0.5,64]",
        ],
    ),
    # what a run here needs (kvrl.preflight.machine.run_problems: never for dry_run / print_config, which plan for another machine)
    (
        "env_data_file_missing",
        ["recipe=tiny_rl_full", "env.id=kvrl/math-v0", "env.kwargs.path=/no/such/aime.jsonl"],
        None,
        [
            "env.kwargs.path='/no/such/aime.jsonl': no such file; kvrl.envs.math:MathEnv reads its problems",
            "set env.kwargs.path=<the file>",
        ],
    ),
    (
        "env_data_file_a_folder",
        ["recipe=tiny_rl_full", "env.id=kvrl/math-v0", "env.kwargs.path={tmp}"],
        None,
        ["env.kwargs.path=", "a folder, not a file", "set env.kwargs.path=<the file>"],
    ),
    (
        "self_distilled_tasks_missing",
        [
            "recipe=tiny_rl_full",
            "env.id=kvrl.data.self_distill:SelfDistilledEnv",
            "env.kwargs.path=/no/such/tasks.jsonl",
        ],
        None,
        [
            "env.kwargs.path='/no/such/tasks.jsonl': no such file",
            "the task set job=self_distill writes",
            "run that step first",
        ],
    ),
    (
        "self_distill_source_missing",
        [
            "recipe=tiny_self_distill",
            "self_distill.source=kvrl/math-v0",
            "self_distill.source_kwargs.path=/no/such/deepscaler.jsonl",
        ],
        None,
        [
            "self_distill.source_kwargs.path='/no/such/deepscaler.jsonl': no such file",
            "set self_distill.source_kwargs.path=<the file>",
        ],
    ),
    (
        "eval_run_missing",
        ["recipe=tiny_eval", "eval.settings.foresight.run=/no/such/run"],
        None,
        [
            "eval.settings.foresight.run='/no/such/run': no such file or folder; set eval.settings.foresight.run to "
            "the output_dir of the run that trained the line"
        ],
    ),
    (
        "output_dir_in_use",
        ["recipe=tiny_rl_full", "output_dir={locked}"],
        None,
        ["is in use by another run (pid ", "set output_dir=<another folder>"],
    ),
    (
        "resume_with_changed_settings",
        ["recipe=tiny_rl_full", "output_dir={run}", "trainer.lr=0.001"],
        None,
        [
            "holds a run whose settings differ from this one's (checkpoint ",
            "step_000002",
            "trainer.lr: 0.0003 -> 0.001",
            "set output_dir=<another folder> (or resume=never to overwrite this one)",
        ],
    ),
    (
        "hub_model_offline",
        ["recipe=tiny_rl_full", "model.path=kvrl-test/no-such-model"],
        None,
        [
            "model.path=kvrl-test/no-such-model is not in the local Hugging Face cache",
            "HF_HUB_OFFLINE is set",
            "set model.path=DIR",
        ],
    ),
    (
        "eval_learned_without_run",
        ["recipe=tiny_eval", "eval.policies=[full,fs]", "eval.settings.fs={policy: learned}"],
        None,
        ["eval.settings.fs.run is not set; set eval.settings.fs.run=<output_dir of that run>"],
    ),
    # what used to be a traceback once the job had started
    (
        "group_size_zero",
        ["recipe=tiny_rl_full", "rl.group_size=0"],
        None,
        ["rl.group_size must be >= 2 (got 0); set rl.group_size=8"],
    ),
    (
        "lr_absurd",
        ["recipe=tiny_rl_full", "trainer.lr=1e39"],
        None,
        [
            "trainer.lr must be in (0, 1] (Adam moves each weight by about lr per step) (got 1e+39); "
            "set trainer.lr=0.003"
        ],
    ),
    (
        "device_unknown",
        ["recipe=tiny_rl_full", "device=foo"],
        None,
        ["device must be cpu, cuda or cuda:N (got 'foo'); set device=cpu"],
    ),
    (
        "address_unknown",
        ["recipe=tiny_rl_full", "workers.address=foo"],
        None,
        [
            "workers.address must be empty (a private local Ray, or $RAY_ADDRESS), auto, local, inline, HOST:PORT or "
            "ray://HOST:PORT (got 'foo')"
        ],
    ),
    (
        "output_dir_a_file",
        ["recipe=tiny_rl_full", "output_dir={file}"],
        None,
        ["output_dir={file}: {file} is a file, not a folder", "set output_dir=<a folder>"],
    ),
    (
        "output_dir_under_a_file",
        ["recipe=tiny_eval", "output_dir={file}/run"],
        None,
        ["output_dir={file}/run: {file} is a file, not a folder"],
    ),
    (
        "output_dir_undecodable",
        ["recipe=tiny_eval", "output_dir=/tmp/run\udcff"],
        None,
        [
            "command line: output_dir=/tmp/run\\xff holds a byte that is not UTF-8",
            "set output_dir to a UTF-8 value (a path: rename the folder, or choose one whose name is UTF-8)",
        ],
    ),
    # a folder that is not the run's own: the run wrote settings, samples, .lock and plots among what was there
    *(
        (
            f"output_dir_{name}",
            ["recipe=tiny_eval", f"output_dir={value}"],
            None,
            [said, "set output_dir=outputs/${run_name} (or another new folder: it is made)"],
        )
        for name, value, said in [
            ("cwd", ".", f"output_dir=. is the current directory ({REPO})"),
            ("root", "/", "output_dir=/ is a folder that holds"),
            ("cwd_by_path", str(REPO), f"output_dir={REPO} is the current directory"),  # the checkout, here
            (
                "package",
                "kvrl",
                f"output_dir=kvrl is inside kvrl's package (its code and shipped models), {REPO / 'kvrl'}",
            ),
            ("shipped_model", "kvrl/models/weights/tiny_reasoner", "is inside kvrl's package"),
            ("git", ".git", f"output_dir=.git is inside kvrl's git repository, {REPO / '.git'}"),
            ("recipes", "recipes/new_run", f"output_dir=recipes/new_run is inside kvrl's recipes, {REPO / 'recipes'}"),
            ("not_a_run", "{stuff}", "is a folder that holds 1 file(s) of something else than a kvrl run (notes.txt)"),
        ]
    ),
    (
        "eval_sparsity_over_one",
        ["recipe=tiny_eval", "eval.settings.rlkv.sparsities=[1.5]"],
        None,
        [
            "eval.settings.rlkv.sparsities must be a list of fractions in [0, 1] (the share of KV heads compressed; "
            "got [1.5]); set eval.settings.rlkv.sparsities=[0.5]"
        ],
    ),
    (
        "eval_alpha_nan",
        ["recipe=tiny_eval", "eval.settings.gkv.alpha=.nan"],
        None,
        ["eval.settings.gkv.alpha must be a finite number (got nan)"],
    ),
    (
        "eval_alpha_over_one",
        ["recipe=tiny_eval", "eval.settings.gkv.alpha=1.5"],
        None,
        [
            "eval.settings.gkv: gkv refuses its settings: alpha=1.5: must be in [0, 1]",
            "set eval.settings.gkv.alpha=0.8",
        ],
    ),
    (
        "eval_setting_mistyped",
        ["recipe=tiny_eval", "eval.settings.gkv.mix_lambda=abc"],
        None,
        ["eval.settings.gkv.mix_lambda expects float, got 'abc'; set eval.settings.gkv.mix_lambda=0.5"],
    ),
    (
        "env_weight_nan",
        ["recipe=tiny_rl_full", "env.kwargs.overlong_penalty=.nan"],
        None,
        ["env.kwargs.overlong_penalty must be a finite number (got nan); set env.kwargs.overlong_penalty=0.0"],
    ),
    # before: a TypeError from the constructor or numpy (a traceback, exit 1), or numpy asking for 745 GiB
    (
        "env_size_not_a_number",
        ["recipe=tiny_rl_full", "env.kwargs.n_digits=abc"],
        None,
        [
            "env.kwargs.n_digits must be an integer (kvrl.envs.counts:CountsEnv takes n_digits: int; got 'abc'); "
            "set env.kwargs.n_digits=24"
        ],
    ),
    (
        "env_size_a_whole_float",
        ["recipe=tiny_rl_full", "env.kwargs.n_digits=1e3"],
        None,
        ["env.kwargs.n_digits must be an integer", "got 1000.0); set env.kwargs.n_digits=1000"],
    ),
    (
        "env_size_a_bool",
        ["recipe=tiny_rl_full", "env.kwargs.n_digits=true"],
        None,
        ["env.kwargs.n_digits must be an integer", "got True); set env.kwargs.n_digits=24"],
    ),
    (
        "env_size_a_float_past_its_bound",
        ["recipe=tiny_rl_full", "env.kwargs.n_digits=1e11"],
        None,
        ["env.kwargs.n_digits must be an integer", "got 100000000000.0); set env.kwargs.n_digits=24"],
    ),
    (
        "env_size_past_its_bound",
        ["recipe=tiny_rl_full", "env.kwargs.n_digits=100000000000"],
        None,
        [
            "env.kwargs.n_digits must be in [1, 65536] for kvrl.envs.counts:CountsEnv (got 100000000000); "
            "set env.kwargs.n_digits=24"
        ],
    ),
    (
        "env_optional_argument_mistyped",
        ["recipe=tiny_rl_full", "env.id=kvrl/math-v0", "env.kwargs.limit=abc"],
        None,
        [
            "env.kwargs.limit must be an integer or null (kvrl.envs.math:MathEnv takes limit: int | None; got "
            "'abc'); set env.kwargs.limit=null"
        ],
    ),
    (
        "env_multihop_statements_past_the_names",
        ["recipe=tiny_multihop_sparse", "env.kwargs.max_statements=100000"],
        None,
        ["env.kwargs.max_statements must be in [2, 52] for kvrl.envs.multihop:MultiHopEnv (got 100000)"],
    ),
    (
        "eval_pass_k_over_samples",
        ["recipe=tiny_eval", "eval.pass_k=[1,5]"],
        None,
        [
            "eval.pass_k=[1,5] asks for pass@5 but eval.samples=1 draws fewer samples per task; set eval.samples=5 "
            "(or eval.pass_k=[1])"
        ],
    ),
]


SCRIPT = r"""
import contextlib, io, json, os, sys
from kvrl.run import main
results = {}
for case in json.load(sys.stdin):
    os.environ.pop("KVRL_RECIPES_DIR", None)
    if case["recipes"]:
        os.environ["KVRL_RECIPES_DIR"] = case["recipes"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(case["argv"])
    results[case["id"]] = {"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "ray": "ray" in sys.modules}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def tmp_recipes(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recipes")
    (folder / "latin1.yaml").write_bytes("# Caf\xe9 recipe\njob: eval\n".encode("latin-1"))
    (folder / "bare_rl.yaml").write_text("# RL with the schema's defaults\njob: rl\n")
    return folder


@pytest.fixture(scope="module")
def outcomes(tmp_recipes, tmp_path_factory) -> dict:
    folders = {
        "{tmp}": tmp_path_factory.mktemp("not_a_model"),
        "{locked}": tmp_path_factory.mktemp("locked"),
        "{run}": tmp_path_factory.mktemp("run"),
        "{file}": tmp_path_factory.mktemp("file") / "a_file",
        "{stuff}": tmp_path_factory.mktemp("stuff"),
    }
    earlier_run(folders["{run}"])
    (folders["{stuff}"] / "notes.txt").write_text("a user's file")
    folders["{file}"].write_text("not a folder")
    cases, fresh = [], tmp_path_factory.mktemp("out")
    for id_, argv, recipes, _ in CASES:
        for mark, folder in folders.items():
            argv = [a.replace(mark, str(folder)) for a in argv]
        if not any(a.startswith("output_dir=") for a in argv):  # not the checkout's outputs/, which a run may hold
            argv.append(f"output_dir={fresh / id_}")
        cases.append({"id": id_, "argv": argv, "recipes": str(tmp_recipes) if recipes == "tmp" else None})
    # offline: a hub id is refused without asking the network (test_an_unreachable_hub_is_refused asks one)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("KVRL_RECIPES_DIR", "RAY_ADDRESS")},
        "HF_HUB_OFFLINE": "1",
    }
    lock = OutputLock(folders["{locked}"])  # a live run's, held by this process while the cases run
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            input=json.dumps(cases),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        lock.release()
    assert proc.returncode == 0, proc.stderr
    return {**json.loads(proc.stdout.splitlines()[-1]), "{file}": str(folders["{file}"])}


@pytest.mark.parametrize("case, expected", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_each_case_exits_2_before_ray_with_the_fix(outcomes, case, expected):
    result, expected = outcomes[case], [text.replace("{file}", outcomes["{file}"]) for text in expected]
    assert result["rc"] == 2, result
    assert not result["ray"], "ray was imported before the gate refused the config"
    err = result["err"]
    assert err.startswith("kvrl: error: ") and "Traceback" not in err and result["out"] == "", err
    for text in expected:
        assert text in err, (text, err)


def test_help_lists_a_broken_recipe_with_a_note(tmp_recipes, monkeypatch, capsys):
    monkeypatch.setenv("KVRL_RECIPES_DIR", str(tmp_recipes))
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "latin1" in ln)
    assert "(unreadable: not UTF-8 (byte 0xe9 at offset 5, line 1); save the file as UTF-8)" in line
    assert "RL with the schema's defaults" in out
    assert "latin1" in available_recipes()


def test_the_gates_policy_names_are_the_zoos():
    """The gate names kv.policy's values without importing torch; they must stay the zoo's."""
    from kvrl.policies import POLICIES
    from kvrl.section import POLICY_NAMES

    assert set(POLICY_NAMES) == {"full", *POLICIES}
