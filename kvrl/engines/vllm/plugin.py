"""kvrl's ``vllm.general_plugins`` entry point.

``setup.cfg`` declares ``vllm.general_plugins = kvrl = kvrl.engines.vllm.plugin:register``;
vLLM runs :func:`register` in every process it starts (front end, engine core, workers).
It is idempotent, and does nothing unless ``KVRL_VLLM_PLUGIN=1`` is set in the
environment — :class:`kvrl.engines.vllm.VLLMEngine` sets it (workers inherit it) and also
calls :func:`register` itself, so the engine works without the entry point in-process.
Even when registered, the backends behave exactly like vLLM's until a kvrl engine attaches
its worker context and installs a policy.

What it registers:

* the KV-cache spec/manager pair of :mod:`kvrl.engines.vllm.kv_manager` (per-request block
  caps under token policies; the backends return the spec from ``customize_spec``);

* CPU: an override of ``AttentionBackendEnum.CPU_ATTN`` (the CPU platform only picks that
  entry) with :class:`kvrl.engines.vllm.cpu_backend.KVRLCPUBackend`;
* CUDA: ``AttentionBackendEnum.CUSTOM`` as
  :class:`kvrl.engines.vllm.cuda_backend.KVRLFlashBackend` (the engine selects it with
  ``attention_config={"backend": "CUSTOM"}``);
* CPU: :func:`kvrl.engines.vllm.patches.rewind_cpu_generators`, so that seeded sampling
  survives chunked prefill (the one patch that outlives engine construction).
"""

from __future__ import annotations

import os

ENV = "KVRL_VLLM_PLUGIN"
CPU_BACKEND = "kvrl.engines.vllm.cpu_backend.KVRLCPUBackend"
CUDA_BACKEND = "kvrl.engines.vllm.cuda_backend.KVRLFlashBackend"

_registered = False


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def register() -> None:
    """Register kvrl's attention backends with vLLM (once per process, only when enabled)."""
    global _registered
    if _registered or not enabled():
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        from kvrl.engines.vllm.patches import rewind_cpu_generators

        rewind_cpu_generators()
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
    else:
        return
    from kvrl.engines.vllm import kv_manager

    kv_manager.register()
    try:  # a stock engine created earlier in this process may have cached its choice
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()
    except (ImportError, AttributeError):
        pass
    _registered = True
