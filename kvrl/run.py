"""The only entry point: `python -m kvrl.run recipe=NAME key=value ...`.

The config is loaded and validated first (`kvrl.config`), then, for a job that runs here,
what the run needs (`kvrl.preflight.machine.run_problems`: its input files, its output_dir free, the checkpoint
it resumes written with its settings, a hub model reachable) and what this machine must give it
(`kvrl.preflight.machine.machine_problems`: CUDA, the CPUs of a local Ray's actors); only then is the job's module imported, so a mistake costs well under a second (exit
status 2, a message on stderr, no traceback), not a torch/Ray start-up.
"""

import contextlib
import difflib
import importlib
import io
import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

from kvrl.config import JOBS, ConfigError, available_recipes, cli_value, load_config, recipes_dir, schema_keys
from kvrl.config.load import ENV_REFERENCE, redact, secret_names

USAGE = "usage: python -m kvrl.run [recipe=NAME] [key=value ...]  (print_config=true shows the result)"


def help_text() -> str:
    """Usage, the recipes with their descriptions, the jobs, and every key with its default."""
    recipes = available_recipes()
    width = max(map(len, recipes), default=0)
    lines = [USAGE, "", f"recipes ({recipes_dir()}):"]
    lines += [f"  {name:<{width}}  {about}" for name, about in recipes.items()] or ["  (none)"]
    lines += ["", "jobs (job=NAME): " + ", ".join(JOBS), "", "keys and defaults (??? = required):"]
    section = ""
    for key, (_, default) in schema_keys().items():
        if "." in key and key.split(".")[0] != section:
            section = key.split(".")[0]
            lines.append(f"  {section}:")
        indent = "    " if "." in key else "  "
        lines.append(f"{indent}{key}={cli_value(default)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(help_text())
        return 0
    if "--version" in args:
        import kvrl

        print(f"kvrl {kvrl.__version__}")
        return 0
    try:
        cfg = load_config(args)
    except ConfigError as err:
        print(f"kvrl: error: {err}", file=sys.stderr)
        return 2

    # what the environment gave (`${oc.env:NAME}` on the command line, where recipe= is read too, or in the recipe)
    secrets = [*ENV_REFERENCE.findall(" ".join(args)), *secret_names(cfg)]

    def refuse(what: str) -> int:  # a value read from the environment is shown as its reference
        print(redact(f"kvrl: error: {what}", secrets), file=sys.stderr)
        return 2

    if cfg.job not in JOBS:
        near = difflib.get_close_matches(cfg.job, JOBS, n=1)
        hint = f"did you mean job={near[0]}? " if near else ""
        return refuse(f"unknown job {cfg.job!r}; {hint}available jobs: {', '.join(JOBS)}")
    if cfg.print_config:  # a value read from the environment is shown as its reference, never in the clear
        shown = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(cfg)))
        for key, reference in cfg.env_references.items():
            OmegaConf.update(shown, key, reference, merge=False)
        print(OmegaConf.to_yaml(shown), end="")
        return 0
    # heavy imports (torch, transformers, ray) start here, after the config is known good
    if cfg.dry_run:
        from kvrl.preflight.plan import dry_run

        plan = io.StringIO()  # the plan names values (the recipe, the model): printed with the secrets redacted
        try:
            with contextlib.redirect_stdout(plan):
                dry_run(cfg)
        except ConfigError as err:
            return refuse(str(err))
        finally:
            print(redact(plan.getvalue(), secrets), end="")
        return 0
    from kvrl.preflight.machine import machine_problems, run_problems

    problems = run_problems(cfg)
    if problems:
        return refuse("the run cannot start: " + "\n".join(problems))
    problems = machine_problems(cfg, ray=JOBS[cfg.job].ray)
    if problems:
        return refuse("this machine cannot run the config: " + "\n".join(problems))
    module, _, function = JOBS[cfg.job].entry.partition(":")
    from kvrl.envs.base import RewardError

    try:
        result = getattr(importlib.import_module(module), function)(cfg)
    except ConfigError as err:  # what only the job can know (a data set's prompts), refused before it trains
        return refuse(f"the run cannot start: {err}")
    except RewardError as err:  # the environment's reward code, not a bug of the run: named, no traceback
        return refuse(str(err))
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
