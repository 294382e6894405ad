"""kvrl's vLLM rollout engine: per-head eviction, head reallocation and mixed-gate attention
inside vLLM through a ``vllm.general_plugins`` plugin (no fork).

* :mod:`.plugin` — the entry point (registers the attention backends); :mod:`.patches` —
  every monkeypatch of vLLM.
* :mod:`.runtime` — the worker context: requests, side stores, query ring, shared by every
  backend; it plans each forward's rows and delegates the rest to the installed regime.
* :mod:`.full`, :mod:`.evicting`, :mod:`.static`, :mod:`.mixed` — one module per cache
  regime: its plan, KV write and attention. :mod:`.steps` — the per-step plan types and
  the per-layer call (``LayerCall``) every regime's KV write and attention receive.
* :mod:`.shim` — the builder/implementation overrides both backends share;
  :mod:`.layout`, :mod:`.cpu_backend`, :mod:`.cuda_backend` — how a paged cache stores K/V;
  :mod:`.kv_manager` — per-request block caps.
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
