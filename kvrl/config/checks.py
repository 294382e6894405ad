"""Validation of a typed config: the rules the types cannot express.

Contract: `validate(cfg)` raises one ConfigError listing every problem: the range rules declared
beside the fields (`checked`; every float must be finite), then the cross-field rules of the
sections the job names and of its rl.algo (`kvrl.jobs.JOBS`, `kvrl.algos.ALGOS`), each stated once, by what it
configures (`kvrl.config.shared`, or the section registered beside an algorithm or a job). A
proposed fix is itself checked: where the job's rules refuse the default (trainer.steps=0 in an RL
job), the message proposes the value their message names instead.
"""

import copy
import difflib
import math
import re
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import fields, is_dataclass
from typing import Any

from kvrl.algos import ALGOS, algo_class
from kvrl.jobs import JOBS, Job
from kvrl.section import SECTIONS, ConfigError, cli_value


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
            near = difflib.get_close_matches(str(value), f.metadata.get("names", ()), n=1, cutoff=0.6)
            problems.append((key, f.metadata["check"][1], value, near[0] if near else default))
    return problems


def _section_problems(cfg) -> list[str]:
    """The cross-field rules of the job's sections and of its rl.algo, with the shared sections each uses."""
    problems = []
    job = JOBS.get(cfg.job, Job(""))  # an unknown job: kvrl.run names the jobs
    names = list(job.sections) + (["workers"] if job.ray else [])  # its actors' settings
    algo = cfg.rl.algo  # an RL job ("rl" among its sections) runs it: its section's rules apply too
    if "rl" in job.sections and ":" in algo:  # by path: the job the config names runs it
        try:
            section = algo_class(algo).section
        except ConfigError:  # RLConfig's to report
            section = None
        if section and section not in SECTIONS and not hasattr(cfg, section):
            problems.append(
                f"rl.algo={algo} names section {section!r}, which nothing registered; call "
                f"kvrl.section.register_section({section!r}, ...) in its module, or set its section=None"
            )
        names += [section] if section else []
    elif "rl" in job.sections and algo in ALGOS:  # an unknown name is RLConfig's to report
        if ALGOS[algo].job == cfg.job:
            names.append(algo)
        else:
            runs = [name for name, a in ALGOS.items() if a.job == cfg.job]
            problems.append(
                f"job={cfg.job} runs rl.algo={' | '.join(runs)}, not rl.algo={algo}; "
                f"set job={ALGOS[algo].job} (or rl.algo={runs[0]})"
            )
    checked = []
    for name in names:  # a registered section, then the shared sections it uses ("kv")
        checked += [name, *(SECTIONS[name].uses if name in SECTIONS else ())]
    for name in dict.fromkeys(checked):
        if name in SECTIONS:
            problems += SECTIONS[name].problems(cfg) if SECTIONS[name].problems else []
        elif hasattr(getattr(cfg, name, None), "problems"):
            problems += getattr(cfg, name).problems(cfg)
    return problems


def job_fix(cfg, key: str, value: Any) -> str:
    """`value` as the fix for `key`, unless the job's cross-field checks refuse it (trainer.steps=0 in an
    RL job): then the value their message proposes."""
    trial, (*path, leaf) = copy.deepcopy(cfg), key.split(".")
    section = trial
    for name in path:
        section = getattr(section, name)
    setattr(section, leaf, value)
    found = re.search(rf"set (?:e\.g\. )?{re.escape(key)}=([^\s,;)]+)", "\n".join(_section_problems(trial)))
    return found.group(1) if found else cli_value(value)


def validate(cfg) -> None:
    """The checks the types cannot express; raises one ConfigError listing every problem."""
    problems = [
        f"{key} {rule} (got {value!r}); set {key}={job_fix(cfg, key, default)}"
        for key, rule, value, default in _field_problems(cfg)
    ]
    problems += _section_problems(cfg)
    if problems:
        raise ConfigError("invalid config: " + "\n".join(problems))
