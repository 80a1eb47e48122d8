"""Mixture-of-experts expert FFNs as grouped GEMMs: :func:`moe_experts`, dropless, in transformers 5's stacked
weight layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), forward and backward.

Files, by phase: :mod:`.routing` (the (token, slot) pairs sorted by expert and the tile map, on the device without
a host sync), :mod:`.kernels` (the ``@jit`` grouped GEMMs), :mod:`.launch` (tile tables, launchers, custom ops, the
autograd Function); what the tooling reads is ``kernels/registrations/moe.py``.
"""

from .launch import ACTIVATIONS, MoEExpertsFunction, moe_backward, moe_experts, moe_forward

__all__ = ["moe_experts", "MoEExpertsFunction", "moe_forward", "moe_backward", "ACTIVATIONS"]
