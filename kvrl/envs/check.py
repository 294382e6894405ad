"""``check_env``: a contract test for user environments (like Gymnasium's ``env_checker``).

Run it once on a new subclass, in a test or before a long run::

    from kvrl.envs import check_env
    check_env(MyEnv())                          # text env
    check_env(MyEnv(), tokenizer=tok)           # ... whose tasks the model behind `tok` can read
    check_env(MyTraceEnv(), action_fn=my_policy)  # trace env: action_fn(obs, rng) -> action

It raises :class:`EnvCheckError` naming the first broken rule and how to fix it. It
consumes the environment's task stream; call ``env.reset(seed=...)`` afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from kvrl.envs.base import Env, Task, TextEnv

JUNK_COMPLETION = "I am not sure. Maybe the answer is banana."
# A text is unreadable when at least this share of its tokens are the tokenizer's unknown (or pad) id.
# A subword tokenizer with byte fallback (every hub reasoner's) yields none; a word-level one (the tiny
# reasoners') turns each word outside its vocabulary into one. Half the words gone leaves a task no model
# can solve, while a rare symbol in a real data set costs a token and should not stop a run.
UNREADABLE_SHARE = 0.5


class EnvCheckError(Exception):
    """The environment breaks the kvrl Env contract; the message says what and how to fix it."""


def check_env(
    env: Env,
    seed: int = 0,
    n: int = 4,
    action_fn: Callable[[Any, np.random.Generator], Any] | None = None,
    tokenizer=None,
) -> None:
    """Validate ``env`` against the contract in :mod:`kvrl.envs.base`.

    Parameters
    ----------
    env : Env
        The instance to check.
    seed : int
        Base seed; ``seed + 1, seed + 2, ...`` are used to test that the seed matters.
    n : int
        How many consecutive observations are compared in the determinism and resume checks.
    action_fn : callable, optional
        Trace envs only: ``action_fn(obs, rng) -> action``; defaults to ``env.sample_action``.
    tokenizer : transformers tokenizer, optional
        Text envs: the model's. The first ``n`` tasks' prompts and answers must be readable by it
        (:func:`unreadable`), as a run checks its tasks before it starts.
    """
    name = type(env).__name__
    if not isinstance(env, Env):
        raise EnvCheckError(f"{name} is not a kvrl.envs.Env: subclass kvrl.envs.TextEnv or TraceEnv")
    if env.kind not in ("text", "trace"):
        raise EnvCheckError(f"{name}.kind is {env.kind!r}; set the class attribute kind = 'text' or 'trace'")
    if env.kind == "text":  # malformed tasks first: they would also fail the checks below
        for i, obs in enumerate(_stream(env, seed, n)):
            where = f"reset(seed={seed})" if i == 0 else "reset()"
            _check_task(obs, where)
            for what, text in (("prompt", obs.prompt), ("answer", obs.answer)) if tokenizer is not None else ():
                why = unreadable(tokenizer, tokenizer(text)["input_ids"], text, what) if text else None
                if why is not None:
                    raise EnvCheckError(f"{where}: task {obs.id!r}: {why}")
    _check_determinism(env, seed, n)
    if env.kind == "text":
        _check_text(env, seed, n)
    else:
        _check_trace(env, seed, action_fn)
    _check_state_dict(env, seed, n)


# ---- shared checks ---------------------------------------------------------------------


def _call(what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call user code; turn its exceptions into an EnvCheckError naming the call."""
    try:
        return fn(*args, **kwargs)
    except EnvCheckError:
        raise
    except Exception as e:
        raise EnvCheckError(f"{what} raised {type(e).__name__}: {e}") from e


