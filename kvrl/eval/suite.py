"""The evaluation suite's parts: which cache each row runs, what each sample is, what a row reports.

Contract:

* :class:`PolicySpec` names one line of the comparison (``eval.policies`` /
  ``eval.settings``) and builds its cache regime at a budget: ``full``, any zoo member, a
  :class:`~kvrl.policies.KVPolicy` of the user's own (``policy: pkg.module:Class``),
  ``window`` (sink + recent on every head), ``learned`` (a ForesightKV scorer loaded from
  a run directory), ``heads`` (RLKV's head reallocation from an RLKV run's gates, at
  its ``sparsities`` instead of budgets). A token-policy line runs in G-KV's ratio mode
  (:meth:`kvrl.policies.KVPolicy.budget_at`, the budget then being the floor) with its own
  ``budget_ratio``, else ``kv.budget_ratio``, and with its own ``interval``, ``window`` and
  ``sink`` where it sets them, else ``kv``'s: each paper's line can run at its own settings
  (R-KV observes 8 queries, G-KV 16, StreamingLLM keeps 4 sinks).
* :func:`error_mode` classifies a sample by deterministic rules (the README lists them):
  ``correct`` (reward > 0), ``repetition`` (its last :data:`LOOP_WINDOW` words are one
  short span repeated: at most :data:`LOOP_DISTINCT` distinct n-grams, RLKV's "repetition
  loops"), ``no_answer`` (no final answer after the thinking block, or none at all),
  ``wrong`` (an answer that is not the gold one). Repetition is not applicable where
  outputs cannot reach the rule's window (:func:`loops_apply`): its share is then None, not 0.
* :func:`summarise` turns a row's samples into its metrics: accuracy (the mean reward over
  every sample = pass@1) with its standard error over tasks, pass@k (the unbiased
  estimator of Chen et al. 2021) for k <= samples per task, mean generated length, the
  share cut at the length limit, error-mode shares, KV retention and peak KV tokens per
  sequence, decode tokens/s, and the mean of each of the environment's own metrics
  (``info/NAME``: its weight-0 rewards).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvrl.envs.chat import after_thinking
from kvrl.envs.verify import extract_boxed
from kvrl.policies import POLICIES, Full, Static, Window, make_policy, policy_class
from kvrl.policies.heads import GATES_FILE, head_allocation
from kvrl.runlog import SUMS, damage, scorer_file

KINDS = ("full", "window", "heads", *POLICIES)
MODES = ("correct", "wrong", "no_answer", "repetition")
LOOP_WINDOW, LOOP_N, LOOP_DISTINCT = 120, 4, 12


@dataclass
class PolicySpec:
    """One policy line: ``name`` (its label), ``kind`` (a :data:`KINDS` entry, or a dotted path
    ``pkg.module:Class`` to a KVPolicy) and its own keyword arguments (a token policy's, e.g.
    ``alpha``; ``run`` for learned / heads;
    ``sparsities`` for heads)."""

    name: str
    kind: str
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, settings: dict) -> PolicySpec:
        own = dict(settings.get(name, {}))
        kind = own.pop("policy", name)
        if ":" in str(kind):  # a KVPolicy of the user's own, by path: imported and type-checked here
            try:
                policy_class(kind)
            except (ImportError, AttributeError, SyntaxError, ValueError) as err:
                raise ValueError(
                    f"eval.settings.{name}.policy={kind!r} cannot be used ({' '.join(str(err).split())}); "
                    "set it to an importable pkg.module:Class of your own KVPolicy"
                ) from err
        elif kind not in KINDS:
            raise ValueError(
                f"eval policy {name!r} is {kind!r}, which is none of {', '.join(KINDS)}; set "
                f"eval.settings.{name}.policy to one of them or to a pkg.module:Class of your own"
            )
        return cls(name, kind, own)

    @property
    def budgeted(self) -> bool:
        return self.kind not in ("full", "heads")

    def points(self, budgets: list[int]) -> list:
        """The x values of this line: token budgets, RLKV sparsities, or one point (full)."""
        if self.kind == "full":
            return [None]
        if self.kind == "heads":
            return list(self.kwargs.get("sparsities", [0.5]))
        return budgets

    def budget_ratio(self, kv: dict) -> float | None:
        """The ratio mode of this line: its own ``budget_ratio``, else ``kv``'s; None for
        the lines without a token budget (full, heads)."""
        if self.kind in ("full", "heads"):
            if "budget_ratio" in self.kwargs:
                raise ValueError(
                    f"eval policy {self.name!r} ({self.kind}) has no token budget to scale; drop "
                    f"eval.settings.{self.name}.budget_ratio"
                )
            return None
        return self.kwargs.get("budget_ratio", kv["budget_ratio"])

    def regime(self, config, point, kv: dict):
        """The cache regime at ``point`` (a budget in tokens, or a sparsity for heads).
        ``kv``: interval, window, sink, budget_ratio; a token policy's own arguments
        override them."""
        kw = {k: v for k, v in self.kwargs.items() if k not in ("run", "sparsities", "budget_ratio")}
        if self.kind == "full":
            return Full()
        if self.kind == "window":
            if self.budget_ratio(kv) is not None:
                raise ValueError(
                    f"eval policy {self.name!r} is a fixed sink + recent window, which has no ratio mode; "
                    "drop its budget_ratio (and kv.budget_ratio)"
                )
            return Static(Window.of(config, kv["sink"], point - kv["sink"]))
        if self.kind == "heads":
            return head_allocation(self._run(), point, config, **kw)
        kv = {**kv, "budget_ratio": self.budget_ratio(kv)}
        policy = make_policy(self.kind, config if self.kind == "learned" else None, budget=point, **{**kv, **kw})
        if self.kind == "learned":
            policy.load_scorer(self._scorer())
        return policy

    def artefact(self) -> Path | None:
        """The file a line's samples depend on beyond its settings: a learned or heads line's scorer or
        gates, a policy of the user's own its source file (edited, it is another policy); None for
        the zoo's lines."""
        if ":" in self.kind:
            return Path(inspect.getsourcefile(policy_class(self.kind)))
        if self.kind == "learned":
            return self._scorer()
        if self.kind == "heads":
            run = self._run()
            return run / GATES_FILE if run.is_dir() else run
        return None

    def _run(self) -> Path:
        if "run" not in self.kwargs:
            raise ValueError(
                f"eval policy {self.name!r} ({self.kind}) needs the run that trained it: set "
                f"eval.settings.{self.name}.run=<output_dir of that run>"
            )
        return Path(self.kwargs["run"])

    def _scorer(self) -> Path:
        run = self._run()
        path = scorer_file(run)
        if path is None:
            raise FileNotFoundError(
                f"no ForesightKV scorer in {run} (rl/scorer.safetensors or sft/scorer.safetensors): "
                f"run `python -m kvrl.run recipe=tiny_foresight output_dir={run}` or point "
                f"eval.settings.{self.name}.run at a scorer.safetensors"
            )
        # a folder sealed by a SHA256SUMS (the shipped tiny_artefacts) vouches for its files
        why = damage(path.parent, only=path.name) if (path.parent / SUMS).is_file() else None
        if why is not None:
            raise ValueError(
                f"the ForesightKV scorer {path} is damaged: {why}; restore the file (shipped with "
                f"kvrl: reinstall kvrl, or `git checkout -- {path}` in a clone) or regenerate it "
                "with the run that wrote it (python -m kvrl.run recipe=tiny_foresight writes "
                "rl/scorer.safetensors)"
            )
        return path


