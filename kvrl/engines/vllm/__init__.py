"""kvrl's vLLM rollout engine: per-head eviction, head reallocation and mixed-gate attention
inside vLLM through a ``vllm.general_plugins`` plugin (no fork).

* :mod:`.plugin` — the entry point (registers the attention backends).
* :mod:`.runtime` — worker-side state and steps shared by every backend.
* :mod:`.cpu_backend`, :mod:`.cuda_backend` — the layout-specific parts.
* :mod:`.worker_ext` — weight and cache-state (gates, scorer) push through ``collective_rpc``.
* :mod:`.engine` — :class:`VLLMEngine`, the HF engine's ``generate()`` contract.

Importing this package does not import vLLM; :class:`VLLMEngine` does.
"""

__all__ = ["VLLMEngine"]


def __getattr__(name):
    if name == "VLLMEngine":
        from kvrl.engines.vllm.engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
