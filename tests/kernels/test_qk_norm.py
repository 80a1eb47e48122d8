"""``qk_rms_norm``: an attention layer's q and k RMSNorms in one launch (Qwen3 / Gemma 3 per head, OLMo 2 over the
projections), against PyTorch's ``F.rms_norm`` in fp64: forward and backward in fp32 / fp16 / bf16, q and k rows
of different counts and widths, several leading dims, non-contiguous inputs, Gemma's (1 + w), bad inputs, and the
launch count."""

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import qk_norm, qk_rms_norm, rmsnorm

from helpers import DTYPE_TOLERANCES, record_launches


def _fp64(x, w, dy, eps, offset):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = TF.rms_norm(x64, (x.shape[-1],), w64 + offset, eps)
    y.backward(dy.double())
    return y, x64.grad, w64.grad


def _check(q, k, wq, wk, eps=1e-6, offset=0.0, tol=None):
    yq, yk = qk_rms_norm(q, k, wq, wk, eps, weight_offset=offset)
    dyq, dyk = torch.randn_like(yq), torch.randn_like(yk)
    torch.autograd.backward((yq, yk), (dyq, dyk))
    for x, w, y, dy in ((q, wq, yq, dyq), (k, wk, yk, dyk)):
        y64, dx64, dw64 = _fp64(x, w, dy, eps, offset)
        assert y.dtype == x.dtype and y.shape == x.shape
        torch.testing.assert_close(y.double(), y64, **tol)
        torch.testing.assert_close(x.grad.double(), dx64, **tol)
        scale = max(1.0, dw64.abs().max().item())  # (the weight gradient sums over every row)
        torch.testing.assert_close(w.grad.double() / scale, dw64 / scale, **tol)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("q_shape, k_shape", [
    ((2, 7, 4, 24), (2, 7, 2, 24)),      # per head: [batch, seq, heads, d], GQA
    ((3, 5, 96), (3, 5, 40)),            # over projections of different widths (OLMo 2)
    ((1, 1), (9, 33)),                   # one q row, odd widths
])
def test_forward_backward_vs_fp64(q_shape, k_shape, dtype, tol):
    torch.manual_seed(0)
    q = torch.randn(q_shape, dtype=dtype, requires_grad=True)
    k = (3 * torch.randn(k_shape)).to(dtype).requires_grad_()
    wq = (1 + 0.3 * torch.randn(q_shape[-1])).to(dtype).requires_grad_()
    wk = (1 + 0.3 * torch.randn(k_shape[-1])).to(dtype).requires_grad_()
    _check(q, k, wq, wk, tol={key: v * 4 for key, v in tol.items()})


def test_non_contiguous_inputs_and_weight_offset():
    """Head-split views of projections ([batch, heads, seq, d] transposes) and Gemma's (1 + w) weights."""
    torch.manual_seed(1)
    q = torch.randn(2, 11, 3, 16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 11, 1, 16).transpose(1, 2).requires_grad_()
    assert not q.is_contiguous()
    wq, wk = (0.2 * torch.randn(16)).requires_grad_(), (0.2 * torch.randn(16)).requires_grad_()
    _check(q, k, wq, wk, eps=1e-5, offset=1.0, tol=dict(atol=1e-5, rtol=1e-5))


def test_one_forward_launch_and_one_backward_row_kernel(monkeypatch):
    launched = record_launches(monkeypatch, qk_norm._qk_norm_fwd_kernel, qk_norm._qk_norm_bwd_kernel,
                               rmsnorm._rms_norm_fwd_kernel, rmsnorm._column_sum_kernel)
    q, k = torch.randn(4, 8, 32, requires_grad=True), torch.randn(4, 2, 32, requires_grad=True)
    w = torch.ones(32, requires_grad=True)
    yq, yk = qk_rms_norm(q, k, w, w)
    assert launched == ["_qk_norm_fwd_kernel"]
    (yq.sum() + yk.sum()).backward()
    assert launched[1:] == ["_qk_norm_bwd_kernel", "_column_sum_kernel", "_column_sum_kernel"]


def test_rows_wider_than_registers_take_two_rms_norm_calls(monkeypatch):
    launched = record_launches(monkeypatch, qk_norm._qk_norm_fwd_kernel, rmsnorm._rms_norm_fwd_kernel)
    q = torch.randn(2, qk_norm.MAX_QK_COLS + 8, requires_grad=True)
    k = torch.randn(3, 64, requires_grad=True)
    wq, wk = torch.randn(q.shape[-1], requires_grad=True), torch.randn(64, requires_grad=True)
    _check(q, k, wq, wk, tol=dict(atol=1e-5, rtol=1e-5))
    assert launched == ["_rms_norm_fwd_kernel", "_rms_norm_fwd_kernel"]


def test_bad_inputs():
    q, k, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="k must be"):
        qk_rms_norm(q, torch.randn(2, 6), w, w)
    with pytest.raises(ValueError, match="q must be"):
        qk_rms_norm(q, k, torch.ones(2, 4), w)
    with pytest.raises(TypeError, match="share a dtype"):
        qk_rms_norm(q, k.half(), w, w)
    with pytest.raises(TypeError):
        qk_rms_norm(q.long(), k, w, w)
