"""Model components: ``reference`` (einsum spec), ``fused`` (Triton hot paths), ``functional`` ops and
the shared ``TransformerBlock``/``TransformerLM`` assembly."""

from . import functional, reference
from .model import TransformerBlock, TransformerLM, resolve_backend

__all__ = ["functional", "reference", "TransformerBlock", "TransformerLM", "resolve_backend"]
