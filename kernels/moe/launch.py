"""MoE launch: tile tables, the forward and backward launchers, the custom ops (opaque to ``torch.compile``), the
autograd Function and :func:`moe_experts`.

Forward: routing metadata (:mod:`.routing`), ``_up_kernel`` (gate and up pre-activations, ``[T·K, 2I]``, saved for
backward), ``_down_kernel`` (``w · (act(gate) * up) @ downᵀ`` on each pair's row), a sum over K. Backward:
``_down_bwd_kernel`` (``dPRE`` and the routing weights' gradient), ``_dx_kernel`` (+ a sum over K) and
``_weight_grad_kernel`` twice (``d gate_up``, ``d down``). Saved for backward: the pre-activations and the routing
metadata besides the inputs; never the gathered ``[T·K, H]`` token matrix.
"""

from __future__ import annotations

import torch
import triton

from .. import tuned
from .._common import check_device, check_float, dot_precision, first_order_backward, on_gpu, use_custom_op
from .._ranges import kernel_range
from .kernels import _down_bwd_kernel, _down_kernel, _dx_kernel, _up_kernel, _weight_grad_kernel
from .routing import Routing, max_tiles, route

ACTIVATIONS = ("silu", "gelu_tanh")

# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
#: Rows per row tile (one expert's sorted pairs), shared by every row-tile kernel of a call (one routing).
BLOCK_M_GPU = 64
#: (BLOCK_N, BLOCK_K, num_warps, num_stages) per row-tile kernel on GPUs, 16-bit inputs: the up projection and the
#: down backward hold two fp32 accumulators / an epilogue over both halves, so narrower column tiles; the down
#: projection forms act(gate) * up on load, and with 64-wide reduction steps spills on sm_80 (8 B; 32: none).
ROW_TILE_CONFIGS = {"up": (64, 64, 4, 3), "down": (128, 32, 8, 3), "down_bwd": (64, 64, 4, 3), "dx": (128, 64, 8, 3)}
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
def moe_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str, routing: Routing | None = None):
    """``(out [T, H], pre [T·K, 2I], routing)`` for ``hidden [T, H]``, ``top_k_index / top_k_weights [T, K]``."""
    n_tokens, d_model = hidden.shape
    top_k = top_k_index.shape[1]
    n_experts, d_ff2 = gate_up_proj.shape[0], gate_up_proj.shape[1]
    d_ff, n_pairs = d_ff2 // 2, n_tokens * top_k
    hidden, weights = _rows(hidden), top_k_weights.reshape(-1).contiguous()
    if routing is None:
        routing = route(top_k_index.reshape(-1), n_experts, _block_m(hidden.device))
    pre = torch.empty(n_pairs, d_ff2, dtype=hidden.dtype, device=hidden.device)
    y = torch.empty(n_pairs, d_model, dtype=hidden.dtype, device=hidden.device)
    if n_pairs == 0:
        return y.view(n_tokens, top_k, d_model).sum(1), pre, routing
    block_m = _block_m(hidden.device)
    n_tiles = max_tiles(n_pairs, n_experts, block_m)
    tile_map = (routing.pair_of_row, routing.tile_expert, routing.tile_start, routing.tile_end)
    precision = dot_precision(hidden.dtype)
    cfg = _row_tile_config("up", hidden.dtype, hidden.device)
    _up_kernel[(n_tiles, triton.cdiv(d_ff, cfg["BLOCK_N"]))](
        hidden, gate_up_proj, pre, *tile_map, hidden.stride(0), *gate_up_proj.stride(), pre.stride(0),
        n_experts, top_k, d_model, d_ff, BLOCK_M=block_m, **cfg, **precision)
    cfg = _row_tile_config("down", hidden.dtype, hidden.device)
    _down_kernel[(n_tiles, triton.cdiv(d_model, cfg["BLOCK_N"]))](
        pre, down_proj, weights, y, *tile_map, pre.stride(0), *down_proj.stride(), y.stride(0),
        n_experts, top_k, d_model, d_ff, ACTIVATION=activation, BLOCK_M=block_m, **cfg, **precision)
    out = y.view(n_tokens, top_k, d_model)
    return (out[:, 0] if top_k == 1 else out.sum(1)), pre, routing


