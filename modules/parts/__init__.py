"""Layer parts: what a decoder layer is made of, one module per kind.

A layer is two norms around a **mixer** (the token mixer: :class:`AttentionSpec`, :class:`LatentAttentionSpec`,
:class:`GatedDeltaNetSpec`) and an **MLP** (:class:`DenseMLPSpec`, :class:`MoESpec`). Each part kind is a frozen
spec that knows, from its fields alone,

* how to build its module from a backend's components (``build``: the reference and fused classes share their
  constructor and ``state_dict`` keys, so one spec builds either),
* the cache a mixer keeps between decoding calls (``new_cache``),
* its Hugging Face tensor names and layout transforms (``hf_names``, ``state_from_hf`` / ``state_to_hf``),
* its accounting: parameters, matmul FLOPs, cache bytes and the activations it saves for backward.

The assembly (:mod:`tritonlm.modules.model`), the generic Hugging Face code and :mod:`tritonlm.accounting` ask the
parts and name no kind; :meth:`ModelConfig.layer_mixer` / :meth:`ModelConfig.layer_mlp` translate the config's
fields into each layer's specs. A new mixer is a new module here (see CONTRIBUTING, "Adding a mixer").
"""

from .attention import AttentionSpec
from .base import Part
from .dense_mlp import DenseMLPSpec
from .gated_deltanet import GatedDeltaNetSpec
from .latent_attention import LatentAttentionSpec
from .moe import MoESpec

#: the mixer and MLP part kinds, by their ``kind`` names
MIXERS = {spec.kind: spec for spec in (AttentionSpec, LatentAttentionSpec, GatedDeltaNetSpec)}
MLPS = {spec.kind: spec for spec in (DenseMLPSpec, MoESpec)}



def flop_categories() -> tuple[str, ...]:
    """The FLOP categories the part kinds count (:func:`tritonlm.accounting.forward_flops`' keys before
    ``lm_head``), in the kinds' order."""
    return tuple(dict.fromkeys(c for spec in (*MIXERS.values(), *MLPS.values()) for c in spec.flop_categories))


__all__ = ["flop_categories", "Part", "AttentionSpec", "LatentAttentionSpec", "GatedDeltaNetSpec", "DenseMLPSpec", "MoESpec",
           "MIXERS", "MLPS"]
