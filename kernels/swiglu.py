"""SwiGLU gate: ``h = silu(a) * b = a * sigmoid(a) * b`` for ``a = x W1ᵀ``, ``b = x W3ᵀ``.

The projections stay cuBLAS matmuls; this kernel owns the elementwise part. Forward saves only a and b;
backward recomputes ``s = sigmoid(a)`` in registers::

    da = dh * b * s * (1 + a * (1 - s))
    db = dh * a * s

Math in fp32, results in the inputs' dtype. The tensors are walked as flat arrays of ``BLOCK`` elements
per program (contiguous, so loads vectorise to 128-bit); ``BLOCK = 1024`` with 4 warps gives each thread
8 elements: one 16-byte load per operand in bf16 (a tuned table, ``kernels/tuned``, may pick others per GPU).

``inplace_backward=True`` writes da and db over the saved a and b (each program reads its elements before it
writes them), so the backward allocates nothing: for the FFN's gate, whose a and b are the projections'
fresh outputs that nothing else reads. The graph can then be walked backward only once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _registry, tuned
from ._common import check_device, check_float, first_order_backward, use_custom_op
from ._ranges import kernel_range

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


def _launch_config(a: torch.Tensor) -> dict:
    return tuned.choose("swiglu", tuned.dtype_name(a.dtype), a.device, dict(BLOCK=BLOCK, num_warps=4))


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = _flat(a), _flat(b)
    h = torch.empty_like(a)
    n = a.numel()
    if n:
        cfg = _launch_config(a)
        _swiglu_fwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](a, b, h, n, **cfg)
    return h


def swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, inplace: bool = False):
    """``(da, db)``; with ``inplace`` they are written over (contiguous) a and b."""
    dh, a, b = _flat(dh), _flat(a), _flat(b)
    da, db = (a, b) if inplace else (torch.empty_like(a), torch.empty_like(b))
    n = a.numel()
    if n:
        cfg = _launch_config(a)
        _swiglu_bwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](dh, a, b, da, db, n, **cfg)
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
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, inplace_backward: bool = False):
        ctx.save_for_backward(a, b)
        ctx.inplace, ctx.consumed = inplace_backward, False
        with kernel_range("tritonlm::swiglu_fwd"):
            return (_swiglu_fwd_op if use_custom_op(a) else swiglu_forward)(a, b)

    @staticmethod
    @first_order_backward
    def backward(ctx, dh: torch.Tensor):
        a, b = ctx.saved_tensors
        if ctx.consumed:
            raise RuntimeError("swiglu_gate(inplace_backward=True): its backward already overwrote the saved a and b; "
                               "a second backward through the graph (retain_graph) needs inplace_backward=False")
        # in place only in eager mode: under torch.compile the op stays functional
        inplace = ctx.inplace and not use_custom_op(a) and a.is_contiguous() and b.is_contiguous()
        ctx.consumed = inplace
        with kernel_range("tritonlm::swiglu_bwd"):
            if use_custom_op(a):
                da, db = _swiglu_bwd_op(dh, a, b)
            else:
                da, db = swiglu_backward(dh, a, b, inplace)
        return da, db, None


def swiglu_gate(a: torch.Tensor, b: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(a) * b`` elementwise for ``a``, ``b`` of one shape and dtype (e.g. ``[..., d_ff]``).

    ``inplace_backward=True``: the backward writes the gradients over a and b (no new memory). Only for a and b
    that nothing else reads afterwards (fresh projection outputs, as in the FFN), and one backward pass."""
    if a.shape != b.shape:
        raise ValueError(f"swiglu_gate: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape")
    if a.dtype != b.dtype:
        raise TypeError(f"swiglu_gate: a is {a.dtype} but b is {b.dtype}")
    check_float("swiglu_gate", a)
    check_device("swiglu_gate", a, b)
    return SwiGLUGateFunction.apply(a, b, inplace_backward)


# ----------------------------------------------------------------------------------------------------
# registration: what the SASS report, the sweep and the op suite need (kernels/_registry.py)
# ----------------------------------------------------------------------------------------------------
def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    cases = []
    for dtype, hidden in _registry.sass_shapes(quick):
        x = torch.empty(_registry.SASS_ROWS, hidden, dtype=dtype, device="meta")
        case = f"{_registry.SASS_ROWS}x{hidden} {_registry.dtype_label(dtype)}"
        cases += [_registry.SassCase(case, lambda x=x: swiglu_forward(x, x), (_registry.SassLaunch("swiglu.fwd"),)),
                  _registry.SassCase(case, lambda x=x: swiglu_backward(x, x, x), (_registry.SassLaunch("swiglu.bwd"),))]
    return cases


def _sweep_cases(device: torch.device, smoke: bool) -> list[_registry.SweepCase]:
    """The gate of a Llama-7B FFN's worth of tokens: 8K x 11008 (smoke: 64 x 96)."""
    dtype = torch.float32 if smoke else torch.bfloat16

    def step():
        shape = (64, 96) if smoke else (8192, 11008)
        a, b = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
        return lambda: swiglu_gate(a, b)

    return [_registry.SweepCase("swiglu", tuned.dtype_name(dtype), step, _SWEEP_CANDIDATES)]


def _reference_swiglu(a, b):
    return a * torch.sigmoid(a) * b


def _bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> _registry.BenchCase:
    a, b = (torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    n = _registry.nbytes(a)
    return _registry.BenchCase({"reference": _reference_swiglu, "tritonlm": swiglu_gate}, (a, b),
                               {"fwd": 3 * n, "bwd": 5 * n}, liger="swiglu")


_SWEEP_CANDIDATES = (dict(BLOCK=2048, num_warps=4), dict(BLOCK=2048, num_warps=8), dict(BLOCK=4096, num_warps=8),
                     dict(BLOCK=512, num_warps=4))

_registry.register(_registry.Op(
    name="swiglu", entry_points=("swiglu_gate", "SwiGLUGateFunction"), reference="tritonlm.modules.reference.SwiGLU",
    tunables=(_registry.Tunable("swiglu", ("BLOCK", "num_warps"), _SWEEP_CANDIDATES,
                                lambda key, device, dtype: dict(BLOCK=BLOCK, num_warps=4)),),
    sass_cases=_sass_cases, sweep_cases=_sweep_cases, bench_case=_bench_case))