def moe_backward(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, pre: torch.Tensor, routing: Routing, activation: str):
    """``(d hidden, d top_k_weights, d gate_up_proj, d down_proj)``."""
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
    # ---- dPRE and the routing weights' gradient (one partial per FFN column tile, summed below)
    cfg = _row_tile_config("down_bwd", hidden.dtype, hidden.device)
    n_col_tiles = triton.cdiv(d_ff, cfg["BLOCK_N"])
    d_pre = torch.empty_like(pre)
    d_weight_parts = torch.zeros(n_col_tiles, n_pairs, dtype=torch.float32, device=hidden.device)
    dxp = torch.empty(n_pairs, d_model, dtype=hidden.dtype, device=hidden.device)
    if n_pairs:
        _down_bwd_kernel[(n_tiles, n_col_tiles)](
            dout, down_proj, pre, weights, d_pre, d_weight_parts, *tile_map, dout.stride(0), *down_proj.stride(),
            pre.stride(0), d_pre.stride(0), n_pairs, n_experts, top_k, d_model, d_ff, ACTIVATION=activation,
            BLOCK_M=block_m, **cfg, **precision)
        # ---- d hidden: each pair's dPRE @ gate_up[e], summed over the token's K pairs
        cfg = _row_tile_config("dx", hidden.dtype, hidden.device)
        _dx_kernel[(n_tiles, triton.cdiv(d_model, cfg["BLOCK_N"]))](
            d_pre, gate_up_proj, dxp, *tile_map, d_pre.stride(0), *gate_up_proj.stride(), dxp.stride(0),
            n_experts, top_k, d_model, d_ff2, BLOCK_M=block_m, **cfg, **precision)
    # ---- weight gradients: one program per (tile of the gradient, expert), over the expert's rows
    cfg = _weight_grad_config(hidden.dtype, hidden.device)
    block_r = cfg["BLOCK_R"]
    opts = dict(ACTIVATION=activation, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_R=block_r,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **precision)
    _weight_grad_kernel[(triton.cdiv(d_ff2, cfg["BLOCK_M"]), triton.cdiv(d_model, cfg["BLOCK_N"]), n_experts)](
        d_pre, hidden, weights, d_gate_up, routing.pair_of_row, routing.expert_start, d_pre.stride(0),
        hidden.stride(0), *d_gate_up.stride(), top_k, d_ff2, d_model, d_ff, DOWN=False, **opts)
    _weight_grad_kernel[(triton.cdiv(d_model, cfg["BLOCK_M"]), triton.cdiv(d_ff, cfg["BLOCK_N"]), n_experts)](
        dout, pre, weights, d_down, routing.pair_of_row, routing.expert_start, dout.stride(0), pre.stride(0),
        *d_down.stride(), top_k, d_model, d_ff, d_ff, DOWN=True, **opts)
    dx = dxp.view(n_tokens, top_k, d_model)
    dx = dx[:, 0] if top_k == 1 else dx.sum(1)
    d_weights = d_weight_parts.sum(0).view(n_tokens, top_k).to(top_k_weights.dtype)
    return dx, d_weights, d_gate_up, d_down


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::moe_experts_fwd", mutates_args=())
def _moe_fwd_op(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, activation: str) -> list[torch.Tensor]:
    out, pre, routing = moe_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    return [out, pre, *routing.tensors()]


@_moe_fwd_op.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
    n_pairs, n_experts = top_k_index.numel(), gate_up_proj.shape[0]
    n_tiles = max_tiles(n_pairs, n_experts, _block_m(hidden.device))
    i32 = dict(dtype=torch.int32, device=hidden.device)
    return [hidden.new_empty(hidden.shape), hidden.new_empty(n_pairs, gate_up_proj.shape[1]),
            torch.empty(n_pairs, **i32), torch.empty(n_experts + 1, **i32), *(torch.empty(n_tiles, **i32)
                                                                              for _ in range(3))]


@torch.library.custom_op("tritonlm::moe_experts_bwd", mutates_args=())
def _moe_bwd_op(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, pre: torch.Tensor, routing: list[torch.Tensor], activation: str
                ) -> list[torch.Tensor]:
    return list(moe_backward(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre, Routing(*routing),
                             activation))


@_moe_bwd_op.register_fake
def _(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre, routing, activation):
    return [torch.empty_like(hidden), torch.empty_like(top_k_weights), torch.empty_like(gate_up_proj),
            torch.empty_like(down_proj)]


class MoEExpertsFunction(torch.autograd.Function):
    """``MoEExpertsFunction.apply(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H],
    down_proj [E, H, I], activation)``; differentiable in hidden, top_k_weights and both weights."""

    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation="silu"):
        with kernel_range("tritonlm::moe_experts_fwd"):
            if use_custom_op(hidden):
                out, pre, *routing = _moe_fwd_op(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                                 activation)
            else:
                out, pre, routing = moe_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                                activation)
                routing = list(routing.tensors())
        ctx.save_for_backward(hidden, top_k_weights, gate_up_proj, down_proj, pre, *routing)
        ctx.activation = activation
        return out

    @staticmethod
    @first_order_backward
    def backward(ctx, dout):
        hidden, top_k_weights, gate_up_proj, down_proj, pre, *routing = ctx.saved_tensors
        with kernel_range("tritonlm::moe_experts_bwd"):
            if use_custom_op(hidden):
                dx, dw, dgu, dd = _moe_bwd_op(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre, routing,
                                              ctx.activation)
            else:
                dx, dw, dgu, dd = moe_backward(dout, hidden, top_k_weights, gate_up_proj, down_proj, pre,
                                               Routing(*routing), ctx.activation)
        return dx, None, dw, dgu, dd, None


def _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation) -> None:
    op = "moe_experts"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
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
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """The routed experts' FFNs, summed with their routing weights: ``out[t] = Σ_k w[t,k] · down[e] @
    (act(gate[e] @ x_t) * (up[e] @ x_t))`` with ``e = top_k_index[t, k]``.

    ``hidden [..., H]``; ``top_k_index`` (int) and ``top_k_weights`` ``[..., K]``; ``gate_up_proj [E, 2I, H]`` (gate
    rows first, then up) and ``down_proj [E, H, I]``: transformers 5's stacked layout, read as stored.
    ``activation``: "silu" (Mixtral, Qwen-MoE) or "gelu_tanh". Dropless (every routed pair is computed), one grouped
    GEMM per projection; differentiable in hidden, top_k_weights, gate_up_proj and down_proj. Returns ``[..., H]``.
    """
    _check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    lead, d_model, top_k = hidden.shape[:-1], hidden.shape[-1], top_k_index.shape[-1]
    out = MoEExpertsFunction.apply(hidden.reshape(-1, d_model), top_k_index.reshape(-1, top_k),
                                   top_k_weights.reshape(-1, top_k), gate_up_proj, down_proj, activation)
    return out.reshape(*lead, d_model)
