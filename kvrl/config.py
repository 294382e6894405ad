"""Typed configuration: schema ⊕ recipe ⊕ command line, validated before anything runs.

Contract:

* The schema is the dataclass `Config` below; it is the only place keys, types, defaults and
  checks are declared: a field's range check sits beside it (`checked`), a section's
  cross-field checks are its `problems(cfg)` method.
* `JOBS` is the single list of jobs: the function each runs and the sections it checks.
* `load_config(argv)` merges, in this order, the schema (`OmegaConf.structured`), the recipe's
  base (`base: NAME` in the recipe -> `recipes/base/NAME.yaml`), `recipes/NAME.yaml` (NAME from
  `recipe=NAME` on the command line, else `Config.recipe`) and the command-line `key=value`
  dotlist, makes the result read-only, resolves interpolations and converts it to the
  dataclasses with `OmegaConf.to_object`.
* Constructor arguments belong to what they construct: when the command line changes `env.id`,
  `self_distill.source` or `kv.policy`, the recipe's `env.kwargs`, `self_distill.source_kwargs`
  or `kv.kwargs` are dropped (`env.id=kvrl/math-v0 env.kwargs.path=data.jsonl` on an RL recipe
  over counts gives MathEnv only `path`), and a mapping given whole on the command line
  (`env.kwargs='{path: data.jsonl}'`, `env.kwargs={}` to clear) replaces the recipe's instead of
  merging into it; `env.kwargs.path=...` merges one key.
* Recipes live in the repository's `recipes/` folder, or in `$KVRL_RECIPES_DIR`; `recipe=` takes a
  name there (a path, `../x` or `/x`, is refused), `base:` likewise a name in its `base/`. A recipe
  of your own loads by path with `recipe_file=PATH` (its stem becomes `recipe`).
* `${oc.env:NAME}` reads an environment variable into the config (the job gets the value), but what
  a run writes down (a checkpoint's config.json, W&B, `print_config`) holds the reference, never
  the value (`Config.env_references`), and an error message shows `${oc.env:NAME}` where the value
  would be; a resumed run compares the references.
* Every problem — unknown recipe or base, a recipe that is not UTF-8 or YAML, unknown or renamed
  key (in a recipe or on the command line), wrong type, malformed argument, out-of-range or
  non-finite value, KV geometry the job's policy refuses, a model path or an environment
  argument that cannot work (`kvrl.gate`) — raises `ConfigError` whose message names the key,
  where it came from, and the fix. Nothing here imports torch or Ray; `kvrl.run` adds the
  machine's checks (`kvrl.gate.machine_problems`) just before a job starts.
"""

import copy
import difflib
import io
import math
import os
import re
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, get_origin

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, GrammarParseError, OmegaConfBaseException, ValidationError

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration problem; the message says what is wrong and how to fix it."""


def checked(default: Any, ok: Callable[[Any], bool] | None = None, rule: str = "", *, ge: float | None = None) -> Any:
    """A schema field whose value must pass `ok`, else `validate` reports "KEY RULE (got VALUE); set
    KEY=DEFAULT". `ge=LOW` is short for `v >= LOW` with the rule "must be >= LOW"."""
    if ge is not None:
        ok, rule = (lambda v: v >= ge), f"must be >= {ge}"
    if isinstance(default, (list, dict)):  # a mutable default: a fresh copy per instance
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"check": (ok, rule)})
    return field(default=default, metadata={"check": (ok, rule)})


@dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" = the shipped kvrl/models/weights/tiny_reasoner; else a dir or hub id
    dtype: str = checked("float32", lambda v: v in DTYPES, f"must be one of {' | '.join(DTYPES)}")  # parameter dtype
    # ids that end a sample; [] = all of the generation config's eos_token_id and the tokenizer's EOS
    stop_ids: List[int] = field(default_factory=list)
    # prompt + generated tokens a sequence may hold (vLLM sizes its KV cache check by it); 0 = the longest
    # prompt of a data set + sampling.max_new_tokens, else the model's max_position_embeddings
    max_model_len: int = checked(0, ge=0)

    def problems(self, cfg: "Config") -> list[str]:
        from kvrl.gate import model_problems  # a folder with a config.json, or a well-formed hub id

        return model_problems(self.path)


@dataclass
class EnvConfig:
    id: str = "kvrl/counts-v0"  # registered environment id, or a dotted path pkg.mod:Class
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the environment's constructor
    chat_template: bool = True  # render prompts with the tokenizer's chat template when it has one; false = raw
    system_prompt: str = ""  # the chat's system message; "" = none
    thinking: bool = True  # Qwen3's enable_thinking (other templates ignore it)
    num_eval_tasks: int = checked(256, ge=1)  # tasks drawn for evaluation

    def problems(self, cfg: "Config") -> list[str]:
        from kvrl.gate import env_problems  # the id resolves and the kwargs fit its constructor

        return env_problems("env.id", self.id, "env.kwargs", self.kwargs)


