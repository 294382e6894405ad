"""The config gate: whatever can be known before Ray starts exits 2 with the key and the fix.

Every case runs through `kvrl.run.main` in one fresh interpreter, which must not have imported
Ray when the case is refused (that the gate comes before Ray is what makes it fast)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrl.config import ConfigError, available_recipes, load_config
from kvrl.gate import hub_problems, run_problems
from kvrl.lookup import env_problems, model_problems
from kvrl.run import main
from kvrl.runlog import OutputLock, flatten

REPO = Path(__file__).resolve().parent.parent
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
    # what a run here needs (kvrl.gate.run_problems: never for dry_run / print_config, which plan for another machine)
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


def earlier_run(out: Path, *args: str) -> None:
    """What an RL run in `out` leaves for resume=auto: a sealed checkpoint with its config (no weights: the gate
    reads none)."""
    checkpoint = out / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    cfg = load_config(["recipe=tiny_rl_full", f"output_dir={out}", *args])
    (checkpoint / "config.json").write_text(json.dumps(flatten(cfg)))
    (checkpoint / "SHA256SUMS").write_text("")


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


# --- what the gate lets through ---


def test_every_recipe_passes_the_gate_without_ray():
    script = (
        "import sys; from kvrl.config import available_recipes, load_config\n"
        "for name in available_recipes(): load_config([f'recipe={name}'])\n"
        "assert 'ray' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVRL_RECIPES_DIR"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "path", ["tiny", "Qwen/Qwen3-4B", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "my-org/my.model_2"]
)
def test_model_paths_that_can_work(path):
    assert model_problems(path) == []


def test_a_saved_model_folder_passes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model_problems(str(tmp_path)) == []
    assert model_problems(str(tmp_path / "config.json"))  # a file is not a model folder


def test_a_resume_may_change_what_config_resumable_names(tmp_path, monkeypatch):
    """The gate compares a checkpoint's settings as the job does: trainer.steps (Config.RESUMABLE) may change,
    resume=never starts afresh, a run over a data set derives model.max_model_len when it is 0; trainer.lr may not."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    earlier_run(tmp_path, "model.max_model_len=300")
    assert run_problems(load_config(["recipe=tiny_rl_full", f"output_dir={tmp_path}", "trainer.steps=80"])) == []
    assert run_problems(load_config(["recipe=tiny_rl_full", f"output_dir={tmp_path}", "model.max_model_len=300"])) == []
    changed = ["recipe=tiny_rl_full", f"output_dir={tmp_path}", "model.max_model_len=256"]
    [err] = run_problems(load_config(changed))
    assert "model.max_model_len: 300 -> 256" in err
    assert run_problems(load_config([*changed, "resume=never"])) == []
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    [err] = run_problems(load_config([*changed, "resume=never", f"resume={checkpoint}"]))
    assert f"(checkpoint {checkpoint})" in err


def test_an_output_dir_of_a_kvrl_run_or_empty_passes(tmp_path, monkeypatch):
    """What output_dir refuses (a folder of other files) leaves a rerun its own folder: an interrupted job=eval
    run's (its lock and settings), and an empty folder."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    run, empty = tmp_path / "eval", tmp_path / "empty"
    run.mkdir(), empty.mkdir()
    (run / ".lock").write_text("")
    (run / "settings.json").write_text('{"settings": {}, "files": {}}')
    for folder in (run, empty):
        assert run_problems(load_config(["recipe=tiny_eval", f"output_dir={folder}"])) == []


def test_inputs_are_checked_for_a_run_here_only(tmp_path, monkeypatch):
    """dry_run plans for another machine, where the data is: a missing data file is no error there."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    args = [
        "recipe=tiny_rl_full",
        "env.id=kvrl/math-v0",
        "env.kwargs.path=/no/such/aime.jsonl",
        f"output_dir={tmp_path}",
    ]
    assert main([*args, "dry_run=true"]) == 0
    assert main([*args, "print_config=true"]) == 0


