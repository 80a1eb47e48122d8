"""The gated RMSNorm's registration (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry
from ..rms_norm_gated import rms_norm_gated, rms_norm_gated_backward, rms_norm_gated_forward


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """Qwen3.5's norm before the gate: 4096 tokens x 32 value heads x 128 (bf16), forward and backward."""
    meta = torch.device("meta")
    x = torch.empty(4096 * 32, 128, dtype=torch.bfloat16, device=meta)
    w = torch.empty(128, dtype=torch.bfloat16, device=meta)
    rstd = torch.empty(4096 * 32, dtype=torch.float32, device=meta)
    case = "4096 tokens x 32 heads x 128 bf16"
    return [_registry.SassCase(case, lambda: rms_norm_gated_forward(x, x, w, 1e-6),
                               (_registry.SassLaunch("rms_norm_gated.fwd"),)),
            _registry.SassCase(case, lambda: rms_norm_gated_backward(x, x, x, w, rstd),
                               (_registry.SassLaunch("rms_norm_gated.bwd"),))]


def _bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> _registry.BenchCase:
    """``rows`` tokens of ``hidden / 128`` heads of 128 features, against the reference twin
    (``modules.reference.RMSNormGated``)."""
    heads = max(1, hidden // 128)
    x, gate = (torch.randn(rows, heads, 128, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.ones(128, device=device, dtype=dtype, requires_grad=True)
    twin = _registry.op("rms_norm_gated").reference_twin()(128, 1e-6, device=device, dtype=dtype)
    n = _registry.nbytes(x)
    return _registry.BenchCase(
        {"reference": lambda x, g, w: torch.func.functional_call(twin, {"weight": w}, (x, g)),
         "tritonlm": lambda x, g, w: rms_norm_gated(x, g, w, 1e-6)},
        (x, gate, w), {"fwd": 3 * n, "bwd": 6 * n})


def _opcheck_cases() -> dict[str, list[tuple]]:
    x, g, w = torch.randn(2, 5, 40), torch.randn(2, 5, 40), torch.randn(40)
    return {"rms_norm_gated_fwd": [(x, g, w, 1e-6)],
            "rms_norm_gated_bwd": [(torch.randn(2, 5, 40), x, g, w, torch.rand(10) + 0.5)]}


def _double_backward_cases():
    x, g, w = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8), torch.ones(8, requires_grad=True)
    return [("rms_norm_gated", rms_norm_gated(x, g, w), [x])]


_registry.register(_registry.Op(
    name="rms_norm_gated", entry_points=("rms_norm_gated", "RMSNormGatedFunction"),
    reference="tritonlm.modules.reference.RMSNormGated", sass_cases=_sass_cases, bench_case=_bench_case,
    opcheck_cases=_opcheck_cases, double_backward_cases=_double_backward_cases,
    notes=("Qwen3.5 / Qwen3-Next's norm before the gate: rmsnorm(x) · w · silu(g), one kernel each way",)))
