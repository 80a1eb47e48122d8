"""The gated delta rule's registration (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry
from ..gated_delta.interface import chunk_gated_delta_rule, gated_delta_backward, gated_delta_forward


def _layer_inputs(device, dtype, tokens: int, n_heads: int = 16, n_v_heads: int = 32, d: int = 128):
    """Packed Qwen3.5 layer inputs: ``q, k [tokens, 16, 128]``, ``v [tokens, 32, 128]``, ``g, beta [tokens, 32]``."""
    q = torch.empty(tokens, n_heads, d, device=device, dtype=dtype)
    v = torch.empty(tokens, n_v_heads, d, device=device, dtype=dtype)
    g = torch.empty(tokens, n_v_heads, device=device, dtype=torch.float32)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device) if device.type != "meta" else \
        torch.empty(2, dtype=torch.int32, device=device)
    return q, q, v, g, g, cu


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """Qwen3.5's linear-attention layer (H 16, HV 32, K = V = 128), one document of 4096 tokens, bf16: the forward's
    three kernels, the recurrence, and the backward's four (after its recomputation)."""
    q, k, v, g, beta, cu = _layer_inputs(torch.device("meta"), torch.bfloat16, 4096)
    case = "4096 tokens, H 16, HV 32, K = V = 128, bf16"
    # the sequential passes' loops: one chunk (BLOCK_C tokens) per iteration; the recurrence's: one token (each per
    # program's BLOCK_V state columns)
    per_chunk = dict(unit="token", per_iteration=lambda c: c["BLOCK_C"])
    return [_registry.SassCase(case, lambda: gated_delta_forward(q, k, v, g, beta, 128 ** -0.5, None, cu, True),
                               (_registry.SassLaunch("gated_delta.wy", 0),
                                _registry.SassLaunch("gated_delta.state", 1, **per_chunk),
                                _registry.SassLaunch("gated_delta.output", 2))),
            _registry.SassCase(case, lambda: gated_delta_forward(q, k, v, g, beta, 128 ** -0.5, None, cu, True,
                                                                 recurrent=True),
                               (_registry.SassLaunch("gated_delta.recurrent", 0, unit="token",
                                                     per_iteration=lambda c: 1),)),
            _registry.SassCase(case, lambda: gated_delta_backward(v, None, q, k, v, g, beta, 128 ** -0.5, None, cu),
                               (_registry.SassLaunch("gated_delta.bwd_state", 2, **per_chunk),
                                _registry.SassLaunch("gated_delta.bwd_dqk", 3),
                                _registry.SassLaunch("gated_delta.bwd_dv", 4),
                                _registry.SassLaunch("gated_delta.bwd_wy", 5)))]


def _opcheck_cases() -> dict[str, list[tuple]]:
    q, k = torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    v = torch.randn(9, 4, 16)
    g, beta = -torch.rand(9, 4), torch.rand(9, 4)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    s0 = torch.randn(2, 4, 8, 16)
    return {"gated_delta_fwd": [(q, k, v, g, beta, 0.3, s0, cu, True, False, False),
                                (q, k, v, g, beta, 0.3, None, cu, False, True, True)],
            "gated_delta_bwd": [(torch.randn(9, 4, 16), torch.randn(2, 4, 8, 16), q, k, v, g, beta, 0.3, s0, cu)]}


def _double_backward_cases():
    q = torch.randn(1, 5, 1, 8, requires_grad=True)
    v = torch.randn(1, 5, 1, 8)
    g, beta = -torch.rand(1, 5, 1), torch.rand(1, 5, 1)
    return [("chunk_gated_delta_rule", chunk_gated_delta_rule(q, q, v, g, beta)[0], [q])]


_registry.register(_registry.Op(
    name="gated_delta", entry_points=("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                                      "GatedDeltaRuleFunction"),
    reference="tritonlm.modules.functional.gated_delta_rule", sass_cases=_sass_cases, bench_section="gated_delta",
    opcheck_cases=_opcheck_cases, double_backward_cases=_double_backward_cases,
    notes=("Gated DeltaNet (Qwen3.5, Qwen3-Next): chunked WY-form forward and backward, recurrent decoding",)))