def test_an_unreachable_hub_is_refused(monkeypatch):
    """A hub id that is not cached, with the network allowed but no answer: refused with the fix, not left to
    the download's retries. (An endpoint that refuses connections: no network is needed.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    [err] = hub_problems("kvrl-test/no-such-model")
    assert "model.path=kvrl-test/no-such-model is not in the local Hugging Face cache" in err
    assert "the hub (http://127.0.0.1:9) cannot be reached (" in err and "set model.path=DIR" in err
    assert hub_problems("tiny") == hub_problems("/no/such/folder/") == []  # not hub ids


def test_top_p_is_for_eval():
    assert load_config(["recipe=tiny_eval", "sampling.temperature=0.6", "sampling.top_p=0.9"]).sampling.top_p == 0.9
    assert load_config(["recipe=eval_math_qwen3_4b"]).sampling.top_p == 0.95  # the papers' sampling


def test_run_directories_as_model_path(tmp_path):
    """The output_dir of a run that saved model weights passes; an RLKV or ForesightKV run is
    refused with the eval policy to use instead and its base model; a run without a sealed
    model yet says so. Nothing is read but names (kvrl.runlog.trained_model, verify=False)."""

    def checkpoint(run, step, config, model=False):
        folder = run / "checkpoints" / f"step_{step:06d}"
        (folder / "model").mkdir(parents=True) if model else folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
        if model:
            (folder / "model" / "SHA256SUMS").write_text("")
        (folder / "SHA256SUMS").write_text("")

    sparse = tmp_path / "sparse"
    checkpoint(sparse, 10, {"job": "rl", "rl.algo": "rl_sparse", "model.path": "tiny"}, model=True)
    assert model_problems(str(sparse)) == []
    rlkv = tmp_path / "rlkv"
    checkpoint(rlkv, 5, {"job": "rlkv", "rl.algo": "rlkv", "model.path": "Qwen/Qwen3-4B"})
    (rlkv / "gates.safetensors").write_bytes(b"")
    [err] = model_problems(str(rlkv))
    assert "is an RLKV run: it trained per-head gates, not model weights" in err
    assert f"set model.path=Qwen/Qwen3-4B and eval.settings.NAME='{{policy: heads, run: {rlkv}}}'" in err
    foresight = tmp_path / "foresight"
    (foresight / "sft").mkdir(parents=True)
    (foresight / "sft" / "scorer.safetensors").write_bytes(b"")
    checkpoint(foresight / "rl", 20, {"job": "foresight", "rl.algo": "foresight", "model.path": "tiny"})
    for run in (foresight, foresight / "rl"):
        [err] = model_problems(str(run))
        assert f"set model.path=tiny and eval.settings.NAME='{{policy: learned, run: {run}}}'" in err, err
    early = tmp_path / "early"
    early.mkdir()
    (early / "metrics.jsonl").write_text("")
    [err] = model_problems(str(early))
    assert "holds no trained model yet" in err and f"rerun it with output_dir={early}" in err


def test_readme_example_math_env_on_an_rl_recipe(tmp_path, monkeypatch):
    """`env.id=kvrl/math-v0 env.kwargs.path=FILE` on a recipe over counts: the recipe's n_digits is dropped."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    cfg = load_config(["recipe=tiny_rl_full", "env.id=kvrl/math-v0", f"env.kwargs.path={data}"])
    assert (cfg.env.id, cfg.env.kwargs) == ("kvrl/math-v0", {"path": str(data)})
    from kvrl.envs import make

    env = make(cfg.env.id, **cfg.env.kwargs)
    env.reset(seed=0)
    assert len(env.tasks(3)) == 3


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ([], {"n_digits": 24}),  # the recipe's
        (["env.kwargs.n_digits=8"], {"n_digits": 8}),  # one key merges
        (["env.kwargs={}"], {}),  # a mapping given whole replaces the recipe's: {} clears it
        (["env.kwargs={n_digits: 8}"], {"n_digits": 8}),
        (["env.id=kvrl/counts-v0"], {"n_digits": 24}),  # the same environment keeps its arguments
        (["env.id=kvrl/chains-v0"], {}),  # another environment drops them
        (["env.id=kvrl/chains-v0", "env.kwargs.min_depth=2"], {"min_depth": 2}),
    ],
)
def test_the_command_line_owns_the_kwargs_of_what_it_changes(monkeypatch, args, kwargs):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    assert load_config(["recipe=tiny_rl_full", *args]).env.kwargs == kwargs


def test_help_lists_a_broken_recipe_with_a_note(tmp_recipes, monkeypatch, capsys):
    monkeypatch.setenv("KVRL_RECIPES_DIR", str(tmp_recipes))
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "latin1" in ln)
    assert "(unreadable: not UTF-8 (byte 0xe9 at offset 5, line 1); save the file as UTF-8)" in line
    assert "RL with the schema's defaults" in out
    assert "latin1" in available_recipes()