@dataclass
class KVConfig:
    policy: str = "full"  # KV policy name (full, streaming, h2o, snapkv, rkv, gkv, ...)
    budget: int = checked(0, ge=0)  # cached tokens kept per KV head; 0 = unbounded (eval jobs sweep eval.budgets)
    interval: int = checked(16, ge=1)  # evict every this many decoded tokens
    window: int = checked(8, ge=1)  # number of most recent queries used to score cached tokens
    sink: int = checked(4, ge=0)  # leading tokens that are never evicted
    # G-KV's ratio mode: an eviction keeps max(kv.budget, floor(ratio x tokens seen so far, prompt included));
    # null = the fixed kv.budget. job=eval applies it to its token-policy lines at every eval.budgets floor
    budget_ratio: Optional[float] = checked(None, lambda v: v is None or 0 < v <= 1,
                                            "must be null (a fixed budget) or a fraction in (0, 1]")
    kwargs: Dict[str, Any] = field(default_factory=dict)  # the policy's own arguments, e.g. {alpha: 0.8, mix_lambda: 0.5}

    def problems(self, cfg: "Config") -> list[str]:
        """Checked by the jobs (and rl.algo values) whose token policy is built from kv.*: the policy
        always keeps kv.sink + kv.window tokens and must choose at least one more by score."""
        job = JOBS[cfg.job]
        who = f"job={cfg.job}" + (f" rl.algo={cfg.rl.algo}" if job.algos else "")
        least = self.window + self.sink + 1
        fix = max(least, 4 * self.interval)
        if self.budget == 0:
            return [f"kv.budget=0 keeps every token, but {who} evicts with kv.policy={self.policy} and needs a "
                    f"budget; set kv.budget={fix}"]
        if self.budget < least:
            return [f"kv.budget must be >= kv.window + kv.sink + 1 = {least} (got {self.budget}): the policy always "
                    f"keeps the kv.sink first and kv.window newest tokens and chooses at least one by score; set "
                    f"kv.budget={fix} (or lower kv.window / kv.sink)"]
        if "budget_ratio" in self.kwargs:
            return [f"kv.kwargs.budget_ratio={self.kwargs['budget_ratio']}: the ratio mode is a kv key, which the "
                    f"memory plan and the engines' block caps read too; set kv.budget_ratio="
                    f"{self.kwargs['budget_ratio']} instead"]
        return []


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
    lr: float = checked(3e-3, lambda v: v > 0, "must be > 0")  # peak learning rate
    steps: int = checked(0, ge=0)  # optimizer steps; 0 = no training
    batch_size: int = checked(32, ge=1)  # samples per optimizer step
    warmup_steps: int = checked(100, ge=0)  # linear learning-rate warmup length
    weight_decay: float = checked(0.0, ge=0)  # AdamW weight decay
    log_every: int = checked(50, ge=1)  # steps between metric log lines
    max_grad_norm: float = checked(1.0, ge=0)  # clip the global gradient norm to this (0 = no clipping)
    # padded tokens (samples x longest prompt+completion) a learner scores and backpropagates at once; its
    # share of a step is split into such micro-batches and their gradients summed; 0 = the whole share at once
    micro_batch_tokens: int = checked(0, ge=0)
    # recompute each decoder layer's activations in backward instead of keeping them (full-model training)
    gradient_checkpointing: bool = False
    # RL jobs: an update whose loss or gradient norm is not finite is skipped (logged with skipped=1); this
    # many skipped in a row stop the run (the weights are not saved: resume=auto continues from the last checkpoint)
    max_nonfinite_steps: int = checked(3, ge=1)


@dataclass
class RLConfig:
    # RL jobs (job=rl): trainer.batch_size samples per step = batch_size / group_size tasks x group_size
    algo: str = "rl_full"  # algorithm in kvrl.algos: what is trained, the loss, what is pushed to rollouts
    group_size: int = checked(8, ge=2)  # samples per task (G); advantages are normalised within each task's group
    # advantage scaling: group (divide by the group's std, GRPO) | none (Dr. GRPO)
    scale: str = checked("group", lambda v: v in ("group", "none"), "must be group | none")
    # advantage of samples cut at max_new_tokens: zero | clip (max(A, 0), G-KV's) | keep
    truncated: str = checked("zero", lambda v: v in ("zero", "clip", "keep"), "must be zero | clip | keep")
    # loss: token (sum / all tokens, DAPO) | sequence (mean per sample, then mean)
    aggregation: str = checked("token", lambda v: v in ("token", "sequence"), "must be token | sequence")
    eps_low: float = checked(0.2, ge=0)  # PPO clip range below 1: ratio floor 1 - eps_low
    # PPO clip range above 1: ratio ceiling 1 + eps_high (DAPO's clip-higher: 0.28)
    eps_high: float = checked(0.2, ge=0)
    kl_coef: float = checked(0.0, ge=0)  # weight of the k3 KL to the initial model; 0 = no reference model is kept
    # 0 = on-policy; 1 = generate step t+1 while training on step t (staleness <= 1)
    async_steps: int = checked(0, lambda v: v in (0, 1), "must be 0 (on-policy) or 1 (one step ahead)")
    # steps between checkpoints in output_dir/checkpoints; 0 = only the last step
    checkpoint_every: int = checked(0, ge=0)

    def problems(self, cfg: "Config") -> list[str]:
        """Cross-field checks of RL jobs; each message names the key and a value that works."""
        problems = []
        g, n = self.group_size, cfg.trainer.batch_size
        if n % g or n < g:
            problems.append(f"trainer.batch_size ({n}) must be a multiple of rl.group_size ({g}): it is the number "
                            f"of samples per step; set trainer.batch_size={max(1, round(n / g)) * g}")
        if cfg.sampling.temperature <= 0:
            problems.append("sampling.temperature must be > 0 for RL: greedy decoding gives every sample of a "
                            "group the same text, hence zero advantages; set sampling.temperature=1.0")
        if cfg.sampling.top_p < 1:
            problems.append(f"sampling.top_p={cfg.sampling.top_p:g}: a rollout records each token's logprob in the "
                            "renormalised nucleus it was drawn from (vLLM's processed_logprobs; the HF engine records "
                            "the same), but the learner scores the token under the whole softmax, so the importance "
                            "ratio would be off by the nucleus's mass at every token; set sampling.top_p=1.0 (top-p "
                            "is for job=eval)")
        if cfg.workers.engine == "vllm" and cfg.sampling.temperature > 2:
            problems.append(f"sampling.temperature={cfg.sampling.temperature:g}: vLLM samples at temperatures in "
                            "[0, 2] only; set sampling.temperature=2.0 or workers.engine=hf")
        parts = max(cfg.workers.rollout, cfg.workers.learners)
        if n < parts:
            problems.append(f"trainer.batch_size ({n}) must be >= the number of rollout workers and of learners "
                            f"({parts}), each takes a share of the samples; set trainer.batch_size={parts * g}")
        from kvrl.algos import ALGOS  # a table of names; importing it loads no algorithm

        if self.algo not in ALGOS:
            near = difflib.get_close_matches(self.algo, ALGOS, n=1)
            problems.append(f"unknown rl.algo {self.algo!r}; set rl.algo={near[0] if near else next(iter(ALGOS))} "
                            f"(available: {', '.join(ALGOS)})")
        if cfg.trainer.steps < 1:
            problems.append("trainer.steps must be >= 1 for RL (it is the number of RL steps); set trainer.steps=20")
        return problems