def _reset(env: Env, what: str, **kwargs: Any) -> tuple[Any, dict]:
    out = _call(what, env.reset, **kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise EnvCheckError(f"{what} must return (obs, info), got {_short(out)}")
    obs, info = out
    if not isinstance(info, dict):
        raise EnvCheckError(f"{what} returned info of type {type(info).__name__}; return a dict ({{}} is fine)")
    return obs, info


def _stream(env: Env, seed: int, n: int) -> list[Any]:
    """reset(seed=seed), then n - 1 plain resets: the first n observations."""
    obs = [_reset(env, f"reset(seed={seed})", seed=seed)[0]]
    obs += [_reset(env, "reset()")[0] for _ in range(n - 1)]
    return obs


def _check_determinism(env: Env, seed: int, n: int) -> None:
    first = _stream(env, seed, n)
    again = _stream(env, seed, n)
    for i, (a, b) in enumerate(zip(first, again)):
        if not _same(a, b):
            raise EnvCheckError(
                f"reset(seed={seed}) twice gave different observations (episode {i}: "
                f"{_short(a)} vs {_short(b)}). Draw all randomness from self.np_random, call "
                "super().reset(seed=seed) first, and rewind the data cursor when a seed is given"
            )
    # A seed must matter, unless there is only one order the tasks can come in.
    num_tasks = getattr(env, "num_tasks", None)
    if (num_tasks is not None and num_tasks <= 1) or getattr(env, "shuffle", True) is False:
        return
    for s in range(seed + 1, seed + 1 + max(n, 8)):
        if not _same(_stream(env, s, n), first):
            return
    raise EnvCheckError(
        f"reset(seed=s) gives the same observations for seeds {seed}..{seed + max(n, 8)}: the "
        "seed is ignored. Draw tasks with self.np_random (seeded by super().reset(seed=seed)); "
        "if the order is fixed on purpose set shuffle = False, or num_tasks = 1 for a single task"
    )


def _check_state_dict(env: Env, seed: int, n: int) -> None:
    _reset(env, f"reset(seed={seed})", seed=seed)
    state = _call("state_dict()", env.state_dict)
    if not isinstance(state, dict):
        raise EnvCheckError(f"state_dict() returned {type(state).__name__}; return a dict")
    try:
        state = pickle.loads(pickle.dumps(state))  # checkpoints pickle it; also a deep copy
    except Exception as e:
        raise EnvCheckError(f"state_dict() is not picklable ({e}); keep it to plain Python/numpy values") from e
    expected = [_reset(env, "reset()")[0] for _ in range(n)]
    _call("load_state_dict(state)", env.load_state_dict, state)
    got = [_reset(env, "reset() after load_state_dict")[0] for _ in range(n)]
    if not _same(expected, got):
        raise EnvCheckError(
            "after load_state_dict(state_dict()) the next observations differ from the ones the "
            "state was taken before: save the data cursor and self.np_random.bit_generator.state "
            "(call super().state_dict() / super().load_state_dict() in overrides)"
        )


# ---- text environments -----------------------------------------------------------------


def _check_task(task: Any, where: str) -> None:
    if not isinstance(task, Task):
        raise EnvCheckError(f"{where} returned obs of type {type(task).__name__}; text envs yield kvrl.envs.Task")
    for attr in ("id", "prompt"):
        value = getattr(task, attr)
        if not isinstance(value, str) or not value:
            raise EnvCheckError(
                f"{where} returned a Task whose {attr} is {value!r}; {attr} must be a non-empty str "
                + ("(a stable unique name such as f'{source}-{index}')" if attr == "id" else "")
            )
    if task.answer is not None and not isinstance(task.answer, str):
        raise EnvCheckError(f"{where}: Task.answer is a {type(task.answer).__name__}; use a str or None")
    if not isinstance(task.meta, dict):
        raise EnvCheckError(f"{where}: Task.meta is a {type(task.meta).__name__}; use a dict")


def _check_reward(reward: Any, what: str) -> None:
    if not is_finite_float(reward):
        kind = type(reward).__module__ + "." + type(reward).__qualname__
        fix = "convert with float(...)" if type(reward) is not float else "guard the NaN/inf case"
        raise EnvCheckError(f"{what} returned reward {reward!r} ({kind}); it must be a finite Python float: {fix}")


def _check_text(env: TextEnv, seed: int, n: int) -> None:
    rewards = getattr(env, "rewards", None)
    if not rewards:
        raise EnvCheckError("env.rewards is empty: pass rewards=[Reward(fn, weight, name), ...] to TextEnv.__init__")
    names = [getattr(r, "name", None) for r in rewards]
    if len(set(names)) != len(names) or not all(isinstance(x, str) and x for x in names):
        raise EnvCheckError(f"reward names must be unique non-empty strings, got {names}")

    task, _ = _reset(env, f"reset(seed={seed})", seed=seed)
    _check_task(task, f"reset(seed={seed})")
    for completion in (f"The answer is \\boxed{{{task.answer or ''}}}.", JUNK_COMPLETION):
        what = f"step({completion!r})"
        _, reward, terminated, truncated, info = _step(env, completion, what)
        if not terminated:
            raise EnvCheckError(f"{what} returned terminated=False; a text episode is one step: return True")
        missing = [k for k in [*names, "reward"] if k not in info]
        if missing:
            raise EnvCheckError(f"{what} info lacks {missing}: report every reward by name plus 'reward'")
        again, _ = _call(f"score(task, {completion!r})", env.score, task, completion)
        _check_reward(again, f"score(task, {completion!r})")
        if again != reward:
            raise EnvCheckError(f"step() gave reward {reward} but score() gave {again} for the same completion")
        task, _ = _reset(env, "reset()")
        _check_task(task, "reset()")

    batch = _call(f"tasks({n})", env.tasks, n)
    if not (isinstance(batch, list) and len(batch) == n):
        raise EnvCheckError(f"tasks({n}) must return a list of {n} Tasks, got {_short(batch)}")
    for t in batch:
        _check_task(t, f"tasks({n})")


def _step(env: Env, action, what: str) -> tuple:
    """``env.step(action)``, checked to be Gymnasium's 5-tuple with a finite float reward,
    bool flags and an info dict."""
    out = _call(what, env.step, action)
    if not (isinstance(out, tuple) and len(out) == 5):
        raise EnvCheckError(f"{what} must return (obs, reward, terminated, truncated, info), got {_short(out)}")
    _, reward, terminated, truncated, info = out
    _check_reward(reward, what)
    for flag, value in (("terminated", terminated), ("truncated", truncated)):
        if type(value) is not bool:
            raise EnvCheckError(f"{what} returned {flag}={value!r} ({type(value).__name__}); use a Python bool")
    if not isinstance(info, dict):
        raise EnvCheckError(f"{what} returned info of type {type(info).__name__}; return a dict")
    return out


# ---- trace environments ----------------------------------------------------------------


def _check_trace(env: Env, seed: int, action_fn: Callable | None) -> None:
    max_steps = getattr(env, "max_steps", None)
    if not isinstance(max_steps, int) or max_steps <= 0:
        raise EnvCheckError(f"max_steps is {max_steps!r}; set it to an upper bound on steps per episode")
    if action_fn is None:
        action_fn = getattr(env, "sample_action", None)
        if action_fn is None:
            raise EnvCheckError(
                "pass check_env(env, action_fn=fn) with fn(obs, rng) -> action, or define env.sample_action(obs, rng)"
            )
    first = _episode(env, seed, action_fn, max_steps)
    if first != _episode(env, seed, action_fn, max_steps):
        raise EnvCheckError(
            f"two episodes with reset(seed={seed}) and the same actions gave different rewards: "
            "step() must be deterministic given the actions (use self.np_random for any sampling)"
        )


def _episode(env: Env, seed: int, action_fn: Callable, max_steps: int) -> list[float]:
    obs, _ = _reset(env, f"reset(seed={seed})", seed=seed)
    rng = np.random.default_rng(seed)
    rewards = []
    for t in range(max_steps):
        action = _call(f"action_fn(obs, rng) at step {t}", action_fn, obs, rng)
        obs, reward, terminated, truncated, info = _step(env, action, f"step(action) at step {t}")
        rewards.append(reward)
        if terminated or truncated:
            return rewards
    raise EnvCheckError(
        f"the episode did not end within max_steps={max_steps}: return terminated=True on the last "
        "decision, or raise max_steps"
    )


# ---- helpers ---------------------------------------------------------------------------


def unreadable(tokenizer, ids: list[int], text: str, what: str) -> str | None:
    """Why ``text`` (the task's ``what``: prompt or answer), tokenised by ``tokenizer`` as ``ids``,
    is unreadable: at least :data:`UNREADABLE_SHARE` of its tokens (special ones aside) are the
    unknown or pad id. None when it is readable."""
    lost = {tokenizer.unk_token_id, tokenizer.pad_token_id} - {None}
    special = set(tokenizer.all_special_ids) - lost
    words = [i for i in ids if i not in special]
    n = sum(i in lost for i in words)
    if not words or n < UNREADABLE_SHARE * len(words):
        return None
    shown = " ".join(tokenizer.convert_ids_to_tokens(ids[:16])) + (" ..." if len(ids) > 16 else "")
    names = "/".join(sorted({tokenizer.convert_ids_to_tokens(i) for i in lost}))
    return (
        f"{n} of the {len(words)} tokens of its {what} {_short(text, 60)} are {names}, which the model's "
        f"tokenizer puts for what it does not know (it reads: {shown}); the model cannot read this task: write "
        "it in words the tokenizer knows (a word-level one, as the tiny reasoners', knows only its vocabulary), "
        "or use a model whose tokenizer reads it"
    )


def is_finite_float(x: Any) -> bool:
    """True for a finite Python ``float`` (not ``bool``, numpy or torch scalars)."""
    return type(x) is float and math.isfinite(x)


def _same(a: Any, b: Any) -> bool:
    """Structural equality for observations: dataclasses, containers, numpy and torch arrays."""
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if type(a).__module__ == "torch" and hasattr(a, "detach"):  # a tensor, without importing torch
        return a.shape == b.shape and bool((a.detach().cpu() == b.detach().cpu()).all())
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    try:
        return bool(a == b)
    except Exception:
        return False


def _short(x: Any, limit: int = 120) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."