def test_env_arguments_a_class_takes_through_kwargs_are_not_second_guessed():
    assert env_problems("env.id", "kvrl.data.self_distill:SelfDistilledEnv", "env.kwargs", {"path": "x"}) == []
    missing = env_problems("env.id", "kvrl.data.self_distill:SelfDistilledEnv", "env.kwargs", {})
    assert missing == [
        "env.kwargs.path is required by kvrl.data.self_distill:SelfDistilledEnv (its arguments: "
        "path, env, env_kwargs); set env.kwargs.path=..."
    ]
    assert "cannot be imported" in env_problems("env.id", "no_such_pkg.envs:Env", "env.kwargs", {})[0]


def test_a_type_hint_is_valid_for_the_job(monkeypatch):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"set e\.g\. sampling\.temperature=2\.5$"):
        load_config(["recipe=tiny_rl_full", "sampling.temperature=hot"])


@pytest.mark.parametrize(
    "amx, dtype, refused", [(True, "bfloat16", True), (True, "float32", False), (False, "bfloat16", False)]
)
def test_vllm_bf16_on_an_amx_cpu_is_refused_before_the_engine_starts(monkeypatch, amx, dtype, refused):
    """vLLM's CPU attention stores a bf16 cache in its AMX layout where the CPU has AMX; kvrl's
    eviction cannot read that layout, so the gate refuses the combination with the fix."""
    import torch

    from kvrl.gate import machine_problems

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cfg = load_config(
        ["recipe=tiny_rl_full", "workers.engine=vllm", "sampling.temperature=1.0", f"model.dtype={dtype}"]
    )
    problems = [p for p in machine_problems(cfg, ray=True) if "AMX" in p]
    assert bool(problems) == refused
    if refused:
        assert "set model.dtype=float32" in problems[0]


@pytest.mark.parametrize(
    "override, refused",
    [([], False), (["sampling.batch_size=1000000000"], True), (["trainer.batch_size=1000000000000"], True)],
)
def test_sizes_this_machine_cannot_hold_are_refused_before_any_actor_starts(monkeypatch, override, refused):
    """sampling.batch_size=10**9 used to dry-run to a 217,437 GiB KV estimate and start; a huge
    trainer.batch_size climbed in memory until killed. The gate compares the plan's estimate of
    the local Ray's CPU actors with this machine's memory."""
    from kvrl.gate import machine_problems

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    cfg = load_config(["recipe=tiny_rl_full", *override])
    problems = [p for p in machine_problems(cfg, ray=True) if "CPU actors need" in p]
    assert bool(problems) == refused
    if refused:
        assert "lower sampling.batch_size" in problems[0] and "dry_run=true shows the estimate" in problems[0]


def test_a_seed_no_generator_takes_is_refused_by_the_config(monkeypatch):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"seed must be in \[0, 2\*\*32\) \(got 99999999999999999999\); set seed=0"):
        load_config(["recipe=tiny_rl_full", "seed=99999999999999999999"])


@pytest.mark.parametrize(
    "kv",
    [
        ["kv.window=100000", "kv.budget=100020"],  # before: "set kv.budget=100005 (below 1024)"
        ["kv.window=100000", "kv.budget=50"],  # before: "set kv.budget=100005 (or lower kv.window / kv.sink)"
        ["kv.window=100000", "kv.budget=0"],
        ["kv.sink=5000", "kv.budget=0"],
        ["kv.window=900", "kv.sink=200", "kv.budget=2000"],
        ["kv.window=40", "kv.budget=0", "kv.interval=1000"],
        ["kv.budget=2000"],
    ],
)
def test_the_suggested_kv_settings_pass_every_kv_rule(monkeypatch, kv):
    """Whatever kv.budget the refusal suggests (with kv.window / kv.sink when no budget fits beside them) is
    accepted when given back: a budget at least kv.window + kv.sink + 1 and below the 1024 positions."""
    import re

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    with pytest.raises(ConfigError) as refused:
        load_config(["recipe=tiny_multihop_sparse", *kv])
    fix = re.search(r"; set ((?:kv\.\w+=\d+ ?)+)", str(refused.value))
    assert fix is not None, str(refused.value)
    load_config(["recipe=tiny_multihop_sparse", *kv, *fix.group(1).split()])


