"""The config gate's checks that look outside the config: the model folder or hub id (and its positions),
an environment's constructor, a KV policy class given by path; what a run here needs (its input files,
its output_dir free, the checkpoint it resumes written with its settings, a hub model cached or the hub
reachable); and this machine (CUDA, the CPUs and memory a local Ray can give its actors, the KV cache
layout vLLM would pick on this CPU).

`kvrl.config` calls the first ones from its sections' `problems(cfg)`; `kvrl.run` calls `run_problems`,
then `machine_problems`, just before a job starts (not for `print_config` or `dry_run`, which plan for
another machine, where the data and the weights are). Each returns messages in the config's style ("KEY
must be ... (got VALUE); set KEY=VALUE"). Nothing here imports Ray; torch is imported to ask about CUDA
when a CUDA device or GPUs are asked for and, for a local Ray, by the memory plan; an environment's (or a
kv.policy class's) module only to read its constructor's signature (nothing is built: building may need
data files); the network is asked once, for a hub model.path that is not cached, unless HF_HUB_OFFLINE.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable

from kvrl.jobs import JOBS
from kvrl.models import SHIPPED, seal_problem
from kvrl.runlog import flatten, intact_checkpoint, lock_holder, resume_changes, trained_model
from kvrl.workers.inline import INLINE

ARCHITECTURES = Path(__file__).parent / "models" / "architectures.json"  # the dry runs' known hub ids
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")  # org/name

# rules on an environment's arguments that its signature cannot say: class path -> argument ->
# (ok, rule); the fix is the constructor's default
ENV_ARG_RULES: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "kvrl.envs.math:MathEnv": {
        "timeout": (
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
            "must be > 0 seconds (at 0 every answer's check times out and scores 0)",
        ),
    },
}

# arguments of an environment's constructor that name a file it reads: class path -> argument -> what it reads
INPUT_FILES: dict[str, dict[str, str]] = {
    "kvrl.envs.math:MathEnv": {"path": "its problems from it (a .jsonl or .parquet file)"},
    "kvrl.data.self_distill:SelfDistilledEnv": {
        "path": "the task set job=self_distill writes to its output_dir/tasks.jsonl (run that step first: python "
        "-m kvrl.run recipe=RECIPE job=self_distill output_dir=DIR writes DIR/tasks.jsonl)"
    },
}


def model_problems(path: str) -> list[str]:
    """model.path: a shipped model ("tiny", "tiny-multihop"), a folder with a config.json, the output_dir of a run that trained model
    weights (:func:`kvrl.runlog.trained_model`, without reading them), a known architecture, or a
    hub id org/name."""
    fix = (
        "pass a local folder with a config.json (save_pretrained writes one), the output_dir of an RL run "
        f"(the weights it trained), a hub id such as Qwen/Qwen3-4B, or set model.path=tiny (shipped: "
        f"{' | '.join(SHIPPED)})"
    )
    if path in SHIPPED or path in json.loads(ARCHITECTURES.read_text()):
        return []
    local = Path(path).expanduser()
    if local.exists():
        if (local / "config.json").is_file():
            return []
        if local.is_dir():
            try:
                if trained_model(local, verify=False) is not None:
                    return []
            except ValueError as err:
                return [f"model.path={path!r}: {err}"]
        what = "a folder without a config.json" if local.is_dir() else "a file, not a model folder"
        return [f"model.path={path!r} is {what}; {fix}"]
    if HUB_ID.match(path):
        return []  # fetched from the hub when the job loads it
    return [f"model.path={path!r} is neither a folder here nor a hub id (org/name: letters, digits, - _ .); {fix}"]


def model_positions(path: str) -> int | None:
    """The positions model.path holds (its max_position_embeddings), read from JSON without transformers: a
    known architecture's, a shipped model's, a local folder's config.json, a run directory's trained model's;
    None when the config is not here (a hub id fetched when the job loads it)."""
    known = json.loads(ARCHITECTURES.read_text())
    if path in known:
        config = known[path]
    else:
        folder = SHIPPED[path][0] if path in SHIPPED else Path(path).expanduser()
        if folder.is_dir() and not (folder / "config.json").is_file():
            try:
                found = trained_model(folder, verify=False)
            except ValueError:  # model_problems says what the run is
                return None
            folder = found[0] if found else folder
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return positions if isinstance(positions, int) and positions > 0 else None


def cache_limit(cfg) -> tuple[float, str]:
    """The most tokens a sequence of this config can hold, and why: model.max_model_len when set, else the
    model's positions (:func:`model_positions`); inf when neither is known here (a hub id)."""
    positions = model_positions(cfg.model.path) or float("inf")
    if cfg.model.max_model_len and cfg.model.max_model_len <= positions:
        return cfg.model.max_model_len, "model.max_model_len"
    return positions, f"the max_position_embeddings of model.path={cfg.model.path}"


