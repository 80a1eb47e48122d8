"""Fused RMSNorm (Triton, interpreter) against the reference module and an fp64 recomputation."""

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import add_rms_norm, rms_norm
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES


def _fp64_reference(x, w, dy, eps=1e-5):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = TF.rms_norm(x64, (x.shape[-1],), w64, eps)
    y.backward(dy.double())
    return y, x64.grad, w64.grad


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 4, 1000), (5, 4097), (1, 9000)])
def test_forward_backward_vs_fp64(shape, dtype, tol):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    y = rms_norm(x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    y64, dx64, dw64 = _fp64_reference(x, w, dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == dtype
    torch.testing.assert_close(y.double(), y64, **{k: v * 4 for k, v in tol.items()})
    torch.testing.assert_close(x.grad.double(), dx64, **{k: v * 4 for k, v in tol.items()})
    # dweight sums over every row: its error grows with the row count
    scale = max(1.0, dw64.abs().max().item())
    torch.testing.assert_close(w.grad.double() / scale, dw64 / scale, **{k: v * 4 for k, v in tol.items()})


def test_widest_rows_65536():
    x = torch.randn(2, 65536, requires_grad=True)
    w = torch.randn(65536, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    y64, dx64, dw64 = _fp64_reference(x, w, dy, 1e-6)
    torch.testing.assert_close(y.double(), y64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), dx64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), dw64, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_fused_module_matches_reference_module(dtype, tol):
    ref = reference.RMSNorm(48, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48))
    fz = fused.RMSNorm(48, eps=1e-6, dtype=dtype)
    fz.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 48, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), fz(x2)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(y2, y1, **tol)
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    torch.testing.assert_close(fz.weight.grad.float(), ref.weight.grad.float(), atol=tol["atol"] * 10,
                               rtol=tol["rtol"] * 10)


def test_non_contiguous_inputs():
    base = torch.randn(6, 40, 3)
    x = base[..., 1].T.contiguous().T  # [6, 40] with strides (1, 6): last dim not contiguous
    x = x.requires_grad_()
    strided = torch.randn(8, 80)[:, :40].requires_grad_()  # row stride 80: viewed in place
    w = torch.randn(40, requires_grad=True)
    for inp in (x, strided):
        y = rms_norm(inp, w)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, (inp, w), dy)
        y64, dx64, dw64 = _fp64_reference(inp, w, dy)
        torch.testing.assert_close(y.double(), y64, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[0].double(), dx64, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[1].double(), dw64, atol=1e-5, rtol=1e-5)


def test_bad_inputs():
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        rms_norm(torch.randn(2, 7), w)
    with pytest.raises(TypeError, match="bfloat16"):
        rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.float16))
    with pytest.raises(TypeError):
        rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError):
        rms_norm(torch.randn(2, 8), torch.ones(2, 8))


def test_fp32_weight_with_low_precision_input_under_autocast():
    # autocast keeps master weights fp32 while activations are bf16: accepted, computed in fp32
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.randn(32)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):  # cuda when the suite reruns this on a GPU
        y = rms_norm(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), TF.rms_norm(x.float(), (32,), w, 1e-5), atol=2e-2, rtol=2e-2)


def test_zero_rows_give_zero_weight_gradient():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    rms_norm(x, w).sum().backward()
    assert x.grad.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros(16))


# ----------------------------------------------------------------------------------------------------
# add_rms_norm: h = x + residual, y = rmsnorm(h), in one pass
# ----------------------------------------------------------------------------------------------------
def _add_rms_norm_fp64(x, residual, w, dy, dh, eps=1e-5):
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, residual, w))
    h = x64 + r64
    y = TF.rms_norm(h, (x.shape[-1],), w64, eps)
    torch.autograd.backward((y, h), (dy.double(), dh.double()))
    return y, h, x64.grad, r64.grad, w64.grad


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 4, 1000), (1, 9000)])
def test_add_rms_norm_vs_fp64_composition(shape, dtype, tol):
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    residual = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    y, h = add_rms_norm(x, residual, w)
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward((y, h), (dy, dh))
    y64, h64, dx64, dr64, dw64 = _add_rms_norm_fp64(x, residual, w, dy, dh)
    tol = {k: v * 4 for k, v in tol.items()}
    assert y.dtype == h.dtype == x.grad.dtype == residual.grad.dtype == dtype
    torch.testing.assert_close(h.double(), h64, **tol)
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), dx64, **tol)
    torch.testing.assert_close(residual.grad.double(), dr64, **tol)
    scale = max(1.0, dw64.abs().max().item())
    torch.testing.assert_close(w.grad.double() / scale, dw64 / scale, **tol)


