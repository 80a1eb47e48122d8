"""MoE launch: tile tables, the forward and backward launchers, the custom ops (opaque to ``torch.compile``), the
autograd Function and :func:`moe_experts`.

Forward: routing metadata (:mod:`.routing`), ``_up_kernel`` (gate and up pre-activations, ``[T·K, 2I]``, saved for
backward), ``_down_kernel`` (``w · (act(gate) * up) @ downᵀ`` on each pair's row), a sum over K. Backward:
``_down_bwd_kernel`` (``dPRE`` and the routing weights' gradient), ``_dx_kernel`` (+ a sum over K) and
``_weight_grad_kernel`` twice (``d gate_up``, ``d down``). Saved for backward: the pre-activations and the routing
metadata besides the inputs; never the gathered ``[T·K, H]`` token matrix.
"""

from __future__ import annotations

import math

import torch
import triton

from .. import tuned
from .._common import check_device, check_float, dot_precision, first_order_backward, on_gpu, use_custom_op
from .._ranges import kernel_range
from .kernels import (
    _down_bwd_kernel,
    _down_kernel,
    _dx_kernel,
    _scale_rows_kernel,
    _up_kernel,
    _weight_grad_kernel,
)
from .routing import Routing, max_tiles, route

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamped")

# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
#: Rows per row tile (one expert's sorted pairs), shared by every row-tile kernel of a call (one routing).
BLOCK_M_GPU = 64
#: (BLOCK_N, BLOCK_K, num_warps, num_stages) per row-tile kernel on GPUs, 16-bit inputs: the up projection and the
#: down backward hold two fp32 accumulators / an epilogue over both halves, so narrower column tiles; the down
#: projection is a plain grouped GEMM over the stored gated unit (it formed act(gate) * up on load before, which
#: needed 32-wide reduction steps to stay spill-free on sm_80).
ROW_TILE_CONFIGS = {"up": (64, 64, 4, 3), "down": (128, 64, 8, 3), "down_bwd": (64, 64, 4, 3), "dx": (128, 64, 8, 3)}
#: (BLOCK_M, BLOCK_N, BLOCK_R, num_warps, num_stages) of the weight-gradient kernel on GPUs.
WEIGHT_GRAD_CONFIG = (128, 128, 32, 8, 3)
#: The interpreter runs whole tiles as numpy ops: small tiles keep tests of odd shapes quick.
INTERPRETER_BLOCK_M = 16
INTERPRETER_ROW_TILE = (32, 32, 4, 1)
INTERPRETER_WEIGHT_GRAD = (32, 32, 16, 4, 1)


def _block_m(device: torch.device) -> int:
    return BLOCK_M_GPU if on_gpu(device) else INTERPRETER_BLOCK_M


def _row_tile_config(kernel: str, dtype: torch.dtype, device: torch.device) -> dict:
    if not on_gpu(device):
        block_n, block_k, warps, stages = INTERPRETER_ROW_TILE
    else:
        block_n, block_k, warps, stages = ROW_TILE_CONFIGS[kernel]
        if dtype == torch.float32:
            # fp32 tiles hold twice the bytes: half the reduction step; the two-accumulator kernels also halve their
            # columns (IEEE dots on FMA units spilled 600 B on sm_80 with 64: SASS report)
            block_k //= 2
            if kernel in ("up", "down_bwd"):
                block_n //= 2
    shipped = dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return tuned.choose(f"moe_{kernel}", tuned.dtype_name(dtype), device, shipped)


def _weight_grad_config(dtype: torch.dtype, device: torch.device) -> dict:
    block_m, block_n, block_r, warps, stages = WEIGHT_GRAD_CONFIG if on_gpu(device) else INTERPRETER_WEIGHT_GRAD
    if on_gpu(device) and dtype == torch.float32:
        block_r //= 2
    shipped = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=warps, num_stages=stages)
    return tuned.choose("moe_weight_grad", tuned.dtype_name(dtype), device, shipped)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride and columns by position: unit last stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------
#: what a call's kernels compile for besides its dtype: the gated unit, where gate and up rows sit, the biases
class Spec(tuple):
    """``(activation, alpha, limit, interleaved)``: see :func:`moe_experts`."""

    def __new__(cls, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, interleaved: bool = False):
        return super().__new__(cls, (activation, float(alpha), float(limit), bool(interleaved)))

    @property
    def activation(self) -> str:
        return self[0]

    def kernel_args(self) -> dict:
        return dict(alpha=self[1], limit=self[2])


