"""Model components: ``reference`` (einsum spec), ``fused`` (Triton hot paths), ``functional`` ops and
the shared ``TransformerBlock``/``TransformerLM`` assembly, built from one ``ModelConfig``.

Imports run downward: ``cache`` <- ``parts`` (each layer's mixer and MLP specs) <- ``config``, ``functional``,
``sampling`` <- ``model`` (the assembly) <- ``reference`` <- ``fused``. The two namespaces register their components with the assembly when imported (both
are imported here; ``fused`` imports Triton only when a fused component first runs).
"""

from . import functional, fused, reference  # noqa: F401  (fused registers the "triton" backend's components)
from .config import ModelConfig
from .model import TransformerBlock, TransformerLM, resolve_backend

__all__ = ["functional", "reference", "ModelConfig", "TransformerBlock", "TransformerLM", "resolve_backend"]
