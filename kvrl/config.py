"""Typed configuration: schema ⊕ recipe ⊕ command line, validated before anything runs.

Contract:

* The schema is the dataclass `Config` below; it is the only place keys, types and
  defaults are declared.
* `load_config(argv)` merges, in this order, the schema (`OmegaConf.structured`),
  `recipes/NAME.yaml` (NAME from `recipe=NAME` on the command line, else `default`) and
  the command-line `key=value` dotlist, makes the result read-only, resolves
  interpolations and converts it to the dataclasses with `OmegaConf.to_object`.
* Recipes live in the repository's `recipes/` folder, or in `$KVRL_RECIPES_DIR`.
* Every problem — unknown recipe, unknown key (in a recipe or on the command line),
  wrong type, malformed argument, out-of-range value — raises `ConfigError` whose message
  names the key, where it came from, and the fix. Nothing here imports torch.
"""

import difflib
import operator
import os
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration problem; the message says what is wrong and how to fix it."""


@dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" = the shipped kvrl/models/weights/tiny_reasoner; else a dir or hub id
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16 | float16


@dataclass
class EnvConfig:
    id: str = "kvrl/counts-v0"  # registered environment id, or a dotted path pkg.mod:Class
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the environment's constructor
    num_eval_tasks: int = 256  # tasks drawn for evaluation


@dataclass
class KVConfig:
    policy: str = "full"  # KV policy name (full, streaming, h2o, snapkv, rkv, gkv, ...)
    budget: int = 0  # cached tokens kept per KV head; 0 = unbounded (eval jobs sweep eval.budgets)
    interval: int = 16  # evict every this many decoded tokens
    window: int = 8  # number of most recent queries used to score cached tokens
    sink: int = 4  # leading tokens that are never evicted
    kwargs: Dict[str, Any] = field(default_factory=dict)  # the policy's own arguments, e.g. {alpha: 0.8, mix_lambda: 0.5}


@dataclass
class SamplingConfig:
    max_new_tokens: int = 160  # generation length limit per sample
    temperature: float = 0.0  # 0 = greedy decoding
    batch_size: int = 64  # prompts generated together


@dataclass
class TrainerConfig:
    lr: float = 3e-3  # peak learning rate
    steps: int = 0  # optimizer steps; 0 = no training
    batch_size: int = 32  # samples per optimizer step
    warmup_steps: int = 100  # linear learning-rate warmup length
    weight_decay: float = 0.0  # AdamW weight decay
    log_every: int = 50  # steps between metric log lines
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = no clipping)


@dataclass
class RLConfig:
    # RL jobs (job=rl): trainer.batch_size samples per step = batch_size / group_size tasks x group_size
    algo: str = "rl_full"  # algorithm in kvrl.algos: what is trained, the loss, what is pushed to rollouts
    group_size: int = 8  # samples per task (G); advantages are normalised within each task's group
    scale: str = "group"  # advantage scaling: group (divide by the group's std, GRPO) | none (Dr. GRPO)
    truncated: str = "zero"  # advantage of samples cut at max_new_tokens: zero | clip (max(A, 0), G-KV's) | keep
    aggregation: str = "token"  # loss: token (sum / all tokens, DAPO) | sequence (mean per sample, then mean)
    eps_low: float = 0.2  # PPO clip range below 1: ratio floor 1 - eps_low
    eps_high: float = 0.2  # PPO clip range above 1: ratio ceiling 1 + eps_high (DAPO's clip-higher: 0.28)
    beta: float = 0.0  # weight of the k3 KL to the initial model; 0 = no reference model is kept
    async_steps: int = 0  # 0 = on-policy; 1 = generate step t+1 while training on step t (staleness <= 1)
    checkpoint_every: int = 0  # steps between checkpoints in output_dir/checkpoints; 0 = only the last step


@dataclass
class WorkersConfig:
    # "" = the cluster of `ray job submit` ($RAY_ADDRESS) if any, else a private local Ray; or auto / host:port
    address: str = ""
    num_cpus: int = 0  # CPUs a private local Ray may use; 0 = all of this machine
    engine: str = "hf"  # rollout engine: hf (kvrl's reference) | vllm (vLLM with kvrl's plugin: pip install .[cpu] or .[gpu])
    rollout: int = 2  # RolloutWorker actors, each wrapping an engine; a step's samples are split across them
    rollout_cpus: float = 0.5  # CPUs reserved per rollout actor (fractions pack several actors on a core)
    rollout_gpus: float = 0.0  # GPUs per rollout actor (set device=cuda too)
    learners: int = 1  # Learner actors; > 1 = data parallel, gradients all-reduced (gloo on CPU, nccl on GPU)
    learner_cpus: float = 0.5  # CPUs reserved per learner actor
    learner_gpus: float = 0.0  # GPUs per learner actor
    backend: str = "ddp"  # learner optimizer: ddp (torch AdamW, all-reduced grads) | deepspeed (ZeRO)
    zero_stage: int = 2  # DeepSpeed ZeRO stage for backend=deepspeed: 1 | 2
    max_restarts: int = 3  # times a dead rollout actor is restarted (its shard redone) before the run fails
    timeout_s: float = 900.0  # longest any single Ray call may take before the run fails with the actor's name


@dataclass
class DistillConfig:
    # rl.algo=distill (G-KV Appendix C): T^2 KL(full-cache teacher || sparse student), both at temperature T
    temperature: float = 1.0  # soft-target temperature T of the distillation loss


@dataclass
class RLKVConfig:
    # RLKV (seed 000, methods.md §3): one gate per (layer, KV head) trained with GRPO (job=rlkv, rl.algo=rlkv)
    # and head reallocation from the exported gates (job=eval_budgets with rlkv.gates). Defaults: Table 3.
    beta: float = 1.0e-3  # β of the adaptive L1 penalty 1(r̄ > τ)·β·(exp(r̄) − 1)·mean|α| (Qwen3-4B: 2.5e-3)
    tau: float = 0.5  # τ: no penalty while the batch's mean reward r̄ ≤ τ (Qwen-2.5-7B-R1: 0.55)
    sink: int = 128  # training window of the compressed branch: sink tokens ...
    recent: int = 256  # ... and recent tokens (deployment uses eval_sink / eval_recent)
    gates: str = ""  # exported gates (a gates.safetensors, or the rlkv run's output_dir) to evaluate; "" = none
    sparsity: float = 0.5  # fraction of (layer, KV head) pairs compressed at deployment, lowest gates first
    eval_sink: int = 16  # deployment window of a compressed head (the paper's 16 sink + 64 recent)
    eval_recent: int = 64


@dataclass
class SelfDistillConfig:
    # job=self_distill (RLKV §3.3, App. B): tasks the model solves greedily with the full cache, by output length
    # the candidates' environment: in an RL recipe env.id is the selected set (SelfDistilledEnv), so the
    # data step has its own source (e.g. kvrl/math-v0 with {path: deepscaler.jsonl})
    source: str = "kvrl/counts-v0"
    source_kwargs: Dict[str, Any] = field(default_factory=dict)
    candidates: int = 4096  # tasks drawn from the source and decoded (a finite dataset: at most all of it)
    edges: List[int] = field(default_factory=lambda: [0, 2048, 4096, 6144, 8192])  # output-length bucket edges
    counts: List[int] = field(default_factory=lambda: [600, 600, 1000, 800])  # solved tasks kept per bucket


@dataclass
class LoggingConfig:
    tensorboard: bool = False  # also write TensorBoard events to output_dir/tensorboard (`pip install tensorboard`)


@dataclass
class EvalConfig:
    # KV budgets to evaluate, as fractions of the average sequence length
    budgets: List[float] = field(default_factory=lambda: [0.25, 0.5])


@dataclass
class ForesightConfig:
    # ForesightKV (job=foresight): trace data -> Golden Eviction -> stage 1 SFT -> stage 2 RL.
    # The eviction setting is kv.budget / kv.interval / kv.window / kv.sink (kv.policy=learned);
    # stage 2 uses trainer.* (steps, lr, batch_size = traces x rl.group_size) and rl.* (beta = KL to stage 1).
    traces: int = 256  # training traces to keep (correct, at least min_tokens long), generated with the full cache
    heldout: int = 64  # held-out traces (other prompts) for the loss-ratio evaluation
    min_tokens: int = 0  # keep only traces of at least this many tokens (prompt + completion)
    shard_size: int = 64  # traces per parquet shard: the unit the data step resumes from
    sft_steps: int = 1000  # stage 1 optimizer steps (Adam, 10 warm-up steps, cosine decay)
    sft_batch_size: int = 8  # traces per stage 1 step
    sft_lr: float = 1.0e-2  # stage 1 peak learning rate
    margin: float = 0.01  # stage 1 pairwise ranking hinge margin
    eta: float = 1.5  # stage 2 reward: a token counts when its loss rose by more than eta
    low_entropy: float = 0.8  # stage 2 reward: only this fraction of tokens, lowest full-cache entropy first


@dataclass
class Config:
    recipe: str = "tiny_foresight"  # recipe name (file stem in the recipes folder); the default is the main job
    job: str = MISSING  # which job runs (see `python -m kvrl.run --help`)
    seed: int = 0  # seed for every random number generator
    run_name: str = "${recipe}"  # name of this run in logs and output paths
    output_dir: str = "outputs/${run_name}"  # where metrics, checkpoints and plots go
    device: str = "cpu"  # torch device, e.g. cpu or cuda
    print_config: bool = False  # print the resolved config as YAML and exit
    dry_run: bool = False  # print the resource plan and the KV-memory estimate, then exit (no weights needed)
    resume: str = "auto"  # auto (latest checkpoint in output_dir, if any) | never | a checkpoint path
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
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def recipes_dir() -> Path:
    repo_recipes = Path(__file__).resolve().parent.parent / "recipes"
    return Path(os.environ.get("KVRL_RECIPES_DIR") or repo_recipes)


def available_recipes() -> dict[str, str]:
    """Recipe name -> its description (the first comment line of the file)."""
    recipes = {}
    for path in sorted(recipes_dir().glob("*.yaml")):
        comments = [ln for ln in path.read_text().splitlines() if ln.startswith("#")]
        recipes[path.stem] = comments[0].lstrip("#").strip() if comments else ""
    return recipes


def _parse_cli(argv: Sequence[str]) -> DictConfig:
    for arg in argv:
        key = arg.partition("=")[0]
        if "=" not in arg or not key or "" in key.split("."):
            raise ConfigError(
                f"malformed argument {arg!r}: arguments are key=value with a dotted key, "
                "e.g. `python -m kvrl.run recipe=tiny_rl_full trainer.lr=1e-3`"
            )
    return OmegaConf.from_dotlist(list(argv))


def _merge_error(err: OmegaConfBaseException, layer: DictConfig, source: str) -> ConfigError:
    """Turn an OmegaConf merge error into a message that names the key and the fix."""
    keys = schema_keys()
    key = str(getattr(err, "full_key", None) or "")
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
        expected, default = keys[base]
        name = expected.__name__ if isinstance(expected, type) else str(expected).replace("typing.", "")
        given = OmegaConf.select(layer, key, default=None, throw_on_missing=False)
        return ConfigError(
            f"{source}: {key} expects {name}, got {given!r}; set e.g. {base}={cli_value(default)}"
        )
    reason = str(err).splitlines()[0]
    return ConfigError(f"{source}: {reason}; `python -m kvrl.run --help` lists the keys and defaults")


def _load_recipe(name: str) -> tuple[DictConfig, str]:
    path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(available_recipes()) or "(none)"
        raise ConfigError(f"unknown recipe {name!r}: no {path}; available recipes: {names}")
    try:
        recipe = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())}); fix the file") from None
    if not isinstance(recipe, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping of keys to values")
    return recipe, str(path)


# (key, check, rule broken); the fix offered is the key's schema default
_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("model.dtype", lambda v: v in DTYPES, f"must be one of {' | '.join(DTYPES)}"),
    ("trainer.lr", lambda v: v > 0, "must be > 0"),
    ("eval.budgets", lambda v: len(v) > 0 and all(0 < b <= 1 for b in v), "must be fractions in (0, 1]"),
    ("resume", lambda v: v in ("auto", "never") or Path(v).exists(), "must be auto, never or a path"),
    ("rl.scale", lambda v: v in ("group", "none"), "must be group | none"),
    ("rl.truncated", lambda v: v in ("zero", "clip", "keep"), "must be zero | clip | keep"),
    ("rl.aggregation", lambda v: v in ("token", "sequence"), "must be token | sequence"),
    ("rl.async_steps", lambda v: v in (0, 1), "must be 0 (on-policy) or 1 (one step ahead)"),
    ("workers.backend", lambda v: v in ("ddp", "deepspeed"), "must be ddp | deepspeed"),
    ("distill.temperature", lambda v: v > 0, "must be > 0 (the soft-target temperature T)"),
    ("workers.engine", lambda v: v in ("hf", "vllm"), "must be hf | vllm"),
    ("workers.zero_stage", lambda v: v in (1, 2), "must be 1 or 2 (ZeRO-3's partitioned weights are not "
     "gathered for the push yet)"),
] + [(key, lambda v, low=low: v >= low, f"must be >= {low}") for key, low in {
    "env.num_eval_tasks": 1, "kv.budget": 0, "kv.interval": 1, "kv.window": 1, "kv.sink": 0,
    "sampling.max_new_tokens": 1, "sampling.temperature": 0, "sampling.batch_size": 1,
    "trainer.steps": 0, "trainer.batch_size": 1, "trainer.warmup_steps": 0,
    "trainer.weight_decay": 0, "trainer.log_every": 1, "trainer.max_grad_norm": 0,
    "rl.group_size": 2, "rl.eps_low": 0, "rl.eps_high": 0, "rl.beta": 0, "rl.checkpoint_every": 0,
    "workers.num_cpus": 0, "workers.rollout": 1, "workers.rollout_cpus": 0, "workers.rollout_gpus": 0,
    "workers.learners": 1, "workers.learner_cpus": 0, "workers.learner_gpus": 0, "workers.max_restarts": 0,
    "workers.timeout_s": 1,
    "foresight.traces": 1, "foresight.heldout": 1, "foresight.min_tokens": 0, "foresight.shard_size": 1,
    "foresight.sft_steps": 0, "foresight.sft_batch_size": 1, "foresight.margin": 0, "foresight.eta": 0,
}.items()] + [
    ("foresight.sft_lr", lambda v: v > 0, "must be > 0"),
    ("foresight.low_entropy", lambda v: 0 < v <= 1, "must be a fraction in (0, 1]"),
    ("rlkv.beta", lambda v: v >= 0, "must be >= 0 (the L1 penalty weight)"),
    ("rlkv.sparsity", lambda v: 0 <= v <= 1, "must be a fraction in [0, 1] (of the heads compressed)"),
    ("rlkv.recent", lambda v: v >= 1, "must be >= 1 (a token must see itself)"),
    ("rlkv.eval_recent", lambda v: v >= 1, "must be >= 1 (a token must see itself)"),
    ("rlkv.sink", lambda v: v >= 0, "must be >= 0"),
    ("rlkv.eval_sink", lambda v: v >= 0, "must be >= 0"),
    ("self_distill.candidates", lambda v: v >= 1, "must be >= 1"),
    ("self_distill.counts", lambda v: all(c >= 0 for c in v), "must be task counts >= 0, one per bucket"),
    ("self_distill.edges", lambda v: len(v) >= 2 and all(a < b for a, b in zip(v, v[1:])) and v[0] >= 0,
     "must be >= 2 increasing token counts (bucket b is edges[b] <= output length < edges[b+1])"),
]


def validate(cfg: Config) -> None:
    """Range checks the types cannot express; raises one ConfigError listing every problem."""
    keys = schema_keys()
    problems = [
        f"{key} {rule} (got {value!r}); set {key}={cli_value(keys[key][1])}"
        for key, check, rule in _RULES
        if not check(value := operator.attrgetter(key)(cfg))
    ]
    if cfg.job in ("rl", "rlkv"):
        problems += _rl_problems(cfg)
    if cfg.job == "rlkv" or cfg.rl.algo == "rlkv":
        problems += _rlkv_problems(cfg)
    if cfg.job == "self_distill" and len(cfg.self_distill.counts) != len(cfg.self_distill.edges) - 1:
        problems.append(f"self_distill.counts has {len(cfg.self_distill.counts)} entries for "
                        f"{len(cfg.self_distill.edges) - 1} buckets (self_distill.edges); give one count per bucket")
    if cfg.job == "foresight":
        problems += _foresight_problems(cfg)
    if problems:
        raise ConfigError("invalid config: " + "\n".join(problems))


def _rl_problems(cfg: Config) -> list[str]:
    """Cross-field checks of RL jobs; each message names the key and a value that works."""
    problems = []
    g, n = cfg.rl.group_size, cfg.trainer.batch_size
    if n % g or n < g:
        problems.append(f"trainer.batch_size ({n}) must be a multiple of rl.group_size ({g}): it is the number "
                        f"of samples per step; set trainer.batch_size={max(1, round(n / g)) * g}")
    if cfg.sampling.temperature <= 0:
        problems.append("sampling.temperature must be > 0 for RL: greedy decoding gives every sample of a "
                        "group the same text, hence zero advantages; set sampling.temperature=1.0")
    if cfg.workers.engine == "vllm" and cfg.sampling.temperature > 2:
        problems.append(f"sampling.temperature={cfg.sampling.temperature:g}: vLLM samples at temperatures in "
                        "[0, 2] only; set sampling.temperature=2.0 or workers.engine=hf")
    parts = max(cfg.workers.rollout, cfg.workers.learners)
    if n < parts:
        problems.append(f"trainer.batch_size ({n}) must be >= the number of rollout workers and of learners "
                        f"({parts}), each takes a share of the samples; set trainer.batch_size={parts * g}")
    from kvrl.algos import ALGOS  # a table of names; importing it loads no algorithm

    if cfg.rl.algo not in ALGOS:
        near = difflib.get_close_matches(cfg.rl.algo, ALGOS, n=1)
        problems.append(f"unknown rl.algo {cfg.rl.algo!r}; set rl.algo={near[0] if near else next(iter(ALGOS))} "
                        f"(available: {', '.join(ALGOS)})")
    if cfg.trainer.steps < 1:
        problems.append("trainer.steps must be >= 1 for RL (it is the number of RL steps); set trainer.steps=20")
    return problems


def _rlkv_problems(cfg: Config) -> list[str]:
    """Cross-field checks of RLKV training."""
    problems = []
    if cfg.job == "rlkv" and cfg.rl.algo != "rlkv":
        problems.append(f"job=rlkv trains RLKV's gates, but rl.algo={cfg.rl.algo!r}; set rl.algo=rlkv")
    if cfg.job == "rl" and cfg.rl.algo == "rlkv":
        problems.append("rl.algo=rlkv runs as job=rlkv (the RL loop, then the gates exported); set job=rlkv")
    if cfg.workers.engine != "vllm":
        problems.append(f"workers.engine={cfg.workers.engine!r}: RLKV's rollouts use the vLLM engine's mixed-gate "
                        "attention; set workers.engine=vllm")
    if cfg.kv.policy != "full":
        problems.append(f"kv.policy={cfg.kv.policy!r}: RLKV's rollouts mix full and rlkv.sink + rlkv.recent "
                        "attention per head, not a token policy; set kv.policy=full")
    return problems


def _foresight_problems(cfg: Config) -> list[str]:
    """Cross-field checks of the ForesightKV pipeline."""
    problems = []
    if cfg.kv.policy != "learned":
        problems.append(f"kv.policy is {cfg.kv.policy!r}; ForesightKV trains the learned scorer: set kv.policy=learned")
    if cfg.kv.budget < cfg.kv.window + cfg.kv.sink + 1:
        problems.append(f"kv.budget ({cfg.kv.budget}) must be > kv.window + kv.sink ({cfg.kv.window + cfg.kv.sink}) "
                        f"for ForesightKV; set e.g. kv.budget={4 * cfg.kv.interval}")
    g, n = cfg.rl.group_size, cfg.trainer.batch_size
    if n % g or n < g:
        problems.append(f"trainer.batch_size ({n}) must be a multiple of rl.group_size ({g}): stage 2 draws "
                        f"rl.group_size eviction trajectories per trace; set trainer.batch_size={max(1, round(n / g)) * g}")
    return problems


def load_config(argv: Sequence[str]) -> Config:
    """schema ⊕ recipes/NAME.yaml ⊕ `key=value` arguments -> validated, typed Config."""
    cli = _parse_cli(argv)
    name = str(cli.get("recipe", Config.recipe))
    cli.recipe = name  # the name chosen here wins over a `recipe:` written in the file
    recipe, recipe_path = _load_recipe(name)
    merged = OmegaConf.structured(Config)
    for layer, source in ((recipe, recipe_path), (cli, "command line")):
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            raise _merge_error(err, layer, source) from None
    if OmegaConf.is_missing(merged, "job"):
        raise ConfigError(f"job is not set; add `job: NAME` to {recipe_path} or pass job=NAME "
                          "(`python -m kvrl.run --help` lists the jobs)")
    OmegaConf.set_readonly(merged, True)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve the config: {str(err).splitlines()[0]}") from None
    assert isinstance(cfg, Config)
    validate(cfg)
    return cfg
