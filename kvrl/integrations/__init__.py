"""kvrl inside other training frameworks.

* :mod:`kvrl.integrations.trl`: TRL's ``GRPOTrainer`` with rollouts under a kvrl eviction
  policy and every logprob forward of the loss replaying their traces (``pip install -e ".[trl]"``).

Importing this package imports no framework; each module imports its own.
"""
