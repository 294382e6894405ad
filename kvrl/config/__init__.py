"""Typed configuration: schema ⊕ recipe ⊕ command line, validated before anything runs.

* The schema is the dataclass `Config`: the shared sections (`kvrl.config.shared`: model, env, kv,
  sampling, trainer, rl, workers, logging and the top-level keys) plus the section each algorithm
  and job declares beside its code and registers (`kvrl.section.register_section`, e.g.
  `kvrl/algos/rlkv_config.py`); `kvrl.config.schema` assembles them. Keys, types, defaults and
  rules are declared once, by what they configure: a field's range check sits beside it
  (`checked`), a section's cross-field rules are its `problems(cfg)`.
* `kvrl.jobs.JOBS` is the single list of jobs: the function each runs and the sections it checks;
  `kvrl.algos.ALGOS` lists the algorithms, each with the job that runs it, whose registered rules an
  RL job checks too. An algorithm of your own, `rl.algo=pkg.module:Class`, is imported before the
  schema is built (its module may register a section); the job the config names runs it.
* `load_config(argv)` merges, in this order, the schema (`OmegaConf.structured`), the recipe's base
  (`base: NAME` in the recipe -> `recipes/base/NAME.yaml`), `recipes/NAME.yaml` (NAME from `recipe=NAME`
  on the command line, else `Config.recipe`) and the command-line `key=value` dotlist, makes the result
  read-only, resolves interpolations and converts it to the dataclasses with `OmegaConf.to_object`.
* Constructor arguments belong to what they construct (a section pairs the two keys:
  `checked(..., kwargs=FIELD)`, read by `kwargs_of()`): when the command line changes `env.id`,
  `self_distill.source` or `kv.policy`, the recipe's `env.kwargs`, `self_distill.source_kwargs`
  or `kv.kwargs` are dropped (`env.id=kvrl/math-v0 env.kwargs.path=data.jsonl` on an RL recipe
  over counts gives MathEnv only `path`), and a mapping given whole on the command line
  (`env.kwargs='{path: data.jsonl}'`, `env.kwargs={}` to clear) replaces the recipe's instead of
  merging into it; `env.kwargs.path=...` merges one key.
* Recipes live in `recipes/` or `$KVRL_RECIPES_DIR`: `recipe=` and `base:` take a name there (a path
  is refused); a recipe of your own loads by path with `recipe_file=PATH` (its stem becomes `recipe`).
* `${oc.env:NAME}` reads an environment variable into the config (the job gets the value), but what
  a run writes down (a checkpoint's config.json, W&B, `print_config`) holds the reference, never
  the value (`Config.env_references`), and an error message or the dry-run plan shows `${oc.env:NAME}`
  wherever the value would be, glued to other text or escaped (`kvrl.config.load.redact`); a resumed
  run compares the references.
* Every problem — unknown recipe or base, a recipe that is not UTF-8 or YAML, unknown or renamed
  key (in a recipe or on the command line), wrong type, malformed argument, out-of-range or
  non-finite value, KV geometry the job's policy refuses, a model path or an environment
  argument that cannot work (`kvrl.preflight.names`) — raises `ConfigError` whose message names the key,
  where it came from, and the fix (`kvrl.config.load`, `kvrl.config.checks`). Nothing here imports
  torch or Ray; `kvrl.run` adds what a run here needs (`kvrl.preflight.machine.run_problems`: input files, a free
  output_dir, a resumable checkpoint, a reachable hub model) and the machine's checks
  (`kvrl.preflight.machine.machine_problems`) just before a job starts.

This package re-exports the names that code and tests import from `kvrl.config`.
"""

from kvrl.algos.distill_config import DistillConfig
from kvrl.algos.rlkv_config import RLKVConfig
from kvrl.config.checks import validate
from kvrl.config.load import RENAMED, available_recipes, load_config, recipes_dir
from kvrl.config.schema import kwargs_of, schema, schema_keys
from kvrl.config.shared import (
    DTYPES,
    EnvConfig,
    KVConfig,
    LoggingConfig,
    ModelConfig,
    RLConfig,
    SamplingConfig,
    Shared,
    TrainerConfig,
    WorkersConfig,
)
from kvrl.jobs import JOBS, Job
from kvrl.jobs.eval_config import EvalConfig
from kvrl.jobs.foresight_config import ForesightConfig
from kvrl.jobs.pretrain_tiny_config import PretrainConfig
from kvrl.jobs.self_distill_config import SelfDistillConfig
from kvrl.section import ConfigError, checked, cli_value, register_section

Config = schema()  # the shipped sections' (a section registered later gets its own class: `schema()`)

__all__ = [
    "DTYPES",
    "JOBS",
    "RENAMED",
    "Config",
    "ConfigError",
    "DistillConfig",
    "EnvConfig",
    "EvalConfig",
    "ForesightConfig",
    "Job",
    "KVConfig",
    "LoggingConfig",
    "ModelConfig",
    "PretrainConfig",
    "RLConfig",
    "RLKVConfig",
    "SamplingConfig",
    "SelfDistillConfig",
    "Shared",
    "TrainerConfig",
    "WorkersConfig",
    "available_recipes",
    "checked",
    "cli_value",
    "kwargs_of",
    "load_config",
    "recipes_dir",
    "register_section",
    "schema",
    "schema_keys",
    "validate",
]
