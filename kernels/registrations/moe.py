"""MoE's registration: what the SASS report, the sweep and the GPU suite need (``kernels/_registry.py``)."""

from __future__ import annotations

import torch

from .. import _registry, tuned
from ..moe.launch import (
    BLOCK_M_GPU,
    ROW_TILE_CONFIGS,
    Spec,
    _row_tile_config,
    _weight_grad_config,
    moe_backward,
    moe_experts,
    moe_forward,
)
from ..moe.routing import Routing, max_tiles


def _dot_kmac(c):
    """One main-loop iteration of a row-tile GEMM: BLOCK_M x BLOCK_N outputs over BLOCK_K of the reduction."""
    return c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"] / 1000


def _up_kmac(c):
    """The up projection's iteration feeds two accumulators (gate and up), BLOCK_N columns each."""
    return 2 * _dot_kmac(c)


def _weight_grad_kmac(c):
    """A weight gradient's iteration: a BLOCK_M x BLOCK_N tile of the gradient over BLOCK_R routed rows."""
    return c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_R"] / 1000


def _gemm(kernel, index, flops, per_iteration=_dot_kmac):
    """A grouped-GEMM report row, counted in warp-instructions per thousand multiply-adds of its main loop."""
    return _registry.SassLaunch(kernel, index, flops, unit="kMAC", per_iteration=per_iteration, per_warp=True)


L = _registry.SassLaunch

#: Mixtral-8x7B's layer: 8192 tokens, H 4096, I 14336, 8 experts, top-2
MIXTRAL = dict(tokens=8192, d_model=4096, d_ff=14336, experts=8, top_k=2)
#: gpt-oss-20b's layer: 8192 tokens, H 2880, I 2880, 32 experts, top-4
GPT_OSS = dict(tokens=8192, d_model=2880, d_ff=2880, experts=32, top_k=4)


