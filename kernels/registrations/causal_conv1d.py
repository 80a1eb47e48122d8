"""The causal conv1d's registration (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry
from ..causal_conv1d import causal_conv1d_backward, causal_conv1d_fn, causal_conv1d_forward


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """Qwen3.5's short convolution: 4 taps over the q/k/v projection (8192 channels) of 4096 tokens, laid out as
    transformers passes it (the ``[1, T, D]`` projection transposed), bf16, SiLU, forward and both backward kernels."""
    meta = torch.device("meta")
    x = torch.empty(1, 4096, 8192, dtype=torch.bfloat16, device=meta).transpose(1, 2)
    w = torch.empty(8192, 4, dtype=torch.bfloat16, device=meta)
    b = torch.empty(8192, dtype=torch.bfloat16, device=meta)
    case = "1 x 8192 channels x 4096 tokens, 4 taps, bf16"
    return [_registry.SassCase(case, lambda: causal_conv1d_forward(x, w, b, None, True),
                               (_registry.SassLaunch("causal_conv1d.fwd"),)),
            _registry.SassCase(case, lambda: causal_conv1d_backward(x, x, w, b, None, True),
                               (_registry.SassLaunch("causal_conv1d.bwd_dz", 0),
                                _registry.SassLaunch("causal_conv1d.bwd_dx", 1)))]


def _bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> _registry.BenchCase:
    """``rows`` tokens of ``hidden`` channels, 4 taps, SiLU, against the reference twin (``F.conv1d``)."""
    x = torch.randn(1, rows, hidden, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    w = torch.randn(hidden, 4, device=device, dtype=dtype, requires_grad=True)
    twin = _registry.op("causal_conv1d").reference_twin()
    n = _registry.nbytes(x)
    return _registry.BenchCase({"reference": lambda x, w: twin(x, w, None, "silu"),
                                "tritonlm": lambda x, w: causal_conv1d_fn(x, w, None, "silu")},
                               (x, w), {"fwd": 2 * n, "bwd": 4 * n})


def _opcheck_cases() -> dict[str, list[tuple]]:
    x, w, b = torch.randn(2, 6, 11), torch.randn(6, 4), torch.randn(6)
    seq = torch.tensor([[0] * 5 + [1] * 6, [0] * 11], dtype=torch.int32)
    return {"causal_conv1d_fwd": [(x, w, b, None, True), (x, w, None, seq, False)],
            "causal_conv1d_bwd": [(torch.randn(2, 6, 11), x, w, b, seq, True)]}


def _double_backward_cases():
    x, w = torch.randn(1, 4, 7, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    return [("causal_conv1d_fn", causal_conv1d_fn(x, w, None, "silu"), [x])]


_registry.register(_registry.Op(
    name="causal_conv1d", entry_points=("causal_conv1d_fn", "causal_conv1d_update", "CausalConv1dFunction"),
    reference="tritonlm.modules.functional.causal_conv1d", sass_cases=_sass_cases, bench_case=_bench_case,
    opcheck_cases=_opcheck_cases, double_backward_cases=_double_backward_cases,
    notes=("Gated DeltaNet's short depthwise convolution, causal-conv1d's calls",)))
