"""The RL loop: a single controller on Ray driving rollout workers and learners.

Jobs build one (``kvrl/jobs/rl.py``: ``python -m kvrl.run recipe=tiny_rl_full``), call
:meth:`Controller.run` and :meth:`Controller.close`; subclasses change what a run leaves
behind (:meth:`Controller.finish`). Its Ray plumbing (:func:`connect`, :func:`reserve`,
:func:`get`, :func:`raise_if_start_failed`) also serves ForesightKV's trace actors
(:mod:`kvrl.workers.traces`).

One step, top to bottom (:meth:`Controller.run`):

1. tasks       the controller owns the environment and its cursor: batch_size / G tasks
2. rollouts    G samples per task, split into one shard per RolloutWorker; every sample
               is stamped with the policy version of the weights that generated it
3. rewards     ``env.score(task, completion)``, scored on the rollout workers with the
               samples (``Algorithm.generate``): in parallel, within workers.timeout_s
4. advantages  normalised within each task's group (per segment under rl.credit=segment); truncated samples zeroed (grpo.py)
5. update      the samples split across the learners, which recompute logprobs (the
               train/inference mismatch is measured before the update) and step
6. push        the trainable state through the object store to every worker, which
               checks it against the learner's checksum
7. log         one JSONL line per step (kvrl.runlog), a progress bar, optional TensorBoard;
               checkpoints every rl.checkpoint_every steps and at the end

On-policy by default. ``rl.async_steps=1`` starts step t+1's generation (with the weights
of version t) before training on step t, as slime's train_async does: samples are then
at most one version stale, which is asserted. A rollout worker that dies is restarted by
Ray (``workers.max_restarts``), given the current weights, and its whole shard is redone
with the same seed; a shard's samples replace, never add to, the step's, and the
learners' sample ids are checked against the step's, so each sample counts exactly once.

Resume (``resume=auto``) reloads trainables, optimizer, environment cursor and RNG, and
the step; seeds are derived from (seed, step, shard), so an on-policy run resumed at
step k repeats the uninterrupted run exactly. With ``rl.async_steps=1`` the first step
after a resume regenerates its samples with the resumed weights (staleness 0).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from tqdm import tqdm

from kvrl.algos import make_algo
from kvrl.algos.base import Sample
from kvrl.algos.grpo import group_advantages, mask_truncated, segment_advantages
from kvrl.budget import budget_evicts
from kvrl.engines.base import check_prompts
from kvrl.envs.base import RewardError
from kvrl.envs.chat import Chat
from kvrl.models.tiny import resolve_path
from kvrl.runlog import (
    OutputLock,
    RunLog,
    damage,
    flatten,
    intact_checkpoint,
    mark_latest,
    plot_rewards,
    resume_changes,
    save_torch,
    seal,
    write_json,
)
from kvrl.section import SECTIONS, ConfigError
from kvrl.workers.inline import INLINE, Done, spawn
from kvrl.workers.learner import Learner
from kvrl.workers.rollout import RolloutWorker

PROBE = 256  # tasks drawn from a procedural environment to estimate its longest prompt
# Steps in a row in which every group's rewards are all equal (zero_std_groups 1.0) before the run warns
# that it learns nothing: group-normalised advantages are then all 0. Five, because a model with any
# signal rarely gets there by chance: a task solved 5 % of the time fails all 8 samples of a group with
# p = 0.66, all 4 groups of a tiny step with p = 0.19, five such steps in a row with p = 2.5e-4.
ZERO_SPREAD_STEPS = 5
TIMINGS = ("rollout_s", "learn_s", "step_s", "gen_tokens_per_s")  # metrics that vary between identical runs


@dataclass
class Pending:
    """One step's generation, in flight on the rollout workers."""

    step: int
    env_state: dict  # the environment before these tasks were drawn: what a checkpoint saves
    args: dict[int, tuple]  # worker -> its generate() arguments (to redo the shard)
    refs: dict[int, ray.ObjectRef]
    start: float
    weights: tuple  # the push the shards were sent to generate with (async: a version behind the learners')
    lives: list[int]  # each worker's incarnation when the shards were sent
    send_s: float  # the time sending the shards took: inline, the whole rollout (each call runs when made)