@dataclass
class WorkersConfig:
    # "" = the cluster of `ray job submit` ($RAY_ADDRESS) if any, else a private local Ray; or auto / host:port
    address: str = ""
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
    zero_stage: int = checked(2, lambda v: v in (1, 2), "must be 1 or 2 (ZeRO-3's partitioned weights are not "
                              "gathered for the push yet)")
    # times a dead rollout actor is restarted (its shard redone) before the run fails
    max_restarts: int = checked(3, ge=0)
    # longest any single Ray call may take before the run fails with the actor's name
    timeout_s: float = checked(900.0, ge=1)


@dataclass
class DistillConfig:
    # rl.algo=distill (G-KV Appendix C): T^2 KL(full-cache teacher || sparse student), both at temperature T
    # soft-target temperature T of the distillation loss
    temperature: float = checked(1.0, lambda v: v > 0, "must be > 0 (the soft-target temperature T)")


@dataclass
class RLKVConfig:
    # RLKV (seed 000, methods.md §3): one gate per (layer, KV head) trained with GRPO (job=rlkv, rl.algo=rlkv)
    # and head reallocation from the exported gates (job=eval with eval.settings.NAME: {policy: heads, run: DIR}). Defaults: Table 3.
    # β of the adaptive L1 penalty 1(r̄ > τ)·β·(exp(r̄) − 1)·mean|α| (Qwen3-4B: 2.5e-3)
    l1_coef: float = checked(1.0e-3, lambda v: v >= 0, "must be >= 0 (the L1 penalty weight)")
    tau: float = 0.5  # τ: no penalty while the batch's mean reward r̄ ≤ τ (Qwen-2.5-7B-R1: 0.55)
    sink: int = checked(128, ge=0)  # training window of the compressed branch: sink tokens ...
    recent: int = checked(256, lambda v: v >= 1, "must be >= 1 (a token must see itself)")  # ... and recent tokens
    # fraction of (layer, KV head) pairs compressed at deployment, lowest gates first
    sparsity: float = checked(0.5, lambda v: 0 <= v <= 1, "must be a fraction in [0, 1] (of the heads compressed)")
    # deployment window of a compressed head (the paper's 16 sink + 64 recent)
    eval_sink: int = checked(16, ge=0)
    eval_recent: int = checked(64, lambda v: v >= 1, "must be >= 1 (a token must see itself)")

    def problems(self, cfg: "Config") -> list[str]:
        """Cross-field checks of RLKV training (an RL job with rl.algo=rlkv)."""
        problems = []
        if cfg.workers.engine != "vllm":
            problems.append(f"workers.engine={cfg.workers.engine!r}: RLKV's rollouts use the vLLM engine's "
                            "mixed-gate attention; set workers.engine=vllm")
        if cfg.kv.policy != "full":
            problems.append(f"kv.policy={cfg.kv.policy!r}: RLKV's rollouts mix full and rlkv.sink + rlkv.recent "
                            "attention per head, not a token policy; set kv.policy=full")
        return problems


