"""Worker extension for kvrl's vLLM engines (``LLM(worker_extension_cls=...)``).

Methods are called through ``llm.collective_rpc("kvrl_...")``. In multi-process mode
arguments are pickled (tensors inside plain containers travel; vllm.md §2f), so full
weights can also be pushed by file path. Every push is verified on the worker and returns
a small report; a failed check raises.

* ``kvrl_attach`` — hand the model runner to the worker context (:mod:`.runtime`).
* ``kvrl_set_policy`` / ``kvrl_pop`` — install a cache regime; collect finished requests' traces.
* ``kvrl_push_weights`` — full weights through vLLM's in-place reload path
  (``Worker.reload_weights``; ``model.load_weights`` after start-up breaks on CPU, where
  linear weights are repacked and the parameters emptied). Verified by comparing every
  readable parameter bitwise and every repacked linear layer functionally (its forward on
  a probe input vs ``x @ Wᵀ`` from the pushed tensors, stacked as vLLM stacks them).
* ``kvrl_push_cache_state`` — new trainable state (RLKV's gates, a learned scorer's state
  dict) for the installed regime (``regime.load_state``); returns the checksum of what the
  regime then holds, which the engine compares with the one of what it sent.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from kvrl.engines.vllm.runtime import context


def _weights_from(source) -> dict[str, torch.Tensor]:
    if isinstance(source, (str, Path)):
        from safetensors.torch import load_file

        path = Path(source)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        out = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    return dict(source)


def verify_weights(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], stacked: dict[str, list[str]], atol: float = 1e-4
) -> dict:
    """Check the model holds ``weights`` (checkpoint names): plain parameters bitwise,
    repacked linear layers by their forward on a probe input. Raises ValueError."""
    from vllm.model_executor.layers.linear import LinearBase

    checked = functional = 0
    worst = 0.0
    seen = set()
    for name, param in model.named_parameters():
        w = weights.get(name)
        if (
            w is None
            or param.numel() == 0
            or param.dim() != w.dim()
            or param.shape[1:] != w.shape[1:]
            or param.shape[0] < w.shape[0]
        ):
            continue  # absent, repacked (checked below) or stacked under another name
        # vocabulary-parallel embeddings are padded: compare the real rows
        if not torch.equal(param.detach()[: w.shape[0]].cpu(), w.to(param.dtype)):
            raise ValueError(f"pushed weight {name} did not arrive")
        seen.add(name)
        checked += 1
    gen = torch.Generator().manual_seed(0)
    for mod_name, module in model.named_modules():
        if not isinstance(module, LinearBase) or f"{mod_name}.weight" in seen:
            continue
        leaf = mod_name.rpartition(".")
        parts = stacked.get(leaf[2])
        names = [f"{leaf[0]}.{p}.weight" for p in parts] if parts else [f"{mod_name}.weight"]
        if not all(n in weights for n in names):
            continue
        w = torch.cat([weights[n] for n in names], 0).float()
        bias = getattr(module, "bias", None)
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        x = torch.randn(3, w.shape[1], generator=gen).to(dtype)
        got = module.quant_method.apply(module, x, bias=bias).float()
        want = x.float() @ w.T + (0 if bias is None else bias.float())
        err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
        worst = max(worst, err)
        if err > atol:
            raise ValueError(f"pushed weights of {mod_name} did not arrive (relative error {err:.2e})")
        seen.update(names)
        functional += 1
    return {"checked": checked, "functional": functional, "max_rel_err": worst}


class KVRLWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def kvrl_call(self, method: str, blob: bytes) -> bytes:
        """Dispatch ``method`` with pickled (args, kwargs); return its pickled result.

        Pickled bytes cross vLLM's multi-process RPC where tensor arguments do not."""
        if not method.startswith("kvrl_") or method == "kvrl_call":
            raise ValueError(f"not a kvrl worker method: {method}")
        args, kwargs = pickle.loads(blob)
        return pickle.dumps(getattr(self, method)(*args, **kwargs))

    def kvrl_attach(self) -> list[tuple[int, int, int]]:
        """Attach the worker context; returns (heads, kv_heads, head_size) of every attention
        layer vLLM built, for :meth:`VLLMEngine` to compare with transformers' reading."""
        context(self.vllm_config).attach(self.model_runner, self.vllm_config)
        layers = self.vllm_config.compilation_config.static_forward_context.values()
        return [(a.num_heads, a.num_kv_heads, a.head_size) for a in layers if hasattr(a, "head_size")]

    def kvrl_set_policy(self, regime=None, sample: bool = False) -> bool:
        context(self.vllm_config).set_policy(regime, sample=sample)
        return True

    def kvrl_pop(self, tags: list[str]) -> list:
        ctx = context(self.vllm_config)
        ctx._release_finished()
        return ctx.pop(tags)

    def kvrl_push_weights(self, source, verify: bool = True) -> dict:
        """Reload full weights (checkpoint names) from a dict/list of tensors or a
        safetensors file/folder, then verify them."""
        weights = _weights_from(source)
        tied = getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False)
        if tied:
            # tied: the embedding is the one weight (vLLM would load lm_head.weight over it)
            weights.pop("lm_head.weight", None)
        self.reload_weights(weights_iterator=iter(list(weights.items())), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        if tied and "model.embed_tokens.weight" in weights:
            # vLLM's layerwise reload skips the tied LM head ("ParallelLMHead: Failed to
            # load weights"): on CPU its logits would keep using the GEMM weights packed
            # from the old embedding (dispatch_cpu_unquantized_gemm). Copy the embedding
            # in, re-pack, and check the logits layer by its output.
            emb = weights["model.embed_tokens.weight"]
            head = model.lm_head
            with torch.no_grad():
                head.weight[: emb.shape[0]].copy_(emb.to(head.weight.dtype))
            head.quant_method.process_weights_after_loading(head)
            x = torch.randn(3, emb.shape[1], generator=torch.Generator().manual_seed(0)).to(head.weight.dtype)
            got = head.quant_method.apply(head, x)[:, : emb.shape[0]].float()
            want = x.float() @ emb.float().T
            err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
            if verify and err > 1e-4:
                raise ValueError(f"pushed embedding did not reach the tied LM head (relative error {err:.2e})")
        if not verify:
            return {"checked": 0}
        stacked = getattr(model, "packed_modules_mapping", {}) or {}
        report = verify_weights(model, weights, stacked)
        if report["checked"] + report["functional"] == 0:
            raise ValueError(
                "no pushed weight could be matched to a model parameter: check the names "
                "(checkpoint names, e.g. model.layers.0.self_attn.q_proj.weight)"
            )
        return report

    def kvrl_push_cache_state(self, state: dict) -> str:
        """Load ``state`` into the installed regime; returns the checksum it then holds."""
        return context(self.vllm_config).push_cache_state(state)
