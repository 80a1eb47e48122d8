"""Kernel-launch ranges: ``with kernel_range("tritonlm::rms_norm_fwd"):`` around each Triton launch pushes an
NVTX range (for ``nsys``) and a ``record_function`` label (for torch.profiler) -- only once
:func:`tritonlm.profiling.enable` / ``annotate`` turned them on; otherwise one module-level flag is checked.

The bottom of the layering (kernels import nothing from ``tritonlm``): ``tritonlm.profiling`` re-exports these.
"""

from __future__ import annotations

import torch

_ENABLED = False


def enable(flag: bool = True) -> None:
    """Turn kernel-launch ranges on or off (off by default)."""
    global _ENABLED
    _ENABLED = bool(flag)


def enabled() -> bool:
    return _ENABLED


class _Range:
    """``with kernel_range("name"):`` pushes an NVTX range and a record_function label when enabled."""

    __slots__ = ("name", "_rf", "_nvtx")

    def __init__(self, name: str):
        self.name = name
        self._rf = None
        self._nvtx = False

    def __enter__(self):
        if _ENABLED:
            self._rf = torch.profiler.record_function(self.name)
            self._rf.__enter__()
            if torch.cuda.is_available():
                torch.cuda.nvtx.range_push(self.name)
                self._nvtx = True
        return self

    def __exit__(self, *exc):
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
            self._nvtx = False
        if self._rf is not None:
            self._rf.__exit__(*exc)
            self._rf = None
        return False


def kernel_range(name: str) -> _Range:
    return _Range(name)
