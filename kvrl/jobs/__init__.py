"""Jobs: what ``python -m kvrl.run`` starts, one flat top-to-bottom module per job.

Each module has ``main(cfg)`` and reads like a short script with section comments; the
library below it (algorithms, engines, workers, environments) never imports a job.

``JOBS`` is the single list of jobs: the function each runs and the config sections whose rules
apply to it, as ``kvrl.algos.ALGOS`` lists the algorithms (each with the job that runs it: a job
whose sections include "rl" runs an ``rl.algo``). A job with keys or rules of its own
declares them beside its module, in ``<job>_config.py`` (a light module: the config gate imports
it, see :mod:`kvrl.section`), imported below so that it registers.
"""

from dataclasses import dataclass

from kvrl.jobs import eval_config, foresight_config, pretrain_tiny_config, self_distill_config  # noqa: F401


@dataclass(frozen=True)
class Job:
    entry: str  # "module:function" called with the typed Config
    # the config sections whose cross-field rules (`problems`) apply to the job; "kv" = the job builds
    # a token policy from kv.budget / kv.window / kv.sink
    # "rl": an RL job, which runs rl.algo (the algorithms kvrl.algos.ALGOS gives it, or one by path),
    # whose registered rules (and the shared sections it uses) apply too
    sections: tuple[str, ...] = ()
    # runs actors (workers.*, whose rules apply): on Ray, where a local Ray must host them
    # (kvrl.preflight.machine.machine_problems), or inline in this process (workers.address=inline)
    ray: bool = False
    # resumes from output_dir/checkpoints/step_*, whose config.json the run's settings must match but for
    # Config.RESUMABLE (kvrl.preflight.machine.resume_problems compares them before the job starts)
    resumes: bool = False


# cfg.job -> Job
JOBS = {
    "eval": Job("kvrl.jobs.eval:main", sections=("model", "env", "eval")),
    "foresight": Job("kvrl.jobs.foresight:main", sections=("model", "env", "kv", "foresight"), ray=True),
    "foresight_traces": Job("kvrl.jobs.foresight_traces:main", sections=("model", "env"), ray=True),
    "pretrain_tiny": Job("kvrl.jobs.pretrain_tiny:main", sections=("env", "pretrain"), resumes=True),
    "rl": Job("kvrl.jobs.rl:main", sections=("model", "env", "rl"), ray=True, resumes=True),
    "rlkv": Job("kvrl.jobs.rlkv:main", sections=("model", "env", "rl"), ray=True, resumes=True),
    "self_distill": Job("kvrl.jobs.self_distill:main", sections=("model", "self_distill")),
}
