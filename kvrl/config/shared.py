"""The shared sections: the top-level keys and the sections every job may read (model, env, kv,
sampling, trainer, rl, workers, logging), with their rules.

Contract: each field's range rule sits beside it (`checked`), a section's cross-field rules are its
`problems(cfg)` method, run when a job names the section (`kvrl.jobs.JOBS`) or its rl.algo `uses` it
(`kvrl.section`). An algorithm's or a job's own section is not here: it sits beside its code and
registers itself; `kvrl.config.schema` assembles the whole schema. No torch, no Ray: the gate's
checks that look outside the config (a model folder, an environment's constructor) are in `kvrl.preflight.names`.
"""

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING

from kvrl.algos import ALGOS, algo_class
from kvrl.budget import budget_evicts, least_budget
from kvrl.jobs import JOBS
from kvrl.preflight.names import cache_limit, env_problems, model_problems, policy_problems
from kvrl.section import POLICY_NAMES, ConfigError, checked
from kvrl.workers.inline import INLINE

DTYPES = ("float32", "bfloat16", "float16")
ADDRESS = re.compile(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):\d{1,5}")  # a Ray head: HOST:PORT


@dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" = the shipped kvrl/models/weights/tiny_reasoner; else a dir or hub id
    dtype: str = checked("float32", lambda v: v in DTYPES, f"must be one of {' | '.join(DTYPES)}")  # parameter dtype
    # ids that end a sample; [] = all of the generation config's eos_token_id and the tokenizer's EOS
    stop_ids: list[int] = field(default_factory=list)
    # prompt + generated tokens a sequence may hold (vLLM sizes its KV cache check by it); 0 = the longest
    # prompt of a data set + sampling.max_new_tokens, else the model's max_position_embeddings
    max_model_len: int = checked(0, ge=0)

    def problems(self, cfg: "Shared") -> list[str]:
        return model_problems(self.path)


@dataclass
class EnvConfig:
    id: str = checked("kvrl/counts-v0", kwargs="kwargs")  # registered environment id, or a dotted path pkg.mod:Class
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the environment's constructor
    chat_template: bool = True  # render prompts with the tokenizer's chat template when it has one; false = raw
    system_prompt: str = ""  # the chat's system message; "" = none
    thinking: bool = True  # Qwen3's enable_thinking (other templates ignore it)
    num_eval_tasks: int = checked(256, ge=1)  # tasks drawn for evaluation

    def problems(self, cfg: "Shared") -> list[str]:
        return env_problems("env.id", self.id, "env.kwargs", self.kwargs)


