"""The q/k RMSNorm pair's registration (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry
from ..qk_norm import qk_norm_backward, qk_norm_forward, qk_rms_norm
from ..rmsnorm import rms_norm

L = _registry.SassLaunch


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """Qwen3-8B's q/k norms on 4096 tokens: 32 q heads and 8 k heads of 128 (bf16)."""
    meta = torch.device("meta")
    q = torch.empty(4096 * 32, 128, dtype=torch.bfloat16, device=meta)
    k = torch.empty(4096 * 8, 128, dtype=torch.bfloat16, device=meta)
    w = torch.empty(128, dtype=torch.bfloat16, device=meta)
    rstd = torch.empty(4096 * 40, dtype=torch.float32, device=meta)
    case = "4096 tokens x (32 q + 8 k heads) x 128 bf16"
    return [_registry.SassCase(case, lambda: qk_norm_forward(q, k, w, w, 1e-6), (L("qk_norm.fwd"),)),
            _registry.SassCase(case, lambda: qk_norm_backward(q, k, q, k, w, w, rstd), (L("qk_norm.bwd"),))]


def _bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> _registry.BenchCase:
    """q/k norms of ``rows`` tokens with hidden/128 q heads and a quarter as many k heads of 128: one launch vs two
    ``rms_norm`` calls (and vs the reference twin, ``modules.reference.RMSNorm`` per head)."""
    heads = max(4, hidden // 128)
    q = torch.randn(rows, heads, 128, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(rows, heads // 4, 128, device=device, dtype=dtype, requires_grad=True)
    wq, wk = (torch.ones(128, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    n = _registry.nbytes(q) + _registry.nbytes(k)
    twin = _registry.op("qk_norm").reference_twin()(128, 1e-6, device=device, dtype=dtype)

    def reference(x, w):
        return torch.func.functional_call(twin, {"weight": w}, (x,))

    def joined(impl):
        return lambda q, k, wq, wk: torch.cat([t.flatten() for t in impl(q, k, wq, wk)])

    return _registry.BenchCase(
        {"reference": joined(lambda q, k, wq, wk: (reference(q, wq), reference(k, wk))),
         "two rms_norm calls": joined(lambda q, k, wq, wk: (rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6))),
         "tritonlm": joined(lambda q, k, wq, wk: qk_rms_norm(q, k, wq, wk, 1e-6))},
        (q, k, wq, wk), {"fwd": 2 * n, "bwd": 3 * n})


def _opcheck_cases() -> dict[str, list[tuple]]:
    # q/k norms of different row counts and widths (the fakes must agree on both outputs and rstd's length)
    x, w, q = torch.randn(6, 40), torch.randn(40), torch.randn(2, 3, 9, 16)
    return {"qk_norm_fwd": [(x, q, w, torch.randn(16), 1e-6, 1.0)],
            "qk_norm_bwd": [(x, q, x, q, w, torch.randn(16), torch.rand(6 + 2 * 3 * 9) + 0.5, 0.0)]}


def _double_backward_cases():
    x, w = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    return [("qk_rms_norm", qk_rms_norm(x, x * 1.0, w, w)[0], [x])]


_registry.register(_registry.Op(
    name="qk_norm", entry_points=("qk_rms_norm", "QKNormFunction"), reference="tritonlm.modules.reference.RMSNorm",
    sass_cases=_sass_cases, bench_case=_bench_case, opcheck_cases=_opcheck_cases,
    double_backward_cases=_double_backward_cases,
    notes=("one launch for a layer's q and k norms (Qwen3, Gemma 3 heads; OLMo 2 projections)",)))