def env_problems(id_key: str, env_id: str, kwargs_key: str, kwargs: dict) -> list[str]:
    """`env_id` names an environment (registered id or pkg.mod:Class) and `kwargs` fit its constructor."""
    import kvrl.envs  # noqa: F401  (registers the built-in ids)
    from kvrl.envs.registry import ENTRY_POINTS, ID_PATTERN, EnvNotFoundError, registered, resolve

    try:
        factory, defaults = resolve(env_id)
    except EnvNotFoundError:
        near = difflib.get_close_matches(env_id, registered(), n=1, cutoff=0.5)
        namespace = env_id.partition("/")[0]
        if ID_PATTERN.match(env_id) and not any(i.startswith(namespace + "/") for i in registered()):
            # a namespace nothing registered: a typo among kvrl's ids is not the likely fix
            return [
                f"{id_key}={env_id!r} is not registered: nothing importable named {namespace!r} registers it, "
                f"and no installed package declares it under the entry-point group {ENTRY_POINTS!r}; put the "
                f"package {namespace!r} on PYTHONPATH (a Ray job: launch/ray_submit.sh --py-module "
                f"path/to/{namespace}) with kvrl.envs.register({env_id!r}, 'pkg.module:Class') in its "
                f"__init__, or set {id_key}=pkg.module:Class"
            ]
        near = near or registered()[:1]
        return [
            f"{id_key}={env_id!r} is neither a registered environment ({', '.join(registered())}) nor a "
            f"dotted path pkg.module:Class; set {id_key}={near[0]}"
        ]
    except TypeError as err:  # imported, but not an environment class: nothing of it is called
        return [
            f"{id_key}={env_id!r} cannot be used: {err}; set {id_key} to a registered id or a pkg.module:Class "
            "of your own environment"
        ]
    except (ImportError, AttributeError, ValueError) as err:
        return [
            f"{id_key}={env_id!r} cannot be imported ({' '.join(str(err).split())}); set {id_key} to a "
            "registered id or an importable pkg.module:Class"
        ]
    return argument_problems(factory, defaults, kwargs_key, kwargs)


def policy_problems(policy: str, kwargs: dict) -> list[str]:
    """kv.policy as a dotted path `pkg.module:Class` (as env.id takes one): it imports, is a KVPolicy,
    and kv.kwargs fit its constructor (the kv section's budget, interval, window, sink and budget_ratio
    come from their own keys). A policy name is the zoo's: `make_policy` names the known ones."""
    if ":" not in policy:  # a name: importing the zoo to list them would import torch here
        return []
    from kvrl.policies import policy_class  # what make_policy resolves; the user's module imports torch anyway

    try:
        cls = policy_class(policy)
    except (ImportError, ValueError) as err:
        return [
            f"kv.policy={policy!r} cannot be used ({' '.join(str(err).split())}); set kv.policy to a policy "
            "name (gkv, h2o, snapkv, ...) or an importable pkg.module:Class of your own KVPolicy"
        ]
    from_kv = {"budget": 0, "interval": 0, "window": 0, "sink": 0, "budget_ratio": None}  # given by kv.*
    return argument_problems(cls, from_kv, "kv.kwargs", kwargs)


