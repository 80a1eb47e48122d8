"""Fused gates (SwiGLU, GeGLU) and their modules against the reference and an fp64 recomputation."""

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import geglu_gate, swiglu_gate
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES

#: gate -> (ours, the same in PyTorch): SwiGLU, and GeGLU with both GELUs
GATES = {"swiglu": (swiglu_gate, lambda a, b: TF.silu(a) * b),
         "geglu-tanh": (lambda a, b: geglu_gate(a, b), lambda a, b: TF.gelu(a, approximate="tanh") * b),
         "geglu-erf": (lambda a, b: geglu_gate(a, b, approximate="none"), lambda a, b: TF.gelu(a) * b)}


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1000), (2, 3, 4, 17), (1, 4097)])
@pytest.mark.parametrize("gate", list(GATES))
def test_gate_forward_backward_vs_fp64(gate, shape, dtype, tol):
    ours, theirs = GATES[gate]
    a = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    b = torch.randn(shape, dtype=dtype, requires_grad=True)
    h = ours(a, b)
    dh = torch.randn_like(h)
    h.backward(dh)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    h64 = theirs(a64, b64)
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


def test_geglu_non_contiguous_and_bad_inputs():
    a = torch.randn(10, 6).T.requires_grad_()
    b = torch.randn(6, 10, requires_grad=True)
    geglu_gate(a, b).sum().backward()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (TF.gelu(a2, approximate="tanh") * b2).sum().backward()
    torch.testing.assert_close(a.grad, a2.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="approximate"):
        geglu_gate(a, b, approximate="erf")
    with pytest.raises(ValueError, match="one shape"):
        geglu_gate(a, b[:3])


def test_fused_geglu_module_matches_reference():
    ref = reference.GeGLU(32, 80)
    fz = fused.GeGLU(32, 80)
    fz.load_state_dict(ref.state_dict())
    assert list(ref.state_dict()) == ["w1.weight", "w2.weight", "w3.weight"]
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(fz(x), ref(x), atol=1e-5, rtol=1e-5)
