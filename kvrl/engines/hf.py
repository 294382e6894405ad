"""The reference engine: batched decoding with transformers models on any device.

It implements :class:`kvrl.engines.base.Engine` and adds the learner's ``score``:

* ``generate(prompts, sampling, policy=None) -> Rollouts`` decodes a left-padded batch
  with a :class:`kvrl.cache.KVCache`. ``policy`` is a cache regime
  (:mod:`kvrl.policies.regime`) or anything :func:`kvrl.policies.as_regime` takes:
  None / ``Full()`` (full cache), a :class:`kvrl.policies.KVPolicy` / ``Evicting`` (dynamic
  eviction; the rollouts carry the recorded :class:`kvrl.cache.EvictionTrace`), a static
  pattern / ``Static`` (:class:`kvrl.policies.HeadAllocation`, :class:`kvrl.policies.Window`,
  or a death tensor [layers, B, H_kv, T]; the trace is the pattern), or ``Mixed`` (RLKV's
  mixed-gate attention over the full cache; no trace).
* ``score(sequences, prompt_lens, trace=None) -> Scores`` gives teacher-forced per-token
  logprobs, losses and entropies of the generated tokens in one forward, under the
  replayed trace (``"kvrl_replay"``), under full attention, or under RLKV's mixed-gate
  attention (``policy=Mixed``, :mod:`kvrl.kernels.reference.mixed`: the learner of ``rl.algo=rlkv``).

Every other engine is checked against this one. It runs its own decode loop, which passes
the cache to the attention function and the true RoPE positions (which the cache's length
stops being after an eviction) explicitly; ``model.generate`` does the same inside
:func:`kvrl.cache.generating` and gives the same tokens (``tests/test_hf_engine.py``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from kvrl.cache import EvictionTrace, KVCache
from kvrl.engines.base import Rollouts, Sampling, Scores, check_request, default_stop_ids, finish, nucleus
from kvrl.engines.vllm.patches import keep_norms_in_float64
from kvrl.envs.chat import Chat, encode_prompts
from kvrl.kernels.reference.replay import NEVER
from kvrl.policies.regime import Evicting, Full, Mixed, Static, as_regime, checksum


class HFEngine:
    """The reference engine over a transformers model.

    stop_ids: the ids that end a sequence; default those of the model's generation config
    and the tokenizer (:func:`default_stop_ids`). max_model_len: prompt + generated tokens
    a sequence may hold (default the config's ``max_position_embeddings``): a sequence that
    reaches it is cut (``"length"``), as vLLM does. chat: prompts are rendered through the
    tokenizer's chat template (:class:`kvrl.envs.chat.Chat`); None: raw prompts.

    A float64 model is the oracle: its logprobs stay float64 (generate and score), and its
    RMSNorms are made to compute in float64 (:func:`kvrl.engines.vllm.patches.keep_norms_in_float64`;
    transformers' round to float32, which turns differences of ~1e-16 into jumps of ~1e-8).

    The model keeps its attention implementation: generate and score switch it to kvrl's for
    their forwards and back, so ``model(...)`` and ``model.generate(...)`` work as before between
    calls. One exception: ``score`` under grad on a model with gradient checkpointing leaves it
    on ``"kvrl_replay"``, which its backward recomputes under; set it back after the backward
    (``model.set_attn_implementation(...)``) to call the model plainly.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        stop_ids: list[int] | None = None,
        max_model_len: int | None = None,
        chat: Chat | None = None,
    ):
        self.model, self.tokenizer, self.chat = model, tokenizer, chat
        self.stop_ids = (
            list(stop_ids) if stop_ids else default_stop_ids(getattr(model, "generation_config", None), tokenizer)
        )
        self.max_model_len = max_model_len or getattr(model.config, "max_position_embeddings", None)
        # fills left padding and the rows that stopped; a tokenizer without a pad token gets a stop id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        keep_norms_in_float64(model)  # a no-op unless the model is float64

    @property
    def device(self):
        return self.model.device

    def encode(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Token ids per prompt (rendered by ``chat`` when set), as every engine encodes them.
        Prompts given as token ids (lists of ints: a trainer that tokenised them with its own
        chat template, as TRL does) are taken as they are."""
        if prompts and all(isinstance(p, (list, tuple)) for p in prompts):
            return [[int(t) for t in p] for p in prompts]
        if any(isinstance(p, (list, tuple)) for p in prompts):
            raise TypeError("generate() got prompts that mix texts and token ids: pass all texts or all id lists")
        return encode_prompts(self.tokenizer, prompts, self.chat)

    def pad(self, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded input ids [B, P] and true positions [B, P] (-1 at padding)."""
        P = max(len(x) for x in ids)
        out = torch.tensor([[self.pad_id] * (P - len(x)) + x for x in ids], device=self.device)
        pos = torch.arange(P, device=self.device) - torch.tensor([P - len(x) for x in ids], device=self.device)[:, None]
        return out, pos.masked_fill(pos < 0, -1)

    @contextmanager
    def _replaying(self):
        """The model on ``"kvrl_replay"`` (it runs mixed gates too) for a scoring forward, then on
        the attention it had. Not after a gradient-checkpointed forward under grad: its layers
        recompute in backward, after score() returned, and must run the attention they ran here."""
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("kvrl_replay")
        try:
            yield
        finally:
            if not (torch.is_grad_enabled() and getattr(self.model, "is_gradient_checkpointing", False)):
                self.model.set_attn_implementation(previous)

    @torch.no_grad()
    def generate(self, prompts: list[str] | list[list[int]], sampling: Sampling, policy=None) -> Rollouts:
        """prompts: texts, or token ids (:meth:`encode`). policy: a cache regime or anything
        :func:`kvrl.policies.as_regime` takes (None, a KVPolicy, a static pattern with ``death(T)``,
        a death tensor [layers, B, H_kv, T] with T >= longest prompt + max_new_tokens, ``Mixed``)."""
        regime = as_regime(policy)
        prompt_ids = self.encode(prompts)
        check_request([len(x) for x in prompt_ids], sampling, regime, self.max_model_len)
        ids, pos = self.pad(prompt_ids)
        B = ids.shape[0]
        T = int(pos.max()) + 1 + sampling.max_new_tokens
        # generated tokens each row may hold: max_new_tokens, or up to the model's length limit
        limits = (pos[:, -1] + 1).neg().add(self.max_model_len or T).clamp(max=sampling.max_new_tokens)
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        cache = KVCache.for_model(
            self.model,
            B,
            T,
            regime,
            sample=sampling.sample_evictions,
            generator=torch.Generator(device=self.device).manual_seed(sampling.seed + 1),
        )
        stops = torch.tensor([] if sampling.ignore_eos else self.stop_ids, dtype=torch.long, device=self.device)
        step_ids, step_pos = ids, pos
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("kvrl_evict")
        start = time.perf_counter()
        try:
            for step in range(sampling.max_new_tokens):
                cache.begin(step_pos, generated=step)  # this forward writes generated token step-1
                logits = self.model(
                    input_ids=step_ids,
                    position_ids=step_pos.clamp(min=0),
                    past_key_values=cache,
                    use_cache=True,
                    kvrl_cache=cache,
                ).logits[:, -1]
                # at least float32, float64 for a float64 model: score() works in the same precision
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                if sampling.temperature > 0:
                    logp = torch.log_softmax(nucleus(logits / sampling.temperature, sampling.top_p), -1)
                    nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
                else:
                    logp = torch.log_softmax(logits, -1)
                    nxt = logits.argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
                tokens.append(nxt)
                logps.append(logp.gather(-1, nxt[:, None]).squeeze(-1))  # float64 kept: see score()
                done |= torch.isin(nxt, stops) | (limits <= step + 1)
                if bool(done.all()):
                    break
                step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
        finally:
            self.model.set_attn_implementation(previous)
        out = Rollouts([], [], [])
        stop_set = set(stops.tolist())
        for row, lp, limit in zip(torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist(), limits.tolist()):
            out.append(*finish(self.tokenizer, row, lp, stop_set, limit))
        out.prompt_ids = prompt_ids
        lengths = torch.tensor([len(p) + len(t) for p, t in zip(out.prompt_ids, out.tokens)])
        if isinstance(regime, (Evicting, Static)):
            out.traces = cache.trace(lengths)
        out.timing = {"decode": time.perf_counter() - start, "evict": cache.evict_seconds}
        return out

    def push_weights(self, weights) -> dict:
        """Load a full model state dict (strict) into the model; returns ``{"checksum": ...}``,
        the :func:`~kvrl.policies.checksum` of the model's state after the load, which the
        sender compares with the one of what it sent."""
        self.model.load_state_dict(dict(weights))
        return {"checksum": checksum(self.model.state_dict())}

    def score(
        self,
        sequences,
        prompt_lens: list[int] | None = None,
        *,
        policy=None,
        trace: EvictionTrace | None = None,
        temperature: float = 1.0,
        distributions: bool = False,
    ) -> Scores:
        """Teacher-forced scores of the generated part of each sequence, in one forward.

        sequences: token ids (prompt + generated) per sequence, with ``prompt_lens``; or
        :class:`Rollouts` (its prompts and generated tokens). ``policy`` is a cache regime
        or anything :func:`kvrl.policies.as_regime` takes. Attention replays ``trace`` (the
        batch's trace, in the same order), or a ``Static`` pattern, or is full when both are
        None; under ``Mixed`` it is RLKV's mixed-gate attention (:mod:`kvrl.kernels.reference.mixed`). An
        ``Evicting`` policy is replayed from its recorded trace. Logprobs are of
        ``softmax(logits / temperature)``. Runs under the caller's grad mode (wrap in
        ``torch.no_grad()`` unless training). Memory: no [B, S, V] logits exist unless
        ``distributions`` — the LM head runs on the generated positions' hidden states chunk
        by chunk (:func:`kvrl.kernels.reference.logprobs.token_logprobs`), forward and backward; it
        must be a plain ``nn.Linear`` (ValueError otherwise).
        """
        regime = as_regime(policy)
        if isinstance(sequences, Rollouts):
            prompt_lens = [len(p) for p in sequences.prompt_ids]
            sequences = [p + t for p, t in zip(sequences.prompt_ids, sequences.tokens)]
        lens = torch.tensor([len(s) for s in sequences], device=self.device)
        n_gen = lens - torch.tensor(prompt_lens, device=self.device)
        B, S = len(sequences), int(lens.max())
        ids = torch.tensor([[self.pad_id] * (S - len(s)) + list(s) for s in sequences], device=self.device)
        pos = torch.arange(S, device=self.device) - (S - lens)[:, None]
        pos = pos.masked_fill(pos < 0, -1)
        extra = None
        match regime:
            case Mixed():
                # RLKV's learner: the rollout engines' mixed-gate attention over the padded batch;
                # the gates may require grad (the gradient then reaches them through the mix)
                if trace is not None:
                    raise ValueError("mixed gates attend over the whole sequence: pass no trace with policy=Mixed")
                extra = {"kvrl_mixed": regime, "kvrl_key_pos": pos}
            case Evicting() if trace is None:
                raise ValueError("a dynamic KV policy is replayed from its recorded trace: pass trace=rollouts.traces")
            case Static() if trace is None:
                trace = EvictionTrace.from_death(regime.death(S, B).to(self.device), lens)
            case Full() if trace is None:
                cfg = self.model.config
                trace = EvictionTrace.from_death(
                    torch.full(
                        (cfg.num_hidden_layers, B, cfg.num_key_value_heads, S),
                        NEVER,
                        dtype=torch.int32,
                        device=self.device,
                    ),
                    lens,
                )
        if extra is None:
            if trace.death.shape[1] != B:
                raise ValueError(f"the trace holds {trace.death.shape[1]} sequences, score() got {B}")
            extra = {"kvrl_replay": trace.replay(pos)}
        G = int(n_gen.max())
        j = torch.arange(G, device=self.device)
        mask = j < n_gen[:, None]
        col = (S - n_gen[:, None] + j).clamp(max=S - 1)  # column of generated token j
        if distributions:
            # distillation needs the whole next-token distributions: dense logits [B, S, V]
            with self._replaying():
                logits = self.model(input_ids=ids, position_ids=pos.clamp(min=0), **extra).logits
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as generate()
            logp = torch.log_softmax(logits / temperature, -1)
            lp = logp.gather(1, (col - 1)[..., None].expand(-1, -1, logp.shape[-1]))  # [B, G, V]
            token_lp = lp.gather(-1, ids.gather(1, col)[..., None]).squeeze(-1) * mask
            entropy = -(lp.exp() * lp).sum(-1) * mask
            return Scores(token_lp, -token_lp, entropy, mask, distributions=lp * mask[..., None])
        # Otherwise no [B, S, V] logits: the transformer body's final hidden states at the
        # positions that predict generated tokens, then the LM head chunk by chunk
        # (kvrl.kernels.reference.logprobs; memory O(chunk·V + N·D), also in backward).
        from kvrl.kernels.reference.logprobs import token_logprobs

        head = self.model.get_output_embeddings()
        if type(head) is not torch.nn.Linear:
            raise ValueError(
                f"score() computes logprobs from the LM head's weight and needs a plain torch.nn.Linear "
                f"output layer; {type(self.model).__name__}.get_output_embeddings() is "
                f"{type(head).__name__}"
            )
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(self.model.config, attr, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"score() does not apply the model's {attr}={getattr(self.model.config, attr)} "
                    "(its logits are not the LM head's); use score(..., distributions=True) for it"
                )
        with self._replaying():
            hidden = self.model.get_decoder()(
                input_ids=ids, position_ids=pos.clamp(min=0), use_cache=False, **extra
            ).last_hidden_state  # no K/V kept: nothing decodes after
        rows = hidden.gather(1, (col - 1)[..., None].expand(-1, -1, hidden.shape[-1]))[mask]  # [N, D]
        lp, ent = token_logprobs(rows, head.weight, ids.gather(1, col)[mask], temperature=temperature, bias=head.bias)
        # float32, or float64 for a float64 model: rounding a float64 oracle's logprobs to float32
        # would hide every replay error under ~6e-8 (test_replay_is_exact_in_float64)
        token_lp = torch.zeros(B, G, dtype=lp.dtype, device=self.device).masked_scatter(mask, lp)
        entropy = torch.zeros(B, G, dtype=ent.dtype, device=self.device).masked_scatter(mask, ent)
        return Scores(token_lp, -token_lp, entropy, mask)