def _bias_or(bias: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """A bias, or a stand-in pointer the kernel never reads (``HAS_BIAS`` off)."""
    return other if bias is None else bias


def moe_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str, routing: Routing | None = None,
                *, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                spec: Spec | None = None):
    """``(out [T, H], pre [T·K, 3I], routing)`` (``pre``: gate, up, and the gated unit h, per row) for ``hidden [T, H]``, ``top_k_index / top_k_weights [T, K]``;
    ``spec`` (default: ``activation``, stacked rows) names the gated unit and the gate/up layout."""
    spec = spec or Spec(activation)
    n_tokens, d_model = hidden.shape
    top_k = top_k_index.shape[1]
    n_experts, d_ff2 = gate_up_proj.shape[0], gate_up_proj.shape[1]
    d_ff, n_pairs = d_ff2 // 2, n_tokens * top_k
    hidden, weights = _rows(hidden), top_k_weights.reshape(-1).contiguous()
    if routing is None:
        routing = route(top_k_index.reshape(-1), n_experts, _block_m(hidden.device))
    pre = torch.empty(n_pairs, 3 * d_ff, dtype=hidden.dtype, device=hidden.device)  # [gate | up | h] per row
    y = torch.empty(n_pairs, d_model, dtype=hidden.dtype, device=hidden.device)
    if n_pairs == 0:
        return y.view(n_tokens, top_k, d_model).sum(1), pre, routing
    block_m = _block_m(hidden.device)
    n_tiles = max_tiles(n_pairs, n_experts, block_m)
    tile_map = (routing.pair_of_row, routing.tile_expert, routing.tile_start, routing.tile_end)
    precision = dot_precision(hidden.dtype)
    cfg = _row_tile_config("up", hidden.dtype, hidden.device)
    _up_kernel[(n_tiles, triton.cdiv(d_ff, cfg["BLOCK_N"]))](
        hidden, gate_up_proj, _bias_or(gate_up_bias, pre), pre, *tile_map, hidden.stride(0), *gate_up_proj.stride(),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, pre.stride(0), n_experts, top_k, d_model, d_ff,
        **spec.kernel_args(), ACTIVATION=spec.activation, INTERLEAVED=spec[3], HAS_BIAS=gate_up_bias is not None,
        BLOCK_M=block_m, **cfg, **precision)
    cfg = _row_tile_config("down", hidden.dtype, hidden.device)
    _down_kernel[(n_tiles, triton.cdiv(d_model, cfg["BLOCK_N"]))](
        pre, down_proj, _bias_or(down_bias, pre), weights, y, *tile_map, pre.stride(0), *down_proj.stride(),
        down_bias.stride(0) if down_bias is not None else 0, y.stride(0), n_experts, top_k, d_model, d_ff,
        HAS_BIAS=down_bias is not None, BLOCK_M=block_m, **cfg, **precision)
    out = y.view(n_tokens, top_k, d_model)
    return (out[:, 0] if top_k == 1 else out.sum(1)), pre, routing


