"""Chunked LM-head logprobs (kvrl.kernels.reference.logprobs.token_logprobs) equal the dense
``log_softmax(hidden @ weight.T / temperature)``, values and gradients, and HFEngine.score
uses them without changing its Scores."""

import pytest
import torch

from kvrl.engines.base import Sampling
from kvrl.kernels.reference.logprobs import token_logprobs
from kvrl.policies import make_policy


def dense(h, w, t, temperature=1.0, bias=None):
    logits = h @ w.T if bias is None else h @ w.T + bias
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def inputs(N, D, V, dtype, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g, dtype=dtype) * 0.5).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype)).requires_grad_() if bias else None
    return h, w, b, torch.randint(V, (N,), generator=g)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_dense(dtype, tol, temperature, bias):
    """A medium case (N = 300 over chunks of 64, the last one short; V = 1000): logprobs,
    entropies and the gradients of a loss using both w.r.t. hidden, weight and bias."""
    h, w, b, t = inputs(300, 32, 1000, dtype, bias=bias)
    lp, ent = token_logprobs(h, w, t, temperature=temperature, chunk=64, bias=b)
    lp_d, ent_d = dense(h, w, t, temperature, b)
    assert lp.dtype == ent.dtype == dtype and lp.shape == ent.shape == (300,)
    assert (lp - lp_d).abs().max() < tol and (ent - ent_d).abs().max() < tol
    g = torch.Generator().manual_seed(1)
    a, c = torch.randn(300, generator=g, dtype=dtype), torch.randn(300, generator=g, dtype=dtype)
    params = (h, w) if b is None else (h, w, b)
    got = torch.autograd.grad((lp * a).sum() + (ent * c).sum(), params)
    want = torch.autograd.grad((lp_d * a).sum() + (ent_d * c).sum(), params)
    for x, y in zip(got, want):
        assert (x - y).abs().max() < tol * max(1.0, float(y.abs().max())), (x - y).abs().max()


def test_gradcheck_float64():
    h, w, b, t = inputs(5, 3, 7, torch.float64, bias=True)
    assert torch.autograd.gradcheck(
        lambda h, w, b: token_logprobs(h, w, t, temperature=0.8, chunk=2, bias=b), (h, w, b)
    )
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, t, chunk=3, entropies=False)[0], (h, w))
    assert torch.autograd.gradcheck(lambda h: token_logprobs(h, w.detach(), t, chunk=4)[1], (h,))


def test_options_and_refusals():
    h, w, _, t = inputs(10, 4, 9, torch.float32)
    lp, ent = token_logprobs(h, w, t, entropies=False)
    assert ent is None and torch.allclose(lp, dense(h, w, t)[0], atol=1e-6)
    with torch.no_grad():  # a frozen head: only the hidden states get a gradient
        w0 = w.detach()
    token_logprobs(h, w0, t)[0].sum().backward()
    assert h.grad is not None and w0.grad is None
    lp16, _ = token_logprobs(h.detach().bfloat16(), w.detach().bfloat16(), t)  # bf16 matmul, float32 softmax
    assert lp16.dtype == torch.float32 and (lp16 - lp.detach()).abs().max() < 0.1
    empty, _ = token_logprobs(h[:0], w, t[:0])
    assert empty.shape == (0,)
    for kwargs, match in [({"chunk": 0}, "chunk"), ({"temperature": 0.0}, "temperature")]:
        with pytest.raises(ValueError, match=match):
            token_logprobs(h, w, t, **kwargs)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(h, w, t[:3])


def test_score_equals_the_dense_path(engine):
    """HFEngine.score (chunked head) against its dense path (distributions=True) on a padded
    batch replaying an eviction trace: same logprobs, losses, entropies and mask, and the
    same parameter gradients of a GRPO-like loss."""
    batch = [
        "a = 3 . b = a + 1 . c = b + 2 . d = c + 1 . e = d + 4 . what is e ?",
        "x = 1 . y = x + 2 . y ?",
        "p = 2 . q = p + 2 . r = q + 3 . r ?",
    ]
    policy = make_policy("rkv", engine.model.config, budget=12, interval=4, window=4, sink=2)
    out = engine.generate(batch, Sampling(max_new_tokens=20, temperature=1.0, seed=3), policy=policy)
    for temperature in (1.0, 0.7):
        new = engine.score(out, trace=out.traces, temperature=temperature)
        old = engine.score(out, trace=out.traces, temperature=temperature, distributions=True)
        assert new.distributions is None and old.distributions is not None
        assert torch.equal(new.mask, old.mask) and new.logprobs.shape == old.logprobs.shape
        for name in ("logprobs", "losses", "entropies"):
            x, y = getattr(new, name), getattr(old, name)
            assert x.dtype == torch.float32 and (x - y).abs().max() < 1e-5, name
            assert (x[~new.mask] == 0).all()
    params = [p for p in engine.model.parameters() if p.requires_grad]
    adv = torch.randn(new.mask.shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for distributions in (False, True):
        s = engine.score(out, trace=out.traces, distributions=distributions)
        loss = -(s.logprobs * adv).sum() - 0.01 * s.entropies.sum()
        grads.append(torch.autograd.grad(loss, params, allow_unused=True))
    for p, x, y in zip(params, *grads):
        assert (x is None) == (y is None)
        if x is not None:
            assert (x - y).abs().max() < 1e-5 * max(1.0, float(y.abs().max())), p.shape


def test_score_refuses_a_head_it_cannot_chunk(engine, monkeypatch):
    out = engine.generate(["x = 1 . x ?"], Sampling(max_new_tokens=3))
    monkeypatch.setattr(engine.model, "get_output_embeddings", lambda: torch.nn.Identity())
    with pytest.raises(ValueError, match="plain torch.nn.Linear"):
        engine.score(out)
    engine.score(out, distributions=True)  # the dense path does not need it
    monkeypatch.undo()
    monkeypatch.setattr(engine.model.config, "final_logit_softcapping", 30.0, raising=False)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        engine.score(out)
