"""job=rl: GRPO on the shared Ray controller (RL-Full, G-KV RL-Sparse and Distill).

    python -m kvrl.run recipe=tiny_rl_full

The loop itself, step by step, is :meth:`kvrl.workers.controller.Controller.run`; what is
trained, the loss and what is pushed to the rollout workers is the algorithm ``rl.algo``
(``kvrl/algos``). The run leaves ``metrics.jsonl``, ``checkpoints/``, ``reward.png`` and
the trained model as a transformers folder in ``output_dir/model``.
"""

from __future__ import annotations

from kvrl.runlog import setup_process
from kvrl.workers.controller import Controller


def main(cfg, controller_cls: type[Controller] = Controller) -> dict:
    setup_process()
    controller = controller_cls(cfg)
    try:
        return controller.run()
    finally:
        controller.close()
