"""Post-training heads (Triton, interpreter): ``linear_log_probs`` (per-token log-probabilities and entropy from
hidden states, the logits never formed), TRL's ``selective_log_softmax`` / ``entropy_from_logits`` on logits, and the
distillation divergences ``jsd`` / ``kl_div`` / ``fused_linear_jsd``, forward and backward in fp32 / fp16 / bf16
against fp64 recomputations with PyTorch's own ops; chunk boundaries, ignored positions, temperatures, softcaps,
biases, leading dims, non-contiguous inputs, bad inputs; the peak memory of the head on CPU."""

import math

import pytest
import torch

from tritonlm.kernels import (
    entropy_from_logits,
    fused_linear_jsd,
    jsd,
    kl_div,
    linear_log_probs,
    selective_log_softmax,
)
from tritonlm.kernels import log_probs as lp_module
from tritonlm.memory import peak_live_bytes

from helpers import DTYPE_TOLERANCES


def _fp64(logits, targets=None, temperature=1.0, softcap=None, ignore_index=-100):
    """``(log p_t, H)`` in fp64 from torch's log_softmax (0 at ignored targets)."""
    z = logits.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    if targets is None:
        return None, entropy
    keep = targets != ignore_index
    chosen = log_p.gather(-1, torch.where(keep, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, chosen, 0.0), torch.where(keep, entropy, 0.0)


def _targets(shape, vocab, ignore_every=4):
    t = torch.randint(0, vocab, shape)
    t.view(-1)[::ignore_every] = -100
    return t


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("temperature, softcap, bias", [(1.0, None, False), (0.6, None, True), (1.3, 4.0, False)])
def test_linear_log_probs_and_entropy_match_fp64(dtype, tol, temperature, softcap, bias, monkeypatch):
    """Several chunks (the chunk size forced small), a ragged vocabulary, ignored positions, two leading dims; the
    gradients of a weighted sum of both outputs, in every input."""
    monkeypatch.setattr(lp_module, "log_prob_chunk_rows", lambda n, v, e=4: 5)
    torch.manual_seed(0)
    b, s, d, v = 2, 9, 24, 1037
    hidden = (torch.randn(b, s, d) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, d) * 0.5).to(dtype).requires_grad_()
    bias_t = (torch.randn(v) * 0.5).to(dtype).requires_grad_() if bias else None
    targets = _targets((b, s), v)
    logp, ent = linear_log_probs(hidden, weight, targets, bias=bias_t, temperature=temperature, softcap=softcap,
                                 return_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (b, s)
    inputs = [hidden, weight] + ([bias_t] if bias else [])
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    logits = ref_in[0] @ ref_in[1].t() + (ref_in[2] if bias else 0)
    r_logp, r_ent = _fp64(logits, targets, temperature, softcap)
    scale = 4.0 if dtype != torch.float32 else 1.0
    torch.testing.assert_close(logp.double(), r_logp, **tolerance_of(tol, scale * 10))
    torch.testing.assert_close(ent.double(), r_ent, **tolerance_of(tol, scale * 10))
    assert bool((logp[targets == -100] == 0).all()) and bool((ent[targets == -100] == 0).all())
    w_lp, w_ent = torch.randn(b, s), torch.randn(b, s)
    grads = torch.autograd.grad((logp * w_lp).sum() + (ent * w_ent).sum(), inputs)
    ref = torch.autograd.grad((r_logp * w_lp).sum() + (r_ent * w_ent).sum(), ref_in)
    for g, r in zip(grads, ref):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r, **tolerance_of(tol, scale * 10))


def tolerance_of(tol: dict, scale: float) -> dict:
    return {k: v * scale for k, v in tol.items()}