def repeats(text: str) -> bool:
    """Whether the text ends in a loop: its last LOOP_WINDOW words hold at most
    LOOP_DISTINCT distinct LOOP_N-grams (a healthy text has almost as many as words)."""
    words = text.split()[-LOOP_WINDOW:]
    if len(words) < LOOP_WINDOW:
        return False
    grams = {tuple(words[i : i + LOOP_N]) for i in range(len(words) - LOOP_N + 1)}
    return len(grams) <= LOOP_DISTINCT


def loops_apply(max_new_tokens: int) -> bool:
    """Whether outputs of up to ``max_new_tokens`` tokens can hold the LOOP_WINDOW words the
    repetition rule reads (a word is at least one token)."""
    return max_new_tokens >= LOOP_WINDOW


def error_mode(text: str, reward: float) -> str:
    """``correct`` | ``repetition`` | ``no_answer`` | ``wrong`` (module docstring)."""
    if reward > 0:
        return "correct"
    if repeats(text):
        return "repetition"
    return "no_answer" if extract_boxed(after_thinking(text)) is None else "wrong"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with c correct among n samples: 1 − C(n−c, k)/C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def kv_usage(trace, prompt_len: int) -> tuple[float, float]:
    """(retention, peak tokens) of one sequence's trace: the mean over decoding steps, layers
    and KV heads of the share of the sequence so far still cached, and the largest number
    of cached tokens at any step (mean over layers and heads)."""
    T = int(trace.lengths[0])
    death = trace.full()[:, 0, :, :T].long().clamp(max=T)  # [L, H, T]; NEVER -> T
    if T <= prompt_len:
        return 1.0, float(T)
    # keys 0..q are seen at step q; those with death <= q are gone: alive(q) = q + 1 − dead by q
    dead = torch.zeros(*death.shape[:2], T + 1).scatter_add_(-1, death, torch.ones(death.shape)).cumsum(-1)
    q = torch.arange(prompt_len, T)
    alive = (q + 1).float() - dead[..., q]  # [L, H, steps]
    return float((alive / (q + 1)).mean()), float(alive.mean((0, 1)).max())