@dataclass
class SelfDistillConfig:
    # job=self_distill (RLKV §3.3, App. B): tasks the model solves greedily with the full cache, by output length
    # the candidates' environment: in an RL recipe env.id is the selected set (SelfDistilledEnv), so the
    # data step has its own source (e.g. kvrl/math-v0 with {path: deepscaler.jsonl})
    source: str = "kvrl/counts-v0"
    source_kwargs: Dict[str, Any] = field(default_factory=dict)
    # tasks drawn from the source and decoded (a finite dataset: at most all of it)
    candidates: int = checked(4096, ge=1)
    # output-length bucket edges
    edges: List[int] = checked([0, 2048, 4096, 6144, 8192],
                               lambda v: len(v) >= 2 and all(a < b for a, b in zip(v, v[1:])) and v[0] >= 0,
                               "must be >= 2 increasing token counts (bucket b is edges[b] <= output length < "
                               "edges[b+1])")
    # solved tasks kept per bucket
    counts: List[int] = checked([600, 600, 1000, 800], lambda v: all(c >= 0 for c in v),
                                "must be task counts >= 0, one per bucket")

    def problems(self, cfg: "Config") -> list[str]:
        from kvrl.gate import env_problems

        problems = env_problems("self_distill.source", self.source, "self_distill.source_kwargs", self.source_kwargs)
        if len(self.counts) != len(self.edges) - 1:
            problems.append(f"self_distill.counts has {len(self.counts)} entries for {len(self.edges) - 1} buckets "
                            "(self_distill.edges); give one count per bucket")
        return problems


