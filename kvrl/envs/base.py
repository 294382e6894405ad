"""Environment API: tasks, weighted rewards, and Gymnasium-shaped, seeded environments.

Contract
--------
An environment yields *what to roll out* and turns a finished episode into a reward plus an
``info`` dict of metrics. The framework, not the environment, owns tokenization, logprobs
and attention masks.

* ``reset(*, seed=None, options=None) -> (obs, info)`` and
  ``step(action) -> (obs, reward, terminated, truncated, info)``, as in Gymnasium.
  ``reward`` is a finite Python ``float``; ``terminated`` / ``truncated`` are ``bool``.
* All randomness comes from ``self.np_random`` (a ``numpy.random.Generator``).
  ``reset(seed=s)`` reseeds it and rewinds the task stream, so two resets with the same
  seed give the same observation.
* ``state_dict()`` / ``load_state_dict()`` capture the data cursor and the RNG state, so a
  resumed run sees exactly the tasks it would have seen.

Two kinds:

* :class:`TextEnv` (``kind="text"``, RLKV and G-KV): one step per episode. The observation
  is a :class:`Task`; the action is the generated completion (a ``str``).
* :class:`TraceEnv` (``kind="trace"``, ForesightKV): many steps over a fixed token trace;
  the reward arrives at the end.

``kvrl.envs.check.check_env`` validates a subclass against this contract.
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvrl.envs.chat import after_thinking
from kvrl.envs.verify import extract_boxed


@dataclass(frozen=True)
class Task:
    """One problem to roll out.

    Attributes
    ----------
    id : str
        Stable, unique identifier (used for logging, grouping and resume checks).
    prompt : str
        Text given to the model (already formatted; chat templates are the framework's job).
    answer : str | None
        Reference answer for verifiable rewards; ``None`` when there is none.
    meta : dict
        Anything else a reward function needs (source, difficulty, ...).
    """

    id: str
    prompt: str
    answer: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a lone surrogate (JSON's "\ud800", bytes decoded with surrogateescape) is no text: a tokenizer
        # refuses it with a bare TypeError, deep in a rollout, naming neither the task nor the character
        for name in ("prompt", "answer"):
            text = getattr(self, name)
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"task {self.id!r}: its {name} is not valid UTF-8: a lone surrogate {text[e.start]!r} at "
                    f"character {e.start + 1} (half a UTF-16 pair, which no tokenizer encodes); build the {name} "
                    "from decoded text (a file read with encoding='utf-8', a JSON escape of a whole pair)"
                ) from None


class RewardError(ValueError):
    """A reward that is no finite number (:meth:`TextEnv.score`): the environment's code to fix, named
    with the environment, the reward function and the task."""


@dataclass
class Reward:
    """A named reward function with a weight.

    ``fn(task, completion)`` returns a finite number, or ``(number, extra_info)`` to report
    diagnostics (``extra_info`` is merged into the step's ``info``); anything else (NaN,
    inf, a string, a tensor) is a :class:`RewardError` naming the environment, the function and the task.
    The episode reward is ``Σ weight · fn`` (a weight, and the sum, must be finite: a NaN
    weight is refused here, a sum that overflows by :meth:`TextEnv.score`); ``weight == 0``
    makes the function a metric only: it is reported in ``info[name]`` but never added to the reward.
    """

    fn: Callable[[Task, str], Any]
    weight: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            self.name = getattr(self.fn, "__name__", "") or "reward"
        # a NaN weight makes every reward NaN (and `weight != 0` holds for NaN, so a metric could not be told apart)
        if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real) or not math.isfinite(self.weight):
            raise ValueError(
                f"reward {self.name!r}: weight {self.weight!r} ({type(self.weight).__name__}) must be a "
                "finite number; set it to 1.0, or 0.0 for a metric that is reported but not rewarded"
            )


def correct(task: Task, completion: str) -> float:
    """Exact-answer reward of procedural tasks: 1.0 when the completion's last
    ``\\boxed{}`` holds ``task.answer`` (math answers go through math-verify instead)."""
    boxed = extract_boxed(completion)
    return float(boxed is not None and boxed.strip() == task.answer)


def exact_cot(task: Task, completion: str) -> float:
    """1.0 when the completion is the reference one in ``task.meta["completion"]`` (a metric)."""
    return float(completion.strip() == task.meta["completion"])


class Env(abc.ABC):
    """Base class: seeding, RNG state and the Gymnasium call signatures.

    Subclasses set ``kind`` and implement ``reset`` / ``step``; ``reset`` calls
    ``super().reset(seed=seed)`` first, which reseeds ``np_random`` as in Gymnasium.
    :func:`kvrl.envs.make` sets ``id`` to the registered id or the dotted path.
    """

    id: str | None = None
    kind: str = ""
    # inclusive ranges of the constructor's numeric arguments, which the config gate checks before the
    # environment is built (kvrl.preflight.names.argument_problems); a size's bound keeps a task within memory
    arg_bounds: dict[str, tuple[float, float]] = {}

    _np_random: np.random.Generator | None = None

    @property
    def np_random(self) -> np.random.Generator:
        """The environment's generator; seeded from OS entropy until ``reset(seed=...)``."""
        if self._np_random is None:
            self._np_random = np.random.default_rng()
        return self._np_random

    @np_random.setter
    def np_random(self, rng: np.random.Generator) -> None:
        self._np_random = rng

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        """Start an episode. The base implementation only reseeds ``np_random``."""
        if seed is not None:
            self._np_random = np.random.default_rng(seed)
        return None, {}

    @abc.abstractmethod
    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Advance the episode: ``(obs, reward, terminated, truncated, info)``."""

    def state_dict(self) -> dict:
        """Everything needed to continue the task stream exactly (here: the RNG state)."""
        return {"rng": self.np_random.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        self._np_random = rng

    def close(self) -> None:  # noqa: B027 - optional: most environments hold nothing to release
        """Release resources (files, worker processes). Idempotent."""


class TextEnv(Env):
    """Single-step text episodes: ``reset`` yields a :class:`Task`, ``step(completion)`` scores it.

    Tasks come either from a dataset (pass ``data=[Task, ...]``, or a sequence that reads each
    task when indexed and carries their digest as ``tasks_sha256``, as
    :class:`kvrl.envs.math.FileTasks` does; shuffled per epoch with ``np_random`` unless
    ``shuffle=False``) or procedurally (leave ``data=None`` and override :meth:`sample_task`).
    Both go through one cursor, shared by :meth:`reset` and :meth:`tasks`, which is what
    :meth:`state_dict` saves.

    ``step`` returns ``(None, reward, True, False, info)`` with ``info[name]`` for every
    reward function and ``info["reward"]``. Batch callers (the RL controller scores many
    completions per task) call :meth:`score` directly; it is stateless and thread-safe as
    long as the reward functions are.
    """

    kind = "text"

    def __init__(
        self,
        data: Sequence[Task] | None = None,
        rewards: Sequence[Reward] | None = None,
        *,
        shuffle: bool = True,
    ) -> None:
        # a sequence that reads its rows when drawn and knows their digest (kvrl.envs.math.FileTasks) stays
        # as it is: a list of a large file's tasks is what makes a driver hold gigabytes
        self.data = None if data is None else data if hasattr(data, "tasks_sha256") else list(data)
        self.rewards = list(rewards or [])
        self.shuffle = shuffle
        self._order: list[int] | None = None  # dataset permutation for the current epoch
        self._pos = 0  # position in _order
        self._epoch = 0
        self._task: Task | None = None  # the task awaiting step()

    # ---- task stream -------------------------------------------------------------------

    def sample_task(self, rng: np.random.Generator) -> Task:
        """Draw one task (procedural environments override this; use only ``rng``)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no dataset: pass data=[Task, ...] to "
            "TextEnv.__init__ or override sample_task(rng)"
        )

    @property
    def num_tasks(self) -> int | None:
        """Dataset size, or ``None`` for a procedural (unbounded) environment."""
        return None if self.data is None else len(self.data)

    def _next_task(self) -> Task:
        if self.data is None:
            return self.sample_task(self.np_random)
        if not self.data:
            raise ValueError(f"{type(self).__name__} has an empty dataset")
        if self._order is None or self._pos >= len(self._order):
            if self._order is not None:
                self._epoch += 1
            n = len(self.data)
            self._order = (self.np_random.permutation(n) if self.shuffle else np.arange(n)).tolist()
            self._pos = 0
        task = self.data[self._order[self._pos]]
        self._pos += 1
        return task

    def _data_sha256(self) -> str | None:
        """Digest of the data set's tasks (ids, prompts, answers, in order); None if procedural."""
        if self.data is None:
            return None
        if hasattr(self.data, "tasks_sha256"):  # computed in the one pass that indexed the file
            return self.data.tasks_sha256
        h = hashlib.sha256()
        for t in self.data:
            h.update(json.dumps([t.id, t.prompt, t.answer]).encode())
        return h.hexdigest()

    def tasks(self, n: int) -> list[Task]:
        """The next ``n`` tasks from the cursor (advances it, like ``n`` resets)."""
        return [self._next_task() for _ in range(n)]

    # ---- Gymnasium API -----------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Task, dict]:
        """Next task. With ``seed``, reseed and rewind to the start of a fresh epoch first."""
        super().reset(seed=seed)
        if seed is not None:
            self._order, self._pos, self._epoch = None, 0, 0
        self._task = self._next_task()
        return self._task, {}

    def step(self, action: str) -> tuple[None, float, bool, bool, dict]:
        """Score the completion ``action`` for the task from the last ``reset``."""
        if self._task is None:
            raise RuntimeError("call reset() before step(): each episode is one task")
        task, self._task = self._task, None
        reward, info = self.score(task, action)
        return None, reward, True, False, info

    def score(self, task: Task, completion: str) -> tuple[float, dict]:
        """``(Σ weight·fn(task, completion), info)``; info has every reward's value by name.
        The rewards see the answer part of the completion: after its thinking block
        (:func:`kvrl.envs.chat.after_thinking`)."""
        completion = after_thinking(completion)
        info: dict[str, Any] = {}
        total = 0.0
        for r in self.rewards:
            out = r.fn(task, completion)
            if isinstance(out, tuple):
                out, extra = out
                info.update(extra)
            # a NaN or inf would be trained on and checkpointed; "0.5" would pass float() silently
            if not isinstance(out, numbers.Real) or not math.isfinite(out):
                raise RewardError(
                    f"environment {self.id or type(self).__qualname__}: reward function {r.name!r} "
                    f"returned {out!r} ({type(out).__name__}) for task {task.id!r}; a reward must be a "
                    f"finite number (int or float): fix {r.name}, e.g. return 0.0 where it has no value"
                )
            value = float(out)
            info[r.name] = value
            if r.weight != 0:
                total += r.weight * value
        if not math.isfinite(total):  # finite terms whose sum overflows (1e308 + 1e308) would be trained on as inf
            terms = ", ".join(f"{r.weight:g} x {r.name} {info[r.name]:g}" for r in self.rewards if r.weight != 0)
            raise RewardError(
                f"environment {self.id or type(self).__qualname__}: the rewards of task {task.id!r} sum "
                f"to {total} ({terms}); a reward must be a finite number: scale the reward functions "
                "(or their weights) to a range whose sum a float holds"
            )
        info["reward"] = total
        return total, info

    def segments(self, task: Task, completion: str, pieces: list[str]) -> tuple[list[int], list[float]] | None:
        """Per-segment credit (``rl.credit=segment``): ``pieces`` are the completion's tokens, one string each
        (decoded one at a time); return each piece's segment index (−1: none) and each segment's reward,
        the same number of segments for every completion of a task. None (the default): the environment
        has no segments, only the completion's reward."""
        return None

    # ---- resume ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "order": None if self._order is None else list(self._order),
            "pos": self._pos,
            "epoch": self._epoch,
            "data_sha256": self._data_sha256(),
        }

    def load_state_dict(self, state: dict) -> None:
        # The cursor indexes the data set it was saved with: a data file edited or shrunk between
        # a run and its resume would be resumed silently, or fail with a bare IndexError.
        saved, now = state.get("data_sha256"), self._data_sha256()
        if saved is not None and saved != now:
            size = "no" if self.data is None else len(self.data)
            raise ValueError(
                f"{type(self).__name__}: the data set differs from the one this state was saved with "
                f"(sha256 {saved[:12]}... then, {now[:12] if now else None}... now; {size} tasks now): "
                "restore the data file the run started with, or start a new run (output_dir=... or "
                "resume=never) to train on the new one"
            )
        super().load_state_dict(state)
        self._order = None if state["order"] is None else list(state["order"])
        self._pos = state["pos"]
        self._epoch = state["epoch"]
        self._task = None


class TraceEnv(Env):
    """Multi-step episodes over a fixed token trace (ForesightKV's eviction MDP).

    In ForesightKV an episode is one teacher-forced pass over a stored reasoning trace:

    * **obs** (from ``reset`` and each ``step``): the cache state at an eviction step:
      which positions are cached per (layer, KV head), their scorer features, the step
      index and the budget.
    * **action**: the indices to keep at that step (e.g. ``[layers, kv_heads, budget]``
      positions sampled Top-K from the scorer's distribution).
    * **reward**: ``0.0`` on every step but the last; the last step returns the episode
      reward (``−Σ Δloss²`` over the tokens that the evictions hurt) with
      ``terminated=True``.

    Subclasses implement ``reset`` / ``step``, set ``max_steps`` (an upper bound on steps
    per episode) and, for :func:`kvrl.envs.check_env`, may provide
    ``sample_action(obs, rng)`` returning a valid random action.
    """

    kind = "trace"
    max_steps: int = 0

    @abc.abstractmethod
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        """First observation of an episode; call ``super().reset(seed=seed)`` to reseed."""
        return super().reset(seed=seed, options=options)

    @abc.abstractmethod
    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Apply one eviction decision; the last step carries the episode reward."""
