"""Every monkeypatch kvrl applies, each a named function (there are four): three around vLLM,
one of transformers.

kvrl's backends, KV-cache spec and worker extension go through vLLM's registries and
extension points and need no patch. The exceptions fix vLLM 0.32 (the first two on the CPU):

* :func:`restore_torch_set_num_threads` — ``CPUWorker.init_device`` replaces
  ``torch.set_num_threads`` with a function that only logs a warning
  (``v1/worker/cpu_worker.py``). In-process that silently disables thread control for the
  rest of the program (the HF engine, the learner); kvrl puts the original back once the
  engine is built.
* :func:`rewind_cpu_generators` — the model runner undoes the draw of a token it discards
  with ``gen.set_offset(gen.get_offset() - 4)``, which only CUDA generators support, so
  seeded sampling crashes on CPU as soon as a prompt is prefilled in chunks. Applied by
  the plugin (:func:`kvrl.engines.vllm.plugin.register`) in every vLLM process on CPU.
* :func:`keep_distributed_state_while_engines_live` — an in-process engine's shutdown (its
  ``close()``, or the garbage collector's finalizer of a dropped one) tears down vLLM's
  process-wide parallel groups (``EngineCore.shutdown`` → ``cleanup_dist_env_and_memory``),
  which every other in-process engine shares: the next ``generate`` of any of them failed
  with "pipeline model parallel group is not initialized". kvrl lets the last engine alive
  tear them down.

and one makes a float64 transformers model compute in float64 throughout:

* :func:`keep_norms_in_float64` — transformers 5.19's RMSNorm (Llama, Qwen2, Qwen3 and
  the families copied from them) rounds its input to float32 and back, also inside a
  float64 model. A float64 model is kvrl's oracle (``test_replay_is_exact_in_float64``):
  that rounding turns the ~1e-16 differences between decoding and the replay's one
  forward into float32-sized jumps (up to ~1e-7 between replay and generation).
  The :class:`~kvrl.engines.hf.HFEngine` applies it to a float64 model, per module
  instance (no class is touched, so float32 and bf16 models are unaffected).
"""

from __future__ import annotations

import contextlib
import types

import numpy as np
import torch

_ORIGINAL_SET_NUM_THREADS = torch.set_num_threads


@contextlib.contextmanager
def restore_torch_set_num_threads():
    """Restore ``torch.set_num_threads`` (and the thread count) after the block."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = _ORIGINAL_SET_NUM_THREADS
        torch.set_num_threads(threads)


def rewind_cpu_generators() -> None:
    """Make vLLM's rewind of a discarded token's draw work for CPU generators (idempotent).

    A request whose prompt is prefilled over several steps gets a token sampled at each
    partial step, which the runner discards (``discard_request_mask``) and whose draw it
    undoes so that the request's seeded stream is what it would be unchunked. vLLM 0.32
    does that with the Philox offset (``GPUModelRunner._bookkeeping_sync``); a CPU
    generator has none and raises ``RuntimeError: CPU Generator does not use offset``.
    kvrl seeds every request, so any sampled rollout whose prompts overflow one step's token
    budget crashed. Here ``_sample`` first saves the state of the CPU generators of the
    requests it will discard, and ``_bookkeeping_sync`` restores those states and hides the
    generators from vLLM's offset rewind: the same exact rewind, by state.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_kvrl_rewinds_cpu_generators", False):
        return
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def discarded(runner) -> list[int]:
        return np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0].tolist()

    def _sample(self, *args, **kwargs):
        gens = self.input_batch.generators
        self._kvrl_saved_states = {
            i: gens[i].get_state() for i in discarded(self) if i in gens and gens[i].device.type == "cpu"
        }
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        gens, hidden = self.input_batch.generators, {}
        for i, state in getattr(self, "_kvrl_saved_states", {}).items():
            gens[i].set_state(state)
            hidden[i] = gens.pop(i)
        self._kvrl_saved_states = {}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(hidden)

    GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    GPUModelRunner._kvrl_rewinds_cpu_generators = True


def keep_distributed_state_while_engines_live() -> None:
    """Skip the teardown of vLLM's process-wide parallel groups while another engine core of
    this process is alive (idempotent).

    An engine core counts from the start of its ``__init__`` (which collects garbage: a dropped
    engine's finalizer may run there, after this engine's groups exist) to its ``shutdown``."""
    from vllm.v1.engine import core

    if getattr(core, "_kvrl_keeps_distributed_state", False):
        return
    init, shutdown, cleanup = core.EngineCore.__init__, core.EngineCore.shutdown, core.cleanup_dist_env_and_memory
    live: set[int] = set()  # id() of this process's engine cores built or being built, not shut down

    def __init__(self, *args, **kwargs):
        live.add(id(self))
        try:
            init(self, *args, **kwargs)
        except BaseException:
            live.discard(id(self))
            raise

    def _shutdown(self):
        live.discard(id(self))
        return shutdown(self)

    def cleanup_dist_env_and_memory(*args, **kwargs):
        if not live:
            cleanup(*args, **kwargs)

    core.EngineCore.__init__, core.EngineCore.shutdown = __init__, _shutdown
    core.cleanup_dist_env_and_memory = cleanup_dist_env_and_memory
    core._kvrl_keeps_distributed_state = True


def _rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # transformers' formula, in the input's dtype instead of float32
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def keep_norms_in_float64(model) -> int:
    """Make every RMSNorm of a float64 ``model`` compute in float64 (idempotent); returns
    how many modules it patched, 0 for a model that is not float64.

    A module counts when its class name ends in ``RMSNorm`` and it has the ``weight`` and
    ``variance_epsilon`` of transformers' RMSNorm: its ``forward`` is replaced on that
    instance by the same formula without the float32 round trip. Any other norm is left
    alone; a model with such a norm that still rounds to float32 is caught by the float64
    replay test, not here.
    """
    if getattr(model, "dtype", None) != torch.float64:
        return 0
    patched = 0
    for module in model.modules():
        if (
            type(module).__name__.endswith("RMSNorm")
            and hasattr(module, "variance_epsilon")
            and isinstance(getattr(module, "weight", None), torch.Tensor)
        ):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
            patched += 1
    return patched


@contextlib.contextmanager
def apply_patches():
    """The patches around vLLM, for the duration of building an engine (and those that stay)."""
    keep_distributed_state_while_engines_live()
    with restore_torch_set_num_threads():
        yield


__all__ = [
    "apply_patches",
    "keep_distributed_state_while_engines_live",
    "keep_norms_in_float64",
    "restore_torch_set_num_threads",
    "rewind_cpu_generators",
]
