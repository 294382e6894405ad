"""What runs before anything heavy: the checks of a recipe beyond its own keys, and the dry-run plan.

* :mod:`kvrl.preflight.names`: what the config names outside itself, looked up (a model and the
  positions it holds, an environment and its constructor's arguments, a KV policy class given by path).
  The config's sections call it from their ``problems(cfg)``; no torch, no Ray.
* :mod:`kvrl.preflight.machine`: what a run of the config needs here, checked just before its job
  starts (``kvrl.run``): its input files, its output_dir, the checkpoint it resumes, the hub; and this
  machine's CUDA, CPUs and memory for the run's actors.
* :mod:`kvrl.preflight.plan`: ``dry_run=true``, what a recipe would ask of a cluster, without weights.

This ``__init__`` imports none of them: the config path imports ``names`` alone, without the torch
that ``plan`` imports.
"""
