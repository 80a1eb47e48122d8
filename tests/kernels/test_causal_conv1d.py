"""Depthwise causal conv1d (Gated DeltaNet's short convolution) against an fp64 loop written from its definition and
against transformers' own torch implementations (qwen3_next's ``causal_conv1d_fn`` / ``causal_conv1d_update``, when
installed): output and every gradient in fp32 / fp16 / bf16, odd sizes, transformers' transposed layout, packed
documents (seq_idx), the decoding step's in-place state, torch.compile, bad inputs; the readable twin too."""

import pytest
import torch

from tritonlm.kernels import causal_conv1d_fn, causal_conv1d_update
from tritonlm.modules import functional

from helpers import DTYPE_TOLERANCES


def _fp64(x, w, b, silu, seq_idx=None):
    """``out[t] = bias + Σ_k w[k] · x[t - W + 1 + k]`` one position at a time (taps before the sequence, or from
    another packed document, read zero), then SiLU."""
    x, w = x.double(), w.double()
    batch, chans, times = x.shape
    taps = w.shape[1]
    out = torch.zeros(batch, chans, times, dtype=torch.float64)
    for t in range(times):
        for k in range(taps):
            s = t - (taps - 1) + k
            if s < 0:
                continue
            same = 1.0 if seq_idx is None else (seq_idx[:, s] == seq_idx[:, t]).double()[:, None]
            out[:, :, t] = out[:, :, t] + w[:, k] * x[:, :, s] * same
    if b is not None:
        out = out + b.double()[:, None]
    return out * torch.sigmoid(out) if silu else out


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("batch, chans, times, taps, bias, silu", [
    (2, 37, 50, 4, True, True), (1, 5, 1, 4, False, True), (3, 70, 9, 3, True, False), (1, 33, 130, 2, False, False)])
def test_forward_and_gradients_against_fp64(dtype, tol, batch, chans, times, taps, bias, silu):
    gen = torch.Generator().manual_seed(chans + times)
    # transformers' layout: the [batch, T, D] projection transposed (channels contiguous)
    x = torch.randn(batch, times, chans, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    w = (torch.randn(chans, taps, generator=gen) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(chans, generator=gen).to(dtype).requires_grad_() if bias else None
    out = causal_conv1d_fn(x, w, b, "silu" if silu else None)
    assert out.shape == x.shape and out.dtype == dtype
    inputs = [t for t in (x, w, b) if t is not None]
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    ref = _fp64(leaves[0], leaves[1], leaves[2] if bias else None, silu)
    torch.testing.assert_close(out.double(), ref, atol=tol["atol"] * 4, rtol=tol["rtol"] * 4)
    dy = torch.randn(out.shape, generator=gen).to(dtype)
    for a, e in zip(torch.autograd.grad(out, inputs, dy), torch.autograd.grad(ref, leaves, dy.double())):
        size = e.abs().max().clamp_min(1e-3)
        torch.testing.assert_close(a.double() / size, e / size, atol=tol["atol"] * 8, rtol=tol["rtol"] * 8)
    # the readable twin (F.conv1d) against the same recomputation
    twin = functional.causal_conv1d(x.detach(), w.detach(), None if b is None else b.detach(), "silu" if silu else None)
    torch.testing.assert_close(twin.double(), ref, atol=tol["atol"] * 4, rtol=tol["rtol"] * 4)


def test_packed_documents_never_mix():
    """With seq_idx a tap from the previous document reads zero: each document's output and gradients equal its
    own convolution alone."""
    torch.manual_seed(3)
    x = torch.randn(1, 12, 23, requires_grad=True)
    w, b = torch.randn(12, 4, requires_grad=True), torch.randn(12, requires_grad=True)
    seq = torch.tensor([[0] * 7 + [1] * 2 + [2] * 14], dtype=torch.int32)
    out = causal_conv1d_fn(x, w, b, "silu", seq_idx=seq)
    alone = torch.cat([causal_conv1d_fn(x[..., a:e], w, b, "silu") for a, e in ((0, 7), (7, 9), (9, 23))], dim=-1)
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=1e-6)
    dy = torch.randn_like(out)
    for a, e in zip(torch.autograd.grad(out, (x, w, b), dy), torch.autograd.grad(alone, (x, w, b), dy)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_decoding_steps_equal_the_whole_sequence_and_update_the_state_in_place():
    torch.manual_seed(4)
    x, w, b = torch.randn(2, 9, 11), torch.randn(9, 4), torch.randn(9)
    whole = causal_conv1d_fn(x, w, b, "silu")
    state = torch.zeros(2, 9, 3)
    prefix = 5  # a prompt's last inputs as the state, then one token at a time
    state.copy_(x[..., prefix - 3:prefix])
    steps = [causal_conv1d_update(x[..., t:t + 1], state, w, b, "silu") for t in range(prefix, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=-1), whole[..., prefix:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[..., -3:])


def test_matches_transformers_torch_implementations():
    transformers = pytest.importorskip("transformers", reason="the optional extra: pip install 'tritonlm[hf]'")
    theirs = transformers.models.qwen3_next.modeling_qwen3_next
    torch.manual_seed(5)
    x, w, b = torch.randn(2, 16, 13), torch.randn(16, 4), torch.randn(16)
    fn = getattr(theirs.causal_conv1d_fn, "__wrapped__", theirs.causal_conv1d_fn)
    torch.testing.assert_close(causal_conv1d_fn(x, w, b, "silu"), fn(x, w, b, activation="silu"), atol=1e-5, rtol=1e-5)
    update = getattr(theirs.causal_conv1d_update, "__wrapped__", theirs.causal_conv1d_update)
    s_ours, s_theirs = torch.randn(2, 16, 4), None
    s_theirs = s_ours.clone()
    new = torch.randn(2, 16, 1)
    torch.testing.assert_close(causal_conv1d_update(new, s_ours, w, b, "silu"), update(new, s_theirs, w, b, "silu"),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_ours, s_theirs)


def test_traces_whole_under_torch_compile():
    torch.manual_seed(6)
    x, w = torch.randn(1, 8, 10, requires_grad=True), torch.randn(8, 4, requires_grad=True)

    def fn(x, w):
        return causal_conv1d_fn(x, w, None, "silu").square().sum()

    eager = torch.autograd.grad(fn(x, w), (x, w))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, e in zip(torch.autograd.grad(compiled(x, w), (x, w)), eager):
        torch.testing.assert_close(a, e)


def test_bad_inputs_are_one_line_errors():
    x, w = torch.randn(1, 4, 6), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"x must be \[batch, D, T\]"):
        causal_conv1d_fn(x[0], w)
    with pytest.raises(ValueError, match="bias must be"):
        causal_conv1d_fn(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fn(x, w, activation="relu")
    with pytest.raises(TypeError, match="seq_idx must be int32"):
        causal_conv1d_fn(x, w, seq_idx=torch.zeros(1, 6, dtype=torch.int64))
    with pytest.raises(TypeError, match="initial_states"):
        causal_conv1d_fn(x, w, initial_states=torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d_update(x[..., :1], torch.zeros(1, 4, 1), w)