@dataclass
class PretrainConfig:
    # job=pretrain_tiny: the tiny reasoner trained from scratch on env.id's reference completions.
    # Its shape: query heads of size 32 (hidden / 32 of them) in kv_heads groups, tied embeddings
    layers: int = checked(4, ge=1)
    hidden: int = checked(128, lambda v: v >= 32 and v % 32 == 0, "must be a multiple of 32 (query heads of size 32)")
    kv_heads: int = checked(2, ge=1)
    intermediate: int = checked(384, ge=1)  # MLP width
    max_positions: int = checked(1024, ge=64)
    # grow the task sizes from small to env.kwargs's over this fraction of trainer.steps (0 = full size from
    # the start; environments with a size spec, e.g. kvrl/multihop-v0)
    curriculum: float = checked(0.0, lambda v: 0 <= v <= 1, "must be a fraction in [0, 1]")
    # kvrl/counts-v0 only: the share of rows whose unneeded tokens an oracle evicts (the shipped counts
    # reasoner's 0.5); 0 = the full causal context, as a real model is trained
    eviction_dropout: float = checked(0.0, lambda v: 0 <= v < 1, "must be in [0, 1)")
    checkpoint_every: int = checked(0, ge=0)  # steps between resumable checkpoints (0 = none)
    eval_tasks: int = checked(64, ge=1)  # held-out tasks of the greedy accuracy in the log

    def problems(self, cfg: "Config") -> list[str]:
        if (self.hidden // 32) % self.kv_heads:
            return [f"pretrain.kv_heads={self.kv_heads} must divide the {self.hidden // 32} query heads of "
                    f"pretrain.hidden={self.hidden}; set pretrain.kv_heads to a divisor of {self.hidden // 32}"]
        if self.eviction_dropout > 0 and cfg.env.id != "kvrl/counts-v0":
            return [f"pretrain.eviction_dropout={self.eviction_dropout} is the counts task's oracle eviction, but "
                    f"env.id={cfg.env.id}; set pretrain.eviction_dropout=0"]
        return []


@dataclass
class LoggingConfig:
    tensorboard: bool = False  # also write TensorBoard events to output_dir/tensorboard (`pip install tensorboard`)
    # also log to Weights & Biases (`pip install wandb`); WANDB_MODE=offline writes output_dir/wandb without a network
    wandb: bool = False


@dataclass
class EvalConfig:
    # job=eval's lines: zoo names (full streaming h2o snapkv rkv gkv learned), window, or eval.settings entries
    policies: List[str] = checked(["full", "streaming", "h2o", "snapkv", "rkv", "gkv"], lambda v: len(v) > 0,
                                  "must name at least one policy")
    # per-line settings {name: {policy: KIND, run: DIR, sparsities: [...], <the policy's own arguments>}};
    # a token policy's own interval / window / sink replace kv's for its line
    settings: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # KV budgets: <= 1 a fraction of the full cache's mean sequence length, > 1 a number of tokens
    budgets: List[float] = checked([0.25, 0.5], lambda v: len(v) > 0 and all(b > 0 for b in v),
                                   "must be fractions in (0, 1] or token counts > 1")
    samples: int = checked(1, ge=1)  # samples per task; accuracy is their mean (pass@1)
    pass_k: List[int] = checked([1], lambda v: all(k >= 1 for k in v), "must be >= 1")  # pass@k for k <= samples
    # also measure the task's properties on the model's attention (kvrl.eval.properties; the env's tasks must
    # carry their reference chain of thought in meta["completion"]) and set them beside the papers' orderings
    properties: bool = False

    def problems(self, cfg: "Config") -> list[str]:
        """The eval job's budgets are eval.budgets, not kv.budget; every line names a known kind."""
        from kvrl.eval.suite import KINDS

        problems = []
        if cfg.kv.budget > 0:
            problems.append(f"kv.budget={cfg.kv.budget} would be ignored: job={cfg.job} evaluates the budgets of "
                            f"eval.budgets ({cli_value(self.budgets)}: fractions of the mean sequence length or "
                            "tokens); set kv.budget=0 (and eval.budgets to what to evaluate)")
        no_ratio = {"window": "a fixed sink + recent window", "heads": "RLKV's head reallocation",
                    "full": "the full cache"}
        for name in self.policies:
            kind = self.settings.get(name, {}).get("policy", name)
            if kind in no_ratio and "budget_ratio" in self.settings.get(name, {}):
                problems.append(f"eval.policies entry {name!r} is {no_ratio[kind]}, which has no ratio mode, but "
                                f"eval.settings.{name}.budget_ratio is set; drop it")
            elif kind == "window" and cfg.kv.budget_ratio is not None:
                problems.append(f"eval.policies entry {name!r} is {no_ratio[kind]}, which has no ratio mode, but "
                                f"kv.budget_ratio is set; drop {name} from eval.policies, or give the ratio to the "
                                "token-policy lines only (eval.settings.NAME.budget_ratio)")
            if kind not in KINDS:
                near = difflib.get_close_matches(str(kind), KINDS, n=1)
                problems.append(f"eval.policies entry {name!r} is {kind!r}, not one of {', '.join(KINDS)} and no "
                                f"eval.settings.{name}.policy says which; "
                                + (f"set it to {near[0]}" if near else f"add eval.settings.{name}.policy=KIND"))
        return problems


@dataclass
class ForesightConfig:
    # ForesightKV (job=foresight): trace data -> Golden Eviction -> stage 1 SFT -> stage 2 RL.
    # The eviction setting is kv.budget / kv.interval / kv.window / kv.sink (kv.policy=learned);
    # stage 2 uses trainer.* (steps, lr, batch_size = traces x rl.group_size) and rl.* (kl_coef = KL to stage 1).
    # training traces to keep (correct, at least min_tokens long), generated with the full cache
    traces: int = checked(256, ge=1)
    heldout: int = checked(64, ge=1)  # held-out traces (other prompts) for the loss-ratio evaluation
    min_tokens: int = checked(0, ge=0)  # keep only traces of at least this many tokens (prompt + completion)
    shard_size: int = checked(64, ge=1)  # traces per parquet shard: the unit the data step resumes from
    sft_steps: int = checked(1000, ge=0)  # stage 1 optimizer steps (Adam, 10 warm-up steps, cosine decay)
    sft_batch_size: int = checked(8, ge=1)  # traces per stage 1 step
    sft_lr: float = checked(1.0e-2, lambda v: v > 0, "must be > 0")  # stage 1 peak learning rate
    margin: float = checked(0.01, ge=0)  # stage 1 pairwise ranking hinge margin
    eta: float = checked(1.5, ge=0)  # stage 2 reward: a token counts when its loss rose by more than eta
    # stage 2 reward: only this fraction of tokens, lowest full-cache entropy first
    low_entropy: float = checked(0.8, lambda v: 0 < v <= 1, "must be a fraction in (0, 1]")

    def problems(self, cfg: "Config") -> list[str]:
        """Cross-field checks of the ForesightKV pipeline."""
        problems = []
        kv = cfg.kv
        if kv.policy != "learned":
            problems.append(f"kv.policy is {kv.policy!r}; ForesightKV trains the learned scorer: set kv.policy=learned")
        if kv.budget_ratio is not None:
            problems.append(f"kv.budget_ratio={kv.budget_ratio}: ForesightKV's eviction MDP and Golden Eviction keep "
                            "the fixed kv.budget; set kv.budget_ratio=null (job=eval runs a trained scorer in ratio "
                            "mode: eval.settings.NAME: {policy: learned, run: DIR, budget_ratio: R})")
        g, n = cfg.rl.group_size, cfg.trainer.batch_size
        if n % g or n < g:
            problems.append(f"trainer.batch_size ({n}) must be a multiple of rl.group_size ({g}): stage 2 draws "
                            f"rl.group_size eviction trajectories per trace; set trainer.batch_size="
                            f"{max(1, round(n / g)) * g}")
        return problems


@dataclass
class Config:
    # what a resumed run may change (a key, or a section with its dot); anything else must equal the checkpoint's
    RESUMABLE: ClassVar[tuple[str, ...]] = ("trainer.steps", "logging.", "resume", "print_config", "dry_run",
                                            "rl.checkpoint_every", "workers.address", "workers.num_cpus",
                                            "workers.timeout_s", "workers.max_restarts", "workers.kv_cache_gib",
                                            "trainer.max_nonfinite_steps", "workers.niceness",
                                            "recipe_file")  # where the values came from: the values are compared
    # a value read from the environment (`${oc.env:NAME}`, directly or through another key) -> how it reads with
    # the reference unresolved: what checkpoints, W&B and print_config show instead (set by load_config; the
    # resolved value stays in the field for the job to use)
    env_references: ClassVar[Dict[str, Any]] = {}
    recipe: str = "tiny_foresight"  # recipe name (file stem in the recipes folder); the default is the main job
    recipe_file: str = ""  # a recipe of your own, by path (instead of recipe=NAME); its stem becomes recipe
    job: str = MISSING  # which job runs (see `python -m kvrl.run --help`)
    # seed for every random number generator; engines add sample indices to it and torch's generators
    # take at most 64 bits, so 99999999999999999999 used to pass here and fail at engine start
    seed: int = checked(0, lambda v: 0 <= v < 2 ** 32, "must be in [0, 2**32)")
    run_name: str = "${recipe}"  # name of this run in logs and output paths
    output_dir: str = "outputs/${run_name}"  # where metrics, checkpoints and plots go
    device: str = "cpu"  # torch device, e.g. cpu or cuda
    print_config: bool = False  # print the resolved config as YAML and exit
    dry_run: bool = False  # print the resource plan and the KV-memory estimate, then exit (no weights needed)
    # auto (latest checkpoint in output_dir, if any) | never | a checkpoint path
    resume: str = checked("auto", lambda v: v in ("auto", "never") or Path(v).exists(), "must be auto, never or a path")
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    foresight: ForesightConfig = field(default_factory=ForesightConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    rlkv: RLKVConfig = field(default_factory=RLKVConfig)
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)


@dataclass(frozen=True)
class Job:
    entry: str  # "module:function" called with the typed Config
    # the config sections whose cross-field checks (`problems`) apply to the job; "kv" = the job builds
    # a token policy from kv.budget / kv.window / kv.sink
    sections: tuple[str, ...] = ()
    # RL jobs: the rl.algo values the job runs -> the sections each adds (its own, "kv" when it evicts)
    algos: Dict[str, tuple[str, ...]] = field(default_factory=dict)
    ray: bool = False  # runs Ray actors (workers.*): a local Ray must host them (kvrl.gate.machine_problems)


# cfg.job -> Job; the single list of jobs
JOBS = {
    "eval": Job("kvrl.jobs.eval:main", sections=("model", "env", "eval")),
    "foresight": Job("kvrl.jobs.foresight:main", sections=("model", "env", "kv", "foresight"), ray=True),
    "foresight_traces": Job("kvrl.jobs.foresight_traces:main", sections=("model", "env"), ray=True),
    "pretrain_tiny": Job("kvrl.jobs.pretrain_tiny:main", sections=("env", "pretrain")),
    "rl": Job("kvrl.jobs.rl:main", sections=("model", "env", "rl"), ray=True,
              algos={"rl_full": (), "rl_sparse": ("kv",), "distill": ("distill", "kv")}),
    "rlkv": Job("kvrl.jobs.rlkv:main", sections=("model", "env", "rl"), algos={"rlkv": ("rlkv",)}, ray=True),
    "self_distill": Job("kvrl.jobs.self_distill:main", sections=("model", "self_distill")),
}

# a key naming what its kwargs construct: when the command line changes it, the recipe's kwargs are dropped
KWARGS_OF = {"env.id": "env.kwargs", "self_distill.source": "self_distill.source_kwargs", "kv.policy": "kv.kwargs"}

# keys renamed because the old name misled: old key -> (new key, what it is)
RENAMED = {
    "rl.beta": ("rl.kl_coef", "the weight of the KL to the reference model"),
    "rlkv.beta": ("rlkv.l1_coef", "the weight of RLKV's L1 penalty on the gates"),
}


def schema_keys(cls: type = Config, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Every leaf key of the schema as a dotted path -> (type, default); `???` = required."""
    keys: dict[str, tuple[Any, Any]] = {}
    for f in fields(cls):
        if is_dataclass(f.type):
            keys.update(schema_keys(f.type, f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if f.default is NO_DEFAULT else f.default
            keys[prefix + f.name] = (f.type, default)
    return keys


def cli_value(value: Any) -> str:
    """`value` as it would be typed after `key=` on the command line."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def recipes_dir() -> Path:
    repo_recipes = Path(__file__).resolve().parent.parent / "recipes"
    return Path(os.environ.get("KVRL_RECIPES_DIR") or repo_recipes)


def available_recipes() -> dict[str, str]:
    """Recipe name -> its description (the first comment line of the file); bases are not recipes. A
    file that cannot be read is listed with what is wrong (`--help` works whatever one recipe holds)."""
    recipes = {}
    for path in sorted(recipes_dir().glob("*.yaml")):
        try:
            comments = [ln for ln in _read_text(path).splitlines() if ln.startswith("#")]
        except ConfigError as err:
            recipes[path.stem] = f"(unreadable: {str(err).removeprefix(f'{path}: ')})"
            continue
        recipes[path.stem] = comments[0].lstrip("#").strip() if comments else ""
    return recipes


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}: not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}, line {line}); "
                          "save the file as UTF-8") from None


