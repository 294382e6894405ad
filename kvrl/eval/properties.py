"""What a task's traces offer KV-compression methods, measured on the model's own attention.

The papers' methods each bet on a property of real reasoning traces; :func:`measure` puts a
number on each, from one full-cache teacher-forced forward over prompt + reference chain of
thought per task (the model's own keys after RoPE and its attention weights, every layer and
query head):

``cot_tokens``, ``cot_share``
    length of the chain of thought and its share of the sequence (real traces: thousands of
    tokens, most of the sequence).
``cot_far_mass``, ``prompt_mass``, ``near_mass``
    where the chain of thought's attention goes: the mean attention weight of a CoT query on
    earlier CoT tokens at least ``far`` positions back (re-reading its own earlier
    conclusions at long range), on the prompt, and on the ``far`` newest tokens. A
    sink + recent window keeps only the last kind.
``redundant_keys``, ``repeated_trigrams``
    redundancy as R-KV's analysis sees it: the share of CoT keys with a near-duplicate (cosine
    ≥ ``duplicate_cos`` with another key of the same KV head, after RoPE, as the policies
    score them), averaged over layers and KV heads; and the share of CoT tokens that end a
    3-gram already in the sequence (R-KV's n-gram view).
``attention_sparsity``
    G-KV's Figure 9 measure: the share of a CoT query's visible keys whose attention weight
    is below 1 % of that query's largest (real reasoning models: over 90 % in most layers).
    Where attention is diffuse, evicting the keys it spreads over perturbs every head.
``h2o_recall``, ``recent_recall``, ``random_recall``
    is accumulated attention informative but not sufficient? At cuts 25 / 50 / 75 % through
    the chain of thought, the ``keep`` share of the tokens seen so far that the *rest* of the
    trace attends to most (max attention over the later queries) is compared with the same
    number of tokens chosen by accumulated attention so far (H2O's score), by recency, and at
    random (its expectation). Informative: above random; sufficient: 1.

All shares are means over tasks, layers and heads. ``benchmarks/learning/testbed_properties.py``
prints them for the counts and multihop reasoners side by side.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

_RECORD: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _probe_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager causal attention that records each layer's keys (after RoPE) [B, H_kv, T, D] and
    attention weights [B, H, T, T]."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, 1)
    v = value.repeat_interleave(groups, 1)
    T = query.shape[2]
    logits = (query @ k.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool, device=query.device).triu(1), float("-inf"))
    weights = logits.softmax(-1)
    _RECORD[module.layer_idx] = (key.detach(), weights.detach())
    return (weights @ v).transpose(1, 2).contiguous(), weights


AttentionInterface.register("kvrl_probe", _probe_attention)


def trigram_repeats(ids: list[int], start: int) -> float:
    """Share of the tokens from ``start`` on that end a 3-gram seen earlier in ``ids``."""
    seen, hits = set(), 0
    for i in range(2, len(ids)):
        gram = tuple(ids[i - 2 : i + 1])
        if i >= start:
            hits += gram in seen
        seen.add(gram)
    return hits / max(1, len(ids) - start)


def _one(model, ids: list[int], prompt_len: int, far: int, duplicate_cos: float, keep: float) -> dict:
    _RECORD.clear()
    x = torch.tensor([ids], device=model.device)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvrl_probe")
    try:
        with torch.no_grad():
            model(input_ids=x)
    finally:
        model.set_attn_implementation(previous)
    T, P = len(ids), prompt_len
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None]
    cot_q = (q >= P) & (k <= q)
    regions = {"cot_far_mass": (k >= P) & (q - k >= far), "prompt_mass": k < P, "near_mass": (q - k < far) & (k >= P)}
    out = {name: 0.0 for name in regions}
    redundant, sparsity, recall = 0.0, 0.0, {"h2o_recall": 0.0, "recent_recall": 0.0, "random_recall": 0.0}
    cuts = [P + int(f * (T - P)) for f in (0.25, 0.5, 0.75)]
    layers = sorted(_RECORD)
    for layer in layers:
        key, w = _RECORD[layer]
        w = w[0].float().cpu()  # [H, T, T]
        rows = w[:, P:]  # CoT queries
        for name, region in regions.items():
            out[name] += float((rows * (region & cot_q)[P:]).sum(-1).mean()) / len(layers)
        faint = (rows < 0.01 * rows.amax(-1, keepdim=True)) & cot_q[P:]
        sparsity += float((faint.sum(-1) / cot_q[P:].sum(-1)).mean()) / len(layers)
        unit = torch.nn.functional.normalize(key[0].float().cpu(), dim=-1)  # [H_kv, T, D]
        cos = unit @ unit.transpose(-1, -2)
        cos.diagonal(dim1=-2, dim2=-1).fill_(-1.0)
        redundant += float((cos[:, P:].amax(-1) >= duplicate_cos).float().mean()) / len(layers)
        for t in cuts:
            n = max(1, int(keep * t))
            future = w[:, t:, :t].amax(1)  # [H, t]: the most any later query attends to each token
            needed = future.topk(n, -1).indices
            mark = torch.zeros(w.shape[0], t, dtype=torch.bool).scatter_(1, needed, True)
            acc = w[:, :t, :t].sum(1)  # accumulated attention so far (H2O)
            by_acc = torch.zeros_like(mark).scatter_(1, acc.topk(n, -1).indices, True)
            recall["h2o_recall"] += float((mark & by_acc).sum(-1).float().mean()) / n / len(cuts) / len(layers)
            recall["recent_recall"] += float(mark[:, t - n :].sum(-1).float().mean()) / n / len(cuts) / len(layers)
            recall["random_recall"] += n / t / len(cuts) / len(layers)
    return {
        "cot_tokens": T - P,
        "cot_share": (T - P) / T,
        **out,
        "attention_sparsity": sparsity,
        "redundant_keys": redundant,
        "repeated_trigrams": trigram_repeats(ids, P),
        **recall,
    }


def measure(model, tokenizer, tasks, *, far: int = 64, duplicate_cos: float = 0.9, keep: float = 0.25) -> dict:
    """The properties above, averaged over ``tasks`` (each with ``meta["completion"]``, the
    reference chain of thought); ``keep`` is the share of tokens kept in the recall test."""
    rows = []
    for t in tasks:
        if "completion" not in t.meta:
            raise ValueError(
                f"task {t.id} has no reference chain of thought (meta['completion']) to measure the "
                "properties on: use a procedural environment (kvrl/counts-v0, kvrl/multihop-v0, "
                "kvrl/chains-v0) or set eval.properties=false"
            )
        prompt = tokenizer(t.prompt)["input_ids"]
        cot = tokenizer(t.meta["completion"], add_special_tokens=False)["input_ids"]
        rows.append(_one(model, prompt + cot, len(prompt), far, duplicate_cos, keep))
    summary = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    return {
        "tasks": len(rows),
        "far": far,
        "duplicate_cos": duplicate_cos,
        "keep": keep,
        **{k: round(v, 4) for k, v in summary.items()},
    }
