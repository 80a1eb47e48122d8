"""Profiler annotations: NVTX ranges (for ``nsys``) and ``record_function`` labels (for torch.profiler).

Free when not profiling: nothing is registered until :func:`annotate` is called, and the kernel-launch
ranges check one module-level flag. ``annotate(model)`` labels every submodule by its path
(``layers.3.attn``, ``layers.3.ffn``...) so a timeline reads by layer and op; :func:`enable` turns on the
ranges around each Triton kernel launch (``tritonlm::flash_attention_fwd``...).
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


def annotate(model: torch.nn.Module, prefix: str = "") -> list:
    """Label every submodule's forward with its path; also enables kernel-launch ranges.

    Returns the hook handles (call ``.remove()`` on each to undo).
    """
    enable(True)
    handles = []
    for name, module in model.named_modules():
        label = f"{prefix}{name or type(module).__name__}"

        def pre(mod, args, label=label):
            mod._tritonlm_range = _Range(label)
            mod._tritonlm_range.__enter__()

        def post(mod, args, output):
            rng = getattr(mod, "_tritonlm_range", None)
            if rng is not None:
                rng.__exit__(None, None, None)
                mod._tritonlm_range = None

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles
