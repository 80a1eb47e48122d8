"""RMSNorm's and the fused residual add + RMSNorm's registrations (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry, tuned
from ..rmsnorm import (
    TUNABLE,
    add_rms_norm,
    add_rms_norm_forward,
    next_pow2,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)

L = _registry.SassLaunch


def _sass_cases(quick: bool, add: bool = False) -> list[_registry.SassCase]:
    """RMSNorm (``add``: the fused residual add + RMSNorm) forward and backward on 4096 rows."""
    cases = []
    for dtype, hidden in _registry.sass_shapes(quick):
        meta = torch.device("meta")
        x = torch.empty(_registry.SASS_ROWS, hidden, dtype=dtype, device=meta)
        w = torch.empty(hidden, dtype=dtype, device=meta)
        rstd = torch.empty(_registry.SASS_ROWS, dtype=torch.float32, device=meta)
        case = f"{_registry.SASS_ROWS}x{hidden} {_registry.dtype_label(dtype)}"
        if add:
            cases += [
                _registry.SassCase(case, lambda x=x, w=w: add_rms_norm_forward(x, x, w, 1e-5), (L("add_rmsnorm.fwd"),)),
                _registry.SassCase(case, lambda x=x, w=w, r=rstd: rms_norm_backward(x, x, w, r, x),
                                   (L("add_rmsnorm.bwd"),))]
        else:
            cases += [
                _registry.SassCase(case, lambda x=x, w=w: rms_norm_forward(x, w, 1e-5), (L("rmsnorm.fwd"),)),
                _registry.SassCase(case, lambda x=x, w=w, r=rstd: rms_norm_backward(x, x, w, r),
                                   (L("rmsnorm.bwd"), L("rmsnorm.dw_reduce", 1)))]
    return cases


def _sweep_cases(device: torch.device, smoke: bool) -> list[_registry.SweepCase]:
    """RMSNorm forward + backward over 16K rows (smoke: 64) of hidden 768 and 4096 (smoke: 256)."""
    dtype = torch.float32 if smoke else torch.bfloat16
    cases = []
    for n_cols in ((256,) if smoke else (768, 4096)):
        rows = 64 if smoke else 16384

        def step(n_cols=n_cols, rows=rows):
            x = torch.randn(rows, n_cols, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(n_cols, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(rows, n_cols, device=device, dtype=dtype)

            def run():
                y = rms_norm(x, w)
                return (y, *torch.autograd.grad(y, (x, w), grad))
            return run

        block_n = next_pow2(n_cols)
        fitting = tuple(c for c in TUNABLE.candidates if c.get("BLOCK_M", 1) * block_n <= 16384)
        cases.append(_registry.SweepCase("rms_norm", f"{tuned.dtype_name(dtype)}-n{block_n}", step, fitting))
    return cases


def _reference(hidden: int, device, dtype):
    """The reference twin (``modules.reference.RMSNorm``) and the function ``(x, weight) -> twin(x)`` with that
    weight."""
    norm = _registry.op("rmsnorm").reference_twin()(hidden, 1e-5, device=device, dtype=dtype)
    return norm, lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,))


def _bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> _registry.BenchCase:
    x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
    n = _registry.nbytes(x)
    return _registry.BenchCase(
        {"reference": _reference(hidden, device, dtype)[1],
         "torch F.rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-5),
         "tritonlm": lambda x, w: rms_norm(x, w, 1e-5)},
        (x, w), {"fwd": 2 * n, "bwd": 3 * n}, liger="rmsnorm")


def _add_bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> _registry.BenchCase:
    x, r = (torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
    n = _registry.nbytes(x)
    _, norm = _reference(hidden, device, dtype)

    def reference(x, r, w):  # the twin's add_forward spelled out: (rmsnorm(x + r), x + r)
        h = x + r
        return norm(h, w) + h  # one output for the timing loop: both results flow back

    def ours(x, r, w):
        y, h = add_rms_norm(x, r, w, 1e-5)
        return y + h

    # fwd reads x, r and writes y, h; bwd reads dy, dh (one upstream gradient here: y + h summed), h, writes dx
    # (the same tensor serves the residual)
    return _registry.BenchCase({"reference": reference, "tritonlm": ours}, (x, r, w), {"fwd": 4 * n, "bwd": 4 * n})


def _opcheck_cases() -> dict[str, list[tuple]]:
    x, r, w = torch.randn(6, 40), torch.randn(6, 40), torch.randn(40)
    rstd = torch.rand(6) + 0.5
    return {"rms_norm_fwd": [(x, w, 1e-5)], "rms_norm_bwd": [(x, x, w, rstd)],
            "add_rms_norm_fwd": [(x, r, w, 1e-5)], "add_rms_norm_bwd": [(x, x, x, w, rstd)]}


def _double_backward_cases():
    x, w = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    return [("rms_norm", rms_norm(x, w), [x])]


def _add_double_backward_cases():
    x, w = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    return [("add_rms_norm", add_rms_norm(x, x * 1.0, w)[0], [x])]


_registry.register(_registry.Op(
    name="rmsnorm", entry_points=("rms_norm", "RMSNormFunction"), reference="tritonlm.modules.reference.RMSNorm",
    tunables=(TUNABLE,), sass_cases=_sass_cases, sweep_cases=_sweep_cases, bench_case=_bench_case,
    opcheck_cases=lambda: {k: v for k, v in _opcheck_cases().items() if not k.startswith("add_")},
    double_backward_cases=_double_backward_cases))
_registry.register(_registry.Op(
    name="add_rmsnorm", entry_points=("add_rms_norm", "AddRMSNormFunction"),
    reference="tritonlm.modules.reference.RMSNorm", sass_cases=lambda quick: _sass_cases(quick, add=True),
    bench_case=_add_bench_case, notes=("launches with the rms_norm tunable's configuration",),
    opcheck_cases=lambda: {k: v for k, v in _opcheck_cases().items() if k.startswith("add_")},
    double_backward_cases=_add_double_backward_cases))