def test_linear_log_probs_alone_and_at_an_ignored_target_gives_no_gradient():
    torch.manual_seed(1)
    hidden = torch.randn(3, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.tensor([4, -100, 7])
    logp = linear_log_probs(hidden, weight, targets)
    assert isinstance(logp, torch.Tensor) and logp[1] == 0
    (dh,) = torch.autograd.grad(logp.sum(), hidden)
    assert bool((dh[1] == 0).all()) and bool((dh[0] != 0).any())
    r_logp, _ = _fp64(hidden.detach() @ weight.detach().t(), targets)
    torch.testing.assert_close(logp.double(), r_logp, atol=1e-5, rtol=1e-5)


def test_linear_log_probs_of_non_contiguous_inputs():
    torch.manual_seed(2)
    hidden = torch.randn(16, 5, 20)[:, ::2].transpose(0, 1)  # [3, 16, 20] with strides of its own
    weight = torch.randn(20, 61).t()  # [61, 20], column-major
    targets = torch.randint(0, 61, (3, 16))
    logp = linear_log_probs(hidden, weight, targets, temperature=0.9)
    torch.testing.assert_close(logp.double(), _fp64(hidden @ weight.t(), targets, 0.9)[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_selective_log_softmax_and_entropy_from_logits_match_fp64(dtype, tol):
    """TRL's two functions on logits, any leading dims, a large logit range; fp32 results, gradients in the logits'
    dtype."""
    torch.manual_seed(3)
    logits = (torch.randn(2, 3, 7, 1500) * 6).to(dtype).requires_grad_()
    index = torch.randint(0, 1500, (2, 3, 7))
    logp, ent = selective_log_softmax(logits, index), entropy_from_logits(logits, chunk_size=2)
    assert logp.dtype == ent.dtype == torch.float32
    ref = logits.detach().double().requires_grad_()
    r_logp, r_ent = _fp64(ref, index)
    scale = 10.0 if dtype != torch.float32 else 2.0
    torch.testing.assert_close(logp.double(), r_logp, **tolerance_of(tol, scale))
    torch.testing.assert_close(ent.double(), r_ent, **tolerance_of(tol, scale))
    w1, w2 = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    (g,) = torch.autograd.grad((logp * w1).sum() + (ent * w2).sum(), logits)
    (r,) = torch.autograd.grad((r_logp * w1).sum() + (r_ent * w2).sum(), ref)
    assert g.dtype == dtype
    torch.testing.assert_close(g.double(), r, **tolerance_of(tol, scale))
    # a non-contiguous view reads as the tensor it shows
    view = logits.detach()[..., ::2]
    torch.testing.assert_close(entropy_from_logits(view).double(), _fp64(view)[1], **tolerance_of(tol, scale))


def test_argmax_rides_the_statistics_pass():
    logits = torch.randn(37, 1300)
    logits[3, 1299] = logits[3].max() + 1  # in the ragged last tile
    logits[5, 7] = logits[5, 900] = logits[5].max() + 1  # a tie: the first index, as torch.argmax
    _, _, _, best = lp_module.log_prob_stats(logits, None, argmax=True)
    assert torch.equal(best, logits.argmax(-1))


def test_bad_inputs_are_one_line_errors():
    h, w, t = torch.randn(2, 8), torch.randn(10, 8), torch.tensor([1, 2])
    cases = [
        (lambda: linear_log_probs(h, w, t, temperature=0.0), "temperature must be a number > 0"),
        (lambda: linear_log_probs(h, w, t, temperature=-1), "temperature must be a number > 0"),
        (lambda: linear_log_probs(h, w, torch.tensor([1, 10])), r"ids must be in \[0, 10\)"),
        (lambda: linear_log_probs(h, w[:, :4], t), "expected hidden"),
        (lambda: linear_log_probs(h, w, t[:1]), "disagree"),
        (lambda: linear_log_probs(h, w, t, bias=torch.zeros(9)), "bias must be"),
        (lambda: linear_log_probs(h, w, t.float()), "int64 or int32"),
        (lambda: selective_log_softmax(torch.randn(2, 10), torch.tensor([0])), "index"),
        (lambda: selective_log_softmax(torch.randn(2, 10), torch.tensor([0, 12])), r"ids must be in \[0, 10\)"),
        (lambda: entropy_from_logits(torch.randn(2, 10), chunk_size=0), "chunk_size must be a positive int"),
        (lambda: jsd(torch.randn(2, 10), torch.randn(2, 11)), "one vocabulary"),
        (lambda: jsd(torch.randn(2, 10), torch.randn(2, 10), beta=1.5), r"beta must be in \[0, 1\]"),
        (lambda: fused_linear_jsd(h, w, h, torch.randn(11, 8)), "one vocabulary"),
        (lambda: fused_linear_jsd(h, w, h, w, temperature=0), "temperature must be a number > 0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------
# distillation
# ----------------------------------------------------------------------------------------------------
def _fp64_divergence(x, y, beta):
    x, y = x.double(), y.double()
    p, q = y.exp(), x.exp()
    if beta == 0:
        return (p * (y - x)).sum(-1)  # = F.kl_div(x, y, log_target=True) summed over the vocabulary
    if beta == 1:
        return (q * (x - y)).sum(-1)
    m = beta * p + (1 - beta) * q
    return beta * (p * (y - m.log())).sum(-1) + (1 - beta) * (q * (x - m.log())).sum(-1)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("beta", [0.0, 0.5, 0.1, 1.0])
def test_jsd_on_log_probs_matches_fp64(dtype, tol, beta):
    torch.manual_seed(4)
    student = torch.log_softmax(torch.randn(3, 5, 1100) * 2, -1).to(dtype).requires_grad_()
    teacher = torch.log_softmax(torch.randn(3, 5, 1100) * 2, -1).to(dtype)
    labels = _targets((3, 5), 1100, ignore_every=3)
    loss = jsd(student, teacher, beta, shift_labels=labels)
    ref = student.detach().double().requires_grad_()
    keep = labels != -100
    expected = _fp64_divergence(ref, teacher, beta)[keep].mean()
    scale = 10.0 if dtype != torch.float32 else 1.0
    torch.testing.assert_close(loss.double(), expected, **tolerance_of(tol, scale))
    (g,) = torch.autograd.grad(loss * 3, student)
    (r,) = torch.autograd.grad(expected * 3, ref)
    torch.testing.assert_close(g.double(), r, **tolerance_of(tol, scale))
    if beta in (0.0, 1.0):  # kl_div is the same divergence, named
        torch.testing.assert_close(kl_div(student, teacher, reverse=beta == 1.0, shift_labels=labels), loss)
    if beta == 0.0:  # PyTorch's own forward KL, summed over the vocabulary, averaged over the counted tokens
        torch_kl = torch.nn.functional.kl_div(student.double()[keep], teacher.double()[keep], log_target=True,
                                              reduction="sum") / keep.sum()
        torch.testing.assert_close(loss.double(), torch_kl, **tolerance_of(tol, scale))


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("beta, temperature", [(0.5, 1.0), (0.0, 2.0), (1.0, 0.7), (0.25, 1.0)])
def test_fused_linear_jsd_matches_the_formula_on_materialised_logits(dtype, tol, beta, temperature, monkeypatch):
    """Chunks forced small; the student and teacher of different widths; ignored tokens; gradients to the student's
    input and weight only."""
    import tritonlm.kernels.distill as distill

    monkeypatch.setattr(distill, "_chunk_buffer", lambda n, v, dt, dev: torch.empty(4, v + 3, dtype=dt, device=dev))
    torch.manual_seed(5)
    hs = (torch.randn(2, 7, 20) * 0.5).to(dtype).requires_grad_()
    ws = (torch.randn(901, 20) * 0.5).to(dtype).requires_grad_()
    ht = (torch.randn(2, 7, 12) * 0.5).to(dtype).requires_grad_()
    wt = (torch.randn(901, 12) * 0.5).to(dtype)
    labels = _targets((2, 7), 901, ignore_every=5)
    loss = fused_linear_jsd(hs, ws, ht, wt, labels, jsd_beta=beta, temperature=temperature)
    r_hs, r_ws = hs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
    x = torch.log_softmax(r_hs @ r_ws.t() / temperature, -1)
    y = torch.log_softmax(ht.detach().double() @ wt.double().t() / temperature, -1)
    keep = labels != -100
    expected = _fp64_divergence(x, y, beta)[keep].mean()
    scale = 10.0 if dtype != torch.float32 else 1.0
    torch.testing.assert_close(loss.double(), expected, **tolerance_of(tol, scale))
    g = torch.autograd.grad(loss * 2, (hs, ws))
    r = torch.autograd.grad(expected * 2, (r_hs, r_ws))
    for a, b in zip(g, r):
        torch.testing.assert_close(a.double(), b, **tolerance_of(tol, scale * 3))
    assert ht.grad is None  # (the teacher is a target)


def test_linear_log_probs_memory_is_flat_in_the_vocabulary(monkeypatch):
    """Peak extra memory of log-probs + entropy forward and backward, against the materialised-logits path (one fp32
    [tokens, vocab] tensor and its softmax): at most a tenth, and the fused peak is the weight, its gradient and one
    chunk -- what grows with the vocabulary is the weight's own size and one chunk's row width, not tokens x vocab.
    (Chunks of 128 tokens here stand for the 1024+ a GPU run takes: the same ratio at 1/8 of TRL's 8,192 tokens.)"""
    rows = 128
    monkeypatch.setattr(lp_module, "log_prob_chunk_rows", lambda n, v, e=4: min(n, rows))
    torch.manual_seed(6)
    n, d = 2048, 16

    def peaks(v):
        hidden = torch.randn(n, d, requires_grad=True)
        weight = (torch.randn(v, d) / 4).requires_grad_()
        targets = torch.randint(0, v, (n,))

        def eager():
            z = torch.log_softmax(hidden @ weight.t(), -1)
            lp = z.gather(-1, targets[:, None])[:, 0]
            ent = -(z.exp() * z).sum(-1)
            (lp.sum() + ent.sum()).backward()

        def fused():
            lp, ent = linear_log_probs(hidden, weight, targets, return_entropy=True)
            (lp.sum() + ent.sum()).backward()

        return peak_live_bytes(eager)[1], peak_live_bytes(fused)[1]

    small, large = peaks(4000), peaks(12000)
    for eager, fused in (small, large):
        assert fused <= eager / 10
    weight_growth = 3 * (12000 - 4000) * d * 4  # (the weight, its fp32 gradient and the returned gradient)
    chunk_growth = 3 * rows * (math.ceil(12000 / 16) - math.ceil(4000 / 16)) * 16 * 4  # (and the interpreter's copies)
    assert large[1] - small[1] <= weight_growth + chunk_growth
    assert large[0] - small[0] >= 3 * n * (12000 - 4000) * 4  # (the materialised path grows by tokens x vocab)


@pytest.mark.parametrize("softcap", [None, 6.0])
def test_cross_entropy_metrics_ride_the_loss(softcap, monkeypatch):
    """Liger's CrossEntropyOutput fields (+ the entropy) from cross_entropy and linear_cross_entropy, against argmax
    and the entropy of the materialised logits; the loss and its gradients are the ones without the metrics."""
    import tritonlm.kernels.linear_cross_entropy_loss as lce
    from tritonlm.kernels import cross_entropy, linear_cross_entropy

    monkeypatch.setattr(lce, "chunk_rows", lambda n, v, e=4: 4)
    torch.manual_seed(7)
    hidden = torch.randn(2, 5, 12, requires_grad=True)
    weight = torch.randn(301, 12, requires_grad=True)
    targets = _targets((2, 5), 301, ignore_every=3)
    logits = hidden.detach() @ weight.detach().t()
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    keep = targets != -100
    want_pred = z.argmax(-1)
    want_acc = ((want_pred == targets) & keep).sum() / keep.sum()
    want_ent = _fp64(z)[1]
    out = linear_cross_entropy(hidden, weight, targets, softcap=softcap, return_token_accuracy=True,
                               return_predicted_tokens=True, return_entropy=True)
    plain = linear_cross_entropy(hidden, weight, targets, softcap=softcap)
    assert torch.equal(out.predicted_tokens, want_pred) and out.token_accuracy == want_acc
    torch.testing.assert_close(out.entropy.double(), want_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, plain)
    g_out = torch.autograd.grad(out.loss, (hidden, weight))
    g_plain = torch.autograd.grad(plain, (hidden, weight))
    for a, b in zip(g_out, g_plain):
        torch.testing.assert_close(a, b)
    on_logits = cross_entropy(logits, targets, softcap=softcap, return_token_accuracy=True, return_entropy=True)
    assert on_logits.token_accuracy == want_acc and on_logits.predicted_tokens is None
    torch.testing.assert_close(on_logits.entropy.double(), want_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(on_logits.loss, cross_entropy(logits, targets, softcap=softcap))
