"""``dry_run=true``: what a recipe would ask of a cluster, printed without loading weights.

    python -m kvrl.run recipe=rlkv_r1_llama_8b dry_run=true

The architecture comes from a local folder's config.json, the shipped tiny reasoner, or,
for the cluster recipes' hub ids, ``kvrl/models/architectures.json`` (so the plan needs no
network); any other hub id is fetched with ``AutoConfig`` when a network is there. The
model is built on the meta device to count its parameters exactly.

KV memory per sequence is ``2 (K, V) · layers · kv_heads · head_dim · bytes`` per cached
token. With the full cache a sequence caches every token up to ``T = prompt +
sampling.max_new_tokens``, the prompt being the mean of 16 of the environment's tasks when
the environment and a local tokenizer are at hand (the plan says when it could not count
them); under a token policy the cache peaks at ``kv.budget + kv.interval``
(it is cut back to the budget every interval tokens; with ``kv.budget_ratio`` the budget
is that of the whole sequence, ``max(kv.budget, ⌊ratio·T⌋)``). For ``job=rlkv`` the estimate is of
the deployment (training keeps the full cache under the mixed attention): a fraction
``s = rlkv.sparsity`` of the heads keeps ``rlkv.eval_sink + rlkv.eval_recent`` tokens, the
others all T, so ``(1 − s)·T + s·min(T, sink + recent)`` per head on average.

For the Ray jobs it estimates the peak memory of a learner and of a rollout actor per GPU
(:func:`memory`), and for ForesightKV's data step that of a trace actor (generation and
scoring, :mod:`kvrl.workers.traces`), and warns, with the fix, when one exceeds ``workers.gpu_gib``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvrl.algos import algo_class
from kvrl.envs.chat import Chat, encode_prompts
from kvrl.jobs import JOBS
from kvrl.policies.base import budget_at, geometry
from kvrl.section import ConfigError
from kvrl.workers.inline import INLINE

ARCHITECTURES = Path(__file__).parents[1] / "models" / "architectures.json"


def model_config(path: str):
    """The transformers config of ``model.path``, without weights."""
    from transformers import AutoConfig

    from kvrl.models.tiny import resolve_path

    known = json.loads(ARCHITECTURES.read_text())
    if path in known:
        fields = dict(known[path])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    try:
        local = Path(resolve_path(path))
    except ValueError as err:  # a damaged sealed folder, a run without model weights: the config's mistake
        raise ConfigError(str(err)) from None
    if (local / "config.json").exists():
        return AutoConfig.from_pretrained(local)
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as err:
        raise ConfigError(
            f"model.path={path!r} is neither a local model folder nor a known architecture "
            f"({', '.join(k for k in known if not k.startswith('_'))}) and could not be fetched "
            f"({err.__class__.__name__}); pass a local folder with a config.json"
        ) from None


def kv_bytes_per_token(config, dtype: str) -> int:
    g = geometry(config)
    return 2 * g["layers"] * g["kv_heads"] * g["head_dim"] * torch.finfo(getattr(torch, dtype)).bits // 8


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024


def prompt_tokens(cfg) -> int | None:
    """Mean prompt length of 16 of the environment's tasks; None when the environment (a
    dataset that is not here) or a local tokenizer (not a hub id: no network wait) is missing, or
    the environment cannot build those tasks (a prompt that is no text: the run refuses it at start)."""
    from transformers import AutoTokenizer

    from kvrl.envs import make
    from kvrl.models.tiny import resolve_path

    local = Path(resolve_path(cfg.model.path))
    if not local.is_dir():  # a hub id: a plan must not wait on the network
        return None
    try:
        env = make(cfg.env.id, **cfg.env.kwargs)
        env.reset(seed=cfg.seed)
        tokenizer = AutoTokenizer.from_pretrained(local)
        prompts = [t.prompt for t in env.tasks(16)]
    except (OSError, ValueError, ImportError):
        return None
    return round(sum(len(ids) for ids in encode_prompts(tokenizer, prompts, Chat.of(cfg.env))) / len(prompts))


def plan(cfg) -> dict:
    """The figures the dry run prints (also returned for tests)."""
    from transformers import AutoModelForCausalLM

    config = model_config(cfg.model.path)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    width = torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8
    per_token = kv_bytes_per_token(config, cfg.model.dtype)
    prompt = prompt_tokens(cfg)
    T = cfg.sampling.max_new_tokens + (prompt or 0)
    kept = T
    if cfg.kv.policy != "full" and cfg.kv.budget > 0:
        # the budget at the longest length (KVPolicy.budget_at: G-KV's ratio mode grows it with the length)
        kept = min(T, budget_at(cfg.kv.budget, cfg.kv.budget_ratio, T) + cfg.kv.interval)
    if cfg.job == "rlkv":
        r = cfg.rlkv
        kept = round((1 - r.sparsity) * T + r.sparsity * min(T, r.eval_sink + r.eval_recent))
    w = cfg.workers
    actor_gpus = w.rollout * w.rollout_gpus + w.learners * w.learner_gpus
    # job=foresight runs stage 1 (Golden Eviction, SFT) in the driver process, on a GPU of its own
    driver_gpus = 1 if cfg.job == "foresight" and str(cfg.device).startswith("cuda") else 0
    return {
        "model": cfg.model.path,
        "params": params,
        "weights_bytes": params * width,
        "layers": config.num_hidden_layers,
        "kv_heads": config.num_key_value_heads,
        "kv_bytes_per_token": per_token,
        "prompt_tokens": prompt,
        "tokens_per_sequence": T,
        "kept_tokens_per_sequence": kept,
        "kv_full_bytes_per_sequence": per_token * T,
        "kv_kept_bytes_per_sequence": per_token * kept,
        "kv_full_bytes_per_batch": per_token * T * cfg.sampling.batch_size,
        "kv_kept_bytes_per_batch": per_token * kept * cfg.sampling.batch_size,
        "rollout_actors": w.rollout,
        "learner_actors": w.learners,
        "cpus": w.rollout * w.rollout_cpus + w.learners * w.learner_cpus,
        "actor_gpus": actor_gpus,
        "driver_gpus": driver_gpus,
        "gpus": actor_gpus + driver_gpus,
    }


# algorithms whose learner trains every weight of the model (the others train gates or a scorer)
FULL_MODEL = ("rl_full", "rl_sparse", "distill")
LOGIT_CHUNK = 1024  # rows of logits HFEngine.score holds at once (kvrl.kernels.reference.logprobs)
VLLM_GPU_SHARE = 0.9  # vLLM's default gpu_memory_utilization: without workers.kv_cache_gib its KV cache fills it


def mixed_mask_bytes(rows: int, seq: int, layers: int, width: int, checkpointing: bool) -> int:
    """Peak bytes of the masks RLKV's learner builds in its mixed-gate attention
    (:func:`kvrl.kernels.reference.mixed.mixed_gate_attention`), for ``rows`` sequences of ``seq``
    tokens in one micro-batch.

    Per layer it builds one Q × N bool mask per sequence for each of its two branches
    (causal, sink+recent), broadcast over the heads, and ``scaled_dot_product_attention``
    turns each into an additive mask of the model's dtype (``width`` bytes), which it keeps
    for backward. So each layer whose attention is kept for backward holds
    ``2·rows·seq²·width`` bytes: every layer but the first without checkpointing (the first
    layer's attention inputs do not depend on the gates, so autograd keeps nothing of it),
    one layer at a time with ``trainer.gradient_checkpointing``. On top, the layer being
    built holds its two bool masks (2 bytes per element). Measured on CPU (float32, batch 2,
    S = 1,024 and 2,048, one and two layers of the attention alone: 2 float masks per kept
    layer plus ~2 bytes per element); ``tests/test_plan.py`` checks the whole learner's plan
    against its measured peak at S = 1,024."""
    elements = rows * seq * seq
    kept = 1 if checkpointing else max(layers - 1, 1)
    return elements * (2 * width * kept + 2)


def memory(cfg, config, p: dict) -> dict[str, dict[str, float]]:
    """Peak bytes per GPU of a learner and of a rollout actor, by part (estimates; GPU, so
    attention is flex/flash and keeps no T×T map, except RLKV's mixed attention, whose
    masks are counted as "attention masks": :func:`mixed_mask_bytes`).

    learner: weights (+ a frozen copy for rl.kl_coef > 0 or distill's teacher), gradients
    and AdamW state of what it trains (ZeRO shards both the fp32 master + moments, 12
    bytes per parameter, over the learners), activations of one micro-batch
    (``trainer.micro_batch_tokens``, else the learner's whole share) kept for backward —
    ``(6·hidden + 4·intermediate)`` values per token and layer, or one ``hidden`` per
    token and layer plus one layer's worth with ``trainer.gradient_checkpointing`` — and
    one chunk of float32 logits with its softmax and gradient. rollout: weights and the KV
    cache of ``sampling.batch_size`` sequences at their peak cached length.
    """
    w, tr = cfg.workers, cfg.trainer
    width = torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8
    algo = "rlkv" if cfg.job == "rlkv" else "foresight" if cfg.job == "foresight" else cfg.rl.algo
    # gates and scorers are a few thousand values; an algorithm given by path says (`trains_weights`)
    full_model = algo in FULL_MODEL or (":" in algo and algo_class(algo).trains_weights)
    trained = p["params"] if full_model else 0
    copies = 2 if (algo == "rl_full" and cfg.rl.kl_coef > 0) or algo == "distill" else 1
    if w.backend == "deepspeed":
        grads, optimizer = trained * width / w.learners, 12 * trained / w.learners
    else:
        grads, optimizer = trained * width, 2 * trained * width
    share = max(1, tr.batch_size // w.learners)
    tokens = tr.micro_batch_tokens or share * p["tokens_per_sequence"]
    H, L = config.hidden_size, config.num_hidden_layers
    per_layer = (6 * H + 4 * config.intermediate_size) * width
    logits = 3 * 4 * min(tokens, LOGIT_CHUNK) * config.vocab_size
    if algo == "foresight":  # the scorer learns from episode features, not through the model
        activations = logits = 0
    elif tr.gradient_checkpointing:
        activations = tokens * (L * H * width + per_layer)
    else:
        activations = tokens * L * per_layer
    learner = {
        "weights": copies * p["weights_bytes"],
        "gradients": grads,
        "optimizer": optimizer,
        "activations": activations,
        "logits": logits,
    }
    if algo == "rlkv":  # the micro-batch's sequences, each at the longest length
        T = p["tokens_per_sequence"]
        learner["attention masks"] = mixed_mask_bytes(max(1, tokens // T), T, L, width, tr.gradient_checkpointing)
    return {
        "learner": learner,
        "rollout": {"weights": p["weights_bytes"], "kv cache": p["kv_kept_bytes_per_batch"]},
    }


def trace_memory(cfg, config, p: dict) -> dict[str, float]:
    """Peak bytes of a trace actor (:mod:`kvrl.workers.traces`): the generation engine's weights
    and full-cache KV (``hf``: every sequence of the batch at full length; ``vllm``:
    ``workers.kv_cache_gib``, else vLLM's own sizing: 90 % of the GPU, or 1 GiB on CPU), the
    HF scorer's weights (a second copy beside vLLM) and one scoring forward of up to
    ``SCORE_TOKENS`` tokens: without grad, one layer's activations at a time, the final
    hidden states and a chunk of float32 logits with its softmax.
    """
    from kvrl.data.traces import SCORE_TOKENS

    w, T = cfg.workers, p["tokens_per_sequence"]
    width = torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8
    if w.engine == "hf":
        kv = p["kv_full_bytes_per_batch"]
    elif w.kv_cache_gib:
        kv = w.kv_cache_gib * 2**30
    elif w.rollout_gpus:
        kv = VLLM_GPU_SHARE * w.gpu_gib * 2**30 - p["weights_bytes"]
    else:
        kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1)) * 2**30
    rows = min(cfg.sampling.batch_size, max(1, SCORE_TOKENS // T))
    H = config.hidden_size
    forward = rows * T * ((6 * H + 4 * config.intermediate_size) * width + H * width)
    logits = 3 * 4 * min(rows * cfg.sampling.max_new_tokens, LOGIT_CHUNK) * config.vocab_size
    return {
        "weights": p["weights_bytes"],
        "kv cache": kv,
        "scoring weights": p["weights_bytes"] if w.engine == "vllm" else 0,
        "scoring forward": forward + logits,
    }


def kv_lines(cfg, p: dict) -> list[str]:
    """The plan's opening lines: the model and the KV cache of a sequence and of a batch, full and as kept."""
    budget = (
        f"budget {cfg.kv.budget}"
        if cfg.kv.budget_ratio is None
        else f"budget max({cfg.kv.budget}, {cfg.kv.budget_ratio:g} x {p['tokens_per_sequence']} tokens)"
    )
    kept = (
        f"kv.policy={cfg.kv.policy} ({budget} + interval {cfg.kv.interval})"
        if p["kept_tokens_per_sequence"] < p["tokens_per_sequence"]
        else "kept (no eviction)"
    )
    if cfg.job == "rlkv":
        r = cfg.rlkv
        kept = f"deployed at rlkv.sparsity={r.sparsity:g} (sink {r.eval_sink} + recent {r.eval_recent})"
    return [
        f"dry run of recipe={cfg.recipe} (job={cfg.job}); nothing is loaded or started",
        f"model      {p['model']}: {p['params'] / 1e6:,.1f} M parameters, {size(p['weights_bytes'])} in "
        f"{cfg.model.dtype}; {p['layers']} layers x {p['kv_heads']} KV heads",
        f"KV cache   {size(p['kv_bytes_per_token'])} per token; a {p['tokens_per_sequence']}-token sequence ("
        + (
            f"prompt ~{p['prompt_tokens']} + "
            if p["prompt_tokens"] is not None
            else "prompt not counted: no local tokenizer or environment data; "
        )
        + f"{cfg.sampling.max_new_tokens} new): full "
        f"{size(p['kv_full_bytes_per_sequence'])}, {kept} {size(p['kv_kept_bytes_per_sequence'])} "
        f"({p['kept_tokens_per_sequence'] / p['tokens_per_sequence']:.0%})",
        f"           a batch of {cfg.sampling.batch_size} sequences: full {size(p['kv_full_bytes_per_batch'])}, "
        f"compressed {size(p['kv_kept_bytes_per_batch'])}",
    ]


def actor_lines(cfg, p: dict) -> list[str]:
    """The RL loop's actors (and ForesightKV's stage 1 in this process), what they ask of the cluster, and its steps."""
    w, tr = cfg.workers, cfg.trainer
    lines = []
    engine = w.engine
    if cfg.job == "foresight":
        from kvrl.algos.foresight import ForesightRL

        engine = ForesightRL.rollout_engine
        lines.append(
            f"stage 1    Golden Eviction and SFT in this process, on {cfg.device}; stage 2 "
            "(eviction-MDP GRPO) on the Ray actors below, episodes on the rollout actors"
        )
    lines += [
        f"actors     {w.rollout} rollout ({engine}, {w.rollout_cpus:g} CPU + {w.rollout_gpus:g} GPU each), "
        f"{w.learners} learner ({w.backend}{f' ZeRO-{w.zero_stage}' if w.backend == 'deepspeed' else ''}, "
        f"{w.learner_cpus:g} CPU + {w.learner_gpus:g} GPU each): "
        + (
            "objects in this process, one after another (workers.address=inline)"
            if w.address == INLINE
            else f"the Ray cluster needs {p['cpus']:g} CPUs and {p['actor_gpus']:g} GPUs"
            + (
                f", plus {p['driver_gpus']} GPU for stage 1 in this process: {p['gpus']:g} GPUs in all"
                if p["driver_gpus"]
                else ""
            )
        ),
        f"steps      {tr.steps} x {tr.batch_size} samples ({tr.batch_size // cfg.rl.group_size} tasks x "
        f"{cfg.rl.group_size}) = {tr.steps * tr.batch_size} samples, up to {cfg.sampling.max_new_tokens} "
        f"new tokens each",
    ]
    return lines


def memory_lines(cfg, p: dict, traces: bool) -> list[str]:
    """Each Ray actor's peak memory by part, with a warning and its fix where a GPU's does not fit;
    sets ``p["memory"]`` (:func:`memory`, plus the trace actor's when ``traces``)."""
    w, lines = cfg.workers, []
    fixes = {
        "learner": "set trainer.micro_batch_tokens (smaller micro-batches) and trainer.gradient_checkpointing"
        "=true, or more learners with workers.backend=deepspeed",
        "rollout": "lower sampling.batch_size or kv.budget",
        "trace actor": "set workers.kv_cache_gib (vLLM's cache: it then runs fewer sequences at once) so that "
        "the HF scorer fits beside it"
        if w.engine == "vllm"
        else "lower sampling.batch_size or set workers.engine=vllm",
    }
    config = model_config(cfg.model.path)
    p["memory"] = {} if cfg.job == "foresight_traces" else memory(cfg, config, p)
    if traces:
        p["memory"]["trace actor"] = trace_memory(cfg, config, p)
    for k, (actor, parts) in enumerate(p["memory"].items()):
        total = sum(parts.values())
        gpus = w.learner_gpus if actor == "learner" else w.rollout_gpus
        fit = f" of the {w.gpu_gib:g} GiB GPU (workers.gpu_gib)" if gpus else " (no GPU: host memory)"
        lines.append(
            f"{'memory' if k == 0 else '':<10} {actor} peak ~{size(total)}{fit}: "
            + " + ".join(f"{name} {size(v)}" for name, v in parts.items() if v)
        )
        if gpus and total > w.gpu_gib * 2**30:
            lines.append(f"WARNING    the {actor} does not fit: {fixes[actor]}")
    return lines


def dry_run(cfg) -> dict:
    """Print what ``cfg``'s recipe would ask of a cluster and return its figures (:func:`plan`, with
    ``"memory"`` per actor for the Ray jobs)."""
    p = plan(cfg)
    w, tr = cfg.workers, cfg.trainer
    lines = kv_lines(cfg, p)
    traces = cfg.job in ("foresight", "foresight_traces")
    if traces:  # the data step's actors
        fs = cfg.foresight
        shards = -(-fs.traces // fs.shard_size) + -(-fs.heldout // fs.shard_size)
        engines = w.engine + (" + hf scoring" if w.engine == "vllm" else "")
        lines.append(
            f"traces     {min(w.rollout, shards)} rollout actors ({engines}, {w.rollout_cpus:g} CPU + "
            f"{w.rollout_gpus:g} GPU each), stopped once the data is written: {fs.traces} train + "
            f"{fs.heldout} held-out traces in {shards} shards, a batch of {cfg.sampling.batch_size} "
            "prompts per actor at a time"
        )
    if JOBS[cfg.job].ray and cfg.job != "foresight_traces":  # the RL loop's actors
        lines += actor_lines(cfg, p)
    if JOBS[cfg.job].ray:
        lines += memory_lines(cfg, p, traces)
    elif cfg.job == "eval":
        ev = cfg.eval
        lines.append(
            f"eval       {len(ev.policies)} policies ({', '.join(ev.policies)}) x budgets "
            f"{', '.join(f'{b:g}' for b in ev.budgets)}; {cfg.env.num_eval_tasks} tasks x {ev.samples} samples "
            f"of up to {cfg.sampling.max_new_tokens} new tokens each, on {w.engine} ({cfg.device})"
            + "".join(
                f"; KV per sequence at {b:g} tokens: "
                f"{size(p['kv_bytes_per_token'] * min(b + cfg.kv.interval, p['tokens_per_sequence']))}"
                for b in ev.budgets
                if b > 1
            )
        )
    else:
        lines.append(f"process    one, on {cfg.device}; {tr.steps} steps of {tr.batch_size}")
    print("\n".join(lines))
    return p


def allocation_problems(p: dict, cfg, nodes: int, gpus_per_node: int | None, cpus_per_node: int | None) -> list[str]:
    """What keeps the plan ``p`` (:func:`plan`) off an allocation of ``nodes`` nodes (a Slurm
    job's), each with ``gpus_per_node`` GPUs and ``cpus_per_node`` CPUs (None: not known).
    Ray places an actor on one node, so an actor's own GPUs must fit on one."""
    w, problems = cfg.workers, []
    if gpus_per_node is not None:
        for actor, gpus in (("rollout", w.rollout_gpus), ("learner", w.learner_gpus)):
            if gpus > gpus_per_node:
                problems.append(
                    f"a {actor} actor needs {gpus:g} GPUs (workers.{actor}_gpus) and a node has "
                    f"{gpus_per_node}: lower workers.{actor}_gpus or ask for --gpus-per-node={gpus:g}"
                )
        if p["gpus"] > nodes * gpus_per_node:
            driver = f" + {p['driver_gpus']} for stage 1 in the driver" if p["driver_gpus"] else ""
            problems.append(
                f"the recipe's actors need {p['gpus']:g} GPUs ({w.rollout} rollout x {w.rollout_gpus:g} + "
                f"{w.learners} learners x {w.learner_gpus:g}{driver}) and the allocation has {nodes} nodes x "
                f"{gpus_per_node} = {nodes * gpus_per_node}: lower workers.rollout / workers.learners or "
                f"ask for --nodes={-(-p['gpus'] // gpus_per_node):g}"
            )
    if cpus_per_node is not None and p["cpus"] > nodes * cpus_per_node:
        problems.append(
            f"the recipe's actors need {p['cpus']:g} CPUs and the allocation has {nodes} nodes x "
            f"{cpus_per_node} = {nodes * cpus_per_node}: lower workers.rollout_cpus / "
            "workers.learner_cpus or ask for more nodes"
        )
    return problems


def idle_gpus(p: dict, cfg, nodes: int, gpus_per_node: int | None) -> str | None:
    """A warning when the plan ``p`` leaves GPUs of the allocation idle, with the recipe scaled to
    them: more rollout actors (each ``workers.rollout_gpus``), which generate a step's samples in
    more shards at once. None when every GPU is used or the count is not known."""
    if not gpus_per_node:
        return None
    idle = nodes * gpus_per_node - p["gpus"]
    w = cfg.workers
    if idle <= 0 or not w.rollout_gpus:
        return None
    more = int(idle // w.rollout_gpus)
    return (
        f"the recipe uses {p['gpus']:g} of the allocation's {nodes * gpus_per_node} GPUs; {idle:g} stay idle: "
        f"scale it to the allocation with workers.rollout={w.rollout + more} (each rollout actor takes "
        f"workers.rollout_gpus={w.rollout_gpus:g}), or more workers.learners, or ask "
        "Slurm for fewer GPUs (docs/cluster.md)"
    )
