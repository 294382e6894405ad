"""Rollout engines: hf (the reference decode loop) and vllm (the production plugin).

Both implement the contract of :mod:`kvrl.engines.base` (``generate(prompts, Sampling,
policy=None) -> Rollouts``, where ``policy`` is a cache regime or anything
:func:`kvrl.policies.as_regime` takes); :func:`make_engine` builds the one ``workers.engine``
names.
"""


def make_engine(cfg, tokenizer=None, kind: str | None = None):
    """The generation engine ``kind`` (default ``cfg.workers.engine``) for ``cfg.model``.

    ``hf``: :class:`kvrl.engines.hf.HFEngine` on the loaded model, on ``cfg.device``.
    ``vllm``: :class:`kvrl.engines.vllm.VLLMEngine`, in-process (this process is vLLM's
    engine core and worker: no inter-process copies), with
    ``tokenizer`` or the model folder's, and ``workers.kv_cache_gib`` of KV cache.
    Both stop on ``model.stop_ids`` (default: the model's own), hold
    ``model.max_model_len`` tokens per sequence (0: the model's positions) and render
    prompts with the chat template when ``env.chat_template`` (:class:`kvrl.envs.chat.Chat`).
    """
    import os

    from kvrl.envs.chat import Chat
    from kvrl.models.tiny import load_model, resolve_path

    m = cfg.model
    limits = {"stop_ids": m.stop_ids or None, "max_model_len": m.max_model_len or None, "chat": Chat.of(cfg.env)}
    if (kind or cfg.workers.engine) == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM reads its level once, at import: INFO floods the console with its configuration
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if cfg.logging.verbose else "WARNING")
        from kvrl.engines.vllm import VLLMEngine

        if not cfg.logging.verbose:
            quiet_weight_reloads()

        if limits["max_model_len"] is None:
            del limits["max_model_len"]  # vLLM's own default
        return VLLMEngine(
            resolve_path(m.path),
            tokenizer,
            dtype=m.dtype,
            seed=cfg.seed,
            kv_cache_gib=cfg.workers.kv_cache_gib or None,
            **limits,
        )
    from kvrl.engines.hf import HFEngine

    return HFEngine(*load_model(m.path, m.dtype, cfg.device), **limits)


def quiet_weight_reloads() -> None:
    """Drop vLLM's "ParallelLMHead / RotaryEmbedding: Failed to load weights" warnings, which
    every weight push prints: its in-place reload finds no tensors for the tied LM head (pushed
    with the embedding) and for the rotary embedding (none exist); the push's checksum is the check."""
    import logging

    def benign(record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and record.args
            and record.args[0] in ("ParallelLMHead", "RotaryEmbedding")
        )

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if benign not in logger.filters:
        logger.addFilter(benign)