def _value_syntax(key: str, value: str) -> str:
    """What is wrong with a value the parser refused, and a well-formed one for `key`."""
    default = schema_keys().get(key, (None, None))[1]
    if "${" in value:
        example = default if "${" in str(default) else "${recipe}"
        return (f"an interpolation is ${{other.key}}, closed by a brace (got {value!r}); set e.g. {key}={example}")
    if value.lstrip().startswith("["):
        example = cli_value(default) if isinstance(default, list) else "[a,b]"
        return f"a list is [a,b,...], closed by a bracket (got {value!r}); set e.g. {key}={example}"
    if value.lstrip().startswith("{"):
        return (f"a mapping is {{name: value, ...}}, closed by a brace (got {value!r}); set e.g. "
                f"{key}='{{name: value}}' (quoted for the shell)")
    return f"the parser refused {value!r}; quote a value with special characters, e.g. {key}='a: b'"


def _parse_cli(argv: Sequence[str]) -> DictConfig:
    for arg in argv:
        key, _, value = arg.partition("=")
        if "=" not in arg or not key or "" in key.split("."):
            raise ConfigError(
                f"malformed argument {arg!r}: arguments are key=value with a dotted key, "
                "e.g. `python -m kvrl.run recipe=tiny_rl_full trainer.lr=1e-3`"
            )
        try:
            OmegaConf.from_dotlist([arg])
        except (yaml.YAMLError, OmegaConfBaseException):
            raise ConfigError(f"command line: {key} is malformed: {_value_syntax(key, value)}") from None
    return OmegaConf.from_dotlist(list(argv))


