"""Registrations of the post-training heads (kernels/_registry.py): per-token log-probabilities and entropy
(``kernels/log_probs.py``) and the distillation divergences (``kernels/distill.py``). SASS cases at TRL's shape
(4096 of its 8,192 tokens x Qwen's vocabulary 151,936); the GPU suite's "post_training" section times them."""

from __future__ import annotations

import torch

from .. import _registry
from ..distill import divergence_rows, fused_linear_jsd, jsd
from ..log_probs import (
    entropy_from_logits,
    linear_log_probs,
    log_prob_grad,
    log_prob_stats,
    selective_log_softmax,
)

VOCAB = 151936


def _per_logit(c: dict) -> int:
    return c["BLOCK_T"] * c["BLOCK_V"]


def _log_prob_cases(quick: bool) -> list[_registry.SassCase]:
    """The statistics pass (log-prob, entropy) and the gradient pass of a chunk of logits, as linear_log_probs lays
    it out (rows padded to 16 elements)."""
    rows, cases, meta = _registry.SASS_ROWS, [], torch.device("meta")
    for dtype in _registry.SASS_DTYPES[:1] if quick else _registry.SASS_DTYPES:
        logits = torch.empty(rows, VOCAB, dtype=dtype, device=meta)
        targets = torch.empty(rows, dtype=torch.int64, device=meta)
        stats = torch.empty(rows, dtype=torch.float32, device=meta)
        label = f"{rows}x{VOCAB} {_registry.dtype_label(dtype)}"
        cases.append(_registry.SassCase(
            label, lambda lg=logits, t=targets: log_prob_stats(lg, t, entropy=True),
            (_registry.SassLaunch("log_probs.stats", unit="logit", per_iteration=_per_logit, per_warp=True),),
            bytes_moved=_registry.nbytes(logits)))
        cases.append(_registry.SassCase(
            label, lambda lg=logits, t=targets, st=stats: log_prob_grad(lg, lg, t, st, st, st, st),
            (_registry.SassLaunch("log_probs.grad", unit="logit", per_iteration=_per_logit, per_warp=True),),
            bytes_moved=2 * _registry.nbytes(logits)))
        cases.append(_registry.SassCase(
            label, lambda lg=logits, st=stats: divergence_rows(lg, lg, None, beta=0.5, logits=True, grad=lg,
                                                               scale=st[:1]),
            (_registry.SassLaunch("distill.jsd", unit="logit", per_iteration=_per_logit, per_warp=True),),
            bytes_moved=5 * _registry.nbytes(logits)))  # (three passes over two rows, the gradient written once)
    return cases


def _inputs():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    return x, w, torch.randn(4, 5, requires_grad=True), torch.tensor([0, 1, 2, 4])


def _double_backward_cases():
    x, w, logits, t = _inputs()
    return [("linear_log_probs", linear_log_probs(x, w, t).sum(), [x]),
            ("selective_log_softmax", selective_log_softmax(logits, t).sum(), [logits]),
            ("entropy_from_logits", entropy_from_logits(logits).sum(), [logits])]


def _distill_double_backward_cases():
    x, w, logits, _ = _inputs()
    return [("jsd", jsd(torch.log_softmax(logits, -1), torch.log_softmax(logits.detach().flip(0), -1)), [logits]),
            ("fused_linear_jsd", fused_linear_jsd(x, w, x.detach() * 2, w.detach()), [x])]


_registry.register(_registry.Op(
    name="log_probs", entry_points=("linear_log_probs", "selective_log_softmax", "entropy_from_logits",
                                    "LogProbsFunction", "LinearLogProbsFunction"),
    reference="tritonlm.modules.functional.log_probs", sass_cases=_log_prob_cases, bench_section="post_training",
    double_backward_cases=_double_backward_cases))
_registry.register(_registry.Op(
    name="distill", entry_points=("jsd", "kl_div", "fused_linear_jsd", "DivergenceFunction", "FusedLinearJSDFunction"),
    reference="tritonlm.modules.functional.divergence", bench_section="post_training",
    double_backward_cases=_distill_double_backward_cases))
