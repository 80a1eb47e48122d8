"""RoPE's registration (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry, tuned
from ..rope import TUNABLE, apply_rope, rope_forward, rope_tables


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """q and k together on the ``[batch, heads, seq, d]`` view of a ``[batch, seq, heads*d]`` projection."""
    cases = []
    for dtype in _registry.SASS_DTYPES[:1] if quick else _registry.SASS_DTYPES:
        for d in ([128] if quick else [64, 128]):
            heads, seq = 4096 // d, 4096
            meta = torch.device("meta")
            q = torch.empty(1, seq, heads * d, dtype=dtype, device=meta).unflatten(-1, (heads, d)).transpose(1, 2)
            cos = torch.empty(seq, d // 2, dtype=torch.float32, device=meta)
            pos = torch.empty(seq, dtype=torch.int64, device=meta)
            cases.append(_registry.SassCase(
                f"q,k 1x{seq}x{heads}x{d} {_registry.dtype_label(dtype)}",
                lambda q=q, cos=cos, pos=pos: rope_forward(q, q, cos, cos, pos), (_registry.SassLaunch(
                    "rope.fwd", unit="element", per_iteration=lambda c: c["BLOCK_S"] * c["BLOCK_D"], per_warp=True),),
                bytes_moved=4 * _registry.nbytes(q) + 2 * _registry.nbytes(cos) + _registry.nbytes(pos)))
    return cases


def _sweep_cases(device: torch.device, smoke: bool) -> list[_registry.SweepCase]:
    """RoPE on q and k, ``[4, 32, 4096, 128]`` (smoke: ``[1, 2, 32, 16]``)."""
    dtype = torch.float32 if smoke else torch.bfloat16
    d = 16 if smoke else 128

    def step():
        b, h, n = (1, 2, 32) if smoke else (4, 32, 4096)
        q, k = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(2))
        cos, sin = rope_tables(10000.0, d, n, device)
        pos = torch.arange(n, device=device)
        return lambda: apply_rope(q, k, pos, cos=cos, sin=sin, check_positions=False)

    return [_registry.SweepCase("rope", f"{tuned.dtype_name(dtype)}-d{d}", step, TUNABLE.candidates)]


def _bench_case(rows: int, hidden: int, device: torch.device, dtype: torch.dtype) -> _registry.BenchCase:
    """q and k as ``[1, heads, rows, 128]`` views of ``[1, rows, heads*128]`` (d 16 for tiny hidden sizes)."""
    d = 128 if hidden >= 128 else 16
    heads = max(1, hidden // d)
    cos, sin = rope_tables(10000.0, d, rows, device)
    q, k = (torch.randn(1, rows, heads * d, device=device, dtype=dtype).unflatten(-1, (heads, d)).transpose(1, 2)
            .requires_grad_() for _ in range(2))
    qn = _registry.nbytes(q)
    positions = torch.arange(rows, device=device)
    twin = _registry.op("rope").reference_twin()(10000.0, d, rows, device=device)  # modules.reference's RoPE
    # the cat copies both outputs in every implementation; counted as traffic for all alike
    return _registry.BenchCase(
        {"reference": lambda q, k: torch.cat([twin(q, positions), twin(k, positions)]),
         "tritonlm": lambda q, k: torch.cat(apply_rope(q, k, None, cos=cos, sin=sin))},
        (q, k), {"fwd": 6 * qn, "bwd": 6 * qn}, liger="rope", liger_args=(cos, sin, dtype))


def _opcheck_cases() -> dict[str, list[tuple]]:
    q = torch.randn(2, 3, 9, 16)
    strided = torch.randn(2, 3, 9, 32)[..., ::2]  # last dim strided: the launchers copy, the fakes must agree
    cos, pos = torch.rand(64, 8), torch.arange(9)
    return {"rope": [(q, q, cos, cos, pos, False), (strided, None, cos, cos, pos, True)]}


def _double_backward_cases():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    return [("apply_rope", apply_rope(q), [q])]


_registry.register(_registry.Op(
    name="rope", entry_points=("apply_rope", "RoPEFunction", "rope_tables"),
    reference="tritonlm.modules.reference.RotaryPositionalEmbedding", tunables=(TUNABLE,),
    sass_cases=_sass_cases, sweep_cases=_sweep_cases, bench_case=_bench_case, opcheck_cases=_opcheck_cases,
    double_backward_cases=_double_backward_cases))
