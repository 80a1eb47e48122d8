"""Fused RoPE (q and k in one launch) against the reference module and an fp64 rotation."""

import math

import pytest
import torch
from einops import rearrange

from tritonlm.kernels import apply_rope
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES


def _fp64_rope(x, positions, theta):
    """Rotate pairs by complex multiplication in fp64 (positions broadcast to x.shape[:-1])."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.broadcast_to(positions, x.shape[:-1]).double()[..., None] * freqs
    z = torch.view_as_complex(x.double().unflatten(-1, (d // 2, 2)).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("d", [2, 16, 80])
def test_q_and_k_forward_backward_vs_fp64(d, dtype, tol):
    q = torch.randn(2, 3, 9, d, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 3, 9, d, dtype=dtype, requires_grad=True)
    positions = torch.randint(5, 300, (2, 1, 9))  # per-batch positions, not starting at 0
    q_rot, k_rot = apply_rope(q, k, positions, theta=10000.0)
    dq_out, dk_out = torch.randn_like(q_rot), torch.randn_like(k_rot)
    (q_rot * dq_out + k_rot * dk_out).float().sum().backward()
    torch.testing.assert_close(q_rot.double(), _fp64_rope(q, positions, 1e4), **tol)
    torch.testing.assert_close(k_rot.double(), _fp64_rope(k, positions, 1e4), **tol)
    # the gradient is the inverse rotation of the output gradient
    torch.testing.assert_close(q.grad.double(), _fp64_rope(dq_out, -positions, 1e4), **tol)
    torch.testing.assert_close(k.grad.double(), _fp64_rope(dk_out, -positions, 1e4), **tol)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_fused_module_matches_reference(dtype, tol):
    ref = reference.RotaryPositionalEmbedding(500.0, 12, 64)
    fz = fused.RotaryPositionalEmbedding(500.0, 12, 64)
    x = torch.randn(4, 3, 2, 10, 12, dtype=dtype)  # four leading dims
    positions = torch.arange(3, 13)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1, positions), fz(x2, positions)
    torch.testing.assert_close(y2, y1, **tol)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    assert len(fz.state_dict()) == 0
    torch.testing.assert_close(fz(x[0, 0]), ref(x[0, 0]), **tol)  # default positions


def test_head_split_view_is_read_in_place_and_layout_kept():
    d, heads = 8, 3
    proj = torch.randn(2, 7, heads * d)
    q = rearrange(proj, "b s (h d) -> b h s d", h=heads)  # non-contiguous view
    assert not q.is_contiguous()
    q_rot = apply_rope(q, None, torch.arange(7))
    torch.testing.assert_close(q_rot.double(), _fp64_rope(q, torch.arange(7), 1e4), atol=1e-5, rtol=1e-5)
    assert q_rot.stride() == q.stride()  # same layout: merging heads back is a view


def test_long_positions_match_an_independent_fp64_rotation():
    """At positions up to 20K the angles are large: the fused module (its own fp64-built tables) is compared
    with a rotation computed here in fp64 from the formula, not with the reference's tables."""
    fz = fused.RotaryPositionalEmbedding(10000.0, 64, 20000)
    x = torch.randn(5, 64)
    positions = torch.tensor([0, 1, 4095, 16383, 19999])
    torch.testing.assert_close(fz(x, positions).double(), _fp64_rope(x, positions, 1e4), atol=2e-6, rtol=2e-6)
    ref = reference.RotaryPositionalEmbedding(10000.0, 64, 20000)
    torch.testing.assert_close(ref(x, positions).double(), _fp64_rope(x, positions, 1e4), atol=2e-6, rtol=2e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(3, 5))
    with pytest.raises(ValueError, match="one shape"):
        apply_rope(torch.randn(2, 3, 4), torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match="seq"):
        apply_rope(torch.randn(3, 4), None, torch.arange(4))
    with pytest.raises(TypeError):
        apply_rope(torch.randn(3, 4), None, torch.arange(3.0))
    fz = fused.RotaryPositionalEmbedding(100.0, 4, 8)
    with pytest.raises(ValueError, match="out of range"):
        fz(torch.randn(2, 4), torch.tensor([1, 8]))
    assert math.isfinite(float(fz(torch.randn(2, 4)).sum()))


def test_batch_times_heads_beyond_one_launch(monkeypatch):
    # with grid axis 1 capped at 4 programs, 3 x 5 (batch, head) pairs take four launches at offsets
    import tritonlm.kernels._common as common

    monkeypatch.setattr(common, "MAX_GRID_AXIS1", 4)
    q, k = torch.randn(3, 5, 7, 16), torch.randn(3, 5, 7, 16)
    positions = torch.randint(0, 50, (3, 1, 7))
    q_rot, k_rot = apply_rope(q, k, positions)
    torch.testing.assert_close(q_rot.double(), _fp64_rope(q, positions, 1e4), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot.double(), _fp64_rope(k, positions, 1e4), atol=1e-5, rtol=1e-5)