def _meta_problem(dtype, tokens, d_model, d_ff, experts, top_k):
    meta = torch.device("meta")
    hidden = torch.empty(tokens, d_model, dtype=dtype, device=meta)
    index = torch.empty(tokens, top_k, dtype=torch.int64, device=meta)
    weights = torch.empty(tokens, top_k, dtype=dtype, device=meta)
    gate_up = torch.empty(experts, 2 * d_ff, d_model, dtype=dtype, device=meta)
    down = torch.empty(experts, d_model, d_ff, dtype=dtype, device=meta)
    n_tiles = max_tiles(tokens * top_k, experts, BLOCK_M_GPU)
    i32 = dict(dtype=torch.int32, device=meta)
    routing = Routing(torch.empty(tokens * top_k, **i32), torch.empty(experts + 1, **i32),
                      *(torch.empty(n_tiles, **i32) for _ in range(3)))
    pre = torch.empty(tokens * top_k, 3 * d_ff, dtype=dtype, device=meta)  # (gate | up | h)
    return hidden, index, weights, gate_up, down, routing, pre


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """Mixtral-8x7B layer shapes, bf16 (and fp32 in the full report): the forward's two grouped GEMMs and the
    backward's four (its routing weights' partials, d hidden, both weight gradients); then gpt-oss-20b's biased,
    clamped, interleaved layer (bf16): the forward, and the backward kernels the options change."""
    cases = []
    for dtype in _registry.SASS_DTYPES[:1] if quick else _registry.SASS_DTYPES:
        hidden, index, weights, gate_up, down, routing, pre = _meta_problem(dtype, **MIXTRAL)
        case = f"T8192 H4096 I14336 E8 K2 {_registry.dtype_label(dtype)}"
        pairs = MIXTRAL["tokens"] * MIXTRAL["top_k"]
        up_flops = 2 * pairs * 2 * MIXTRAL["d_ff"] * MIXTRAL["d_model"]  # both halves
        down_flops = up_flops // 2
        cases.append(_registry.SassCase(
            case, lambda h=hidden, i=index, w=weights, g=gate_up, d=down, r=routing: moe_forward(h, i, w, g, d, "silu", r),
            (_gemm("moe.up", 0, up_flops, _up_kmac), _gemm("moe.down", 1, down_flops))))
        cases.append(_registry.SassCase(
            case, lambda h=hidden, w=weights, g=gate_up, d=down, p=pre, r=routing: moe_backward(
                h, h, w, g, d, p, r, "silu"),
            (_gemm("moe.down_bwd", 0, down_flops), _gemm("moe.dx", 1, up_flops),
             _gemm("moe.dgate_up", 2, up_flops, _weight_grad_kmac),
             L("moe.scale_rows", 3), _gemm("moe.ddown", 4, down_flops, _weight_grad_kmac))))
    # gpt-oss-20b's layer as the patched HF module runs it: the parameters read in place through transposed views
    # (gate_up [E, H, 2I] with gate / up interleaved, down [E, I, H]), both biased, the clamped SwiGLU
    dtype, (tokens, d_model, d_ff, experts, top_k) = torch.bfloat16, GPT_OSS.values()
    hidden, index, weights, _, _, routing, pre = _meta_problem(dtype, **GPT_OSS)
    meta = torch.device("meta")
    gate_up = torch.empty(experts, d_model, 2 * d_ff, dtype=dtype, device=meta).transpose(1, 2)
    down = torch.empty(experts, d_ff, d_model, dtype=dtype, device=meta).transpose(1, 2)
    gate_up_bias = torch.empty(experts, 2 * d_ff, dtype=dtype, device=meta)
    down_bias = torch.empty(experts, d_model, dtype=dtype, device=meta)
    spec = Spec("swiglu_clamped", interleaved=True)
    biases = dict(gate_up_bias=gate_up_bias, down_bias=down_bias, spec=spec)
    up_flops = 2 * tokens * top_k * 2 * d_ff * d_model
    case = "T8192 H2880 I2880 E32 K4 gpt-oss bf16"
    cases.append(_registry.SassCase(
        case, lambda: moe_forward(hidden, index, weights, gate_up, down, spec.activation, routing, **biases),
        (_gemm("moe.gpt_oss_up", 0, up_flops, _up_kmac), _gemm("moe.gpt_oss_down", 1, up_flops // 2))))
    cases.append(_registry.SassCase(
        case, lambda: moe_backward(hidden, hidden, weights, gate_up, down, pre, routing, spec.activation, **biases),
        (_gemm("moe.gpt_oss_down_bwd", 0, up_flops // 2), _gemm("moe.gpt_oss_dx", 1, up_flops),
         _gemm("moe.gpt_oss_dgate_up", 2, up_flops, _weight_grad_kmac), L("moe.gpt_oss_dgate_up_bias", 5))))
    return cases


def _sweep_cases(device: torch.device, smoke: bool) -> list[_registry.SweepCase]:
    """A quarter of a Mixtral layer's tokens (2048 x H 4096, I 14336, E 8, top-2; smoke: 24 x 32, I 48, E 5, top-2),
    forward for the forward kernels, forward + backward for the backward ones."""
    dtype = torch.float32 if smoke else torch.bfloat16
    tokens, d_model, d_ff, experts, top_k = (24, 32, 48, 5, 2) if smoke else (2048, 4096, 14336, 8, 2)
    key = tuned.dtype_name(dtype)

    def problem():
        hidden = torch.randn(tokens, d_model, device=device, dtype=dtype, requires_grad=True)
        index = torch.randint(0, experts, (tokens, top_k), device=device)
        weights = torch.rand(tokens, top_k, device=device, dtype=dtype, requires_grad=True)
        gate_up = (torch.randn(experts, 2 * d_ff, d_model, device=device, dtype=dtype) / d_model**0.5).requires_grad_()
        down = (torch.randn(experts, d_model, d_ff, device=device, dtype=dtype) / d_ff**0.5).requires_grad_()
        return hidden, index, weights, gate_up, down

    def forward_step():
        args = problem()
        return lambda: moe_experts(*args)

    def training_step():
        args = problem()
        grad = torch.randn(tokens, d_model, device=device, dtype=dtype)

        def step():
            out = moe_experts(*args)
            return torch.autograd.grad(out, [args[i] for i in (0, 2, 3, 4)], grad)
        return step

    narrow = (dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3), dict(BLOCK_N=128, BLOCK_K=32, num_warps=4,
                                                                              num_stages=4))
    return [_registry.SweepCase("moe_up", key, forward_step, _ROW_CANDIDATES),
            _registry.SweepCase("moe_down", key, forward_step, _ROW_CANDIDATES + narrow),
            _registry.SweepCase("moe_down_bwd", key, training_step, _ROW_CANDIDATES),
            _registry.SweepCase("moe_dx", key, training_step, _ROW_CANDIDATES + narrow),
            _registry.SweepCase("moe_weight_grad", key, training_step, _WEIGHT_GRAD_CANDIDATES)]


_ROW_CANDIDATES = (dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                   dict(BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
                   dict(BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=4))
_WEIGHT_GRAD_CANDIDATES = (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_R=32, num_warps=4, num_stages=3),
                           dict(BLOCK_M=128, BLOCK_N=128, BLOCK_R=64, num_warps=8, num_stages=2),
                           dict(BLOCK_M=128, BLOCK_N=64, BLOCK_R=32, num_warps=4, num_stages=4))
_ROW_FIELDS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def _shipped_row(kernel):
    return lambda key, device, dtype: _row_tile_config(kernel, dtype, device)


def _opcheck_cases() -> dict[str, list[tuple]]:
    hidden, weights = torch.randn(7, 16), torch.rand(7, 2)
    index = torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1], [2, 1], [1, 0], [0, 2]])
    gate_up, down = torch.randn(3, 24, 16), torch.randn(3, 16, 12)
    _, pre, routing = moe_forward(hidden, index, weights, gate_up, down, "silu")
    return {"moe_experts_fwd": [(hidden, index, weights, gate_up, down, "silu")],
            "moe_experts_bwd": [(torch.randn(7, 16), hidden, weights, gate_up, down, pre, list(routing.tensors()),
                                 "gelu_tanh")]}


def _double_backward_cases():
    hidden = torch.randn(5, 16, requires_grad=True)
    index, weights = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]]), torch.rand(5, 2)
    gate_up, down = torch.randn(3, 24, 16), torch.randn(3, 16, 12)
    return [("moe_experts", moe_experts(hidden, index, weights, gate_up, down), [hidden])]


_registry.register(_registry.Op(
    name="moe", entry_points=("moe_experts", "MoEExpertsFunction"), reference="tritonlm.modules.functional.moe_experts",
    tunables=tuple(_registry.Tunable(f"moe_{k}", _ROW_FIELDS, _ROW_CANDIDATES, _shipped_row(k)) for k in ROW_TILE_CONFIGS)
    + (_registry.Tunable("moe_weight_grad", ("BLOCK_M", "BLOCK_N", "BLOCK_R", "num_warps", "num_stages"),
                         _WEIGHT_GRAD_CANDIDATES, lambda key, device, dtype: _weight_grad_config(dtype, device)),),
    sass_cases=_sass_cases, sweep_cases=_sweep_cases, bench_section="moe", opcheck_cases=_opcheck_cases,
    double_backward_cases=_double_backward_cases))
