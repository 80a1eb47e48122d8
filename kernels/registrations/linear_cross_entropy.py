"""The fused linear cross-entropy's registration (kernels/_registry.py): no kernel of its own (cuBLAS matmuls around
cross_entropy's row kernel, whose SASS the report covers); the GPU suite's "lm_head_loss" section times it against
eager, Liger and CCE."""

from __future__ import annotations

import torch

from .. import _registry
from ..linear_cross_entropy_loss import linear_cross_entropy


def _opcheck_cases() -> dict[str, list[tuple]]:
    x, head, one = torch.randn(6, 40), torch.randn(11, 40), torch.ones(1)
    return {"linear_cross_entropy_fwd": [(x, head, torch.randint(0, 11, (6,)), -100, 0.0, 0.0, 30.0, one, True, True,
                                          torch.float32, True, True)],
            "linear_cross_entropy_bwd": [(torch.rand(6), x, head, torch.randint(0, 11, (6,)), -100, 0.0, 0.0, None,
                                          True, True, torch.float32)]}


def _double_backward_cases():
    x, w = torch.randn(4, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    return [("linear_cross_entropy", linear_cross_entropy(x, w[None].expand(3, 8).contiguous(),
                                                          torch.tensor([0, 1, 2, 0])), [x])]


_registry.register(_registry.Op(
    name="linear_cross_entropy", entry_points=("linear_cross_entropy", "LinearCrossEntropyFunction"),
    reference="tritonlm.modules.reference.lm_head_loss", bench_section="lm_head_loss", opcheck_cases=_opcheck_cases,
    double_backward_cases=_double_backward_cases))
