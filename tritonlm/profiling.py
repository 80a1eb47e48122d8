"""Profiler annotations: NVTX ranges (for ``nsys``) and ``record_function`` labels (for torch.profiler).

Free when not profiling: nothing is registered until :func:`annotate` is called, and the kernel-launch
ranges check one module-level flag. ``annotate(model)`` labels every submodule by its path
(``layers.3.attn``, ``layers.3.ffn``...) so a timeline reads by layer and op; :func:`enable` turns on the
ranges around each Triton kernel launch (``tritonlm::flash_attention_fwd``...).
"""

from __future__ import annotations

import torch

# the flag and the range live below the kernels (which open a range around each launch): layers import downward
from .kernels._ranges import _Range, enable, enabled, kernel_range  # noqa: F401  (re-exported)


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
