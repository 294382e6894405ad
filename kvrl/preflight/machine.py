"""The config gate's checks that look at what a run here needs: its input files, its output_dir free,
the checkpoint it resumes written with its settings, a hub model cached or the hub reachable; and this
machine (CUDA, the CPUs and memory a local Ray can give its actors, the KV cache layout vLLM would pick on
this CPU).

`kvrl.run` calls `run_problems`, then `machine_problems`, just before a job starts (not for
`print_config` or `dry_run`, which plan for another machine, where the data and the weights are). Each
returns messages in the config's style ("KEY must be ... (got VALUE); set KEY=VALUE"). Nothing here
imports Ray; torch is imported to ask about CUDA when a CUDA device or GPUs are asked for and, for a
local Ray, by the memory plan; the network is asked once, for a hub model.path that is not cached, unless
HF_HUB_OFFLINE. What the config itself names (a model, an environment, a policy class) is checked by
:mod:`kvrl.preflight.names`, which the config's sections call.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from kvrl.algos.rl_sparse_config import scorer_problems
from kvrl.jobs import JOBS
from kvrl.models import seal_problem
from kvrl.preflight.names import HUB_ID
from kvrl.runlog import flatten, intact_checkpoint, lock_holder, resume_changes
from kvrl.workers.inline import INLINE

# arguments of an environment's constructor that name a file it reads: class path -> argument -> what it reads
INPUT_FILES: dict[str, dict[str, str]] = {
    "kvrl.envs.math:MathEnv": {"path": "its problems from it (a .jsonl or .parquet file)"},
    "kvrl.data.self_distill:SelfDistilledEnv": {
        "path": "the task set job=self_distill writes to its output_dir/tasks.jsonl (run that step first: python "
        "-m kvrl.run recipe=RECIPE job=self_distill output_dir=DIR writes DIR/tasks.jsonl)"
    },
}


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
    if "rl" in job.sections:  # RL-Sparse's and Distill's rollouts under a trained scorer (kv.kwargs.run)
        problems += scorer_problems(cfg)
    out = Path(cfg.output_dir).expanduser()
    above = next(p for p in (out, *out.parents) if p.exists())  # what the run's mkdir would meet first
    if not above.is_dir():  # nothing of the run could be written, nor is a lock or a checkpoint there to read
        problems.append(
            f"output_dir={cfg.output_dir}: {above} is a file, not a folder, so the run cannot write its "
            "output there; set output_dir=<a folder> (a new one is made)"
        )
    problems += output_problems(cfg.output_dir, out)
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


# what a kvrl job leaves in its output_dir (kvrl.runlog's lock, metrics and checkpoints, job=eval's settings and
# samples, job=self_distill's tasks, the trace step's traces): a folder holding one is a run's, which a rerun continues
RUN_FILES = (".lock", "settings.json", "samples.jsonl", "metrics.jsonl", "checkpoints", "tasks.jsonl", "traces")


def output_problems(given: str, out: Path) -> list[str]:
    """output_dir (`given`, which is `out`) is a folder of its own for the run: not the current directory, not
    kvrl's own files (the package with its shipped models, the recipes, the checkout's .git), and, when it
    exists, empty or a kvrl run's (`RUN_FILES`). A run writes .lock, settings, samples, checkpoints and
    plots there, and a rerun takes what it finds there for its own."""
    fix = "set output_dir=outputs/${run_name} (or another new folder: it is made)"
    where = out.resolve()
    package = Path(__file__).resolve().parents[1]  # kvrl/, which holds kvrl/preflight/
    checkout = package.parent
    own = {
        "package (its code and shipped models)": package,
        "recipes": checkout / "recipes",
        "git repository": checkout / ".git",
    }
    for what, folder in own.items():
        if where == folder or folder in where.parents:
            return [
                f"output_dir={given} is inside kvrl's {what}, {folder}: the run would write among kvrl's files; {fix}"
            ]
    if where == Path.cwd().resolve():
        return [
            f"output_dir={given} is the current directory ({where}): the run would write its files (.lock, settings, "
            f"samples or checkpoints, plots) among whatever is there; {fix}"
        ]
    if not where.is_dir() or any(where.joinpath(name).exists() for name in RUN_FILES):
        return []
    try:
        held = sorted(p.name for p in where.iterdir())
    except PermissionError:  # nothing of the run could be written there either: the job says so when it starts
        return []
    if not held:
        return []
    return [
        f"output_dir={given} is a folder that holds {len(held)} file(s) of something else than a kvrl run "
        f"({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}): the run would write among them, and a rerun "
        f"would take them for its own; {fix}"
    ]


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
    estimate (:func:`kvrl.preflight.plan.memory`): sizes that cannot run (``sampling.batch_size=10**9``,
    a ``trainer.batch_size`` whose learner share cannot be held) are refused before any actor
    climbs to an out-of-memory kill."""
    from kvrl.preflight.plan import memory, model_config, plan, size

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