def summarise(samples: list[dict], ks: list[int]) -> dict:
    """A row's metrics from its samples (dicts with task, reward, tokens, finish, mode,
    retention, peak_kv, seconds)."""
    by_task: dict[str, list[dict]] = {}
    for s in samples:
        by_task.setdefault(s["task"], []).append(s)
    per_task = np.array([np.mean([s["reward"] > 0 for s in group]) for group in by_task.values()])
    n = min(len(g) for g in by_task.values())
    row = {
        "accuracy": float(per_task.mean()),
        "accuracy_se": float(per_task.std(ddof=1) / math.sqrt(len(per_task))) if len(per_task) > 1 else 0.0,
        "tasks": len(by_task),
        "samples": len(samples),
        **{
            f"pass@{k}": float(
                np.mean([pass_at_k(len(g), sum(s["reward"] > 0 for s in g), k) for g in by_task.values()])
            )
            for k in ks
            if k <= n
        },
        "gen_tokens": float(np.mean([s["tokens"] for s in samples])),
        "truncated": float(np.mean([s["finish"] == "length" for s in samples])),
        **{f"mode/{m}": float(np.mean([s["mode"] == m for s in samples])) for m in MODES},
        "kv_retention": float(np.mean([s["retention"] for s in samples])),
        "peak_kv_tokens": float(np.mean([s["peak_kv"] for s in samples])),
    }
    # the environment's own metrics (its weight-0 rewards, e.g. multihop's per-query accuracy)
    metrics = [k for k, v in samples[0]["info"].items() if k not in ("reward", "correct") and isinstance(v, float)]
    row.update({f"info/{k}": float(np.mean([s["info"][k] for s in samples])) for k in metrics})
    seconds = sum(s["seconds"] for s in samples)
    row["decode_tokens_per_s"] = sum(s["tokens"] for s in samples) / seconds if seconds > 0 else 0.0
    return row


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion p over n tasks."""
    if n == 0:
        return 0.0, 1.0
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)
