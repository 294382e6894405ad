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
    id: str = "kvrl/chains-v0"  # registered environment id, or a dotted path pkg.mod:Class
    kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to the environment's constructor
    num_eval_tasks: int = 256  # tasks drawn for evaluation


@dataclass
class KVConfig:
    policy: str = "full"  # KV policy name (full, streaming, h2o, snapkv, rkv, gkv, ...)
    budget: int = 0  # cached tokens kept per KV head; 0 = unbounded (eval jobs sweep eval.budgets)
    interval: int = 16  # evict every this many decoded tokens
    window: int = 8  # number of most recent queries used to score cached tokens
    sink: int = 4  # leading tokens that are never evicted


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


@dataclass
class EvalConfig:
    # KV budgets to evaluate, as fractions of the average sequence length
    budgets: List[float] = field(default_factory=lambda: [0.25, 0.5])


@dataclass
class Config:
    recipe: str = "default"  # recipe name (file stem in the recipes folder)
    job: str = MISSING  # which job runs (see `python -m kvrl.run --help`)
    seed: int = 0  # seed for every random number generator
    run_name: str = "${recipe}"  # name of this run in logs and output paths
    output_dir: str = "outputs/${run_name}"  # where metrics, checkpoints and plots go
    device: str = "cpu"  # torch device, e.g. cpu or cuda
    print_config: bool = False  # print the resolved config as YAML and exit
    resume: str = "auto"  # auto (latest checkpoint in output_dir, if any) | never | a checkpoint path
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


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
                "e.g. `python -m kvrl.run recipe=default trainer.lr=1e-3`"
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
] + [(key, lambda v, low=low: v >= low, f"must be >= {low}") for key, low in {
    "env.num_eval_tasks": 1, "kv.budget": 0, "kv.interval": 1, "kv.window": 1, "kv.sink": 0,
    "sampling.max_new_tokens": 1, "sampling.temperature": 0, "sampling.batch_size": 1,
    "trainer.steps": 0, "trainer.batch_size": 1, "trainer.warmup_steps": 0,
    "trainer.weight_decay": 0, "trainer.log_every": 1,
}.items()]


def validate(cfg: Config) -> None:
    """Range checks the types cannot express; raises one ConfigError listing every problem."""
    keys = schema_keys()
    problems = [
        f"{key} {rule} (got {value!r}); set {key}={cli_value(keys[key][1])}"
        for key, check, rule in _RULES
        if not check(value := operator.attrgetter(key)(cfg))
    ]
    if problems:
        raise ConfigError("invalid config: " + "\n".join(problems))


def load_config(argv: Sequence[str]) -> Config:
    """schema ⊕ recipes/NAME.yaml ⊕ `key=value` arguments -> validated, typed Config."""
    cli = _parse_cli(argv)
    name = str(cli.get("recipe", "default"))
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