def moe_backward(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, pre: torch.Tensor, routing: Routing, activation: str, *,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 spec: Spec | None = None):
    """``(d hidden, d top_k_weights, d gate_up_proj, d down_proj, d gate_up_bias, d down_bias)`` (a bias's gradient
    is None without the bias)."""
    spec = spec or Spec(activation)
    n_tokens, d_model = hidden.shape
    top_k = top_k_weights.shape[1]
    n_experts, d_ff2 = gate_up_proj.shape[0], gate_up_proj.shape[1]
    d_ff, n_pairs = d_ff2 // 2, n_tokens * top_k
    dout, hidden, weights = _rows(dout), _rows(hidden), top_k_weights.reshape(-1).contiguous()
    d_gate_up = torch.empty(gate_up_proj.shape, dtype=gate_up_proj.dtype, device=hidden.device)
    d_down = torch.empty(down_proj.shape, dtype=down_proj.dtype, device=hidden.device)
    block_m = _block_m(hidden.device)
    n_tiles = max_tiles(n_pairs, n_experts, block_m)
    tile_map = (routing.pair_of_row, routing.tile_expert, routing.tile_start, routing.tile_end)
    precision = dot_precision(hidden.dtype)
    glu = dict(**spec.kernel_args(), ACTIVATION=spec.activation)
    # ---- dPRE and the routing weights' gradient (one partial per FFN column tile, summed below)
    cfg = _row_tile_config("down_bwd", hidden.dtype, hidden.device)
    n_col_tiles = triton.cdiv(d_ff, cfg["BLOCK_N"])
    d_pre = torch.empty(n_pairs, d_ff2, dtype=pre.dtype, device=pre.device)  # (gate and up only)
    d_weight_parts = torch.zeros(n_col_tiles, n_pairs, dtype=torch.float32, device=hidden.device)
    dxp = torch.empty(n_pairs, d_model, dtype=hidden.dtype, device=hidden.device)
    if n_pairs:
        _down_bwd_kernel[(n_tiles, n_col_tiles)](
            dout, down_proj, _bias_or(down_bias, pre), pre, weights, d_pre, d_weight_parts, *tile_map,
            dout.stride(0), *down_proj.stride(), down_bias.stride(0) if down_bias is not None else 0, pre.stride(0),
            d_pre.stride(0), n_pairs, n_experts, top_k, d_model, d_ff, **glu, HAS_BIAS=down_bias is not None,
            BLOCK_M=block_m, **cfg, **precision)
        # ---- d hidden: each pair's dPRE @ gate_up[e], summed over the token's K pairs
        cfg = _row_tile_config("dx", hidden.dtype, hidden.device)
        _dx_kernel[(n_tiles, triton.cdiv(d_model, cfg["BLOCK_N"]))](
            d_pre, gate_up_proj, dxp, *tile_map, d_pre.stride(0), *gate_up_proj.stride(), dxp.stride(0),
            n_experts, top_k, d_model, d_ff2, INTERLEAVED=spec[3], BLOCK_M=block_m, **cfg, **precision)
    # ---- weight (and bias) gradients: one program per (tile of the gradient, expert), over the expert's rows
    cfg = _weight_grad_config(hidden.dtype, hidden.device)
    block_r = cfg["BLOCK_R"]
    opts = dict(**glu, INTERLEAVED=spec[3], BLOCK_M=cfg["BLOCK_M"], BLOCK_R=block_r, num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], **precision)

    def weight_grad(a, b, out3, rows_out, cols_out, down, ones=False):
        block_n = 16 if ones else cfg["BLOCK_N"]  # (a bias: one column, tl.dot's narrowest tile)
        _weight_grad_kernel[(triton.cdiv(rows_out, cfg["BLOCK_M"]), triton.cdiv(cols_out, block_n), n_experts)](
            a, b, weights, out3, routing.pair_of_row, routing.expert_start, a.stride(0), b.stride(0),
            *out3.stride(), top_k, rows_out, cols_out, d_ff, DOWN=down, ONES_B=ones, BLOCK_N=block_n, **opts)

    weight_grad(d_pre, hidden, d_gate_up, d_ff2, d_model, False)
    # (d down's left operand, w[p] · dout_t per sorted row, gathered and scaled once: T·K x H in dout's dtype)
    scaled = torch.empty(n_pairs, d_model, dtype=dout.dtype, device=dout.device)
    if n_pairs:
        _scale_rows_kernel[(triton.cdiv(n_pairs, 32), triton.cdiv(d_model, 256))](
            dout, weights, routing.pair_of_row, scaled, dout.stride(0), scaled.stride(0), n_pairs, top_k, d_model,
            BLOCK_R=32, BLOCK_C=256, num_warps=4)
    weight_grad(scaled, pre, d_down, d_model, d_ff, True)
    d_gate_up_bias = d_down_bias = None
    if gate_up_bias is not None:
        d_gate_up_bias = torch.empty(gate_up_bias.shape, dtype=gate_up_bias.dtype, device=hidden.device)
        weight_grad(d_pre, hidden, d_gate_up_bias.unsqueeze(-1), d_ff2, 1, False, ones=True)
    if down_bias is not None:
        d_down_bias = torch.empty(down_bias.shape, dtype=down_bias.dtype, device=hidden.device)
        weight_grad(scaled, pre, d_down_bias.unsqueeze(-1), d_model, 1, True, ones=True)
    dx = dxp.view(n_tokens, top_k, d_model)
    dx = dx[:, 0] if top_k == 1 else dx.sum(1)
    d_weights = d_weight_parts.sum(0).view(n_tokens, top_k).to(top_k_weights.dtype)
    return dx, d_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::moe_experts_fwd", mutates_args=())
def _moe_fwd_op(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, alpha: float = 1.702,
                limit: float = 7.0, interleaved: bool = False) -> list[torch.Tensor]:
    out, pre, routing = moe_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation,
                                    gate_up_bias=gate_up_bias, down_bias=down_bias,
                                    spec=Spec(activation, alpha, limit, interleaved))
    return [out, pre, *routing.tensors()]