def connect(cfg) -> bool:
    """Join or start Ray; True when this process started it (and so shuts it down).

    Ray's workers run at ``workers.niceness`` (default 0) above the process that started Ray, not at
    Ray's default of +15, at which actors beside other work get a sliver of the CPU while Ray's own
    daemons (at nice 0) spend it polling them. A private local Ray has no dashboard (its web UI and job server); for those,
    start a head with ``ray start --head`` (launch/ray_submit.sh does) and set workers.address.
    ``workers.address=inline`` starts none: the actors are objects in this process (:mod:`kvrl.workers.inline`)."""
    if cfg.workers.address == INLINE:
        return False
    if ray.is_initialized():  # a test or a notebook brought its own
        return False
    address = cfg.workers.address or os.environ.get("RAY_ADDRESS", "")
    nice = cfg.workers.niceness
    quiet = not cfg.logging.verbose  # the actors' output (vLLM, DeepSpeed) stays in the session's log files
    if quiet:  # "token authentication is enabled" at every start: kvrl's private Ray keeps Ray's default on purpose
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    output = {"log_to_driver": not quiet, "logging_level": logging.WARNING if quiet else logging.INFO}
    if address:  # under `ray job submit` RAY_ADDRESS names the job's cluster
        # the cluster's system config is its head's; each worker also reads RAY_worker_niceness from its own
        # environment (Ray's job server sets it so for its supervisor), and env_vars merge key by key with the job's
        ray.init(address=address, runtime_env={"env_vars": {"RAY_worker_niceness": str(nice)}}, **output)
    else:  # "local", never a stale cluster that a file in the temp dir points at
        # the system config, not a runtime_env, so that the workers Ray prestarts are the ones the actors get
        ray.init(
            address="local",
            num_cpus=cfg.workers.num_cpus or None,
            include_dashboard=False,
            _system_config={"worker_niceness": nice},
            **output,
        )
    if quiet:
        tqdm.write(
            f"kvrl: the actors' logs (vLLM, DeepSpeed, Ray) are in {actor_logs()}; logging.verbose=true "
            "prints them here"
        )
    return True


def actor_logs() -> str:
    """This driver's Ray session's log folder (not /tmp/ray/session_latest, which may be another Ray's)."""
    node = ray._private.worker._global_node  # None in a process that did not start or join Ray itself
    return str(Path(node.get_session_dir_path()) / "logs") if node is not None else "the Ray session's logs folder"


def reserve(cfg, rollout: int, learners: int) -> None:
    """Fail now unless the Ray cluster has the CPUs and GPUs of ``rollout`` rollout and
    ``learners`` learner actors (Ray would otherwise leave them pending forever). Inline actors
    reserve nothing."""
    w = cfg.workers
    if w.address == INLINE:
        return
    for kind, need in (
        ("CPU", rollout * w.rollout_cpus + learners * w.learner_cpus),
        ("GPU", rollout * w.rollout_gpus + learners * w.learner_gpus),
    ):
        have = ray.cluster_resources().get(kind, 0)
        if need > have:
            raise ValueError(
                f"the actors ask for {need:g} {kind}s, the Ray cluster has {have:g}: lower "
                f"workers.rollout_{kind.lower()}s / workers.learner_{kind.lower()}s (fractions "
                "share a device) or workers.rollout / workers.learners"
            )


def get(refs, what: str, timeout_s: float):
    """ray.get with workers.timeout_s: a stuck actor fails the run with its name. An inline actor's
    results are already there."""
    if isinstance(refs, Done):
        return refs.value
    if isinstance(refs, list) and refs and isinstance(refs[0], Done):
        return [r.value for r in refs]
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(
            f"{what} took longer than workers.timeout_s={timeout_s:g}s; raise it if the work is "
            f"slow, else see the actors' logs ({actor_logs()})"
        ) from None