def test_add_rms_norm_matches_reference_module_and_fused_module():
    """The reference RMSNorm's add_forward (the spec) and the fused one agree, non-contiguous inputs included."""
    ref = reference.RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(40))
    fz = fused.RMSNorm(40, eps=1e-6)
    fz.load_state_dict(ref.state_dict())
    x = torch.randn(6, 3, 40).transpose(0, 1)  # [3, 6, 40], not contiguous
    residual = torch.randn(3, 80)[:, :40].unsqueeze(1).expand(3, 6, 40)  # strided, broadcast rows
    outs = []
    for norm in (ref, fz):
        xi, ri = x.clone().requires_grad_(), residual.clone().requires_grad_()
        y, h = norm.add_forward(xi, ri)
        (y.sum() * 3 + (h * h).sum()).backward()
        outs.append((y, h, xi.grad, ri.grad, norm.weight.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_only_one_output_used():
    x, residual = torch.randn(4, 33, requires_grad=True), torch.randn(4, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    y, _ = add_rms_norm(x, residual, w)
    y.sum().backward()  # dh absent
    _, _, dx64, _, dw64 = _add_rms_norm_fp64(x, residual, w, torch.ones(4, 33), torch.zeros(4, 33))
    torch.testing.assert_close(x.grad.double(), dx64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(residual.grad, x.grad)
    torch.testing.assert_close(w.grad.double(), dw64, atol=1e-5, rtol=1e-5)
    x.grad = residual.grad = w.grad = None
    _, h = add_rms_norm(x, residual, w)
    (2 * h).sum().backward()  # dy absent: dL/dx = dL/dresidual = 2
    assert torch.equal(x.grad, torch.full_like(x, 2.0)) and torch.equal(residual.grad, x.grad)


def test_add_rms_norm_bad_inputs():
    w = torch.ones(8)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), w)
    with pytest.raises(TypeError, match="residual is torch.float16"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).half(), w)
    with pytest.raises(ValueError, match="x must be"):
        add_rms_norm(torch.randn(2, 7), torch.randn(2, 7), w)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("n_cols", [37, 9000])  # a row in registers, and the chunked path
def test_weight_offset_vs_fp64(n_cols, dtype, tol):
    """``weight_offset=1`` (Gemma): ``x̂ · (1 + w)`` in fp32, for rms_norm and add_rms_norm, forward and backward;
    the weight's gradient is the plain weight's (d(1 + w)/dw = 1)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, n_cols, generator=gen).to(dtype).requires_grad_()
    r = torch.randn(5, n_cols, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n_cols, generator=gen) / 4).to(dtype).requires_grad_()
    y = rms_norm(x, w, 1e-6, weight_offset=1.0)
    y2, h = add_rms_norm(x, r, w, 1e-6, weight_offset=1.0)
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad((y * dy).sum() + (y2 * dy).sum(), (x, r, w))
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    y64 = TF.rms_norm(x64, (n_cols,), 1 + w64, 1e-6)
    y2_64 = TF.rms_norm(x64 + r64, (n_cols,), 1 + w64, 1e-6)
    grads64 = torch.autograd.grad((y64 * dy.double()).sum() + (y2_64 * dy.double()).sum(), (x64, r64, w64))
    scale = {k: v * 8 for k, v in tol.items()}
    torch.testing.assert_close(y.double(), y64, **scale)
    torch.testing.assert_close(y2.double(), y2_64, **scale)
    for got, want in zip(grads, grads64):
        size = want.abs().max()
        torch.testing.assert_close(got.double() / size, want / size, **scale)


def test_offset_module_starts_at_identity_scale():
    """``RMSNorm(offset=True)``: weights start at 0 (scale 1), reference and fused agree."""
    ref = reference.RMSNorm(24, 1e-6, offset=True)
    assert torch.equal(ref.weight, torch.zeros(24))
    with torch.no_grad():
        ref.weight.uniform_(-0.5, 0.5)
    fz = fused.RMSNorm(24, 1e-6, offset=True)
    fz.load_state_dict(ref.state_dict())
    x = torch.randn(3, 24)
    torch.testing.assert_close(fz(x), ref(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref(x), TF.rms_norm(x, (24,), 1 + ref.weight, 1e-6), atol=1e-6, rtol=1e-6)
