"""Env API, check_env and the registry, on small environments defined here."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvrl.envs import (
    EnvCheckError,
    EnvNotFoundError,
    Reward,
    Task,
    TextEnv,
    TraceEnv,
    check_env,
    make,
    register,
    registered,
)
from kvrl.envs.counts import CountsEnv

# ---- a minimal procedural text env and a minimal trace env -----------------------------


def exact(task: Task, completion: str) -> float:
    return float(f"\\boxed{{{task.answer}}}" in completion)


def length(task: Task, completion: str) -> float:
    return float(len(completion))


class AddEnv(TextEnv):
    """a + b = ? with a, b drawn from np_random."""

    def __init__(self, high: int = 100):
        super().__init__(rewards=[Reward(exact, 1.0, "exact"), Reward(length, 0.0, "length")])
        self.high = high

    def sample_task(self, rng: np.random.Generator) -> Task:
        a, b = (int(x) for x in rng.integers(0, self.high, size=2))
        return Task(id=f"add-{a}-{b}", prompt=f"What is {a} + {b}?", answer=str(a + b))


class DropEnv(TraceEnv):
    """Toy eviction MDP over a fixed trace of per-token losses.

    obs: the losses of the tokens still cached; action: which cached index to drop; the
    episode drops ``n_drop`` tokens and its reward (at the end) is -sum(dropped losses).
    """

    num_tasks = 1  # one fixed trace: the first observation cannot depend on the seed

    def __init__(self, losses=(0.5, 0.1, 2.0, 0.3, 1.2), n_drop: int = 3):
        self.losses = list(losses)
        self.max_steps = n_drop

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cached = list(range(len(self.losses)))
        self.dropped: list[int] = []
        return self._obs(), {}

    def _obs(self):
        return {"losses": np.array([self.losses[i] for i in self.cached]), "step": len(self.dropped)}

    def step(self, action):
        self.dropped.append(self.cached.pop(int(action)))
        done = len(self.dropped) == self.max_steps
        reward = -float(sum(self.losses[i] for i in self.dropped)) if done else 0.0
        return self._obs(), reward, done, False, {"dropped": list(self.dropped)}

    def sample_action(self, obs, rng):
        return int(rng.integers(len(obs["losses"])))


def test_check_env_passes_minimal_envs():
    check_env(AddEnv())
    check_env(DropEnv())
    check_env(DropEnv(), action_fn=lambda obs, rng: int(np.argmin(obs["losses"])))


def test_text_env_step_and_weights():
    env = AddEnv()
    task, info = env.reset(seed=3)
    assert info == {}
    obs, reward, terminated, truncated, info = env.step(f"so \\boxed{{{task.answer}}}")
    assert (obs, reward, terminated, truncated) == (None, 1.0, True, False)
    assert info["length"] > 0 and info["reward"] == 1.0  # weight-0 metric is not added
    with pytest.raises(RuntimeError, match="reset"):
        env.step("again")  # one step per episode
    assert env.score(task, "no idea") == (0.0, {"exact": 0.0, "length": 7.0, "reward": 0.0})


@pytest.mark.parametrize("returned", [float("nan"), float("inf"), "0.5", torch.tensor(1.0)])
def test_a_reward_that_is_no_finite_number_is_an_error_naming_env_function_and_task(returned):
    """NaN and inf would be trained on and checkpointed; "0.5" would pass float() unnoticed."""
    env = TextEnv(rewards=[Reward(exact, 1.0, "exact"), Reward(lambda task, completion: returned, 0.5, "judge")])
    env.id = "my/env-v0"
    with pytest.raises(
        ValueError,
        match=r"environment my/env-v0: reward function 'judge' returned .* for task "
        r"'add-1-2'; a reward must be a finite number",
    ):
        env.score(Task(id="add-1-2", prompt="1 + 2?", answer="3"), "\\boxed{3}")


def test_rewards_whose_sum_overflows_and_a_nan_weight_are_errors_naming_the_task_and_the_reward():
    """Finite one by one, 1e308 + 1e308 summed to inf, and a NaN weight made every reward NaN: both were
    trained on (reward_mean null) and checkpointed."""
    huge = [Reward(lambda task, completion: 1e308, 1.0, "a"), Reward(lambda task, completion: 1e308, 1.0, "b")]
    env = TextEnv(rewards=huge)
    env.id = "my/env-v0"
    with pytest.raises(
        ValueError,
        match=r"environment my/env-v0: the rewards of task 'add-1-2' sum to inf \(1 x a "
        r"1e\+308, 1 x b 1e\+308\); a reward must be a finite number",
    ):
        env.score(Task(id="add-1-2", prompt="1 + 2?", answer="3"), "\\boxed{3}")
    for weight in (float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match=r"reward 'exact': weight .* must be a finite number; set it to 1.0"):
            Reward(exact, weight, "exact")


def test_trace_episode_reward_at_end():
    env = DropEnv()
    obs, _ = env.reset(seed=0)
    rewards = []
    for _ in range(env.max_steps):
        obs, r, term, trunc, _ = env.step(int(np.argmin(obs["losses"])))
        rewards.append(r)
    assert term and rewards[:-1] == [0.0, 0.0] and rewards[-1] == pytest.approx(-0.9)


# ---- resume ----------------------------------------------------------------------------


def _dataset_env(n: int = 3) -> TextEnv:
    data = [Task(id=f"t{i}", prompt=f"p{i}", answer=str(i)) for i in range(n)]
    return TextEnv(data, rewards=[Reward(exact, name="exact")])


@pytest.mark.parametrize("consumed", [0, 2, 3, 4])  # 3 = exactly at the epoch boundary
def test_state_dict_resume_gives_same_next_tasks(consumed):
    env = _dataset_env()
    env.reset(seed=7)
    env.tasks(consumed)
    state = env.state_dict()
    expected = [t.id for t in env.tasks(5)]
    fresh = _dataset_env()
    fresh.load_state_dict(state)
    assert [t.id for t in fresh.tasks(5)] == expected


@pytest.mark.parametrize("change", ["edited", "shrunk"])
def test_resume_refuses_a_data_set_changed_since_the_state_was_saved(change):
    """A data line edited between a run and its resume was resumed silently; a file shrunk
    to fewer rows than the saved cursor failed with a bare IndexError."""
    env = _dataset_env(6)
    env.reset(seed=3)
    env.tasks(4)
    state = env.state_dict()
    fresh = _dataset_env(2 if change == "shrunk" else 6)
    if change == "edited":
        fresh.data[5] = Task(id="t5", prompt="p5 edited", answer="5")
    with pytest.raises(
        ValueError,
        match="data set differs from the one this state was saved with .* restore the "
        "data file the run started with, or start a new run",
    ):
        fresh.load_state_dict(state)
    same = _dataset_env(6)
    same.load_state_dict(state)  # the unchanged data resumes
    assert [t.id for t in same.tasks(3)] == [t.id for t in env.tasks(3)]


def test_dataset_epochs_cover_every_task():
    env = _dataset_env(5)
    env.reset(seed=0)
    ids = [t.id for t in env.tasks(9)]  # reset drew one: 10 tasks = 2 epochs
    ids.insert(0, None)
    assert sorted(ids[5:]) == [f"t{i}" for i in range(5)]


def test_procedural_resume():
    env = AddEnv()
    env.reset(seed=1)
    state = env.state_dict()
    expected = env.tasks(3)
    env.tasks(10)
    env.load_state_dict(state)
    assert env.tasks(3) == expected


# ---- check_env rejects broken subclasses -----------------------------------------------


class UnseededEnv(AddEnv):
    def sample_task(self, rng):
        a = random.randrange(10**9)  # ignores rng
        return Task(id=f"u{a}", prompt=f"{a}?", answer=str(a))


class NoIdEnv(AddEnv):
    def sample_task(self, rng):
        return Task(id="", prompt="1 + 1?", answer="2")


def _bad_reward_env(value):
    class BadReward(AddEnv):
        def score(self, task, completion):
            _, info = super().score(task, completion)
            return value, info

    return BadReward()


class IgnoresSeedEnv(AddEnv):
    def sample_task(self, rng):
        return Task(id="same", prompt="1 + 1?", answer="2")


class ForgetfulStateEnv(AddEnv):
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class NeverEndsEnv(DropEnv):
    def step(self, action):
        obs, r, _, trunc, info = super().step(0)
        return obs, r, False, trunc, info


@pytest.mark.parametrize(
    "env, match",
    [
        (UnseededEnv(), "reset\\(seed=0\\) twice gave different observations"),
        (_bad_reward_env(np.float32(1.0)), "numpy.float32.*finite Python float"),
        (_bad_reward_env(torch.tensor(1.0)), "torch.*Tensor.*finite Python float"),
        (_bad_reward_env(float("nan")), "nan.*finite Python float"),
        (_bad_reward_env(True), "bool.*finite Python float"),
        (NoIdEnv(), "id is ''; id must be a non-empty str"),
        (IgnoresSeedEnv(), "the seed is ignored"),
        (ForgetfulStateEnv(), "load_state_dict"),
        (NeverEndsEnv(), "did not end within max_steps"),
    ],
    ids=["unseeded", "numpy", "torch", "nan", "bool", "no_id", "seed_ignored", "state", "never_ends"],
)
def test_check_env_rejects(env, match):
    with pytest.raises(EnvCheckError, match=match):
        check_env(env)


def test_check_env_needs_an_action_fn_for_trace_envs():
    env = DropEnv()
    env.sample_action = None
    with pytest.raises(EnvCheckError, match="action_fn"):
        check_env(env)


# ---- registry --------------------------------------------------------------------------


def test_register_rejects_bad_ids():
    for bad in ["math", "kvrl/math", "kvrl/math-v", "kvrl/math_v0", "a/b/c-v0"]:
        with pytest.raises(ValueError, match="namespace/name-vN"):
            register(bad, "kvrl.envs.math:MathEnv")


def test_unknown_id_suggests_nearest():
    with pytest.raises(EnvNotFoundError) as e:
        make("kvrl/maths-v0")
    assert isinstance(e.value, KeyError)
    assert "Did you mean 'kvrl/math-v0'" in str(e.value) and "dotted path" in str(e.value)


def test_make_by_id_and_dotted_path():
    register("test/add-v0", f"{__name__}:AddEnv", high=5)
    assert "test/add-v0" in registered()
    env = make("test/add-v0")
    assert env.id == "test/add-v0" and env.high == 5
    assert make("test/add-v0", high=7).high == 7  # kwargs override registered defaults
    env = make(f"{__name__}:AddEnv", high=3)
    assert isinstance(env, AddEnv) and env.id == f"{__name__}:AddEnv"
    with pytest.raises(ValueError, match="already registered"):
        register("test/add-v0", f"{__name__}:DropEnv")
    with pytest.raises(TypeError, match="not a kvrl.envs.Env"):
        make("collections:OrderedDict")


def test_builtin_entry_points_are_lazy():
    code = "import sys, kvrl.envs as e; print(e.registered()); print('kvrl.envs.chains' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "'kvrl/chains-v0'" in out and "'kvrl/math-v0'" in out and out.strip().endswith("False")


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("Let me think. 3+4=7 so \\boxed{6}? no.</think>The answer is \\boxed{7}.", "The answer is \\boxed{7}."),
        ("<think>maybe \\boxed{6}</think>\n\\boxed{7}", "\n\\boxed{7}"),
        ("<think>maybe \\boxed{6} and then I was cut off", ""),
        ("no thinking block: \\boxed{7}", "no thinking block: \\boxed{7}"),
    ],
)
def test_answers_are_read_after_the_thinking_block(completion, answer):
    from kvrl.envs.chat import after_thinking
    from kvrl.envs.math import MathEnv

    assert after_thinking(completion) == answer
    env = MathEnv()
    task = env.tasks(1)[0]
    _, info = env.score(task, completion)  # the rewards see only the answer part
    assert info["has_boxed"] == float("\\boxed" in answer)


def test_an_id_is_found_through_the_package_its_namespace_names(user_package, monkeypatch):
    """`env.id=kvtasks/partial-counts-v0` works with nothing imported by hand: the
    namespace `kvtasks` is imported, and its __init__ registers the id (in the driver and in
    every Ray worker, where the package is a py_module or on PYTHONPATH)."""
    from kvrl.preflight.names import env_problems

    monkeypatch.syspath_prepend(str(user_package))
    assert env_problems("env.id", "kvtasks/partial-counts-v0", "env.kwargs", {}) == []
    env = make("kvtasks/partial-counts-v0")
    assert type(env).__module__ == "kvtasks.envs" and env.n_digits == 8 and env.id == "kvtasks/partial-counts-v0"
    assert "kvtasks/partial-counts-v0" in registered()


def test_an_id_is_found_through_an_installed_packages_entry_points(tmp_path, monkeypatch):
    """An installed distribution declares ids under the `kvrl.envs` entry-point group (a
    .dist-info folder on sys.path is what `pip install` leaves)."""
    info = tmp_path / "kvlab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvlab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvrl.envs]\nlab/adder-v3 = {__name__}:AddEnv\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make("lab/adder-v3", high=4)
    assert isinstance(env, AddEnv) and env.high == 4


def test_an_unregistered_user_id_says_how_to_register_it(monkeypatch):
    from kvrl.preflight.names import env_problems

    [problem] = env_problems("env.id", "nolab/thing-v0", "env.kwargs", {})
    assert "nothing importable named 'nolab' registers it" in problem
    assert "--py-module path/to/nolab" in problem and "entry-point group 'kvrl.envs'" in problem
    with pytest.raises(EnvNotFoundError, match="make the package 'nolab' importable"):
        make("nolab/thing-v0")


# ---- a task the model's tokenizer cannot read -------------------------------------------


class SumEnv(TextEnv):
    """docs/environments.md's example: '12 + 34 = ?' with a boxed answer, in words the tiny reasoner's
    word-level tokenizer does not know (multi-digit numbers, '+', English)."""

    def __init__(self, n: int = 3):
        super().__init__(rewards=[Reward(exact, 1.0, "exact")])
        self.n = n

    def sample_task(self, rng):
        xs = rng.integers(10, 100, size=self.n).tolist()
        return Task(
            id="sum-" + "-".join(map(str, xs)),
            prompt=" + ".join(map(str, xs)) + " = ?\nPut the final answer in \\boxed{}.",
            answer=str(sum(xs)),
        )


class TinyAnswerEnv(AddEnv):
    """Prompts in the tiny vocabulary ('3 ; 4 = ?'), answers of two digits it reads as one unknown word."""

    def sample_task(self, rng):
        a, b = (int(x) for x in rng.integers(0, 10, size=2))
        return Task(id=f"pair-{a}-{b}", prompt=f"{a} ; {b} = ?", answer=str(10 * a + b + 10))


def test_check_env_refuses_a_task_the_tokenizer_cannot_read():
    """Before: SumEnv on the tiny reasoner read `<bos> <pad> <pad> <pad> = ? <pad> ...` and trained on it
    with reward 0 and no word."""
    from kvrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    check_env(SumEnv())  # the contract holds: the tokenizer is what is wrong for it
    with pytest.raises(
        EnvCheckError,
        match=r"reset\(seed=0\): task 'sum-\d+-\d+-\d+': 11 of the 13 tokens of its "
        r"prompt '\d+ \+ \d+ .*' are <pad>, which the model's tokenizer puts for "
        r"what it does not know \(it reads: <bos> <pad> <pad> <pad> <pad> <pad> = "
        r"\? <pad>",
    ):
        check_env(SumEnv(), tokenizer=tok)
    with pytest.raises(EnvCheckError, match=r"task 'pair-\d-\d': 1 of the 1 tokens of its answer '\d+' are <pad>"):
        check_env(TinyAnswerEnv(), tokenizer=tok)
    check_env(CountsEnv(n_digits=8), tokenizer=tok)  # the tiny reasoner's own task reads


def test_a_run_on_a_task_the_model_cannot_read_is_refused_at_start(tmp_path, monkeypatch, capsys):
    """docs/environments.md's SumEnv on tiny_rl_full: exit 2 naming the task, before Ray starts or
    output_dir is made (before: exit 0 with reward 0.000 and zero_std_groups 1.0)."""
    import ray

    from kvrl.run import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "run"
    assert main(["recipe=tiny_rl_full", f"env.id={__name__}:SumEnv", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvrl: error: the run cannot start: env.id={__name__}:SumEnv: task 'sum-"), err
    assert "tokens of its prompt" in err and "the model cannot read this task" in err, err
    assert not ray.is_initialized() and not out.exists()


class SurrogateEnv(TextEnv):
    """Tasks about a third of whose prompts end in a lone surrogate, as text built from JSON's "\\ud800" would."""

    def sample_task(self, rng):
        n = int(rng.integers(1000))
        return Task(id=f"s-{n}", prompt=f"{n % 10} ; ?" + (" \ud800" if n % 3 == 0 else ""), answer="1")


