"""Per-token logprobs and entropies of an LM head without the [N, V] logits.

:func:`token_logprobs` is ``log_softmax((hidden @ weight.T + bias) / temperature)`` gathered at
the targets (and the softmax's entropy), computed ``chunk`` rows at a time so that no more
than a few [chunk, V] float32 buffers ever exist, forward or backward: at the papers' sizes
(V = 152K, tens of thousands of scored tokens) the dense logits alone are hundreds of GB.

The backward is a custom :class:`torch.autograd.Function` that saves only the inputs and the
per-row max and log-sum (and entropy) and recomputes each chunk's logits; it holds two
[chunk, V] buffers at a time, forward and backward. It was measured against
``torch.utils.checkpoint`` of a dense chunk (log_softmax, gather, entropy) on CPU (V = 32K,
D = 64, chunk 1024, float32, forward + backward, peak RSS as in ``tests/test_memory.py``):
266 MiB for this function against 650 MiB checkpointed, at N = 2K and 8K alike (autograd
keeps the logits, the log-softmax, its exp and their gradients of the recomputed chunk alive
together); the dense computation peaks at 1.3 GiB (N = 2K) and 5 GiB (N = 8K).

Gradients (z = logits / temperature, p = softmax(z), lp = log p):

* d lp[t] / dz = onehot(t) − p
* d H / dz = −p ⊙ (lp + H), with H = −Σ p lp

Precision: the matmul runs in the inputs' dtype, exactly like the model's ``lm_head``
(bf16 weights give the logits a bf16 model returns), and everything after it in float32,
or float64 when the inputs are float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """[c, V] logits / temperature of a chunk of rows, in the math dtype."""
    z = F.linear(h, weight, bias).to(_math_dtype(h.dtype))  # a new tensor either way
    return z.div_(temperature) if temperature != 1.0 else z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, want_entropy):
        N = hidden.shape[0]
        dt = _math_dtype(hidden.dtype)
        lp = torch.empty(N, dtype=dt, device=hidden.device)
        # log p = (z − max) − log Σ exp(z − max), in that order, as torch.log_softmax: a
        # confident token keeps its tiny loss (z − logsumexp(z) would round it to 0)
        top = torch.empty(N, dtype=dt, device=hidden.device)
        logsum = torch.empty(N, dtype=dt, device=hidden.device)
        ent = torch.empty(N if want_entropy else 0, dtype=dt, device=hidden.device)
        for i in range(0, N, chunk):
            z = _chunk_logits(hidden[i : i + chunk], weight, bias, temperature)
            top[i : i + chunk] = m = z.amax(-1)
            e = torch.exp(z.sub_(m[:, None]))  # z − max, and its exp
            total = e.sum(-1)
            logsum[i : i + chunk] = s = total.log()
            lp[i : i + chunk] = z.gather(-1, targets[i : i + chunk, None]).squeeze(-1) - s
            if want_entropy:  # H = log Σe − Σ e·(z − max) / Σe
                ent[i : i + chunk] = s - torch.einsum("cv,cv->c", e, z) / total
            del z, e
        ctx.save_for_backward(hidden, weight, bias, targets, top, logsum, ent)
        ctx.temperature, ctx.chunk, ctx.want_entropy = temperature, chunk, want_entropy
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, top, logsum, ent = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        N = hidden.shape[0]
        g_lp = torch.zeros_like(top) if g_lp is None else g_lp.to(top.dtype)
        # a loss without the entropies (GRPO without an entropy bonus) skips their terms
        use_ent = ctx.want_entropy and g_ent is not None and bool(g_ent.any())
        lse = top + logsum
        grad_h = torch.empty_like(hidden) if need_h else None
        # accumulate the weight gradient in at least float32 (bf16 sums over many chunks drift)
        grad_w = torch.zeros(weight.shape, dtype=_math_dtype(weight.dtype), device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=_math_dtype(bias.dtype), device=bias.device) if need_b else None
        for i in range(0, N, chunk):
            h = hidden[i : i + chunk]
            z = _chunk_logits(h, weight, bias, T).sub_(lse[i : i + chunk, None])  # log p
            p = torch.exp(z)
            # d/d logits = (1/T)·[g_lp·(onehot − p) − g_ent·p·(log p + H)]
            gl = g_lp[i : i + chunk, None] / T
            if use_ent:
                ge = g_ent[i : i + chunk, None].to(z.dtype) / T
                grad_z = z.mul_(-ge).sub_(ge * ent[i : i + chunk, None] + gl).mul_(p)
                del p
            else:
                grad_z = p.mul_(-gl)
                del z
            grad_z.scatter_add_(-1, targets[i : i + chunk, None], gl)
            gz = grad_z.to(weight.dtype)
            del grad_z
            if need_h:
                grad_h[i : i + chunk] = (gz @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(gz.T.to(grad_w.dtype), h.to(grad_w.dtype))
            if need_b:
                grad_b += gz.sum(0).to(grad_b.dtype)
            del gz
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    entropies: bool = True,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target and entropy of each next-token distribution, chunked over rows.

    hidden [N, D]: final hidden states (after the final norm) of the positions that predict
    ``targets`` [N] (int64); weight [V, D]: the LM head's weight (bias [V] if it has one).
    Returns ``(logprobs [N], entropies [N] or None)`` of ``softmax(logits / temperature)``,
    float32 (float64 for float64 inputs). Differentiable w.r.t. hidden, weight and bias;
    forward and backward hold at most a few [chunk, V] float buffers, never [N, V].
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, D] and weight [V, D] expected; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets [N] expected with N={hidden.shape[0]}; got {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be ≥ 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    lp, ent = _TokenLogprobs.apply(
        hidden, weight, bias, targets.long(), float(temperature), int(chunk), bool(entropies)
    )
    return lp, (ent if entropies else None)