def test_the_gates_policy_names_are_the_zoos():
    """The gate names kv.policy's values without importing torch; they must stay the zoo's."""
    from kvrl.section import POLICY_NAMES
    from kvrl.policies import POLICIES

    assert set(POLICY_NAMES) == {"full", *POLICIES}


@pytest.mark.parametrize("data", [False, True], ids=["procedural", "data_set"])
def test_a_budget_no_sequence_outgrows_is_refused_at_run_start(tmp_path, monkeypatch, capsys, data):
    """What only the prompts tell: kv.budget >= the longest prompt + sampling.max_new_tokens
    would run RL-Sparse on the full cache. The run stops with exit 2 before Ray starts or output_dir is made."""
    import ray

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "run"
    argv = ["recipe=tiny_gkv_sparse", f"output_dir={out}", "kv.budget=500"]
    if data:  # three short problems: the recipe's own budget (76) outlasts every sequence
        path = tmp_path / "problems.jsonl"
        path.write_text(
            "".join(json.dumps({"question": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(3))
        )
        # the bare question: the tiny reasoner's tokenizer reads no English instruction
        argv = argv[:2] + ["env.id=kvrl/math-v0", f"env.kwargs.path={path}", "env.kwargs.template='{question}'"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    budget = 76 if data else 500
    whence = (
        "the longest prompt of env.id=kvrl/math-v0's data set"
        if data
        else "the longest of 256 prompts drawn from env.id=kvrl/counts-v0"
    )
    assert err.startswith(
        f"kvrl: error: the run cannot start: kv.budget={budget} never evicts: a sequence holds at most "
    ), err
    assert whence in err and "sampling.max_new_tokens=64" in err and "rl.algo=rl_sparse" in err, err
    limit = int(err.split("holds at most ")[1].split()[0])
    assert limit < budget + 1 and f"set kv.budget={max(13, limit // 2)} (below {limit})" in err, err
    assert not ray.is_initialized() and not out.exists()


def test_a_data_set_row_the_model_cannot_hold_is_refused_at_run_start(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    path = tmp_path / "problems.jsonl"
    path.write_text(
        json.dumps({"question": "1 + 1 = ?", "answer": "2"})
        + "\n"
        + json.dumps({"question": " ".join(["3"] * 40), "answer": "3"})
        + "\n"
    )
    assert (
        main(
            [
                "recipe=tiny_rl_full",
                "env.id=kvrl/math-v0",
                f"env.kwargs.path={path}",
                "model.max_model_len=32",
                "env.kwargs.template='{question}'",
                f"output_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "the run cannot start: " in err and "problems.jsonl:2: the prompt has" in err, err
    assert "the model holds 32 positions; drop or shorten that row" in err and "Traceback" not in err, err


def test_a_data_set_row_that_is_not_utf8_is_refused_at_run_start(tmp_path, monkeypatch, capsys):
    """A lone surrogate (JSON's "\\ud800") in a row. Before: the row's ValueError as a traceback (exit 1)."""
    import ray

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = tmp_path / "problems.jsonl"
    path.write_text('{"question": "1 + 1 = ?", "answer": "2"}\n{"question": "1 + \\ud800 = ?", "answer": "3"}\n')
    out = tmp_path / "run"
    env = ["env.id=kvrl/math-v0", f"env.kwargs.path={path}", "env.kwargs.template='{question}'"]
    assert main(["recipe=tiny_rl_full", f"output_dir={out}", *env]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"kvrl: error: the run cannot start: env.id=kvrl/math-v0: {path}:2: the question holds a lone surrogate "
        "'\\ud800' at character 5"
    ), err
    assert "Traceback" not in err and not ray.is_initialized() and not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["recipe=tiny_rl_full", "env.id=os:system", "env.kwargs.command=touch {marker}", "dry_run=true"],
        ["recipe=tiny_rl_full", "env.id=os:system", "env.kwargs.command=touch {marker}"],
        [
            "recipe=tiny_self_distill",
            "self_distill.source=os:system",
            "self_distill.source_kwargs.command=touch {marker}",
        ],
    ],
    ids=["env_dry_run", "env_run", "self_distill_source"],
)
def test_an_env_path_to_anything_but_an_env_class_is_refused_before_it_is_called(tmp_path, monkeypatch, capsys, argv):
    """env.id=os:system with env.kwargs.command: the gate read the signature, found `command`, passed it, and the
    dry run's plan called os.system. A dotted path must name an Env class, refused before anything is called."""
    from kvrl.envs import make

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    marker = tmp_path / "PWNED"
    argv = [a.replace("{marker}", str(marker)) for a in argv] + [f"output_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    key = "self_distill.source" if "source" in argv[1] else "env.id"
    assert (
        f"{key}='os:system' cannot be used: 'os:system' is a builtin_function_or_method, not a kvrl.envs.Env "
        "class" in err
    ), err
    assert "Traceback" not in err and not marker.exists() and not (tmp_path / "run").exists()
    with pytest.raises(TypeError, match="not a kvrl.envs.Env class"):
        make("os:system", command=f"touch {marker}")
    assert not marker.exists()


@pytest.mark.parametrize("dry_run", ["true", "false"])
def test_an_empty_output_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, dry_run):
    """`output_dir=` wrote checkpoints/, model/, metrics.jsonl and .lock into the current directory."""
    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["recipe=tiny_rl_full", "output_dir=", f"dry_run={dry_run}"]) == 2
    err = capsys.readouterr().err
    assert "output_dir must name a folder (empty would write the run into the current directory) (got '')" in err
    assert "set output_dir=outputs/${run_name}" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("key, package", [("logging.tensorboard", "tensorboard"), ("logging.wandb", "wandb")])
def test_a_logger_that_is_not_installed_is_refused_before_the_run_starts(tmp_path, monkeypatch, key, package):
    """logging.tensorboard=true without tensorboard was an ImportError after Ray and the actors had started."""
    import sys

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    monkeypatch.setitem(sys.modules, package, None)  # what an interpreter without the package finds
    cfg = load_config(["recipe=tiny_rl_full", f"{key}=true", f"output_dir={tmp_path / 'run'}"])
    assert (
        f"{key}=true needs the {package} package, which is not installed here: pip install {package}, or set "
        f"{key}=false" in "\n".join(run_problems(cfg))
    )
    cfg = load_config(["recipe=tiny_rl_full", f"{key}=false", f"output_dir={tmp_path / 'run'}"])
    assert package not in "\n".join(run_problems(cfg))


def test_a_run_folder_reached_through_a_symlink_or_copied_continues_as_documented(tmp_path, monkeypatch, capsys):
    """Resume through a symlink to the run folder, or from a copied run folder, was refused because output_dir
    differed, with a fix pointing at the original. A symlink is the same folder; a copy continues with
    resume=<its checkpoint>, which the refusal names; the original folder is only read."""
    import shutil

    monkeypatch.delenv("KVRL_RECIPES_DIR", raising=False)
    args = [
        "recipe=tiny_pretrain",
        "trainer.batch_size=2",
        "trainer.log_every=1",
        "pretrain.eval_tasks=1",
        "pretrain.checkpoint_every=1",
        "pretrain.layers=1",
        "pretrain.hidden=32",
        "pretrain.kv_heads=1",
        "pretrain.intermediate=32",
    ]
    real = tmp_path / "real"
    assert main([*args, f"output_dir={real}", "trainer.steps=2"]) == 0  # step_000001 (the last step: model/ only)
    copy = Path(shutil.copytree(real, tmp_path / "copy", symlinks=True))
    link = tmp_path / "link"
    link.symlink_to(real)
    capsys.readouterr()
    assert main([*args, f"output_dir={link}", "trainer.steps=3"]) == 0
    assert "resumed from" in capsys.readouterr().out
    before = {p: p.read_bytes() for p in real.rglob("*") if p.is_file()}
    assert main([*args, f"output_dir={copy}", "trainer.steps=4"]) == 2
    err = capsys.readouterr().err
    checkpoint = copy / "checkpoints" / "step_000001"
    assert (
        f"output_dir: '{real}' -> '{copy}' (this folder holds a run written as output_dir={real}: copied or moved "
        f"here; to continue it here, set resume={checkpoint}, which continues that checkpoint" in err
    ), err
    assert main([*args, f"output_dir={copy}", "trainer.steps=4", f"resume={checkpoint}"]) == 0
    assert "resumed from" in capsys.readouterr().out and (copy / "checkpoints" / "step_000003").is_dir()
    assert {p: p.read_bytes() for p in real.rglob("*") if p.is_file()} == before  # the original is untouched