def argument_problems(factory: Callable[..., Any], defaults: dict, kwargs_key: str, kwargs: dict) -> list[str]:
    """`kwargs` (given as `kwargs_key`) fit `factory`'s signature, with `defaults` given besides: no
    unknown argument, no float that is not finite, every required one given, and the rules of `ENV_ARG_RULES`."""
    name = f"{factory.__module__}:{getattr(factory, '__qualname__', factory)}"
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: the constructor will say
        return []
    named = {
        p: v
        for p, v in params.items()
        if v.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    listing = f"its arguments: {', '.join(named) or '(none)'}"
    problems = []
    if not any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values()):
        for key in kwargs:
            if key not in named:
                near = difflib.get_close_matches(key, named, n=1, cutoff=0.6)
                hint = f" (did you mean {kwargs_key}.{near[0]}?)" if near else ""
                problems.append(f"{kwargs_key}.{key} is not an argument of {name}{hint}; {listing}")
    for key, value in kwargs.items():  # a NaN weight or penalty passes every range check a constructor states
        if isinstance(value, float) and not math.isfinite(value):
            default = named[key].default if key in named else inspect.Parameter.empty
            fix = f"; set {kwargs_key}.{key}={default}" if default is not inspect.Parameter.empty else ""
            problems.append(f"{kwargs_key}.{key} must be a finite number (got {value}){fix}")
    given = {**defaults, **kwargs}
    for key, p in named.items():
        if p.default is inspect.Parameter.empty and key not in given:
            problems.append(f"{kwargs_key}.{key} is required by {name} ({listing}); set {kwargs_key}.{key}=...")
    for key, (ok, rule) in ENV_ARG_RULES.get(name, {}).items():
        if key in given and not ok(given[key]):
            default = named[key].default if key in named else inspect.Parameter.empty
            fix = f"; set {kwargs_key}.{key}={default}" if default is not inspect.Parameter.empty else ""
            problems.append(f"{kwargs_key}.{key} {rule} (got {given[key]!r}){fix}")
    return problems


def run_problems(cfg) -> list[str]:
    """What a run of `cfg` here needs besides a valid config: the files it reads exist, its output_dir is (or
    can be made) a folder that no live run holds, the logging packages it asks for are installed, a checkpoint
    it would resume was written with its settings, a sealed model.path matches its SHA256SUMS
    (`kvrl.models.seal_problem`), and a hub model.path is cached here or the hub answers. `kvrl.run` asks just
    before the job starts, as `machine_problems` (not for print_config or dry_run: they plan for another
    machine, where the data and the weights are)."""
    job, problems = JOBS[cfg.job], []
    if "env" in job.sections:
        problems += input_problems("env.id", cfg.env.id, "env.kwargs", cfg.env.kwargs)
    if "self_distill" in job.sections:
        sd = cfg.self_distill
        problems += input_problems("self_distill.source", sd.source, "self_distill.source_kwargs", sd.source_kwargs)
    if "eval" in job.sections:
        for name in cfg.eval.policies:
            run = cfg.eval.settings.get(name, {}).get("run")
            if run is not None and not Path(str(run)).expanduser().exists():
                problems.append(
                    f"eval.settings.{name}.run={run!r}: no such file or folder; set "
                    f"eval.settings.{name}.run to the output_dir of the run that trained the line (or "
                    "the file it wrote: a scorer.safetensors, RLKV's gates)"
                )
    out = Path(cfg.output_dir).expanduser()
    above = next(p for p in (out, *out.parents) if p.exists())  # what the run's mkdir would meet first
    if not above.is_dir():  # nothing of the run could be written, nor is a lock or a checkpoint there to read
        problems.append(
            f"output_dir={cfg.output_dir}: {above} is a file, not a folder, so the run cannot write its "
            "output there; set output_dir=<a folder> (a new one is made)"
        )
    if job.ray:  # the controller's RunLog opens them (kvrl.runlog); the metrics file has every value anyway
        for key, package in (("logging.tensorboard", "tensorboard"), ("logging.wandb", "wandb")):
            if getattr(cfg.logging, key.split(".")[1]) and importlib.util.find_spec(package) is None:
                problems.append(
                    f"{key}=true needs the {package} package, which is not installed here: pip install "
                    f"{package}, or set {key}=false (metrics.jsonl has every value)"
                )
    holder = lock_holder(out) if above.is_dir() else None
    if holder is not None:  # kvrl.runlog.OutputLock would refuse it once the job (and Ray) started
        problems.append(
            f"output_dir={cfg.output_dir} is in use by another run ({holder}): wait for it to end, or "
            "set output_dir=<another folder>"
        )
    if job.resumes and above.is_dir():
        problems += resume_problems(cfg)
    if "model" in job.sections:
        problems += hub_problems(cfg.model.path)
        damaged = seal_problem(cfg.model.path)  # reads the weights once: the job's load finds them cached
        problems += [damaged] if damaged else []
    return problems


