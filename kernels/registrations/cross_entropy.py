"""The cross-entropy row kernel's registration (kernels/_registry.py)."""

from __future__ import annotations

import torch

from .. import _registry, tuned
from ..cross_entropy_loss import TUNABLE, cross_entropy, cross_entropy_rows


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """Loss and gradient of a chunk of logits in one kernel: 4096 tokens x GPT-2's vocab (and Llama 3's, 128256);
    warp-instructions per logit counted over the kernel's loops."""
    rows, cases = _registry.SASS_ROWS, []
    for dtype in _registry.SASS_DTYPES[:1] if quick else _registry.SASS_DTYPES:
        for vocab, padded in ((50257, 50272), (128256, 128256)):
            meta = torch.device("meta")
            # as linear_cross_entropy lays out a chunk: rows padded to a multiple of 16 elements
            logits = torch.empty(rows, padded, dtype=dtype, device=meta)[:, :vocab]
            targets = torch.empty(rows, dtype=torch.int64, device=meta)
            scale = torch.empty(1, dtype=torch.float32, device=meta)
            cases.append(_registry.SassCase(
                f"{rows}x{vocab} {_registry.dtype_label(dtype)}",
                lambda lg=logits, t=targets, sc=scale: cross_entropy_rows(lg, t, grad=lg, grad_scale=sc),
                (_registry.SassLaunch("cross_entropy.fwd+grad", unit="logit",
                                      per_iteration=lambda c: c["BLOCK_T"] * c["BLOCK_V"], per_warp=True),),
                bytes_moved=3 * _registry.nbytes(logits)))  # two reads of the logits, one write of the gradient
    return cases


def _sweep_cases(device: torch.device, smoke: bool) -> list[_registry.SweepCase]:
    """Loss and gradient (in place) over 4096 rows of Llama 3's vocabulary, bf16 (smoke: 64 x 1000, fp32)."""
    dtype = torch.float32 if smoke else torch.bfloat16
    rows, vocab = (64, 1000) if smoke else (4096, 128256)

    def step():
        logits = torch.randn(rows, vocab, device=device, dtype=dtype)
        targets = torch.randint(0, vocab, (rows,), device=device)
        scale = torch.full((1,), 1.0 / rows, device=device)

        def run():
            grad = logits.clone()  # (written in place, as the loss's backward does with a dead logits buffer)
            loss, lse, _ = cross_entropy_rows(grad, targets, grad=grad, grad_scale=scale)
            return loss, lse, grad
        return run
    return [_registry.SweepCase("cross_entropy", tuned.dtype_name(dtype), step, TUNABLE.candidates)]


def _opcheck_cases() -> dict[str, list[tuple]]:
    logits, t, one = torch.randn(5, 11), torch.randint(0, 11, (5,)), torch.ones(1)
    return {"cross_entropy_fwd": [(logits, t, -100, 0.1, 1e-3, None, one, True)]}


def _double_backward_cases():
    x = torch.randn(4, 8, requires_grad=True)
    return [("cross_entropy", cross_entropy(x, torch.tensor([0, 1, 2, 3])), [x])]


_registry.register(_registry.Op(
    name="cross_entropy", entry_points=("cross_entropy", "CrossEntropyFunction"),
    reference="tritonlm.modules.functional.cross_entropy", tunables=(TUNABLE,), sass_cases=_sass_cases,
    sweep_cases=_sweep_cases, bench_section="lm_head_loss", opcheck_cases=_opcheck_cases,
    double_backward_cases=_double_backward_cases))