@_moe_fwd_op.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_up_bias=None, down_bias=None,
      alpha=1.702, limit=7.0, interleaved=False):
    n_pairs, n_experts = top_k_index.numel(), gate_up_proj.shape[0]
    n_tiles = max_tiles(n_pairs, n_experts, _block_m(hidden.device))
    i32 = dict(dtype=torch.int32, device=hidden.device)
    return [hidden.new_empty(hidden.shape), hidden.new_empty(n_pairs, 3 * (gate_up_proj.shape[1] // 2)),
            torch.empty(n_pairs, **i32), torch.empty(n_experts + 1, **i32), *(torch.empty(n_tiles, **i32)
                                                                              for _ in range(3))]


@torch.library.custom_op("tritonlm::moe_experts_bwd", mutates_args=())
def _moe_bwd_op(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, pre: torch.Tensor, routing: list[torch.Tensor], activation: str,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, alpha: float = 1.702,
                limit: float = 7.0, interleaved: bool = False) -> list[torch.Tensor]:
    grads = moe_backward(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre, Routing(*routing), activation,
                         gate_up_bias=gate_up_bias, down_bias=down_bias, spec=Spec(activation, alpha, limit, interleaved))
    # (a custom op returns tensors: a missing bias has an empty gradient)
    return [g if g is not None else hidden.new_empty(0) for g in grads]


@_moe_bwd_op.register_fake
def _(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre, routing, activation, gate_up_bias=None,
      down_bias=None, alpha=1.702, limit=7.0, interleaved=False):
    return [torch.empty_like(hidden), torch.empty_like(top_k_weights), torch.empty_like(gate_up_proj),
            torch.empty_like(down_proj), *(torch.empty_like(b) if b is not None else hidden.new_empty(0)
                                           for b in (gate_up_bias, down_bias))]


class MoEExpertsFunction(torch.autograd.Function):
    """``MoEExpertsFunction.apply(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H],
    down_proj [E, H, I], activation, gate_up_bias [E, 2I] | None, down_bias [E, H] | None, alpha, limit,
    interleaved)``; differentiable in hidden, top_k_weights, both weights and both biases."""

    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu",
                gate_up_bias=None, down_bias=None, alpha=1.702, limit=7.0, interleaved=False):
        spec = Spec(activation, alpha, limit, interleaved)
        biases = dict(gate_up_bias=gate_up_bias, down_bias=down_bias)
        with kernel_range("tritonlm::moe_experts_fwd"):
            if use_custom_op(hidden):
                out, pre, *routing = _moe_fwd_op(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                                 activation, gate_up_bias, down_bias, *spec[1:])
            else:
                out, pre, routing = moe_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                                activation, **biases, spec=spec)
                routing = list(routing.tensors())
        ctx.save_for_backward(hidden, top_k_weights, gate_up_proj, down_proj, pre, gate_up_bias, down_bias,
                              *routing)
        ctx.spec = spec
        return out

    @staticmethod
    @first_order_backward
    def backward(ctx, dout):
        hidden, top_k_weights, gate_up_proj, down_proj, pre, gate_up_bias, down_bias, *routing = ctx.saved_tensors
        spec = ctx.spec
        with kernel_range("tritonlm::moe_experts_bwd"):
            if use_custom_op(hidden):
                dx, dw, dgu, dd, dgub, ddb = _moe_bwd_op(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre,
                                                         routing, spec.activation, gate_up_bias, down_bias, *spec[1:])
            else:
                dx, dw, dgu, dd, dgub, ddb = moe_backward(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre,
                                                          Routing(*routing), spec.activation,
                                                          gate_up_bias=gate_up_bias, down_bias=down_bias, spec=spec)
        return (dx, None, dw, dgu, dd, None, dgub if gate_up_bias is not None else None,
                ddb if down_bias is not None else None, None, None, None)