def input_problems(id_key: str, env_id: str, kwargs_key: str, kwargs: dict) -> list[str]:
    """The files an environment's arguments name (`INPUT_FILES`) exist: env_id resolves (`env_problems`
    passed)."""
    import kvrl.envs  # noqa: F401  (registers the built-in ids)
    from kvrl.envs.registry import resolve

    factory, defaults = resolve(env_id)
    name = f"{factory.__module__}:{getattr(factory, '__qualname__', factory)}"
    given, problems = {**defaults, **kwargs}, []
    for key, what in INPUT_FILES.get(name, {}).items():
        path = given.get(key)
        if path is not None and not Path(str(path)).expanduser().is_file():
            found = "a folder, not a file" if Path(str(path)).expanduser().is_dir() else "no such file"
            problems.append(
                f"{kwargs_key}.{key}={str(path)!r}: {found}; {name} reads {what}; set {kwargs_key}.{key}=<the file>"
            )
    return problems


def resume_problems(cfg) -> list[str]:
    """The checkpoint `resume` would continue (resume=auto: the newest sealed one under
    output_dir/checkpoints) holds this run's settings but for `Config.RESUMABLE`: what the job checks
    once it has started (`kvrl.workers.controller`, `kvrl.jobs.pretrain_tiny`), without reading the weights."""
    if cfg.resume == "never":
        return []
    if cfg.resume == "auto":
        path = intact_checkpoint(Path(cfg.output_dir).expanduser() / "checkpoints", verify=False)
    else:
        path = Path(cfg.resume)
    if path is None or not (path / "config.json").is_file():
        return []
    saved = json.loads((path / "config.json").read_text())
    # model.max_model_len=0: an RL job over a data set derives it before it saves, and compares it then
    resumable = (*cfg.RESUMABLE, *(() if cfg.model.max_model_len else ("model.max_model_len",)))
    changed = resume_changes(saved, json.loads(json.dumps(flatten(cfg))), resumable, cfg.resume, path)
    if not changed:
        return []
    return [
        f"output_dir={cfg.output_dir} holds a run whose settings differ from this one's (checkpoint {path}):\n  "
        + "\n  ".join(changed)
        + "\nrerun with the checkpoint's settings to continue it, or start afresh: set "
        "output_dir=<another folder> (or resume=never to overwrite this one)"
    ]


def hub_problems(path: str) -> list[str]:
    """A hub model.path is in the local Hugging Face cache, or the hub answers: without a network a
    download would otherwise retry for minutes before the job fails. HF_HUB_OFFLINE decides without asking;
    else one request (any answer will do), given up after 5 s."""
    if not HUB_ID.match(path) or Path(path).expanduser().exists():
        return []
    import threading
    import urllib.error
    import urllib.request

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return []
    where = f"model.path={path} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
    fix = (
        f"download it where there is a network (huggingface-cli download {path} --local-dir DIR) and set model.path=DIR"
    )
    if constants.HF_HUB_OFFLINE:
        return [f"{where} and HF_HUB_OFFLINE is set; {fix} (or unset HF_HUB_OFFLINE)"]
    answer = ["no answer in 5 s"]

    def ask() -> None:  # in a thread: name resolution is not bound by urlopen's timeout
        try:
            urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=5).close()
            answer[0] = ""
        except urllib.error.HTTPError:  # an answer: the network is there
            answer[0] = ""
        except (OSError, ValueError) as err:
            answer[0] = " ".join(str(getattr(err, "reason", err)).split())

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(6)
    if answer[0]:
        return [f"{where} and the hub ({constants.ENDPOINT}) cannot be reached ({answer[0]}); {fix}"]
    return []


