"""SwiGLU gate: ``h = silu(a) * b = a * sigmoid(a) * b`` for ``a = x W1ᵀ``, ``b = x W3ᵀ``.

The projections stay cuBLAS matmuls; this kernel owns the elementwise part. Forward saves only a and b;
backward recomputes ``s = sigmoid(a)`` in registers::

    da = dh * b * s * (1 + a * (1 - s))
    db = dh * a * s

Math in fp32, results in the inputs' dtype. The tensors are walked as flat arrays of ``BLOCK`` elements
per program (contiguous, so loads vectorise to 128-bit); ``BLOCK = 1024`` with 4 warps gives each thread
8 elements: one 16-byte load per operand in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..profiling import kernel_range
from ._common import check_device, check_float, first_order_backward, use_custom_op

BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(A, B, H, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    # ---- load
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    # ---- compute
    h = a * tl.sigmoid(a) * b
    # ---- store
    tl.store(H + offs, h.to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DH, A, B, DA, DB, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    # ---- load
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    # ---- compute: sigmoid recomputed, never stored
    s = tl.sigmoid(a)
    silu_a = a * s
    da = dh * b * s * (1.0 + a * (1.0 - s))
    db = dh * silu_a
    # ---- store
    tl.store(DA + offs, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, db.to(DB.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = _flat(a), _flat(b)
    h = torch.empty_like(a)
    n = a.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](a, b, h, n, BLOCK=BLOCK, num_warps=4)
    return h


def swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    dh, a, b = _flat(dh), _flat(a), _flat(b)
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](dh, a, b, da, db, n, BLOCK=BLOCK, num_warps=4)
    return da, db


@torch.library.custom_op("tritonlm::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return swiglu_forward(a, b)


@_swiglu_fwd_op.register_fake
def _(a, b):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("tritonlm::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(dh, a, b)


@_swiglu_bwd_op.register_fake
def _(dh, a, b):
    return (torch.empty_like(a, memory_format=torch.contiguous_format),
            torch.empty_like(b, memory_format=torch.contiguous_format))


class SwiGLUGateFunction(torch.autograd.Function):
    """Saves a and b only; backward recomputes the sigmoid."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor):
        ctx.save_for_backward(a, b)
        with kernel_range("tritonlm::swiglu_fwd"):
            return (_swiglu_fwd_op if use_custom_op(a) else swiglu_forward)(a, b)

    @staticmethod
    @first_order_backward
    def backward(ctx, dh: torch.Tensor):
        a, b = ctx.saved_tensors
        with kernel_range("tritonlm::swiglu_bwd"):
            return (_swiglu_bwd_op if use_custom_op(a) else swiglu_backward)(dh, a, b)


def swiglu_gate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` elementwise for ``a``, ``b`` of one shape and dtype (e.g. ``[..., d_ff]``)."""
    if a.shape != b.shape:
        raise ValueError(f"swiglu_gate: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape")
    if a.dtype != b.dtype:
        raise TypeError(f"swiglu_gate: a is {a.dtype} but b is {b.dtype}")
    check_float("swiglu_gate", a)
    check_device("swiglu_gate", a, b)
    return SwiGLUGateFunction.apply(a, b)
