"""What every layer part provides (the defaults of a part without a cache, extra HF tensors or a kind of FLOPs)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import nn


class Part:
    """Base of the frozen part specs (each a ``@dataclass(frozen=True)`` whose fields are its module's constructor
    arguments, so ``build`` is one call and the spec is the single place the part's sizes live).

    Class attributes a part sets: ``kind`` (its name), ``component`` (the class it builds, looked up in a backend's
    component namespace: ``tritonlm.modules.reference`` or ``tritonlm.modules.fused``), ``flop_categories`` (the
    keys its :meth:`forward_flops` fills in :func:`tritonlm.accounting.forward_flops`).
    """

    kind: ClassVar[str]
    component: ClassVar[str]
    flop_categories: ClassVar[tuple[str, ...]] = ()

    # --- the module -------------------------------------------------------------------------------------------
    def module_kwargs(self) -> dict:
        """The component's constructor arguments: the spec's fields (shallow: a RoPE scaling dict is passed as is)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def build(self, comps, device=None, dtype=None) -> nn.Module:
        """The part's module from a backend's component namespace (same parameters and ``state_dict`` keys for
        every backend; only the forward's compute differs)."""
        return getattr(comps, self.component)(**self.module_kwargs(), device=device, dtype=dtype)

    def new_cache(self, context_length: int, reserve: int | None = None):
        """The cache this part keeps between incremental decoding calls (None: it keeps none, as an MLP)."""
        return None

    # --- Hugging Face layout ----------------------------------------------------------------------------------
    def hf_names(self) -> dict[str, str]:
        """Ours -> Hugging Face names of the tensors that map one to one: ours inside the part (``q_proj.weight``),
        theirs inside the layer (``self_attn.q_proj.weight``), in the common (Llama / Qwen) spelling a family record
        may rename."""
        return {}

    def state_from_hf(self, hf_state: dict, hf_layer: str, ours: str, weights, used: set) -> dict:
        """The part's tensors that need a layout transform (an MoE's stacked experts), read from ``hf_state`` under
        ``hf_layer`` (``model.layers.3``) into our names under ``ours`` (``layers.3.ffn``); every key read goes into
        ``used``. ``weights`` is the family record's :class:`~tritonlm.hf.family.Weights`."""
        return {}

    def state_to_hf(self, state: dict, hf_layer: str, ours: str, weights) -> dict:
        """The inverse of :meth:`state_from_hf`."""
        return {}

    # --- accounting ---------------------------------------------------------------------------------------------
    def param_count(self, active: bool = False) -> int:
        """Trainable parameters; ``active``: those one token's forward uses (an MoE's routed experts)."""
        raise NotImplementedError

    def forward_flops(self, batch: int, seq: int) -> dict[str, int]:
        """Matmul FLOPs (2·m·n·k each) of one forward over ``batch`` sequences of ``seq`` tokens, by category."""
        raise NotImplementedError

    def cache_bytes(self, batch: int, seq: int, element_bytes: int) -> int:
        """Bytes of the part's decoding cache holding ``seq`` positions of ``batch`` sequences."""
        return 0

    def saved_elements(self, batch: int, seq: int) -> int:
        """Elements the reference module saves for backward (the CS336 counting convention's estimate)."""
        raise NotImplementedError
