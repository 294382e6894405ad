"""The ``Full`` regime on a vLLM worker (:class:`kvrl.policies.regime.Full`): every key is kept.

The builder plans nothing (``plans = False``), so no forward carries a kvrl plan and vLLM's
own metadata, KV write and attention run untouched; no request is tracked.
"""

from __future__ import annotations

from kvrl.engines.vllm.steps import RegimeWorker


class FullWorker(RegimeWorker):
    plans = False


__all__ = ["FullWorker"]