def _valid_value(key: str, before: DictConfig, layer: DictConfig) -> str:
    """A value of `key` the job accepts: the one the layers before `layer` give (the recipe's, else the
    schema's), or, when the job's checks refuse that one, the value their message proposes."""
    value = OmegaConf.select(before, key, default=None, throw_on_missing=False)
    try:
        trial = OmegaConf.merge(before, {})
        job = OmegaConf.select(layer, "job", default=None, throw_on_missing=False)
        if isinstance(job, str):
            trial.job = job
        return _job_fix(OmegaConf.to_object(trial), key, value)
    except Exception:  # noqa: BLE001 (only a hint: the layers' own problems are reported when they load)
        return cli_value(value)


def _merge_error(err: OmegaConfBaseException, layer: DictConfig, source: str, before: DictConfig) -> ConfigError:
    """Turn an OmegaConf merge error into a message that names the key and the fix."""
    keys = schema_keys()
    key = str(getattr(err, "full_key", None) or "")
    if isinstance(err, ConfigKeyError) and key in RENAMED:
        new, what = RENAMED[key]
        given = OmegaConf.select(layer, key, default=None, throw_on_missing=False)
        return ConfigError(f"{source}: {key} was renamed {new} ({what}); set {new}={cli_value(given)}")
    if isinstance(err, ConfigKeyError) and key:
        section = key.rpartition(".")[0]
        candidates = [k for k in keys if k.rpartition(".")[0] == section]
        # a mistyped section name (trainr.lr) should suggest the section, not a leaf
        candidates += sorted({k.split(".")[0] for k in keys if "." in k and not section})
        near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]}?" if near else "`python -m kvrl.run --help` lists the valid keys"
        return ConfigError(f"{source}: unknown key {key}; {hint}")
    base = key.split("[")[0]
    if isinstance(err, ValidationError) and base in keys:
        expected = keys[base][0]
        name = expected.__name__ if isinstance(expected, type) else str(expected).replace("typing.", "")
        given = OmegaConf.select(layer, key, default=None, throw_on_missing=False)
        return ConfigError(
            f"{source}: {key} expects {name}, got {given!r}; set e.g. {base}={_valid_value(base, before, layer)}"
        )
    reason = str(err).splitlines()[0]
    return ConfigError(f"{source}: {reason}; `python -m kvrl.run --help` lists the keys and defaults")


def _read_yaml(path: Path) -> DictConfig:
    text = _read_text(path)
    try:
        layer = OmegaConf.load(io.StringIO(text))
    except GrammarParseError as err:
        raise ConfigError(f"{path}: {err.full_key} holds a malformed interpolation ({str(err).splitlines()[0]}); "
                          "an interpolation is ${other.key}, closed by a brace, e.g. output_dir: "
                          "outputs/${run_name}") from None
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())}); fix the file") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping of keys to values")
    return layer


def _recipe_path(name: str) -> Path:
    """recipes/NAME.yaml. A name, never a path: `recipe=../../x` or `recipe=/etc/x` would load YAML from
    anywhere under a name that looks like a shipped recipe's (a file of your own is `recipe_file=PATH`)."""
    names = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or ".." in name:
        raise ConfigError(f"recipe={name} is not a recipe name: recipe= takes the name of a file in {recipes_dir()} "
                          f"({', '.join(names) or '(none)'}); load a file of your own with recipe_file={name}")
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f"did you mean recipe={near[0]}? " if near else ""
        raise ConfigError(f"unknown recipe {name!r}: no {path}; {hint}available recipes: "
                          f"{', '.join(names) or '(none)'}")
    return path


