"""Gated activations of the FFN: SwiGLU ``h = silu(a) * b = a · σ(a) · b`` and GeGLU ``h = gelu(a) * b`` (tanh
approximation, Gemma's, or the exact erf GELU), for ``a = x W1ᵀ``, ``b = x W3ᵀ``. One kernel pair, the activation a
constexpr (``ACTIVATION``: "silu", "gelu_tanh", "gelu").

The projections stay cuBLAS matmuls; this kernel owns the elementwise part. Forward saves only a and b;
backward recomputes the activation and its derivative in registers::

    da = dh * b * act'(a)            silu': s (1 + a (1 - s)), s = σ(a)
    db = dh * act(a)                 gelu_tanh': ½(1 + t) + ½ a (1 - t²) k (1 + 3·0.044715 a²),
                                                t = tanh(k (a + 0.044715 a³)), k = √(2/π)
                                     gelu': Φ(a) + a φ(a)  (the normal CDF and density)

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
def _activation(a, ACTIVATION: tl.constexpr):
    """``(act(a), act'(a))`` in fp32."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(a)
        return a * s, s * (1.0 + a * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        k = 0.7978845608028654  # sqrt(2 / pi)
        t = 2.0 * tl.sigmoid(2.0 * k * (a + 0.044715 * a * a * a)) - 1.0  # tanh, from the sigmoid
        return 0.5 * a * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * a * a)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476))
        return a * cdf, cdf + a * tl.exp(-0.5 * a * a) * 0.3989422804014327  # + a·φ(a), φ = e^(-a²/2)/√(2π)


@triton.jit
def _swiglu_fwd_kernel(A, B, H, n_elements, BLOCK: tl.constexpr, ACTIVATION: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    # ---- load
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    # ---- compute
    act, _ = _activation(a, ACTIVATION)
    # ---- store
    tl.store(H + offs, (act * b).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DH, A, B, DA, DB, n_elements, BLOCK: tl.constexpr, ACTIVATION: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    # ---- load
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    # ---- compute: the activation recomputed, never stored
    act, d_act = _activation(a, ACTIVATION)
    da = dh * b * d_act
    db = dh * act
    # ---- store
    tl.store(DA + offs, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, db.to(DB.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


#: activation -> the tuned-table kernel whose launch configuration it uses
TUNED_NAME = {"silu": "swiglu", "gelu_tanh": "geglu", "gelu": "geglu"}


def _launch_config(a: torch.Tensor, activation: str = "silu") -> dict:
    return tuned.choose(TUNED_NAME[activation], tuned.dtype_name(a.dtype), a.device, dict(BLOCK=BLOCK, num_warps=4))


#: The gates' launches a tuned table may replace (one per activation), with the sweep's alternatives.
TUNABLES = {name: _registry.Tunable(name, ("BLOCK", "num_warps"),
                                    (dict(BLOCK=2048, num_warps=4), dict(BLOCK=2048, num_warps=8),
                                     dict(BLOCK=4096, num_warps=8), dict(BLOCK=512, num_warps=4)),
                                    lambda key, device, dtype: dict(BLOCK=BLOCK, num_warps=4))
            for name in ("swiglu", "geglu")}


def swiglu_forward(a: torch.Tensor, b: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    a, b = _flat(a), _flat(b)
    h = torch.empty_like(a)
    n = a.numel()
    if n:
        cfg = _launch_config(a, activation)
        _swiglu_fwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](a, b, h, n, ACTIVATION=activation, **cfg)
    return h


def swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, inplace: bool = False,
                    activation: str = "silu"):
    """``(da, db)``; with ``inplace`` they are written over (contiguous) a and b."""
    dh, a, b = _flat(dh), _flat(a), _flat(b)
    da, db = (a, b) if inplace else (torch.empty_like(a), torch.empty_like(b))
    n = a.numel()
    if n:
        cfg = _launch_config(a, activation)
        _swiglu_bwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](dh, a, b, da, db, n, ACTIVATION=activation, **cfg)
    return da, db


@torch.library.custom_op("tritonlm::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(a: torch.Tensor, b: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    return swiglu_forward(a, b, activation)


@_swiglu_fwd_op.register_fake
def _(a, b, activation="silu"):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("tritonlm::swiglu_bwd", mutates_args=())
def _swiglu_bwd_op(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, activation: str = "silu"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(dh, a, b, activation=activation)


@_swiglu_bwd_op.register_fake
def _(dh, a, b, activation="silu"):
    return (torch.empty_like(a, memory_format=torch.contiguous_format),
            torch.empty_like(b, memory_format=torch.contiguous_format))


class SwiGLUGateFunction(torch.autograd.Function):
    """``act(a) * b`` (``activation``: "silu", "gelu_tanh", "gelu"); saves a and b only, the backward recomputes the
    activation."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, inplace_backward: bool = False, activation: str = "silu"):
        ctx.save_for_backward(a, b)
        ctx.inplace, ctx.consumed, ctx.activation = inplace_backward, False, activation
        with kernel_range("tritonlm::swiglu_fwd"):
            return (_swiglu_fwd_op if use_custom_op(a) else swiglu_forward)(a, b, activation)

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
                da, db = _swiglu_bwd_op(dh, a, b, ctx.activation)
            else:
                da, db = swiglu_backward(dh, a, b, inplace, ctx.activation)
        return da, db, None, None


def _gate(op: str, a: torch.Tensor, b: torch.Tensor, inplace_backward: bool, activation: str) -> torch.Tensor:
    if a.shape != b.shape:
        raise ValueError(f"{op}: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape")
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: a is {a.dtype} but b is {b.dtype}")
    check_float(op, a)
    check_device(op, a, b)
    return SwiGLUGateFunction.apply(a, b, inplace_backward, activation)


def swiglu_gate(a: torch.Tensor, b: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(a) * b`` elementwise for ``a``, ``b`` of one shape and dtype (e.g. ``[..., d_ff]``).

    ``inplace_backward=True``: the backward writes the gradients over a and b (no new memory). Only for a and b
    that nothing else reads afterwards (fresh projection outputs, as in the FFN), and one backward pass."""
    return _gate("swiglu_gate", a, b, inplace_backward, "silu")


def geglu_gate(gate: torch.Tensor, up: torch.Tensor, *, approximate: str = "tanh",
               inplace_backward: bool = False) -> torch.Tensor:
    """``gelu(gate) * up`` elementwise (Gemma's FFN gate): ``approximate="tanh"`` (``F.gelu(..., approximate=
    "tanh")``, transformers' ``gelu_pytorch_tanh``) or ``"none"`` (the exact erf GELU). ``inplace_backward`` as in
    :func:`swiglu_gate`."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"geglu_gate: approximate must be 'tanh' or 'none', got {approximate!r}")
    return _gate("geglu_gate", gate, up, inplace_backward, "gelu_tanh" if approximate == "tanh" else "gelu")
