"""Host-side layout helpers of the attention launchers: ``[batch, heads, seq, d]`` views without copies, output
allocation that keeps a head-split layout, window bounds and the ``tl.dot`` precision of fp32 inputs."""

from __future__ import annotations

import torch

from .._common import as_4d, next_pow2
from .._common import dot_precision as _dot_precision  # noqa: F401  (the launchers' name for it)


def _block_d(d: int) -> int:
    return max(16, next_pow2(d))


def _strides3(t: torch.Tensor, packed: bool = False):
    # packed sequences: program axis "b" indexes cu_seqlens, never memory, so its stride is 0
    return (0 if packed else t.stride(0)), t.stride(1), t.stride(2)


def _empty_4d_like(t: torch.Tensor, packed: bool = False, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An output shaped and laid out like ``t`` (a head-split view stays head-split), plus its 4-D view. ``last``:
    another size of the last dim (MLA's output has V's head dim), the dims kept in ``t``'s memory order."""
    if last is not None and last != t.shape[-1]:
        # outermost stride first, the last dim innermost; allocate in that order and permute back
        order = sorted(range(t.dim() - 1), key=lambda i: -t.stride(i)) + [t.dim() - 1]
        shape = (*t.shape[:-1], last)
        out = torch.empty([shape[i] for i in order], dtype=t.dtype, device=t.device)
        out = out.permute([order.index(i) for i in range(t.dim())])
    else:
        out = torch.empty_like(t)
    view = _as_4d(out, packed)
    if view.data_ptr() != out.data_ptr():
        out = torch.empty(out.shape, dtype=t.dtype, device=t.device)
        view = _as_4d(out, packed)
    return out, view


def _as_4d(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """``[batch, heads, seq, d]`` view: :func:`as_4d` for batches, ``[1, heads, total, d]`` for packed
    ``[total, heads, d]`` sequences (no copy unless the last dim is strided)."""
    if not packed:
        return as_4d(t)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.transpose(0, 1).unsqueeze(0)


def _window(is_causal: bool, window: tuple[int, int], n_q: int, n_k: int) -> tuple[int, int]:
    """Kernel window bounds: -1 (unbounded) becomes a bound no query tile reaches (2**30: past any sequence plus
    any tile, still far from int32 overflow in the range arithmetic); causal caps the right side at 0."""
    unbounded = 1 << 30
    left, right = (unbounded if w < 0 else int(w) for w in window)
    return left, (min(right, 0) if is_causal else right)


def _has_window(is_causal: bool, window) -> bool:
    """Whether a window bounds more than causality does (then the kernels compare both window edges)."""
    left, right = window
    return left >= 0 or (right >= 0 and not is_causal)