@dataclass
class KVConfig:
    # KV policy name (full, streaming, h2o, snapkv, rkv, gkv, ...) or a dotted path pkg.mod:Class (as env.id)
    policy: str = checked(
        "full",
        lambda v: v in POLICY_NAMES or ":" in v,
        f"must be one of {', '.join(POLICY_NAMES)} or a pkg.module:Class of your own",
        names=POLICY_NAMES,
        kwargs="kwargs",
    )
    budget: int = checked(0, ge=0)  # cached tokens kept per KV head; 0 = unbounded (eval jobs sweep eval.budgets)
    interval: int = checked(16, ge=1)  # evict every this many decoded tokens
    window: int = checked(8, ge=1)  # number of most recent queries used to score cached tokens
    sink: int = checked(4, ge=0)  # leading tokens that are never evicted
    # G-KV's ratio mode: an eviction keeps max(kv.budget, floor(ratio x tokens seen so far, prompt included));
    # null = the fixed kv.budget. job=eval applies it to its token-policy lines at every eval.budgets floor
    budget_ratio: float | None = checked(
        None, lambda v: v is None or 0 < v <= 1, "must be null (a fixed budget) or a fraction in (0, 1]"
    )
    kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # the policy's own arguments, e.g. {alpha: 0.8, mix_lambda: 0.5}

    def problems(self, cfg: "Shared") -> list[str]:
        """Checked by the jobs (and rl.algo values) whose token policy is built from kv.*: a policy given
        by path imports and takes kv.kwargs; the policy always keeps kv.sink + kv.window tokens and must
        choose at least one more by score; a budget a sequence never reaches (`kvrl.preflight.names.cache_limit`) never
        evicts. This is the budget's one check on the config path, where it is known earliest (a policy
        built in Python checks its own arguments: `KVPolicy.__post_init__`)."""
        problems = policy_problems(self.policy, self.kwargs)
        job = JOBS[cfg.job]
        who = f"job={cfg.job}" + (f" rl.algo={cfg.rl.algo}" if "rl" in job.sections else "")
        least = least_budget(self.window, self.sink)
        limit, why = cache_limit(cfg)
        if self.budget == 0:
            problems.append(
                f"kv.budget=0 keeps every token, but {who} evicts with kv.policy={self.policy} and needs "
                f"a budget; set {self.budget_fix(limit, 4 * self.interval)}"
            )
        elif self.budget < least:
            fix = self.budget_fix(limit, 4 * self.interval)
            problems.append(
                f"kv.budget must be >= kv.window + kv.sink + 1 = {least} (got {self.budget}): the policy "
                f"always keeps the kv.sink first and kv.window newest tokens and chooses at least one by "
                f"score; set {fix}" + ("" if "kv.window" in fix else " (or lower kv.window / kv.sink)")
            )
        elif not budget_evicts(self.budget, limit):
            problems.append(self.never_evicts(limit, why, who))
        elif "budget_ratio" in self.kwargs:
            problems.append(
                f"kv.kwargs.budget_ratio={self.kwargs['budget_ratio']}: the ratio mode is a kv key, which "
                f"the memory plan and the engines' block caps read too; set kv.budget_ratio="
                f"{self.kwargs['budget_ratio']} instead"
            )
        return problems

    def budget_fix(self, limit: float, prefer: int) -> str:
        """The kv settings to suggest for a budget: kv.budget as near `prefer` as the rules allow, at least
        kv.window + kv.sink + 1 and below the `limit` tokens a sequence holds (inf: not known here). When no
        budget fits between the two, kv.window (and kv.sink) come first, lowered to a quarter of the limit."""
        window, sink = self.window, self.sink
        if not budget_evicts(least_budget(window, sink), limit):
            window, sink = max(1, min(window, limit // 4)), min(sink, limit // 4)
        # a sequence of a token or two: no cache is small enough to evict from
        if not budget_evicts(least_budget(window, sink), limit):
            return "kv.policy=full"
        kept = {"kv.window": (window, self.window), "kv.sink": (sink, self.sink)}
        lowered = [f"{key}={new}" for key, (new, old) in kept.items() if new != old]
        return " ".join([*lowered, f"kv.budget={max(least_budget(window, sink), min(prefer, limit - 1))}"])

    def never_evicts(self, limit: int, why: str, who: str) -> str:
        """The refusal of a kv.budget that a sequence of at most `limit` tokens (`why`) never outgrows: on the
        config path the model's positions (`problems`); at run start, once the data is read, the longest
        prompt + sampling.max_new_tokens (`kvrl.workers.controller.Controller`)."""
        least, fix = least_budget(self.window, self.sink), self.budget_fix(limit, limit // 2)
        lowered = " and ".join(key for key in ("kv.window", "kv.sink") if key in fix)
        lower = (
            ""
            if budget_evicts(least, limit)
            else f"; no kv.budget can evict with kv.window={self.window} kv.sink={self.sink}: the policy always "
            f"keeps kv.window + kv.sink + 1 = {least} tokens, at least as many as a sequence holds, so "
            + (f"lower {lowered}" if lowered else "evicting needs longer sequences")
        )
        return (
            f"kv.budget={self.budget} never evicts: a sequence holds at most {limit} tokens ({why}), so the "
            f"cache never outgrows the budget and {who} would run the full cache{lower}; set {fix}"
            + (f" (below {limit})" if "kv.budget" in fix else "")
        )


@dataclass
class SamplingConfig:
    max_new_tokens: int = checked(160, ge=1)  # generation length limit per sample
    temperature: float = checked(0.0, ge=0)  # 0 = greedy decoding
    # nucleus sampling: draw from the most likely tokens whose probability reaches top_p, renormalised
    # (1 = every token; greedy decoding is unaffected: its token is always in the nucleus)
    top_p: float = checked(1.0, lambda v: 0 < v <= 1, "must be in (0, 1] (1 = no nucleus cut)")
    batch_size: int = checked(64, ge=1)  # prompts generated together


@dataclass
class TrainerConfig:
    # peak learning rate; Adam moves every weight by about lr per step, so above 1 it only destroys the model
    # (1e39 overflowed float32 inside the optimizer's first step)
    lr: float = checked(3e-3, lambda v: 0 < v <= 1, "must be in (0, 1] (Adam moves each weight by about lr per step)")
    steps: int = checked(0, ge=0)  # optimizer steps; 0 = no training
    batch_size: int = checked(32, ge=1)  # samples per optimizer step
    warmup_steps: int = checked(100, ge=0)  # linear learning-rate warmup length
    weight_decay: float = checked(0.0, ge=0)  # AdamW weight decay
    log_every: int = checked(50, ge=1)  # steps between metric log lines
    max_grad_norm: float = checked(1.0, ge=0)  # clip the global gradient norm to this (0 = no clipping)
    # padded tokens (samples x longest prompt+completion; ForesightKV's stage 2: episodes x most decisions x
    # most candidates) a learner scores and backpropagates at once; its share of a step is split into such
    # micro-batches and their gradients summed; 0 = the whole share at once
    micro_batch_tokens: int = checked(0, ge=0)
    # recompute each decoder layer's activations in backward instead of keeping them (full-model training)
    gradient_checkpointing: bool = False
    # RL jobs: an update whose loss or gradient norm is not finite is skipped (logged with skipped=1); this
    # many skipped in a row stop the run (the weights are not saved: resume=auto continues from the last checkpoint)
    max_nonfinite_steps: int = checked(3, ge=1)


@dataclass
class RLConfig:
    # RL jobs (job=rl): trainer.batch_size samples per step = batch_size / group_size tasks x group_size
    # what is trained, the loss, what is pushed to rollouts: a name in kvrl.algos.ALGOS, or a dotted path
    # pkg.module:Class to an Algorithm of your own (as env.id)
    algo: str = "rl_full"
    group_size: int = checked(8, ge=2)  # samples per task (G); advantages are normalised within each task's group
    # advantage scaling: group (divide by the group's std, GRPO) | none (Dr. GRPO)
    scale: str = checked("group", lambda v: v in ("group", "none"), "must be group | none")
    # advantage of samples cut at max_new_tokens: zero | clip (max(A, 0), G-KV's) | keep
    truncated: str = checked("zero", lambda v: v in ("zero", "clip", "keep"), "must be zero | clip | keep")
    # what a token's advantage rewards: sequence (its sample's reward, GRPO) | segment (its segment's reward, for
    # environments that split a completion into segments with their own rewards, e.g. kvrl/multihop-v0's queries:
    # a query's chain of thought is credited with that query's answer, not with the others')
    credit: str = checked("sequence", lambda v: v in ("sequence", "segment"), "must be sequence | segment")
    # loss: token (sum / all tokens, DAPO) | sequence (mean per sample, then mean)
    aggregation: str = checked("token", lambda v: v in ("token", "sequence"), "must be token | sequence")
    eps_low: float = checked(0.2, ge=0)  # PPO clip range below 1: ratio floor 1 - eps_low
    # PPO clip range above 1: ratio ceiling 1 + eps_high (DAPO's clip-higher: 0.28)
    eps_high: float = checked(0.2, ge=0)
    kl_coef: float = checked(0.0, ge=0)  # weight of the k3 KL to the initial model; 0 = no reference model is kept
    # a step whose every advantage is 0 (each group's rewards all equal) carries no reward signal: skip takes no
    # optimizer step there (Adam's momentum and weight decay would still move the weights, with nothing behind
    # them); step takes it anyway. Algorithms with a term that trains regardless (RLKV's gate penalty,
    # Distill's teacher) always step
    no_signal: str = checked("skip", lambda v: v in ("skip", "step"), "must be skip | step")
    # 0 = on-policy; 1 = generate step t+1 while training on step t (staleness <= 1)
    async_steps: int = checked(0, lambda v: v in (0, 1), "must be 0 (on-policy) or 1 (one step ahead)")
    # steps between checkpoints in output_dir/checkpoints; 0 = only the last step
    checkpoint_every: int = checked(0, ge=0)

    def problems(self, cfg: "Shared") -> list[str]:
        """Cross-field checks of RL jobs; each message names the key and a value that works."""
        problems = []
        g, n = self.group_size, cfg.trainer.batch_size
        if g >= 1 and (n % g or n < g):  # below 2 the field's own rule says so (and n % 0 would raise)
            problems.append(
                f"trainer.batch_size ({n}) must be a multiple of rl.group_size ({g}): it is the number "
                f"of samples per step; set trainer.batch_size={max(1, round(n / g)) * g}"
            )
        if cfg.sampling.temperature <= 0:
            problems.append(
                "sampling.temperature must be > 0 for RL: greedy decoding gives every sample of a "
                "group the same text, hence zero advantages; set sampling.temperature=1.0"
            )
        if cfg.sampling.top_p < 1:
            problems.append(
                f"sampling.top_p={cfg.sampling.top_p:g}: a rollout records each token's logprob in the "
                "renormalised nucleus it was drawn from (vLLM's processed_logprobs; the HF engine records "
                "the same), but the learner scores the token under the whole softmax, so the importance "
                "ratio would be off by the nucleus's mass at every token; set sampling.top_p=1.0 (top-p "
                "is for job=eval)"
            )
        if cfg.workers.engine == "vllm" and cfg.sampling.temperature > 2:
            problems.append(
                f"sampling.temperature={cfg.sampling.temperature:g}: vLLM samples at temperatures in "
                "[0, 2] only; set sampling.temperature=2.0 or workers.engine=hf"
            )
        parts = max(cfg.workers.rollout, cfg.workers.learners)
        if n < parts:
            problems.append(
                f"trainer.batch_size ({n}) must be >= the number of rollout workers and of learners "
                f"({parts}), each takes a share of the samples; set trainer.batch_size={parts * g}"
            )
        if ":" in self.algo:  # pkg.module:Class (the loader imported it already, registering its section)
            try:
                algo_class(self.algo)
            except ConfigError as err:
                problems.append(str(err))
        elif self.algo not in ALGOS:
            near = difflib.get_close_matches(self.algo, ALGOS, n=1)
            problems.append(
                f"unknown rl.algo {self.algo!r}; set rl.algo={near[0] if near else next(iter(ALGOS))} "
                f"(available: {', '.join(ALGOS)}, or pkg.module:Class of your own)"
            )
        if self.credit == "segment" and self.algo in ALGOS and not ALGOS[self.algo].token_advantages:
            takes = ", ".join(name for name, a in ALGOS.items() if a.token_advantages)
            problems.append(
                f"rl.credit=segment gives each generated token its own advantage, but rl.algo={self.algo}'s loss "
                f"does not weigh tokens by advantages; set rl.credit=sequence (segment credit: rl.algo={takes})"
            )
        if cfg.trainer.steps < 1:
            problems.append("trainer.steps must be >= 1 for RL (it is the number of RL steps); set trainer.steps=20")
        return problems


@dataclass
class WorkersConfig:
    # "" = the cluster of `ray job submit` ($RAY_ADDRESS) if any, else a private local Ray; or auto / host:port;
    # inline = no Ray: the actors are objects in this process, one after another (a laptop's smallest start-up;
    # no restarts, no timeouts, one learner: kvrl/workers/inline.py)
    address: str = checked(
        "",
        lambda v: v in ("", "auto", "local", INLINE) or ADDRESS.fullmatch(v) is not None,
        f"must be empty (a private local Ray, or $RAY_ADDRESS), auto, local, {INLINE}, HOST:PORT or ray://HOST:PORT",
    )
    num_cpus: int = checked(0, ge=0)  # CPUs a private local Ray may use; 0 = all of this machine
    # nice increment of Ray's workers over the process that starts Ray (Ray's default 15 starves them on a busy machine)
    niceness: int = checked(0, lambda v: 0 <= v <= 19, "must be 0..19 (0 = the driver's priority)")
    # rollout engine: hf (kvrl's reference) | vllm (vLLM with kvrl's plugin: pip install .[cpu] or .[gpu])
    engine: str = checked("hf", lambda v: v in ("hf", "vllm"), "must be hf | vllm")
    # vLLM's KV cache per engine in GiB; 0 = $VLLM_CPU_KVCACHE_SPACE or 1 GiB on CPU, vLLM's own sizing on GPU
    kv_cache_gib: float = checked(0.0, ge=0)
    # RolloutWorker actors, each wrapping an engine; a step's samples are split across them
    rollout: int = checked(2, ge=1)
    # CPUs reserved per rollout actor (fractions pack several actors on a core)
    rollout_cpus: float = checked(0.5, ge=0)
    rollout_gpus: float = checked(0.0, ge=0)  # GPUs per rollout actor (set device=cuda too)
    # Learner actors; > 1 = data parallel, gradients all-reduced (gloo on CPU, nccl on GPU)
    learners: int = checked(1, ge=1)
    learner_cpus: float = checked(0.5, ge=0)  # CPUs reserved per learner actor
    learner_gpus: float = checked(0.0, ge=0)  # GPUs per learner actor
    gpu_gib: float = checked(80.0, lambda v: v > 0, "must be > 0")  # memory of each GPU: dry_run checks the fit
    # learner optimizer: ddp (torch AdamW, all-reduced grads) | deepspeed (ZeRO)
    backend: str = checked("ddp", lambda v: v in ("ddp", "deepspeed"), "must be ddp | deepspeed")
    # DeepSpeed ZeRO stage for backend=deepspeed: 1 | 2
    zero_stage: int = checked(
        2, lambda v: v in (1, 2), "must be 1 or 2 (ZeRO-3's partitioned weights are not gathered for the push yet)"
    )
    # times a dead rollout actor is restarted (its shard redone) before the run fails
    max_restarts: int = checked(3, ge=0)
    # longest any single Ray call may take before the run fails with the actor's name
    timeout_s: float = checked(900.0, ge=1)

    def problems(self, cfg: "Shared") -> list[str]:
        """Checked for the jobs that run actors (`kvrl.jobs.Job.ray`)."""
        if self.address == INLINE and (self.learners > 1 or self.backend == "deepspeed"):
            return [
                f"workers.address=inline runs one learner in this process, without a process group (got "
                f"workers.learners={self.learners} workers.backend={self.backend}); set workers.learners=1 "
                "workers.backend=ddp, or run on Ray (workers.address= or auto or HOST:PORT)"
            ]
        return []


@dataclass
class LoggingConfig:
    tensorboard: bool = False  # also write TensorBoard events to output_dir/tensorboard (`pip install tensorboard`)
    # also log to Weights & Biases (`pip install wandb`); WANDB_MODE=offline writes output_dir/wandb without a network
    wandb: bool = False
    # print Ray's and vLLM's own lines (actors' output, vLLM's INFO) on the console; by default they stay in the
    # Ray session's log folder, which the run names when it starts Ray
    verbose: bool = False


@dataclass
class Shared:
    """The top-level keys and the shared sections; `kvrl.config.Config` adds the registered sections."""

    # what a resumed run may change (a key, or a section with its dot); anything else must equal the checkpoint's
    RESUMABLE: ClassVar[tuple[str, ...]] = (
        "trainer.steps",
        "logging.",
        "resume",
        "print_config",
        "dry_run",
        "rl.checkpoint_every",
        "workers.address",
        "workers.num_cpus",
        "workers.timeout_s",
        "workers.max_restarts",
        "workers.kv_cache_gib",
        "trainer.max_nonfinite_steps",
        # memory knobs with the same gradient (tests/test_rl_loop.py): a run out of memory resumes with smaller ones
        "trainer.micro_batch_tokens",
        "trainer.gradient_checkpointing",
        "workers.niceness",
        "recipe_file",
    )  # where the values came from: the values are compared
    # a value read from the environment (`${oc.env:NAME}`, directly or through another key) -> how it reads with
    # the reference unresolved: what checkpoints, W&B and print_config show instead (set by load_config; the
    # resolved value stays in the field for the job to use)
    env_references: ClassVar[dict[str, Any]] = {}
    recipe: str = "tiny_foresight"  # recipe name (file stem in the recipes folder); the default is the main job
    recipe_file: str = ""  # a recipe of your own, by path (instead of recipe=NAME); its stem becomes recipe
    job: str = MISSING  # which job runs (see `python -m kvrl.run --help`)
    # seed for every random number generator; engines add sample indices to it and torch's generators
    # take at most 64 bits: a larger seed must fail here, not at engine start
    seed: int = checked(0, lambda v: 0 <= v < 2**32, "must be in [0, 2**32)")
    run_name: str = "${recipe}"  # name of this run in logs and output paths
    # where metrics, checkpoints and plots go (empty would put them in the current directory)
    output_dir: str = checked(
        "outputs/${run_name}",
        lambda v: bool(v.strip()),
        "must name a folder (empty would write the run into the current directory)",
    )
    device: str = checked(
        "cpu", lambda v: re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None, "must be cpu, cuda or cuda:N"
    )  # torch device
    print_config: bool = False  # print the resolved config as YAML and exit
    dry_run: bool = False  # print the resource plan and the KV-memory estimate, then exit (no weights needed)
    # auto (latest checkpoint in output_dir, if any) | never | a checkpoint path
    resume: str = checked("auto", lambda v: v in ("auto", "never") or Path(v).exists(), "must be auto, never or a path")
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
