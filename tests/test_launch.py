"""Launchers: `ray job submit` against a local head, and the multi-node Slurm script."""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from kvrl.models.tiny import build_tokenizer, tiny_config

REPO = Path(__file__).resolve().parent.parent
SUBMIT = REPO / "launch" / "ray_submit.sh"
SBATCH = REPO / "launch" / "slurm" / "kvrl.sbatch"


def run(*args, env=None, timeout=60):
    return subprocess.run(
        [str(a) for a in args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("script", [SUBMIT, SBATCH])
def test_scripts_parse(script):
    proc = run("bash", "-n", script)
    assert proc.returncode == 0, proc.stderr


def test_runtime_env_leaves_out_venv_git_and_outputs():
    env = yaml.safe_load((REPO / "launch" / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "." and {".venv", ".git", "outputs"} <= set(env["excludes"])


def test_sbatch_dry_run_prints_head_workers_and_submit():
    proc = run(
        "bash",
        SBATCH,
        "tiny_rl_full",
        "trainer.steps=5",
        env={"DRY_RUN": "1", "KVRL_NODES": "gpu01 gpu02 gpu03", "SLURM_JOB_NODELIST": ""},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    head = [line for line in lines if line.startswith("head:")]
    workers = [line for line in lines if line.startswith("worker:")]
    submit = [line for line in lines if line.startswith("submit:")]
    assert len(head) == 1 and "-w gpu01" in head[0] and "start --head --block" in head[0]
    assert len(workers) == 2 and "-w gpu02" in workers[0] and "-w gpu03" in workers[1]
    assert all("--address=gpu01:6379" in w for w in workers)
    assert any(line.startswith("wait:") and "3 active nodes" in line for line in lines)
    assert len(submit) == 1 and "job submit" in submit[0] and "--runtime-env" in submit[0]
    assert "-m kvrl.run recipe=tiny_rl_full" in submit[0] and submit[0].endswith("trainer.steps=5")
    assert "env:    working_dir: ." in lines  # launch/runtime_env.yaml's, merged
    assert not any("py_modules" in line for line in lines)  # an empty list fails Ray's runtime-env agent


def test_sbatch_log_folder_ships_with_the_clone():
    """#SBATCH --output points into outputs/, which Slurm does not create: a clone must have it."""
    assert "#SBATCH --output=outputs/slurm-%j.log" in SBATCH.read_text()
    tracked = run("git", "ls-files", "outputs").stdout.split()
    assert tracked == ["outputs/.gitkeep"]


@pytest.mark.parametrize(
    "allocation, fix",
    [
        (
            {"KVRL_NODES": "a", "KVRL_GPUS_PER_NODE": "1"},
            "need 2 GPUs (1 rollout x 1 + 1 learners x 1) and the allocation "
            "has 1 nodes x 1 = 1: lower workers.rollout / workers.learners or "
            "ask for --nodes=2",
        ),
        ({"KVRL_NODES": "a b", "KVRL_GPUS_PER_NODE": "1"}, None),
        (
            {"KVRL_NODES": "a b", "KVRL_GPUS_PER_NODE": "1", "EXTRA": "workers.learner_gpus=2"},
            "a learner actor needs 2 GPUs (workers.learner_gpus) and a node has 1",
        ),
    ],
)
def test_sbatch_checks_the_recipes_actors_against_the_allocation(allocation, fix):
    extra = [allocation.pop("EXTRA")] if "EXTRA" in allocation else []
    proc = run(
        "bash",
        SBATCH,
        "rlkv_r1_llama_8b",
        *extra,
        env={"DRY_RUN": "1", "SLURM_JOB_NODELIST": "", **allocation},
        timeout=300,
    )  # a dry run that fits ends with kvrl's plan (torch's import)
    if fix is None:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2 and fix in proc.stderr, proc.stderr
        assert "head:" not in proc.stdout


def test_launcher_options_reach_the_jobs_runtime_env(tmp_path, user_package):
    extra = tmp_path / "extra.yaml"
    extra.write_text("env_vars: {HF_HOME: /data/hf}\npip: [sympy]\n")
    proc = run(
        SUBMIT,
        "--py-module",
        user_package / "kvtasks",
        "--env-var",
        "WANDB_MODE=offline",
        "--runtime-env",
        extra,
        "tiny_rl_full",
        "env.id=kvtasks/partial-counts-v0",
        env={"DRY_RUN": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    env = yaml.safe_load("\n".join(line[8:] for line in proc.stdout.splitlines() if line.startswith("env:")))
    assert env["py_modules"] == [str(user_package / "kvtasks")] and env["pip"] == ["sympy"]
    assert env["env_vars"] == {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HOME": "/data/hf",
        "WANDB_MODE": "offline",
    }
    assert env["working_dir"] == "." and ".venv" in env["excludes"]
    bad = run(SUBMIT, "--py-mod", "x", "tiny_rl_full", env={"DRY_RUN": "1"})
    assert bad.returncode == 2 and "the options are --py-module DIR" in bad.stderr


def test_a_port_another_process_holds_is_named_before_a_head_starts():
    """Another Ray on the machine holding the job agent's port: said at once, with the variable
    to change (it used to retry "the Ray job agent is not up yet" for 10 minutes)."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = run(
            SUBMIT,
            "tiny_rl_full",
            env={
                "RAY_PORT": str(free_port()),
                "RAY_DASHBOARD_PORT": str(free_port()),
                "RAY_DASHBOARD_AGENT_PORT": str(port),
            },
            timeout=60,
        )
    assert proc.returncode == 1
    assert f"port {port} (RAY_DASHBOARD_AGENT_PORT) is held by another process" in proc.stderr
    assert "set RAY_DASHBOARD_AGENT_PORT=<a free port>" in proc.stderr


def test_submit_dry_run_prints_head_and_submit():
    proc = run(SUBMIT, "tiny_rl_full", "trainer.steps=1", env={"DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    head, submit, *env = proc.stdout.splitlines()
    assert env and all(line.startswith("env:") for line in env)
    assert head.startswith("head:") and "start --head --block --port 6379" in head
    assert submit.startswith("submit:") and "job submit --address http://127.0.0.1:8265" in submit
    assert f"output_dir={REPO}/outputs/${{run_name}}" in submit


@pytest.fixture
def random_model(tmp_path):
    torch.manual_seed(0)
    tok = build_tokenizer()
    LlamaForCausalLM(tiny_config(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


ONE_STEP = ["trainer.steps=1", "trainer.batch_size=16", "sampling.max_new_tokens=8"]


def check_one_step_job(proc, out):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and (out / "model" / "config.json").exists()


@pytest.mark.slow
def test_a_users_registered_environment_locally_and_as_a_ray_job(tmp_path, random_model, user_package):
    """A package outside kvrl (nothing installed) registers `kvtasks/partial-counts-v0`;
    its id works from the command line in a local run (the package on PYTHONPATH) and in a Ray
    job through the documented launcher (the package as a py_module): it starts a head,
    submits 1 step, stops the head. The user's metric in metrics.jsonl shows its class ran."""
    user = ["env.id=kvtasks/partial-counts-v0", "sampling.max_new_tokens=8"]
    local = tmp_path / "local"
    proc = run(
        REPO / ".venv" / "bin" / "python",
        "-m",
        "kvrl.run",
        "recipe=tiny_rl_full",
        f"model.path={random_model}",
        f"output_dir={local}",
        *ONE_STEP,
        *user,
        "workers.rollout=1",
        "workers.num_cpus=2",
        "workers.engine=vllm",
        "sampling.temperature=2.0",
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(user_package), os.environ.get("PYTHONPATH")]))},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "env/user_words" in json.loads((local / "metrics.jsonl").read_text().splitlines()[0])
    # quiet by default: kvrl's lines and progress bars only; vLLM's, Ray's and DeepSpeed's stay in the logs it names
    console = proc.stdout + proc.stderr
    assert "kvrl: the actors' logs (vLLM, DeepSpeed, Ray) are in" in console
    for noise in ("(RolloutWorker pid=", "(Learner pid=", "INFO ", "WARNING", "Failed to load weights", "Traceback"):
        assert noise not in console, (noise, console[-3000:])
    out = tmp_path / "out"
    proc = run(
        SUBMIT,
        "--py-module",
        user_package / "kvtasks",
        "tiny_rl_full",
        f"model.path={random_model}",
        f"output_dir={out}",
        *ONE_STEP,
        *user,
        env={
            "RAY_PORT": str(free_port()),
            "RAY_DASHBOARD_PORT": str(free_port()),
            "RAY_NUM_CPUS": "2",
            # the job agent's default port may still be held by the previous test's head, whose
            # agent then cannot start: the job is accepted and never runs (CI hung here 600 s)
            "RAY_DASHBOARD_AGENT_PORT": str(free_port()),
        },
        timeout=600,
    )  # a guard, not a measurement: a loaded machine is slow
    check_one_step_job(proc, out)
    assert "env/user_words" in json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
def test_sbatch_on_one_node_with_a_stand_in_srun(tmp_path, random_model):
    """The Slurm script's real path (head, join wait, submit, teardown) on this machine:
    srun runs its command here and scontrol names one node."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "while [[ $# -gt 0 && $1 == -* ]]; do case $1 in -w) shift 2;; *) shift;; esac; done\n"
        'exec "$@"\n'
    )
    (shims / "scontrol").write_text("#!/usr/bin/env bash\necho localhost\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    out = tmp_path / "out"
    proc = run(
        "bash",
        SBATCH,
        "tiny_rl_full",
        f"model.path={random_model}",
        f"output_dir={out}",
        *ONE_STEP,
        env={
            "PATH": f"{shims}:{os.environ['PATH']}",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_CPUS_ON_NODE": "2",
            "RAY_PORT": str(free_port()),
            "RAY_DASHBOARD_PORT": str(free_port()),
            "RAY_DASHBOARD_AGENT_PORT": str(free_port()),
        },
        timeout=600,
    )
    assert "all 1 nodes joined" in proc.stdout
    check_one_step_job(proc, out)


def test_sbatch_dry_run_from_elsewhere_writes_nothing_into_the_checkout_and_prints_kvrls_plan(tmp_path):
    """Before: outputs/.runtime_env_dry.yaml appeared in the checkout and the plan was Slurm's only."""
    before = sorted(p.name for p in (REPO / "outputs").iterdir())
    proc = subprocess.run(
        ["bash", str(SBATCH), "rlkv_r1_llama_8b"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "DRY_RUN": "1",
            "SLURM_JOB_NODELIST": "",
            "KVRL_NODES": "a",
            "KVRL_REPO": str(REPO),
            "TMPDIR": str(tmp_path),
        },
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (REPO / "outputs").iterdir()) == before
    assert list(tmp_path.iterdir()) == []  # the runtime env's temporary file is gone too
    assert "dry run of recipe=rlkv_r1_llama_8b (job=rlkv)" in proc.stdout
    assert "the Ray cluster needs 8 CPUs and 2 GPUs" in proc.stdout


def test_sbatch_warns_of_idle_gpus_with_the_recipe_scaled_to_them():
    """Before: a 2-GPU recipe on one 8-GPU node passed silently with 6 GPUs idle."""
    proc = run(
        "bash",
        SBATCH,
        "rlkv_r1_llama_8b",
        env={"DRY_RUN": "1", "SLURM_JOB_NODELIST": "", "KVRL_NODES": "a", "KVRL_GPUS_PER_NODE": "8"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "allocation: warning: the recipe uses 2 of the allocation's 8 GPUs; 6 stay idle: scale it to the "
        "allocation with workers.rollout=7 (each rollout actor takes workers.rollout_gpus=1)"
    ) in proc.stderr
    full = run(
        "bash",
        SBATCH,
        "rlkv_r1_llama_8b",
        "workers.rollout=7",
        env={"DRY_RUN": "1", "SLURM_JOB_NODELIST": "", "KVRL_NODES": "a", "KVRL_GPUS_PER_NODE": "8"},
        timeout=300,
    )
    assert full.returncode == 0 and "warning" not in full.stderr, full.stderr
