"""Fused SwiGLU gate and module against the reference and an fp64 recomputation."""

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import swiglu_gate
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1000), (2, 3, 4, 17), (1, 4097)])
def test_gate_forward_backward_vs_fp64(shape, dtype, tol):
    a = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    b = torch.randn(shape, dtype=dtype, requires_grad=True)
    h = swiglu_gate(a, b)
    dh = torch.randn_like(h)
    h.backward(dh)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    h64 = TF.silu(a64) * b64
    h64.backward(dh.double())
    tol = {k: v * 2 for k, v in tol.items()}
    assert h.dtype == dtype
    torch.testing.assert_close(h.double(), h64, **tol)
    torch.testing.assert_close(a.grad.double(), a64.grad, **tol)
    torch.testing.assert_close(b.grad.double(), b64.grad, **tol)


def test_gate_non_contiguous():
    a = torch.randn(10, 6).T.requires_grad_()
    b = torch.randn(6, 20)[:, ::2].requires_grad_()
    h = swiglu_gate(a, b)
    torch.testing.assert_close(h, TF.silu(a) * b)
    ga, gb = torch.autograd.grad(h.sum(), (a, b))
    ga_ref, gb_ref = torch.autograd.grad((TF.silu(a) * b).sum(), (a, b))
    torch.testing.assert_close(ga, ga_ref)
    torch.testing.assert_close(gb, gb_ref)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_fused_module_matches_reference(dtype, tol):
    ref = reference.SwiGLU(32, 80, dtype=dtype)
    fz = fused.SwiGLU(32, 80, dtype=dtype)
    fz.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 32, dtype=dtype)
    y1, y2 = ref(x), fz(x)
    tol = {k: v * 2 for k, v in tol.items()}
    torch.testing.assert_close(y2, y1, **tol)
    y1.float().square().sum().backward()
    y2.float().square().sum().backward()
    for p1, p2 in zip(ref.parameters(), fz.parameters()):
        scale = max(1.0, p1.grad.abs().max().item())
        torch.testing.assert_close(p2.grad.float() / scale, p1.grad.float() / scale, **tol)


def test_bad_inputs():
    with pytest.raises(ValueError, match="one shape"):
        swiglu_gate(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(TypeError):
        swiglu_gate(torch.randn(3), torch.randn(3, dtype=torch.float16))
    with pytest.raises(TypeError):
        swiglu_gate(torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
