"""Rollout engines: hf (the reference decode loop) and vllm (the production plugin).

Both have the same ``generate(prompts, Sampling, policy=None) -> Rollouts`` contract, where
``policy`` is a cache regime (:mod:`kvrl.policies.regime`: Full, Evicting, Static, Mixed) or
anything :func:`kvrl.policies.as_regime` takes; :func:`make_engine` builds the one
``workers.engine`` names.
"""


def make_engine(cfg, tokenizer=None, kind: str | None = None):
    """The generation engine ``kind`` (default ``cfg.workers.engine``) for ``cfg.model``.

    ``hf``: :class:`kvrl.engines.hf.HFEngine` on the loaded model, on ``cfg.device``.
    ``vllm``: :class:`kvrl.engines.vllm.VLLMEngine`, in-process (this process is vLLM's
    engine core and worker, as reference/vllm.md measured fastest on a small machine), with
    ``tokenizer`` or the model folder's.
    """
    import os

    from kvrl.models.tiny import load_model, resolve_path

    if (kind or cfg.workers.engine) == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from kvrl.engines.vllm import VLLMEngine

        return VLLMEngine(resolve_path(cfg.model.path), tokenizer, dtype=cfg.model.dtype, seed=cfg.seed)
    from kvrl.engines.hf import HFEngine

    return HFEngine(*load_model(cfg.model.path, cfg.model.dtype, cfg.device))
