"""The gated RMSNorm (Qwen3.5 / Qwen3-Next's norm before the gate) against an fp64 recomputation and against
transformers' own ``Qwen3NextRMSNormGated`` (its casting, when installed): forward and every gradient in fp32 / fp16 /
bf16, odd widths, several leading dims, non-contiguous inputs, bad inputs; the fused module against the reference."""

import pytest
import torch

from tritonlm.kernels import rms_norm_gated
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES


def _fp64(x, g, w, eps):
    """``(w · x / rms(x)) · g · sigmoid(g)`` in fp64, written out."""
    x, g, w = (t.double() for t in (x, g, w))
    x_hat = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x_hat * g * torch.sigmoid(g)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("shape", [(3, 5, 40), (1, 7), (2, 3, 4, 128), (9, 100)])
def test_forward_and_gradients_against_fp64(dtype, tol, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype).requires_grad_()
    g = (torch.randn(*shape, generator=gen) * 2).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).requires_grad_()
    y = rms_norm_gated(x, g, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    leaves = [t.detach().double().requires_grad_() for t in (x, g, w)]
    ref = _fp64(*leaves, 1e-6)
    scale = 4 if dtype != torch.float32 else 1  # (16-bit: x̂ and w·x̂ are rounded before the gate, as in transformers)
    torch.testing.assert_close(y.double(), ref, atol=tol["atol"] * scale, rtol=tol["rtol"] * scale)
    dy = torch.randn(*shape, generator=gen).to(dtype)
    got = torch.autograd.grad(y, (x, g, w), dy)
    want = torch.autograd.grad(ref, leaves, dy.double())
    for a, b, name in zip(got, want, ("x", "gate", "weight")):
        size = b.abs().max().clamp_min(1e-3)
        torch.testing.assert_close(a.double() / size, b / size, atol=tol["atol"] * 4 * scale,
                                   rtol=tol["rtol"] * 4 * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_non_contiguous_inputs_and_the_reference_module():
    """Strided x and gate (views of wider tensors); the fused module equals the reference one (same weight)."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 64)[..., ::2].requires_grad_()
    g = torch.randn(6, 4, 32).transpose(0, 1).requires_grad_()
    ref = reference.RMSNormGated(32)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    fz = fused.RMSNormGated(32)
    fz.load_state_dict(ref.state_dict())
    y_ref, y = ref(x, g), fz(x, g)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.double(), _fp64(x.detach(), g.detach(), ref.weight.detach(), ref.eps),
                               atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, g, fz.weight), dy), torch.autograd.grad(y_ref, (x, g, ref.weight), dy)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_qwen3_next_gated_norm(dtype):
    """Against ``Qwen3NextRMSNormGated`` itself: outputs equal in fp32; in bf16 within one rounding (the same casts)."""
    transformers = pytest.importorskip("transformers", reason="the optional extra: pip install 'tritonlm[hf]'")
    theirs = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated(48, eps=1e-6).to(dtype)
    torch.manual_seed(1)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
    x, g = (torch.randn(3, 7, 48).to(dtype) for _ in range(2))
    ours = rms_norm_gated(x, g, theirs.weight.detach(), 1e-6)
    expected = theirs(x, g)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(ours, expected, **tol)


def test_bad_inputs_are_one_line_errors():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="gate"):
        rms_norm_gated(x, torch.randn(2, 4), w)
    with pytest.raises(ValueError, match="1-D weight"):
        rms_norm_gated(x, x, torch.ones(2, 8))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        rms_norm_gated(x.double(), x.double(), w.double())
    with pytest.raises(ValueError, match="eps must be > 0"):
        rms_norm_gated(x, x, w, 0.0)


def test_traces_whole_under_torch_compile():
    """The forward and backward are custom ops: ``torch.compile(fullgraph=True)`` traces through them (aot_eager) and
    gives the eager values and gradients."""
    torch.manual_seed(2)
    x, g = torch.randn(3, 5, 24, requires_grad=True), torch.randn(3, 5, 24, requires_grad=True)
    w = torch.rand(24, requires_grad=True)

    def fn(x, g, w):
        return rms_norm_gated(x, g, w).square().sum()

    eager = torch.autograd.grad(fn(x, g, w), (x, g, w))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, b in zip(torch.autograd.grad(compiled(x, g, w), (x, g, w)), eager):
        torch.testing.assert_close(a, b)