def _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_up_bias=None,
           down_bias=None, gate_up_layout="stacked", alpha=1.702, limit=7.0) -> None:
    op = "moe_experts"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_up_layout not in ("stacked", "interleaved"):
        raise ValueError(f"{op}: gate_up_layout must be 'stacked' or 'interleaved', got {gate_up_layout!r}")
    if activation == "swiglu_clamped" and not (alpha > 0 and limit > 0 and math.isfinite(alpha) and math.isfinite(limit)):
        raise ValueError(f"{op}: swiglu_clamped needs finite alpha > 0 and limit > 0, got alpha={alpha}, limit={limit}")
    check_float(op, hidden, gate_up_proj, down_proj)
    if not (hidden.dtype == gate_up_proj.dtype == down_proj.dtype):
        raise TypeError(f"{op}: hidden, gate_up_proj and down_proj dtypes differ: {hidden.dtype}, "
                        f"{gate_up_proj.dtype}, {down_proj.dtype}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{op}: top_k_weights must be floating point, got {top_k_weights.dtype}")
    if top_k_index.is_floating_point() or top_k_index.dtype == torch.bool:
        raise TypeError(f"{op}: top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    check_device(op, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    if hidden.dim() < 1 or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"{op}: expected hidden [..., H], gate_up_proj [E, 2I, H], down_proj [E, H, I]; got "
                         f"{tuple(hidden.shape)}, {tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}")
    n_experts, d_ff2, d_model = gate_up_proj.shape
    if d_ff2 % 2 or d_model != hidden.shape[-1] or down_proj.shape != (n_experts, d_model, d_ff2 // 2):
        raise ValueError(f"{op}: hidden [..., {hidden.shape[-1]}] needs gate_up_proj [E, 2I, {hidden.shape[-1]}] and "
                         f"down_proj [E, {hidden.shape[-1]}, I]; got {tuple(gate_up_proj.shape)} and "
                         f"{tuple(down_proj.shape)}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (n_experts, d_ff2)),
                              ("down_bias", down_bias, (n_experts, d_model))):
        if bias is None:
            continue
        if bias.shape != shape or bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"{op}: {name} must be {hidden.dtype} {list(shape)} on {hidden.device}, got "
                             f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    if top_k_index.dim() != hidden.dim() or top_k_index.shape[:-1] != hidden.shape[:-1] \
            or top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"{op}: top_k_index and top_k_weights must be [..., K] with hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}; got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    if top_k_index.device.type == "cpu":  # free to read; on a GPU a device-side assert (no host sync)
        bad = (top_k_index < 0) | (top_k_index >= n_experts)
        if bool(bad.any()):
            raise ValueError(f"{op}: top_k_index must be in [0, {n_experts}), got {int(top_k_index[bad][0])}")
    elif top_k_index.device.type == "cuda":
        torch._assert_async(((top_k_index >= 0) & (top_k_index < n_experts)).all(),
                            f"{op}: top_k_index out of [0, {n_experts})")


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, activation: str = "silu",
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                alpha: float = 1.702, limit: float = 7.0, gate_up_layout: str = "stacked") -> torch.Tensor:
    """The routed experts' FFNs, summed with their routing weights: ``out[t] = Σ_k w[t,k] · (down[e] @ h + b_down[e])``
    with ``h = glu(gate[e] @ x_t + b_gate, up[e] @ x_t + b_up)`` and ``e = top_k_index[t, k]``.

    ``hidden [..., H]``; ``top_k_index`` (int) and ``top_k_weights`` ``[..., K]``; ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``, read as stored (any strides: gpt-oss's ``[E, H, 2I]`` parameter is passed as its
    transposed view, no copy). ``gate_up_layout``: "stacked" (gate rows first, then up: transformers 5) or
    "interleaved" (rows alternate gate, up: gpt-oss). ``activation``: "silu" (SwiGLU: Mixtral, Qwen-MoE),
    "gelu_tanh", or "swiglu_clamped" (gpt-oss: ``(clamp(up, ±limit) + 1) · g·σ(alpha·g)`` with ``g = min(gate,
    limit)``). Optional biases ``gate_up_bias [E, 2I]`` (in the weight's row layout) and ``down_bias [E, H]``
    (added inside each expert, before its routing weight), fused into the GEMMs' epilogues. Dropless (every routed
    pair is computed), one grouped GEMM per projection; differentiable in hidden, top_k_weights, both weights and
    both biases. Returns ``[..., H]``.
    """
    _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, gate_up_bias, down_bias,
           gate_up_layout, alpha, limit)
    lead, d_model, top_k = hidden.shape[:-1], hidden.shape[-1], top_k_index.shape[-1]
    out = MoEExpertsFunction.apply(hidden.reshape(-1, d_model), top_k_index.reshape(-1, top_k),
                                   top_k_weights.reshape(-1, top_k), gate_up_proj, down_proj, activation,
                                   gate_up_bias, down_bias, float(alpha), float(limit),
                                   gate_up_layout == "interleaved")
    return out.reshape(*lead, d_model)