def test_a_task_whose_text_is_not_utf8_is_an_error_naming_it():
    """Before: the Task was built, and the tokenizer refused its prompt in a rollout with a bare TypeError."""
    with pytest.raises(ValueError, match=r"^task 't': its prompt is not valid UTF-8: a lone surrogate '\\ud800' at "):
        Task(id="t", prompt="1 ; \ud800", answer="1")
    with pytest.raises(ValueError, match=r"^task 't': its answer is not valid UTF-8: .* at character 2 "):
        Task(id="t", prompt="1 ; ?", answer="1\udcff")
    assert Task(id="t", prompt="caf\u00e9 \U0001f600", answer=None).prompt == "caf\u00e9 \U0001f600"


def test_a_run_on_a_custom_env_whose_prompt_is_not_utf8_is_refused_at_start(tmp_path, monkeypatch, capsys):
    import ray

    from kvrl.run import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "run"
    assert main(["recipe=tiny_rl_full", f"env.id={__name__}:SurrogateEnv", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvrl: error: the run cannot start: env.id={__name__}:SurrogateEnv: task 's-"), err
    assert "its prompt is not valid UTF-8: a lone surrogate '\\ud800' at character 7" in err, err
    assert "Traceback" not in err and not ray.is_initialized() and not out.exists()


class InfRewardEnv(CountsEnv):
    """Counts whose one reward is inf for every completion."""

    def __init__(self, n_digits: int = 8):
        super().__init__(n_digits=n_digits)
        self.rewards = [Reward(lambda task, completion: float("inf"), 1.0, "judge")]


def test_an_inf_reward_stops_a_run_by_name(tmp_path, monkeypatch, capsys):
    """Before: the run stopped on the rollout's ValueError with a traceback (exit 1)."""
    from kvrl.run import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = [f"env.id={__name__}:InfRewardEnv", "workers.address=inline", "trainer.steps=1", f"output_dir={tmp_path}"]
    assert main(["recipe=tiny_rl_full", *argv]) == 2
    err = capsys.readouterr().err
    assert f"kvrl: error: environment {__name__}:InfRewardEnv: reward function 'judge' returned inf (float)" in err
    assert "rerun the same command to continue it" in err and "Traceback" not in err, err
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing was trained on it