def machine_problems(cfg, ray: bool) -> list[str]:
    """What this machine cannot give the run: CUDA for a `cuda` device, the CPUs (and GPUs) of the Ray
    actors when Ray is local. `ray`: the job runs Ray actors (workers.*); with a cluster (workers.address
    or $RAY_ADDRESS) the actors and their devices are the cluster's, which the controller checks."""
    w = cfg.workers
    inline = ray and w.address == INLINE  # the actors are this process's objects: its memory, no reservations
    local_ray = ray and (inline or not (w.address or os.environ.get("RAY_ADDRESS")))
    problems = []
    if local_ray and not inline:
        have = w.num_cpus or os.cpu_count() or 1
        need = w.rollout * w.rollout_cpus + w.learners * w.learner_cpus
        if need > have:
            scale = have / need
            problems.append(
                f"the Ray actors reserve {need:g} CPUs (workers.rollout={w.rollout} x workers.rollout_cpus="
                f"{w.rollout_cpus:g} + workers.learners={w.learners} x workers.learner_cpus={w.learner_cpus:g}), "
                f"the local Ray has {have} ({'workers.num_cpus' if w.num_cpus else 'the cores of this machine'}); "
                f"set workers.rollout_cpus={int(w.rollout_cpus * scale * 100) / 100:g} workers.learner_cpus="
                f"{int(w.learner_cpus * scale * 100) / 100:g} (fractions share a core), lower workers.rollout, or "
                "run on a cluster (workers.address=HOST:PORT)"
            )
    if local_ray:
        problems += host_memory_problems(cfg)
    if (
        w.engine == "vllm"
        and cfg.model.dtype == "bfloat16"
        and not cfg.device.startswith("cuda")
        and (local_ray or not ray)
    ):
        import torch

        if torch.cpu._is_amx_tile_supported():  # vLLM's CPU attention then picks its AMX cache layout
            problems.append(
                "model.dtype=bfloat16 with workers.engine=vllm on this CPU makes vLLM store its KV cache in "
                "the AMX layout, which kvrl's eviction cannot read; set model.dtype=float32 (or "
                "workers.engine=hf)"
            )
    gpus = w.rollout * w.rollout_gpus + w.learners * w.learner_gpus if local_ray else 0
    here = cfg.device.startswith("cuda") and not (ray and not local_ray)  # this process or its local actors
    if here or gpus:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = cfg.device.partition(":")[2]
        if here and count == 0:
            problems.append(
                f"device={cfg.device} but CUDA is not available here (torch {torch.__version__}); set device=cpu"
            )
        elif here and index.isdigit() and int(index) >= count:
            problems.append(
                f"device={cfg.device} but this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1}); "
                "set device=cuda:0"
            )
        if gpus > count:
            problems.append(
                f"the Ray actors reserve {gpus:g} GPUs (workers.rollout_gpus, workers.learner_gpus), "
                f"this machine has {count}; set workers.rollout_gpus=0 workers.learner_gpus=0 "
                "device=cpu, or run on a cluster (workers.address=HOST:PORT)"
            )
    return problems


def host_memory_problems(cfg) -> list[str]:
    """The local Ray's CPU actors must fit in this machine's memory, by the dry-run plan's
    estimate (:func:`kvrl.plan.memory`): sizes that cannot run (``sampling.batch_size=10**9``,
    a ``trainer.batch_size`` whose learner share cannot be held) are refused before any actor
    climbs to an out-of-memory kill."""
    from kvrl.plan import memory, model_config, plan, size

    w = cfg.workers
    on_host = {
        a: n
        for a, n, gpus in (("rollout", w.rollout, w.rollout_gpus), ("learner", w.learners, w.learner_gpus))
        if not gpus
    }
    if not on_host:  # every actor on a GPU: the plan (a tokenizer, the environment's tasks) is not needed
        return []
    p = plan(cfg)
    peaks = {actor: sum(parts.values()) for actor, parts in memory(cfg, model_config(cfg.model.path), p).items()}
    need = sum(peaks[a] * n for a, n in on_host.items())
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need <= have:
        return []
    parts = ", ".join(f"{n} {a} x ~{size(peaks[a])}" for a, n in on_host.items())
    return [
        f"the local Ray's CPU actors need ~{size(need)} ({parts}, by the dry-run plan's estimate), this machine "
        f"has {size(have)}: lower sampling.batch_size (sequences a rollout actor holds at once), trainer.batch_size "
        "or set trainer.micro_batch_tokens (the learner's share held for backward), or run on a cluster "
        "(workers.address=HOST:PORT); python -m kvrl.run ... dry_run=true shows the estimate"
    ]
