"""The vLLM rollout engine, with the HF engine's ``generate()`` contract.

::

    engine = VLLMEngine("path/to/model")            # one engine, many calls
    out = engine.generate(prompts, Sampling(max_new_tokens=256), policy=make_policy("gkv", budget=512))
    out.tokens, out.logprobs, out.finish_reasons, out.traces     # as kvrl.engines.hf.HFEngine

``policy`` is a cache regime (:mod:`kvrl.policies.regime`) or anything
:func:`kvrl.policies.as_regime` takes: None / ``Full()`` (vLLM untouched), a
:class:`kvrl.policies.KVPolicy` / ``Evicting`` (per-head eviction inside vLLM; the rollouts
carry the :class:`kvrl.cache.EvictionTrace`), a static pattern / ``Static``
(:class:`kvrl.policies.HeadAllocation`, :class:`kvrl.policies.Window` or a death tensor
``[layers, B, H_kv, T]``), or ``Mixed`` (RLKV's mixed-gate attention), as in the HF engine.

Behaviour worth knowing:

* Each prompt is an independent vLLM request, so a row's eviction schedule is its own
  (:func:`kvrl.engines.vllm.evicting.cache_len_after`); the HF engine decodes the batch in
  lock-step with the same per-row result (its ``test_batch_rows_are_independent``).
* Greedy decoding matches the HF engine; sampled tokens use vLLM's sampler (seed
  ``sampling.seed + i`` for prompt i) and sampled evictions one generator per request
  (seed ``sampling.seed + 1 + i``), so they are reproducible but not the HF engine's draws.
  Both draw from the same top-p nucleus (:func:`kvrl.engines.base.nucleus` is vLLM's rule)
  and record the same logprobs: ``logprobs_mode="processed_logprobs"`` returns those of
  the distribution vLLM sampled from (after temperature and top-p, renormalised).
* A regime is installed on the workers when a different one, or a modified one, is
  passed; :meth:`push_cache_state` updates the installed copy's trainable state (gates, a
  scorer), and passing the same unmodified regime or policy again keeps that push.
* Refused with a clear error when a policy is active: prefix caching, speculative
  decoding, KV connectors, async scheduling, TP/PP > 1, sliding-window models, full CUDA
  graphs and fused RoPE+KV-cache passes (``runtime.check_config``), and preemption (a
  recompute cannot replay incremental evictions: ``EvictionRefused`` is raised mid-run).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
import uuid

import torch

from kvrl.cache import EvictionTrace
from kvrl.engines.base import Rollouts, Sampling, check_request, default_stop_ids, finish
from kvrl.engines.vllm import plugin
from kvrl.engines.vllm.kv_manager import pooled_blocks
from kvrl.engines.vllm.kv_manager import request_id as kv_request_id
from kvrl.engines.vllm.layout import HeadPool
from kvrl.engines.vllm.patches import apply_patches
from kvrl.engines.vllm.static import window_heads
from kvrl.envs.chat import Chat, encode_prompts
from kvrl.kernels.reference.replay import NEVER
from kvrl.policies.base import geometry
from kvrl.policies.regime import Evicting, Full, Mixed, Static, as_regime, checksum

WORKER_EXTENSION = "kvrl.engines.vllm.worker_ext.KVRLWorkerExtension"


def _fingerprint(obj) -> str:
    return hashlib.sha1(pickle.dumps(obj)).hexdigest()


def check_geometry(model: str, config, served: list[tuple[int, int, int]]) -> None:
    """Refuse a model whose attention vLLM builds with another geometry than transformers reads
    from its config: vLLM's Qwen2 derives head_dim = hidden_size // num_attention_heads and
    ignores ``config.head_dim``, loads the weights anyway, and runs a different model (tokens
    differ from the first, 7-8 nats per token from the learner's)."""
    g = geometry(config)
    want = (g["group"] * g["kv_heads"], g["kv_heads"], g["head_dim"])
    wrong = sorted(set(served) - {want})
    if wrong:
        raise ValueError(
            f"vLLM builds {model} with attention (heads, kv_heads, head_dim) = {wrong[0]}, transformers reads "
            f"{want} from its config (head_dim={getattr(config, 'head_dim', None)}, hidden_size // "
            f"num_attention_heads = {config.hidden_size // config.num_attention_heads}): the two engines would run "
            "different models. Set head_dim to hidden_size // num_attention_heads in config.json (or drop it) if "
            "the weights allow, or use workers.engine=hf"
        )


class VLLMEngine:
    """kvrl's rollout engine on vLLM.

    Parameters
    ----------
    model : str
        A local model folder (or anything vLLM loads).
    tokenizer : optional
        A transformers tokenizer; default: the model folder's, left padding.
    dtype : str, default "float32"
    kv_cache_gib : float, optional
        KV cache memory; default ``VLLM_CPU_KVCACHE_SPACE`` or 1 GiB on CPU, vLLM's own
        sizing on GPU.
    seed : int
    stop_ids : list[int], optional
        The ids that end a sequence; default the model folder's generation config and the
        tokenizer's EOS (:func:`kvrl.engines.base.default_stop_ids`), as the HF engine.
    chat : kvrl.envs.chat.Chat, optional
        Render prompts through the tokenizer's chat template; None: raw prompts.
    **llm_kwargs
        Passed to ``vllm.LLM`` (e.g. ``max_model_len``, ``max_num_seqs``,
        ``block_size``). ``enforce_eager`` defaults to True, prefix caching and async
        scheduling to off.
    """

    def __init__(
        self,
        model: str,
        tokenizer=None,
        *,
        dtype: str = "float32",
        kv_cache_gib: float | None = None,
        seed: int = 0,
        stop_ids: list[int] | None = None,
        chat: Chat | None = None,
        **llm_kwargs,
    ):
        os.environ[plugin.ENV] = "1"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        plugin.register()
        from vllm import LLM
        from vllm.platforms import current_platform

        kwargs = dict(
            enforce_eager=True, enable_prefix_caching=False, async_scheduling=False, logprobs_mode="processed_logprobs"
        )
        if current_platform.is_cpu():
            gib = kv_cache_gib if kv_cache_gib is not None else float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
            kwargs["kv_cache_memory_bytes"] = int(gib * 2**30)
        elif kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if current_platform.is_cuda():
            kwargs["attention_config"] = {"backend": "CUSTOM"}
        kwargs.update(llm_kwargs)
        with apply_patches():
            self.llm = LLM(model=model, dtype=dtype, seed=seed, worker_extension_cls=WORKER_EXTENSION, **kwargs)
        check_geometry(model, self.llm.llm_engine.vllm_config.model_config.hf_config, self._rpc("kvrl_attach"))
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
        self.tokenizer, self.chat = tokenizer, chat
        if not stop_ids:
            from transformers import GenerationConfig

            try:
                generation = GenerationConfig.from_pretrained(model)
            except OSError:  # no generation_config.json: the tokenizer's EOS alone
                generation = None
            stop_ids = default_stop_ids(generation, tokenizer)
        self.stop_ids = list(stop_ids)
        cfg = self.llm.llm_engine.vllm_config.model_config
        self.layers = cfg.get_num_layers(self.llm.llm_engine.vllm_config.parallel_config)
        self.max_model_len = cfg.max_model_len  # a prompt must leave room for a token
        self.kv_heads = cfg.get_num_kv_heads(self.llm.llm_engine.vllm_config.parallel_config)
        self._installed: tuple | None = None  # (fingerprint, sample) of the installed policy
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.block_size, self.num_blocks = cache.block_size, cache.num_gpu_blocks
        # "policy": admit requests under a policy only while their peak blocks fit, so vLLM
        # never preempts them (the full cache keeps vLLM's own overcommit + exact recompute);
        # "always": the same for every request; "never": vLLM decides (preemption is refused).
        self.admission = "policy"
        # RLKV heads share their blocks' regions (layout.HeadPool), so a windowed head holds
        # no blocks for keys it no longer sees; the CUDA layout interleaves the heads within
        # a block's slots, so there each head keeps its own regions (no memory saved)
        self.pool_heads = not current_platform.is_cuda()

    # ---- RPC ----

    def _rpc(self, method: str, *args, **kwargs):
        """Call a worker-extension method; arguments and results travel pickled (bytes pass
        vLLM's multi-process serialisation where tensors do not). Returns worker 0's result."""
        if self.llm is None:
            raise RuntimeError("this VLLMEngine is closed (close() shut its vLLM engine down): build a new one")
        blob = pickle.dumps((args, kwargs))
        out = self.llm.collective_rpc("kvrl_call", args=(method, blob))
        return pickle.loads(out[0])

    # ---- generation ----

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids per prompt (rendered by ``chat`` when set), as the HF engine encodes them."""
        return encode_prompts(self.tokenizer, prompts, self.chat)

    def _install(self, regime, sample: bool) -> None:
        key = (_fingerprint(regime), sample)
        if key != self._installed:
            self._rpc("kvrl_set_policy", regime, sample=sample)
            self._installed = key

    @torch.no_grad()
    def generate(self, prompts: list[str], sampling: Sampling, policy=None) -> Rollouts:
        """Decode ``prompts``; see the module docstring and ``HFEngine.generate``."""
        from vllm.inputs import TokensPrompt

        regime = as_regime(policy)
        ids = self.encode(prompts) if prompts else []
        check_request([len(p) for p in ids], sampling, regime, self.max_model_len)
        T = max(len(p) for p in ids) + sampling.max_new_tokens
        tag0 = uuid.uuid4().hex[:12]
        tags = [f"{tag0}-{i}" for i in range(len(ids))]
        keep, pool, death = self._caps(regime, ids, sampling, T)
        self._install(regime, sampling.sample_evictions)
        # vLLM would add the generation config's EOS ids to ours: ignore_eos leaves exactly ours
        stops = [] if sampling.ignore_eos else self.stop_ids
        params = self._params(sampling, tags, stops)
        rids = [kv_request_id(tags[i], len(ids[i]), keep[i], pool) for i in range(len(ids))]
        start = time.perf_counter()
        peaks = self._peaks(ids, keep, pool, sampling.max_new_tokens)
        admit = self.admission == "always" or (self.admission == "policy" and not isinstance(regime, Full))
        try:
            outs = self._run(rids, [TokensPrompt(prompt_token_ids=p) for p in ids], params, peaks if admit else None)
        except BaseException:
            self._installed = None  # the next call re-installs, clearing the workers' request state
            raise
        decode = time.perf_counter() - start
        out = Rollouts([], [], [], prompt_ids=ids)
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            out.append(
                *finish(
                    self.tokenizer, toks, [float(d[t].logprob) for t, d in zip(toks, c.logprobs)], set(stops), len(toks)
                )
            )
        lengths = torch.tensor([len(p) + len(t) for p, t in zip(ids, out.tokens)])
        out.traces, evict = self._traces(regime, tags, T, lengths, death)
        out.timing = {"decode": decode, "evict": evict}
        return out

    def _caps(
        self, regime, ids: list[list[int]], sampling: Sampling, T: int
    ) -> tuple[list, tuple | None, torch.Tensor | None]:
        """What the requests may hold: per-request block caps for the KV manager (only an
        evicting cache is bounded), the pooled heads' (rings, full, regions per block), and a
        static pattern's death [L, B, H, T], checked before anything is installed."""
        keep, pool, death = [None] * len(ids), None, None
        match regime:
            case Static():  # checked here; the workers read row i of the pattern for request i
                death = regime.death(T, len(ids)).cpu()
                windows = window_heads(regime.pattern)
                if windows is not None and self.pool_heads:
                    pool = HeadPool(*windows, self.block_size).sizes
            case Evicting(policy=p):
                # the cache peaks an interval above the budget of the request's longest length
                # (evicting.cache_len_after; the budget grows with the length in ratio mode)
                keep = [p.budget_at(len(x) + sampling.max_new_tokens) + p.interval for x in ids]
        return keep, pool, death

    def _peaks(self, ids: list[list[int]], keep: list, pool: tuple | None, new: int) -> list[int]:
        """The most blocks each request can hold, for admission."""
        bs = self.block_size
        if pool is None:
            return [-(-(max(len(p), k) if k is not None else len(p) + new) // bs) for p, k in zip(ids, keep)]
        peaks = [pooled_blocks(len(p) + new, bs, *pool) for p in ids]
        if max(peaks) > -(-self.max_model_len // bs):  # vLLM's block table has that many columns
            raise ValueError(
                f"the windowed heads' rings need {max(peaks)} blocks per request, vLLM's block "
                f"table holds {-(-self.max_model_len // bs)}: raise max_model_len"
            )
        return peaks

    @staticmethod
    def _params(sampling: Sampling, tags: list[str], stops: list[int]) -> list:
        """vLLM's sampling parameters of each request, with what its worker state reads."""
        from vllm import SamplingParams

        return [
            SamplingParams(
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                seed=sampling.seed + i,
                logprobs=0,
                ignore_eos=True,
                stop_token_ids=stops,
                extra_args={"kvrl_tag": tag, "kvrl_index": i, "kvrl_seed": sampling.seed + 1 + i},
            )
            for i, tag in enumerate(tags)
        ]

    def _traces(
        self, regime, tags: list[str], T: int, lengths: torch.Tensor, death: torch.Tensor | None
    ) -> tuple[EvictionTrace | None, float]:
        """The rollouts' traces and eviction seconds; the workers forget the requests."""
        match regime:
            case Evicting():
                return self._collect_traces(tags, T, lengths)
            case Static():
                traces = EvictionTrace.from_death(death[..., :T], lengths)
                self._rpc("kvrl_pop", tags)  # forget the requests' worker state
                return traces, 0.0
            case Mixed():
                self._rpc("kvrl_pop", tags)
        return None, 0.0

    def _run(self, rids: list[str], prompts: list, params: list, peaks: list[int] | None = None) -> list:
        """Add the requests under our ids and step the engine until all have finished.

        With ``peaks`` (blocks each request can hold at most), requests are admitted only
        while the sum of the admitted peaks fits the KV cache, so vLLM never preempts
        (a preempted request would be recomputed, which eviction cannot replay). On an
        error the outstanding requests are aborted."""
        eng = self.llm.llm_engine
        capacity = self.num_blocks - 1  # block 0 is vLLM's null block
        if peaks is not None and max(peaks) > capacity:
            raise ValueError(f"a request needs {max(peaks)} KV blocks, the cache has {capacity}: raise kv_cache_gib")
        pending = list(range(len(rids)))
        admitted: dict[str, int] = {}
        used = 0
        done = {}
        try:
            while pending or eng.has_unfinished_requests():
                while pending and (peaks is None or used + peaks[pending[0]] <= capacity):
                    i = pending.pop(0)
                    eng.add_request(rids[i], prompts[i], params[i])
                    admitted[rids[i]] = 0 if peaks is None else peaks[i]
                    used += admitted[rids[i]]
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o
                        used -= admitted.pop(o.request_id, 0)
        except BaseException:
            if admitted:
                eng.abort_request(list(admitted), internal=False)
            raise
        missing = [r for r in rids if r not in done]
        if missing:
            raise RuntimeError(f"vLLM returned no output for {missing}")
        return [done[r] for r in rids]

    def _collect_traces(self, tags: list[str], T: int, lengths: torch.Tensor) -> tuple[EvictionTrace, float]:
        rows = self._rpc("kvrl_pop", tags)
        B = len(tags)
        death = torch.full((self.layers, B, self.kv_heads, T), NEVER, dtype=torch.int32)
        events: dict[int, torch.Tensor] = {}
        evict = 0.0
        for b, row in enumerate(rows):
            if row is None:
                raise RuntimeError(f"the vLLM worker holds no trace for request {tags[b]}")
            d = row["death"]
            n = min(T, d.shape[-1])
            death[:, b, :, :n] = d[..., :n]
            evict += row["evict_seconds"]
            for g, lp in row["events"].items():
                events.setdefault(g, torch.zeros(self.layers, B, self.kv_heads))[:, b] = lp
        logprob = torch.stack([events[g] for g in sorted(events)]) if events else None
        return EvictionTrace.from_death(death, lengths, logprob), evict

    # ---- pushing weights and cache state ----

    def push_weights(self, weights, verify: bool = True) -> dict:
        """Full weights (a state dict / (name, tensor) pairs with checkpoint names, or a
        safetensors file/folder path) through vLLM's reload path; verified on the worker."""
        if not isinstance(weights, (str, os.PathLike)):
            weights = {k: v.detach().cpu().contiguous() for k, v in dict(weights).items()}
        return self._rpc("kvrl_push_weights", weights, verify=verify)

    def push_cache_state(self, state: dict) -> None:
        """New trainable state (gates, a scorer's state dict: the regime's ``state()``) for
        the regime installed on the workers; verified by checksum. The next ``generate``
        with the same unmodified regime or policy runs with it."""
        state = {k: torch.as_tensor(v).detach().cpu().clone() for k, v in state.items()}
        held, sent = self._rpc("kvrl_push_cache_state", state), checksum(state)
        if held != sent:
            raise RuntimeError(f"cache state push not verified: the workers hold checksum {held}, sent {sent}")

    def close(self) -> None:
        """Shut the vLLM engine down now (its KV cache freed), not whenever the garbage collector
        reaches it; other engines of the process keep running. Closing twice is harmless."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
