"""The SwiGLU and GeGLU gates' registrations (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry, tuned
from ..swiglu import (
    TUNABLES,
    TUNED_NAME,
    SwiGLUGateFunction,
    geglu_gate,
    swiglu_backward,
    swiglu_forward,
    swiglu_gate,
)

_LABELS = {"silu": "swiglu", "gelu_tanh": "geglu"}


def _sass_cases(quick: bool, activation: str = "silu") -> list[_registry.SassCase]:
    label = _LABELS[activation]
    cases = []
    for dtype, hidden in _registry.sass_shapes(quick):
        x = torch.empty(_registry.SASS_ROWS, hidden, dtype=dtype, device="meta")
        case = f"{_registry.SASS_ROWS}x{hidden} {_registry.dtype_label(dtype)}"
        cases += [_registry.SassCase(case, lambda x=x: swiglu_forward(x, x, activation),
                                     (_registry.SassLaunch(f"{label}.fwd"),)),
                  _registry.SassCase(case, lambda x=x: swiglu_backward(x, x, x, activation=activation),
                                     (_registry.SassLaunch(f"{label}.bwd"),))]
    return cases


def _sweep_cases(device: torch.device, smoke: bool, activation: str = "silu") -> list[_registry.SweepCase]:
    """The gate of a Llama-7B FFN's worth of tokens: 8K x 11008 (smoke: 64 x 96)."""
    dtype = torch.float32 if smoke else torch.bfloat16

    def step():
        shape = (64, 96) if smoke else (8192, 11008)
        a, b = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
        return lambda: SwiGLUGateFunction.apply(a, b, False, activation)

    name = TUNED_NAME[activation]
    return [_registry.SweepCase(name, tuned.dtype_name(dtype), step, TUNABLES[name].candidates)]


def _bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype,
                activation: str = "silu") -> _registry.BenchCase:
    a, b = (torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    n = _registry.nbytes(a)
    label = _LABELS[activation]
    ours = swiglu_gate if activation == "silu" else geglu_gate
    # the reference twin's elementwise part (modules.reference.SwiGLU.gate / GeGLU.gate)
    twin = _registry.op(label).reference_twin()(1, 1, device=device, dtype=dtype)
    return _registry.BenchCase({"reference": twin.gate, "tritonlm": ours}, (a, b),
                               {"fwd": 3 * n, "bwd": 5 * n}, liger=label)


def _opcheck_cases() -> dict[str, list[tuple]]:
    x, r = torch.randn(6, 40), torch.randn(6, 40)
    return {"swiglu_fwd": [(x, r)], "swiglu_bwd": [(x, x, r)]}


def _double_backward_cases():
    x = torch.randn(4, 8, requires_grad=True)
    return [("swiglu_gate", swiglu_gate(x, x), [x])]


for _name, _activation, _entry, _twin in (("swiglu", "silu", "swiglu_gate", "SwiGLU"),
                                          ("geglu", "gelu_tanh", "geglu_gate", "GeGLU")):
    _registry.register(_registry.Op(
        name=_name, entry_points=(_entry, "SwiGLUGateFunction") if _name == "swiglu" else (_entry,),
        reference=f"tritonlm.modules.reference.{_twin}", tunables=(TUNABLES[_name],),
        sass_cases=lambda quick, a=_activation: _sass_cases(quick, a),
        sweep_cases=lambda device, smoke, a=_activation: _sweep_cases(device, smoke, a),
        bench_case=lambda rows, hidden, device, dtype, a=_activation: _bench_case(rows, hidden, device, dtype, a),
        # (both gates are one custom op pair and one autograd Function: checked once, with SwiGLU)
        opcheck_cases=_opcheck_cases if _name == "swiglu" else None,
        double_backward_cases=_double_backward_cases if _name == "swiglu" else None))