def _load_recipe(path: Path) -> list[tuple[DictConfig, str]]:
    """The recipe's layers with their sources, to merge in order: its base (if any), then the recipe."""
    recipe = _read_yaml(path)
    if "base" not in recipe:
        return [(recipe, str(path))]
    # `base: NAME`: the keys a method's recipes share, in recipes/base/NAME.yaml (a name, as recipe= takes)
    base = recipe.pop("base")
    base_path = recipes_dir() / "base" / f"{base}.yaml"
    if not isinstance(base, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", base) or ".." in base \
            or not base_path.is_file():
        names = ", ".join(sorted(p.stem for p in base_path.parent.glob("*.yaml"))) or "(none)"
        raise ConfigError(f"{path}: unknown base {base!r}: no {base_path}; available bases: {names}")
    return [(_read_yaml(base_path), str(base_path)), (recipe, str(path))]


def _field_problems(section: Any, prefix: str = "") -> list[tuple[str, str, Any, Any]]:
    """(key, rule, value, default) of the range checks declared beside the fields (`checked`) that
    fail, over the whole config; every float must be finite (inf and nan pass most range checks)."""
    problems = []
    for f in fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        default = f.default_factory() if f.default is NO_DEFAULT else f.default
        if is_dataclass(value):
            problems += _field_problems(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append((key, "must be a finite number", value, default))
        elif "check" in f.metadata and not f.metadata["check"][0](value):
            problems.append((key, f.metadata["check"][1], value, default))
    return problems


def _section_problems(cfg: Config) -> list[str]:
    """The cross-field checks of the job's sections (`Job.sections`, and its rl.algo's)."""
    problems = []
    job = JOBS.get(cfg.job, Job(""))  # an unknown job: kvrl.run names the jobs
    sections = job.sections
    if job.algos:
        sections += job.algos.get(cfg.rl.algo, ())
        owner = next((name for name, other in JOBS.items() if cfg.rl.algo in other.algos), None)
        if owner not in (None, cfg.job):  # an unknown rl.algo is RLConfig's to report
            problems.append(f"job={cfg.job} runs rl.algo={' | '.join(job.algos)}, not rl.algo={cfg.rl.algo}; "
                            f"set job={owner} (or rl.algo={next(iter(job.algos))})")
    for name in dict.fromkeys(sections):
        section = getattr(cfg, name, None)
        if hasattr(section, "problems"):
            problems += section.problems(cfg)
    return problems


def _job_fix(cfg: Config, key: str, value: Any) -> str:
    """`value` as the fix for `key`, unless the job's cross-field checks refuse it (trainer.steps=0 in an
    RL job): then the value their message proposes."""
    trial, (*path, leaf) = copy.deepcopy(cfg), key.split(".")
    section = trial
    for name in path:
        section = getattr(section, name)
    setattr(section, leaf, value)
    found = re.search(rf"set (?:e\.g\. )?{re.escape(key)}=([^\s,;)]+)", "\n".join(_section_problems(trial)))
    return found.group(1) if found else cli_value(value)


def validate(cfg: Config) -> None:
    """The checks the types cannot express; raises one ConfigError listing every problem."""
    problems = [f"{key} {rule} (got {value!r}); set {key}={_job_fix(cfg, key, default)}"
                for key, rule, value, default in _field_problems(cfg)]
    problems += _section_problems(cfg)
    if problems:
        raise ConfigError("invalid config: " + "\n".join(problems))


def load_config(argv: Sequence[str]) -> Config:
    """schema ⊕ base ⊕ recipes/NAME.yaml ⊕ `key=value` arguments -> validated, typed Config."""
    cli = _parse_cli(argv)
    own = str(cli.get("recipe_file") or "")
    if own:
        if "recipe" in cli:
            raise ConfigError(f"recipe={cli.recipe} and recipe_file={own} both name the recipe; give one")
        path = Path(own).expanduser()
        if not path.is_file():
            raise ConfigError(f"recipe_file={own}: no such file; give the path of a YAML recipe (or recipe=NAME for "
                              f"one in {recipes_dir()})")
        name = path.stem
    else:
        name = str(cli.get("recipe", Config.recipe))
        path = _recipe_path(name)
    # what the command line chose wins over a `recipe:` / `recipe_file:` written in the file
    cli.recipe, cli.recipe_file = name, own
    layers = _load_recipe(path)
    recipe_path = layers[-1][1]
    merged = OmegaConf.structured(Config)
    for layer, source in layers + [(cli, "command line")]:
        if layer is cli:  # what the command line replaces rather than merges into (the module docstring)
            given = [arg.partition("=")[0] for arg in argv]
            dropped = [kw for owner, kw in KWARGS_OF.items()
                       if owner in given and str(OmegaConf.select(cli, owner)) != str(OmegaConf.select(merged, owner))]
            whole = [key for key in given if get_origin(schema_keys().get(key, (None,))[0]) is dict]
            for key in dropped + whole:
                OmegaConf.update(merged, key, {}, merge=False)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _merge_error(err, layer, source, merged) from None
    if OmegaConf.is_missing(merged, "job"):
        raise ConfigError(f"job is not set; add `job: NAME` to {recipe_path} or pass job=NAME "
                          "(`python -m kvrl.run --help` lists the jobs)")
    OmegaConf.set_readonly(merged, True)
    raw = repr(OmegaConf.to_container(merged, resolve=False))
    names = list(dict.fromkeys(name.strip() for name in ENV_REFERENCE.findall(raw)))
    secrets = {name: os.environ[name] for name in names if os.environ.get(name)}
    try:
        try:
            cfg = OmegaConf.to_object(merged)
            references = _env_references(merged) if names else {}
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or "the config"
            raise ConfigError(f"cannot resolve {key}: {str(err).splitlines()[0]}; an interpolation names another "
                              "key, e.g. output_dir=outputs/${run_name}") from None
        assert isinstance(cfg, Config)
        cfg.env_references = references
        validate(cfg)
    except ConfigError as err:  # a message shows values: never the environment's in the clear
        message = str(err)
        for name, value in secrets.items():
            message = re.sub(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", f"${{oc.env:{name}}}", message)
        raise ConfigError(message) from None
    return cfg


ENV_REFERENCE = re.compile(r"\$\{oc\.env:([^,}]+)")


def _env_references(merged: DictConfig) -> dict[str, Any]:
    """The keys whose value reads an environment variable (`${oc.env:NAME}`, directly or through another
    key's interpolation) -> their value with every such reference left as it is written.

    The variables are resolved into the config (a job needs a token's value), but a checkpoint's
    config.json, W&B and print_config would then hold a secret in the clear: they write these instead
    (`Config.env_references`), so a resumed run compares the references, not the values."""

    def escape(node: Any) -> Any:  # `\${` is OmegaConf's literal `${`: the reference survives resolution
        if isinstance(node, dict):
            return {k: escape(v) for k, v in node.items()}
        if isinstance(node, list):
            return [escape(v) for v in node]
        return node.replace("${oc.env:", "\\${oc.env:") if isinstance(node, str) else node

    escaped = OmegaConf.create(escape(OmegaConf.to_container(merged, resolve=False)))
    references = {}
    for key in schema_keys():
        node = OmegaConf.select(escaped, key, throw_on_missing=False)
        value = OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node
        if "${oc.env:" in repr(value):
            references[key] = value
    return references
