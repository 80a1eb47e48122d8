"""Sampling for generation: :func:`sample_next` (temperature, top-k, nucleus). It lives with the model in
``tritonlm.modules.sampling`` (the model's ``generate`` uses it; layers import downward only) and is re-exported
here, its public home."""

from .modules.sampling import sample_next

__all__ = ["sample_next"]