def raise_if_start_failed(err: RayActorError, name: str) -> None:
    """An actor whose engine or environment cannot start fails the run with its own error: a
    restart would fail the same way, and Ray would report it as restarts."""
    if err.actor_init_failed:
        raise RuntimeError(f"{name} failed to start: {err}") from None


class Controller:
    def __init__(self, cfg, on_dispatch=None):
        """on_dispatch(controller, step): called right after a step's shards are sent (tests
        kill a worker there)."""
        self.cfg, self.on_dispatch = cfg, on_dispatch
        self.algo = make_algo(cfg)  # a bad algorithm setting fails here, before any actor starts
        try:  # the task stream; the rollout workers score with their own copies
            self.env = self.algo.make_env()
        except ValueError as err:  # a data file's bad row, sizes that do not fit together: the user's input
            raise ConfigError(f"env.id={cfg.env.id}: {err}") from None
        self.env.reset(seed=cfg.seed)
        self.check_prompts_fit()
        self.out = Path(cfg.output_dir)
        self.lock = OutputLock(self.out)  # before Ray starts: a second run on this directory stops here
        w = cfg.workers
        self.inline, self.own_ray = w.address == INLINE, False
        self.workers, self.learners = [], []
        self.step = 0  # updates done
        self.flat_in_row = 0  # steps in a row whose every group had one reward (warn_if_learning_nothing)
        self.version = 0  # policy version of the learners' weights (= updates applied)
        self.samples_total = 0
        self.skipped_in_row = 0  # updates skipped for a non-finite loss or gradient norm, up to this step
        self.restarts = [0] * w.rollout
        self.lives = [0] * w.rollout  # incarnation of each rollout actor: a death is counted once
        self.runlog: RunLog | None = None  # opened by resume(): fresh, or appending to the resumed run's
        try:
            self.own_ray = connect(cfg)
            reserve(cfg, w.rollout, w.learners)
            rollout = dict(
                num_cpus=w.rollout_cpus, num_gpus=w.rollout_gpus, max_restarts=w.max_restarts, max_task_retries=0
            )
            # inline, an actor that cannot start raises here, with its own traceback; what the actors
            # print goes to a file, as on Ray
            log = self.out / "actors.log" if self.inline and not cfg.logging.verbose else None
            if log is not None:
                tqdm.write(
                    f"kvrl: the actors' output (vLLM, DeepSpeed) is in {log}; logging.verbose=true prints it here"
                )
            self.workers = [
                spawn(RolloutWorker, rollout, cfg, i, inline=self.inline, log=log) for i in range(w.rollout)
            ]
            self.learners = [
                spawn(
                    Learner,
                    dict(num_cpus=w.learner_cpus, num_gpus=w.learner_gpus),
                    cfg,
                    r,
                    w.learners,
                    inline=self.inline,
                    log=log,
                )
                for r in range(w.learners)
            ]
            if w.learners > 1 or w.backend == "deepspeed":
                endpoint = self.get(self.learners[0].endpoint.remote(), "learner 0")
                self.get([learner.join.remote(endpoint) for learner in self.learners], "the learners' process group")
            self.resume()
            self.push()
        except BaseException:
            self.close()  # actors would otherwise hold their CPUs in a Ray that outlives us
            raise

    def check_prompts_fit(self) -> None:
        """Before Ray starts, from the tasks themselves: a data set's row no rollout could serve, or a task
        whose prompt or answer the model's tokenizer cannot read, fails by file:line (a procedural task by
        its id), and (where the rollouts evict with kv.*) a kv.budget no sequence outgrows is refused. A data
        set is read whole; a procedural environment by `PROBE` tasks drawn aside (its stream is untouched), so
        its longest prompt is an estimate and its max_model_len is left to the model."""
        from transformers import AutoConfig, AutoTokenizer

        cfg = self.cfg
        data = getattr(self.env, "data", None)
        section = SECTIONS.get(type(self.algo).section or cfg.rl.algo)  # a registered algorithm's: its name
        evicts = section is not None and "kv" in section.uses  # its rollouts evict with kv.*
        if not data and not hasattr(self.env, "sample_task"):
            return
        path = resolve_path(cfg.model.path)
        positions = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
        rng = np.random.default_rng(cfg.seed)
        try:  # a drawn task whose text is not UTF-8 fails as it is built (kvrl.envs.base.Task)
            tasks = data or [self.env.sample_task(rng) for _ in range(PROBE)]
            longest = check_prompts(
                tasks, AutoTokenizer.from_pretrained(path), cfg.model.max_model_len or positions, Chat.of(cfg.env)
            )
        except ValueError as err:  # a row too long or unreadable: the user's data, not a bug of ours
            raise ConfigError(f"env.id={cfg.env.id}: {err}") from None
        end = longest + cfg.sampling.max_new_tokens
        if data and not cfg.model.max_model_len:  # the engines size their KV checks for what this data needs
            cfg.model.max_model_len = min(end, positions) if positions else end
        if evicts and not budget_evicts(cfg.kv.budget, end):
            whence = (
                f"the longest prompt of env.id={cfg.env.id}'s data set"
                if data
                else f"the longest of {PROBE} prompts drawn from env.id={cfg.env.id}"
            )
            raise ConfigError(
                cfg.kv.never_evicts(
                    end,
                    f"{whence}, {longest} tokens, + sampling.max_new_tokens={cfg.sampling.max_new_tokens}",
                    f"job={cfg.job} rl.algo={cfg.rl.algo}",
                )
            )

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> dict:
        """Train to trainer.steps; the last step's metrics. An actor lost for good (a learner, or a
        rollout worker past workers.max_restarts), or a reward that is no finite number (a RewardError),
        ends the run saying that resume=auto continues it."""
        try:
            return self.loop()
        except RewardError as err:  # scored on a rollout actor: through Ray, its `cause` is the actor's error
            raise RewardError(f"{getattr(err, 'cause', err)}; {self.resume_hint()}") from None
        except RayActorError as err:  # Ray's own report names neither the run nor the way back
            raise RuntimeError(
                f"an actor of the run died after {self.step} steps ({str(err).splitlines()[0]}); {self.resume_hint()}"
            ) from err

    def resume_hint(self) -> str:
        return (
            f"the run stops: rerun the same command to continue it from its newest intact checkpoint in "
            f"{self.out / 'checkpoints'} (resume=auto; steps after that checkpoint are redone)"
        )

    def loop(self) -> dict:
        cfg, steps, G = self.cfg, self.cfg.trainer.steps, self.cfg.rl.group_size
        record: dict = {}
        bar = tqdm(total=steps, initial=self.step, desc=f"rl {cfg.rl.algo}", unit="step")
        pending = self.dispatch(self.step) if self.step < steps else None
        if pending is None:
            tqdm.write(f"nothing to train: the checkpoint is at step {self.step} of trainer.steps={steps}")
        while self.step < steps:
            # ---- 1-2. this step's rollouts (dispatched by the previous step, or just above)
            step = pending.step
            samples, gen = self.collect(pending)
            collected = time.perf_counter()
            # ---- one step ahead: the next generation starts now, with the weights the
            # workers hold (version t), and runs while the learners train on this step
            pending = self.dispatch(step + 1) if cfg.rl.async_steps and step + 1 < steps else None
            # ---- 3. rewards: scored on the rollout workers
            infos = [s.info for s in samples]
            # ---- 4. advantages
            rewards = torch.tensor([s.reward for s in samples])
            truncated = torch.tensor([s.finish_reason == "length" for s in samples])
            adv = group_advantages(rewards, G, scale=cfg.rl.scale)
            if cfg.rl.credit == "segment":  # each token by its segment's reward within the group
                per_token = segment_advantages(
                    adv, [s.segments[0] for s in samples], [s.segments[1] for s in samples], G, scale=cfg.rl.scale
                )
                per_token = [mask_truncated(a, t, cfg.rl.truncated) for a, t in zip(per_token, truncated)]
                for s, a in zip(samples, per_token):
                    s.advantage = a.tolist()
                adv = torch.cat(per_token)
            else:
                adv = mask_truncated(adv, truncated, cfg.rl.truncated)
                for s, a in zip(samples, adv.tolist()):
                    s.advantage = a
            # ---- 5. learner update, on samples at most rl.async_steps versions old
            staleness = self.version - min(s.version for s in samples)
            assert 0 <= staleness <= cfg.rl.async_steps, f"samples {staleness} versions old"
            learn_start = time.perf_counter()
            # no advantage off 0, no reward signal: rl.no_signal=skip scores the samples but takes no step
            no_signal = type(self.algo).advantages_only and cfg.rl.no_signal == "skip" and not adv.any()
            learned = self.learn(samples, update=not no_signal)
            learn_s = time.perf_counter() - learn_start
            # ---- 6. push the new weights; on-policy, the next generation starts only now
            self.version += 1
            self.push()
            if not cfg.rl.async_steps and step + 1 < steps:
                pending = self.dispatch(step + 1)
            # ---- 7. log, checkpoint
            self.step += 1
            self.samples_total += len(samples)
            groups = rewards.view(-1, G)
            record = {
                "step": self.step,
                "policy_version": self.version,
                "samples": len(samples),
                "samples_total": self.samples_total,
                "sample_version_min": min(s.version for s in samples),
                "staleness_max": staleness,
                "reward_mean": rewards.mean().item(),
                "reward_std": rewards.std().item(),
                **{f"env/{k}": float(np.mean([i[k] for i in infos])) for k in infos[0] if k != "reward"},
                "adv_mean": adv.mean().item(),
                "adv_std": adv.std().item(),
                "adv_abs_mean": adv.abs().mean().item(),
                "zero_std_groups": (groups == groups[:, :1]).all(1).float().mean().item(),
                "truncated": truncated.float().mean().item(),
                "completion_len": float(np.mean([len(s.tokens) for s in samples])),
                "kv_retention": float(
                    np.mean([1.0 if s.trace is None else s.trace.retention().mean().item() for s in samples])
                ),
                **learned,
                "gen_tokens": gen["tokens"],
                "gen_tokens_per_s": gen["tokens"] / gen["seconds"],
                "rollout_s": gen["seconds"],
                "learn_s": learn_s,
                # its own rollout and what followed it, less the next step's dispatch (inline, that rollout)
                "step_s": gen["seconds"] + time.perf_counter() - collected - (pending.send_s if pending else 0.0),
                "restarts": sum(self.restarts),
            }
            self.runlog.log(record)  # a non-finite value is written as null (standard JSON)
            if record["skipped"]:
                self.skipped_in_row += 1
                tqdm.write(
                    f"step {self.step}: skipped the update, its loss ({record['loss']}) or gradient norm "
                    f"({record['grad_norm']}) is not finite ({self.skipped_in_row} in a row, the run stops at "
                    f"trainer.max_nonfinite_steps={cfg.trainer.max_nonfinite_steps})"
                )
                if self.skipped_in_row >= cfg.trainer.max_nonfinite_steps:
                    raise FloatingPointError(
                        f"{self.skipped_in_row} updates in a row (to step {self.step}) had a non-finite loss or "
                        f"gradient norm and were skipped (metrics in {self.runlog.path}). Lower "
                        "trainer.lr or trainer.max_grad_norm, or check the algorithm's loss on these samples, or "
                        f"raise trainer.max_nonfinite_steps to tolerate more in a row; {self.resume_hint()}"
                    )
            else:
                self.skipped_in_row = 0
            self.warn_if_learning_nothing(record)
            if self.step == steps or (cfg.rl.checkpoint_every and self.step % cfg.rl.checkpoint_every == 0):
                self.checkpoint(pending)
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", mismatch=f"{record['mismatch_max']:.1e}")
        bar.close()
        self.finish()
        return record

    def warn_if_learning_nothing(self, record: dict) -> None:
        """Once per run: after `ZERO_SPREAD_STEPS` steps in a row whose every group got one reward for all
        its samples, say on stderr that the advantages are all 0 and what to try (an algorithm whose loss
        does not read the rewards, `Algorithm.learns_from_rewards` False, learns regardless)."""
        if not type(self.algo).learns_from_rewards:
            return
        self.flat_in_row = self.flat_in_row + 1 if record["zero_std_groups"] == 1.0 else 0
        if self.flat_in_row != ZERO_SPREAD_STEPS:
            return
        cfg, reward = self.cfg, record["reward_mean"]
        tqdm.write(
            f"kvrl: warning: for {ZERO_SPREAD_STEPS} steps in a row (to step {self.step}) every group of "
            f"rl.group_size={cfg.rl.group_size} samples got one reward for all its samples (zero_std_groups 1.0, "
            f"reward_mean {reward:.3f}): the advantages are all 0 and the run is learning nothing. Read a few "
            "completions against their tasks (check_env(env, tokenizer=...) checks the model can read them); "
            + (
                "the tasks are too easy for this model: make them harder"
                if reward > 0
                else "the model solves none of the tasks: make them easier, give partial credit (a reward with a "
                "weight below 1), or start from a model that solves some"
            )
            + f"; more samples per group (rl.group_size) or a higher sampling.temperature={cfg.sampling.temperature:g} "
            "spread the rewards",
            file=sys.stderr,
        )

    # ---- 1-2. tasks and rollouts ---------------------------------------------------------------

    def dispatch(self, step: int) -> Pending:
        """Draw the step's tasks and send one contiguous shard of its samples to each worker."""
        cfg, G = self.cfg, self.cfg.rl.group_size
        env_state = self.env.state_dict()
        tasks = self.env.tasks(cfg.trainer.batch_size // G)
        ids = [f"{step}/{t}/{g}" for t in range(len(tasks)) for g in range(G)]
        sample_tasks = [task for task in tasks for _ in range(G)]
        parts = np.array_split(np.arange(len(ids)), len(self.workers))
        args = {
            i: (
                [ids[k] for k in part],
                [sample_tasks[k] for k in part],
                int(np.random.SeedSequence([cfg.seed, step, i]).generate_state(1)[0] >> 1),
            )
            for i, part in enumerate(parts)
        }
        sending = time.perf_counter()
        refs = {i: self.workers[i].generate.remote(*args[i]) for i in args}
        sent = time.perf_counter()
        pending = Pending(step, env_state, args, refs, sent, self.push_args, list(self.lives), sent - sending)
        if self.on_dispatch is not None:
            self.on_dispatch(self, step)
        return pending

    def collect(self, pending: Pending) -> tuple[list[Sample], dict]:
        """The step's samples in dispatch order, each exactly once; tokens and seconds."""
        results = self.gather(pending.refs, "generate", pending.args, pending.weights, pending.lives)
        if pending.weights is not self.push_args:  # async: a redone shard left its worker a version behind
            stale = [i for i in results if self.lives[i] != pending.lives[i]]
            self.gather(
                {i: self.workers[i].load.remote(*self.push_args) for i in stale},
                "load",
                dict.fromkeys(stale, self.push_args),
            )
        samples = [s for i in sorted(results) for s in results[i][0]]
        expected = [sid for i in sorted(pending.args) for sid in pending.args[i][0]]
        assert [s.id for s in samples] == expected, "a shard's samples were lost or duplicated"
        tokens = sum(r[1]["tokens"] for r in results.values())
        # On Ray the shards run side by side from their dispatch to here: the wall time is the
        # rollout's. Inline each ran, one after another, inside dispatch(): their own seconds are.
        seconds = sum(r[1]["seconds"] for r in results.values()) if self.inline else time.perf_counter() - pending.start
        return samples, {"tokens": tokens, "seconds": seconds}

    def gather(
        self,
        refs: dict[int, ray.ObjectRef],
        method: str,
        args: dict[int, tuple],
        weights: tuple | None = None,
        lives: list[int] | None = None,
    ) -> dict:
        """Results of calls in flight on rollout workers, by worker.

        A worker that died is restarted by Ray from its constructor (base weights, no
        version): it gets ``weights`` (the push the call was sent with; default the current
        one), then the whole call again, so a shard's samples arrive once, with the seed and
        the weights they would have had. ``lives``: the workers' incarnations when the calls
        were sent; a death that an earlier call already reported (async: a push queued
        behind the generation fails too) is restarted and counted once.
        """
        weights = self.push_args if weights is None else weights
        lives = list(self.lives) if lives is None else lives
        out = {}
        for i, ref in refs.items():
            life = lives[i]
            while i not in out:
                try:
                    out[i] = self.get(ref, f"rollout worker {i} ({method})")
                except RayActorError as err:
                    raise_if_start_failed(err, f"rollout worker {i}")
                    if self.lives[i] == life:  # a death not seen yet
                        self.lives[i] += 1
                        self.restarts[i] += 1
                        tqdm.write(f"rollout worker {i} died during {method}(); restarting it to redo the call")
                        self.wait_restarted(i, err)
                    life = self.lives[i]
                    if method != "load":
                        self.gather({i: self.workers[i].load.remote(*weights)}, "load", {i: weights})
                    ref = getattr(self.workers[i], method).remote(*args[i])
        return out

    def wait_restarted(self, i: int, err: Exception) -> None:
        """Until Ray has restarted worker i (calls made meanwhile fail as unavailable)."""
        limit = self.cfg.workers.max_restarts
        deadline = time.monotonic() + self.cfg.workers.timeout_s
        while self.restarts[i] <= limit:
            try:
                return self.get(self.workers[i].__ray_ready__.remote(), f"restarting rollout worker {i}")
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout worker {i} did not come back within workers.timeout_s") from None
                time.sleep(0.5)
            except ActorDiedError:  # Ray gave up on it
                break
        raise RuntimeError(
            f"rollout worker {i} died {self.restarts[i]} times, more than "
            f"workers.max_restarts={limit}: {err}; {self.resume_hint()}"
        )

    # ---- 5-6. update and push -----------------------------------------------------------------

    def learn(self, samples: list[Sample], update: bool = True) -> dict:
        """One update over all learners (``update`` False: scored only); their metrics combined
        (token-weighted means)."""
        token_level = self.cfg.rl.aggregation == "token"
        num_items = sum(len(s.tokens) for s in samples) if token_level else len(samples)
        parts = np.array_split(np.arange(len(samples)), len(self.learners))
        results = self.get(
            [
                learner.step.remote([samples[k] for k in part], num_items, update)
                for learner, part in zip(self.learners, parts)
            ],
            "the learners' update",
        )
        trained = [sid for r in results for sid in r.pop("ids")]
        assert trained == [s.id for s in samples], "the learners did not train on each sample exactly once"
        digests = {r.pop("checksum", None) for r in results}
        assert len(digests) == 1, "data-parallel learners hold different weights after the update"
        tokens = np.array([r["tokens"] for r in results], dtype=float)
        out = {}
        for key in results[0]:
            values = np.array([r[key] for r in results], dtype=float)
            if key.endswith("_max"):
                out[key] = float(values.max())
            elif key.endswith("_min"):
                out[key] = float(values.min())
            elif key in ("loss", "tokens"):  # each learner's loss is its share of the step's
                out[key] = float(values.sum())
            elif key in ("grad_norm", "lr", "version", "skipped", "no_signal"):  # the same on every learner
                out[key] = float(values[0])
            else:
                out[key] = float((values * tokens).sum() / max(tokens.sum(), 1.0))
        out.pop("version")
        return out

    def push(self) -> None:
        """The learners' trainable state to every worker, through the object store; each
        worker checks what it loaded against the learner's checksum."""
        state, digest = self.learners[0].state.remote()
        self.push_args = (state, self.version, self.get(digest, "learner 0 (state)"))
        self.gather(
            {i: w.load.remote(*self.push_args) for i, w in enumerate(self.workers)},
            "load",
            dict.fromkeys(range(len(self.workers)), self.push_args),
        )

    # ---- 7. logging, checkpoints --------------------------------------------------------------

    def checkpoint(self, pending: Pending | None) -> None:
        path = self.out / "checkpoints" / f"step_{self.step:06d}"
        path.mkdir(parents=True, exist_ok=True)
        self.get([learner.save.remote(str(path)) for learner in self.learners], "saving the checkpoint")
        save_torch(
            {
                "step": self.step,
                "version": self.version,
                "samples_total": self.samples_total,
                # with async_steps=1 the next step's tasks are already drawn: save the cursor before them
                "env": pending.env_state if pending is not None else self.env.state_dict(),
                "numpy_rng": np.random.get_state(),
                "torch_rng": torch.get_rng_state(),
                "restarts": self.restarts,
            },
            path / "controller.pt",
        )
        write_json(path / "config.json", flatten(self.cfg))  # what a resume must match
        seal(path)  # checksums of every file, then the pointer: a crash mid-save leaves the previous checkpoint
        mark_latest(path)

    def resume(self) -> None:
        """resume=auto: the newest intact checkpoint in output_dir, if any; never; or a path.
        A resumed run must have the checkpoint's config, but for ``Config.RESUMABLE``."""
        cfg = self.cfg
        if cfg.resume == "auto":
            path = intact_checkpoint(self.out / "checkpoints")
        else:
            path = None if cfg.resume == "never" else Path(cfg.resume)
            if path is not None and (why := damage(path)):
                raise ValueError(f"resume={cfg.resume}: {why}; pass another checkpoint or resume=auto")
        settings = json.loads(json.dumps(flatten(cfg)))  # as a checkpoint's config.json holds them
        if path is not None and (path / "config.json").exists():
            saved = json.loads((path / "config.json").read_text())
            changed = resume_changes(saved, settings, cfg.RESUMABLE, cfg.resume, path)
            if changed:
                raise ValueError(
                    f"{self.out} holds a run whose settings differ from this one's (checkpoint {path}):"
                    f"\n  " + "\n  ".join(changed) + "\nrerun with the checkpoint's settings to "
                    "continue it, or start fresh in another output_dir=... (or resume=never to "
                    "overwrite this one)"
                )
        self.runlog = RunLog(
            self.out,
            fresh=path is None,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            name=cfg.run_name,
            config=settings,
        )
        if path is None:
            return
        state = torch.load(path / "controller.pt", weights_only=False)
        self.step, self.version, self.samples_total = state["step"], state["version"], state["samples_total"]
        self.env.load_state_dict(state["env"])
        np.random.set_state(state["numpy_rng"])
        torch.set_rng_state(state["torch_rng"])
        self.get([learner.load.remote(str(path), self.version) for learner in self.learners], "loading the checkpoint")
        # drop what a crashed run logged after its last checkpoint, so every step is logged once
        self.runlog.trim(lambda row: row["step"] <= self.step)
        tqdm.write(f"resumed from {path} at step {self.step}")

    def finish(self) -> None:
        """The model as a transformers folder, and the reward curve as a PNG."""
        self.get(self.learners[0].export.remote(str(self.out / "model")), "exporting the model")
        plot_rewards(
            self.runlog.records(),
            self.out / "reward.png",
            f"{self.cfg.run_name}: {self.cfg.rl.algo} on {self.cfg.env.id}",
        )

    # ---- plumbing ------------------------------------------------------------------------------

    def get(self, refs, what: str):
        return get(refs, what, self.cfg.workers.timeout_s)

    def close(self) -> None:
        if self.runlog is not None:
            self.runlog.close()
        for actor in [] if self.inline else self.workers + self.learners:
            ray.kill(actor, no_restart=True)
        if self.own_ray:
            ray.shutdown()
        self.lock.release()
