"""tritonlm: fused Triton kernels for Llama-style Transformer LMs, beside their naive reference twins.

Public surface::

    from tritonlm import ModelConfig, TransformerLM, fuse, unfuse
    from tritonlm.modules import reference, fused, functional
    from tritonlm.kernels import FlashAttention, FlashAttentionTorch, rms_norm, apply_rope, swiglu_gate
"""

from .config import PRESETS, ModelConfig
from .modules import TransformerBlock, TransformerLM

__version__ = "0.1.0"

__all__ = ["ModelConfig", "PRESETS", "TransformerBlock", "TransformerLM", "fuse", "unfuse", "__version__"]


def __getattr__(name):
    # fuse/unfuse import the fused modules (and with them Triton) only when asked for
    if name in ("fuse", "unfuse"):
        from .modules import fused

        return getattr(fused, name)
    raise AttributeError(f"module 'tritonlm' has no attribute {name!r}")
