"""Fused components: the reference modules with their hot paths swapped for Triton kernels.

Each class subclasses its reference twin, keeping the constructor, parameters and ``state_dict`` keys,
and overrides only the compute: RMSNorm -> ``rms_norm`` (and ``add_rms_norm`` for the pre-norm residual
seam); RoPE -> ``apply_rope`` (q and k in one launch
inside attention); SwiGLU's gate -> ``swiglu_gate`` (the three projections stay cuBLAS matmuls);
attention -> ``FlashAttention``. Linear and Embedding are the reference ones (cuBLAS / indexing).

:func:`fuse` / :func:`unfuse` convert a model in place by switching each component's class, so the
parameters, buffers and device placement are kept as they are.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from . import reference as _ref
from .model import TransformerBlock as _Block
from .model import TransformerLM as _LM
from .model import register_components
from .reference import (  # noqa: F401  (unchanged components, re-exported for a complete namespace)
    BatchNorm,
    Documents,
    Embedding,
    KVCache,
    LayerNorm,
    Linear,
    ReLUFFN,
    SiLUFFN,
    SinusoidalPositionalEncoding,
)

__all__ = [
    "Linear", "Embedding", "RMSNorm", "LayerNorm", "BatchNorm", "RotaryPositionalEmbedding",
    "SinusoidalPositionalEncoding", "SwiGLU", "GeGLU", "ReLUFFN", "SiLUFFN", "MoEExperts", "MoEFFN", "MultiHeadSelfAttention",
    "MultiHeadLatentAttention", "RMSNormGated", "GatedDeltaNet",
    "KVCache",
    "TransformerBlock", "TransformerLM", "fuse", "unfuse", "lm_head_loss",
]


def _kernels():
    # imported on first use so that building a reference model never imports Triton
    from .. import kernels

    return kernels


class RMSNorm(_ref.RMSNorm):
    """:class:`reference.RMSNorm` running the fused Triton kernel (fp32 math, x's dtype out)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _kernels().rms_norm(x, self.weight, self.eps, weight_offset=self.offset)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(x + residual), x + residual)`` in one kernel (``add_rms_norm``)."""
        return _kernels().add_rms_norm(x, residual, self.weight, self.eps, weight_offset=self.offset)


class RMSNormGated(_ref.RMSNormGated):
    """:class:`reference.RMSNormGated` as one Triton kernel each way (``kernels.rms_norm_gated``)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _kernels().rms_norm_gated(x, gate, self.weight, self.eps)


class RotaryPositionalEmbedding(_ref.RotaryPositionalEmbedding):
    """:class:`reference.RotaryPositionalEmbedding` running the Triton RoPE kernel on its cos/sin tables."""

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-2] > self.max_seq_len and token_positions is None:
            raise ValueError(f"sequence length {x.shape[-2]} exceeds RoPE max_seq_len {self.max_seq_len}")
        return _kernels().apply_rope(x, None, token_positions, cos=self.cos_cached, sin=self.sin_cached)

    def rotate_pair(self, q: torch.Tensor, k: torch.Tensor, token_positions: torch.Tensor,
                    check_positions: bool = True):
        """Rotate q and k in a single launch (also when GQA gives k fewer heads)."""
        return _kernels().apply_rope(q, k, token_positions, cos=self.cos_cached, sin=self.sin_cached,
                                     check_positions=check_positions)


class SwiGLU(_ref.SwiGLU):
    """:class:`reference.SwiGLU` with the gate ``silu(a) * b`` as one Triton kernel; its backward writes the
    gradients over ``a = w1(x)`` and ``b = w3(x)``, which only the gate reads (lower peak memory)."""

    def gate(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _kernels().swiglu_gate(a, b, inplace_backward=True)


class GeGLU(_ref.GeGLU):
    """:class:`reference.GeGLU` with the gate ``gelu_tanh(a) * b`` as one Triton kernel (backward in place, as
    :class:`SwiGLU`'s)."""

    def gate(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _kernels().geglu_gate(a, b, approximate="tanh", inplace_backward=True)


class MultiHeadSelfAttention(_ref.MultiHeadSelfAttention):
    """:class:`reference.MultiHeadSelfAttention` with RoPE on q and k in one launch and Triton flash
    attention (bottom-right causal, so KV-cache decoding uses the same kernel)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.rope is not None:
            self.rope.__class__ = RotaryPositionalEmbedding
        for norm in (self.q_norm, self.k_norm):  # q/k norms over each head (the RMSNorm kernel on [..., d_k])
            if norm is not None:
                norm.__class__ = RMSNorm

    def norm_qk(self, q, k):
        """Both norms in one launch (``kernels.qk_rms_norm``): per head on ``[..., heads, d_k]`` views of the
        projections (no copies), or over the whole projections."""
        norm = self.q_norm
        if self.qk_norm == "head":
            q_heads, k_heads = q.unflatten(-1, (-1, self.d_k)), k.unflatten(-1, (-1, self.d_k))
            q, k = _kernels().qk_rms_norm(q_heads, k_heads, self.q_norm.weight, self.k_norm.weight, norm.eps,
                                          weight_offset=norm.offset)
            return q.flatten(-2), k.flatten(-2)
        return _kernels().qk_rms_norm(q, k, self.q_norm.weight, self.k_norm.weight, norm.eps, weight_offset=norm.offset)

    def rotate_features(self, q, k, positions, trusted: bool = False):
        return self.rope.rotate_pair(q, k, positions, check_positions=not trusted)

    @property
    def _window(self):
        """flash-attn's ``window_size`` of this layer's sliding window (None: none)."""
        return None if self.window is None else (self.window - 1, 0)

    def attend(self, q, k, v):
        # GQA: k, v keep their num_kv_heads heads; the kernel maps each query head to its kv head
        return _kernels().FlashAttention.apply(q, k, v, True, self.softmax_scale, self._window, None, None, 0, 0, True,
                                               self.softcap or 0.0, self.sinks)

    def attend_paged(self, q, k, v, cache):
        """The paged cache through ``flash_attn_with_kvcache``: the new keys written into the pool in place and
        attended in one call; each sequence reads only its own blocks, up to its own length."""
        pool = cache.cache
        k_pool, v_pool = pool.pools(cache.index, k, v)
        out = _kernels().flash_attn_with_kvcache(
            q.transpose(-3, -2), k_pool, v_pool, k.transpose(-3, -2).to(k_pool.dtype),
            v.transpose(-3, -2).to(v_pool.dtype), cache_seqlens=pool.cache_seqlens, block_table=pool.block_table,
            causal=True, softmax_scale=self.softmax_scale, window_size=self._window or (-1, -1),
            softcap=self.softcap or 0.0, sinks=self.sinks)
        return out.transpose(-3, -2)

    def attend_documents(self, q, k, v, documents):
        """Packed documents as varlen attention: ``[batch, heads, seq, d]`` -> ``[batch*seq, heads, d]`` views
        (no copy for head-split projections), one causal sequence per document, never a mask."""
        batch, seq = documents.ids.shape
        packed = [t.transpose(-3, -2).reshape(batch * seq, t.shape[-3], t.shape[-1]) for t in (q, k, v)]
        out = _kernels().FlashAttention.apply(*packed, True, self.softmax_scale, self._window, documents.cu_seqlens,
                                              documents.cu_seqlens, documents.max_len, documents.max_len, True,
                                              self.softcap or 0.0, self.sinks)
        return out.reshape(batch, seq, q.shape[-3], v.shape[-1]).transpose(-3, -2)


class MultiHeadLatentAttention(_ref.MultiHeadLatentAttention, MultiHeadSelfAttention):
    """:class:`reference.MultiHeadLatentAttention` with fused RMSNorms on the latents, RoPE in one launch and
    Triton flash attention whose value heads are narrower than the query/key heads (no padding of V)."""

    def __init__(self, *args, **kwargs):
        _ref.MultiHeadLatentAttention.__init__(self, *args, **kwargs)
        self.rope.__class__ = RotaryPositionalEmbedding
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                norm.__class__ = RMSNorm

    def attend_padded(self, q, k, v, lengths, cache):
        """The expanded, padded keys and values as a dense KV cache of ``flash_attn_with_kvcache``: each sequence
        reads its own first ``lengths[b]`` keys, its queries bottom-right aligned (no mask tensor)."""
        out = _kernels().flash_attn_with_kvcache(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2),
                                                 cache_seqlens=lengths.to(torch.int32), causal=True,
                                                 softmax_scale=self.softmax_scale)
        return out.transpose(-3, -2)


class GatedDeltaNet(_ref.GatedDeltaNet):
    """:class:`reference.GatedDeltaNet` on the Triton kernels: ``causal_conv1d_fn`` (packed documents through
    ``seq_idx``; with a cache, ``causal_conv1d_update`` on the state in place), ``chunk_gated_delta_rule`` (packed
    documents through ``cu_seqlens``; one new token against a cache: ``fused_recurrent_gated_delta_rule``) and the
    gated RMSNorm kernel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm.__class__ = RMSNormGated

    def forward(self, x, token_positions=None, kv_cache=None, documents=None):
        _ref._check_last_dim(x, self.d_model, "GatedDeltaNet")
        squeeze = x.dim() == 2
        if squeeze:
            x = x.unsqueeze(0)
        kernels = _kernels()
        batch, seq, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(-1, -2)                      # [batch, channels, seq] (a view)
        weight = self.conv1d_weight.squeeze(1)
        g, beta = self.gates(x)
        if kv_cache is not None:
            conv_state, state = self.cache_states(kv_cache, batch)
            conv_state = (mixed.new_zeros(batch, self.conv_dim, self.conv_kernel - 1) if conv_state is None
                          else conv_state.to(mixed.dtype).contiguous())
            conv = kernels.causal_conv1d_update(mixed, conv_state, weight, None, "silu")  # (state updated in place)
            q, k, v = self.split_heads(conv.transpose(-1, -2))
            step = kernels.fused_recurrent_gated_delta_rule if seq == 1 else kernels.chunk_gated_delta_rule
            o, state = step(q, k, v, g, beta, initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
            self.store_states(kv_cache, conv_state, state, seq)
        elif documents is not None:
            seq_idx = documents.ids.to(torch.int32)
            conv = kernels.causal_conv1d_fn(mixed, weight, None, "silu", seq_idx=seq_idx)
            q, k, v = (t.reshape(1, batch * seq, *t.shape[2:]) for t in self.split_heads(conv.transpose(-1, -2)))
            o, _ = kernels.chunk_gated_delta_rule(q, k, v, g.reshape(1, batch * seq, -1),
                                                  beta.reshape(1, batch * seq, -1), use_qk_l2norm_in_kernel=True,
                                                  cu_seqlens=documents.cu_seqlens)
            o = o.reshape(batch, seq, *o.shape[2:])
        else:
            conv = kernels.causal_conv1d_fn(mixed, weight, None, "silu")
            o, _ = kernels.chunk_gated_delta_rule(*self.split_heads(conv.transpose(-1, -2)), g, beta,
                                                  use_qk_l2norm_in_kernel=True)
        out = self.finish(o, x)
        return out[0] if squeeze else out


class MoEExperts(_ref.MoEExperts):
    """:class:`reference.MoEExperts` as the fused grouped GEMMs (``kernels.moe_experts``): dropless, no token
    copies, deterministic weight gradients."""

    def forward(self, x, top_k_index, top_k_weights):
        return _kernels().moe_experts(x, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                      **self.options())


class MoEFFN(_ref.MoEFFN):
    """:class:`reference.MoEFFN` with fused experts (and a fused shared expert's gate)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.experts.__class__ = MoEExperts
        if self.shared_expert is not None:
            self.shared_expert.__class__ = SwiGLU


def lm_head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, check_targets: bool = True,
                 softcap: float | None = None) -> torch.Tensor:
    """:func:`reference.lm_head_loss` as the fused linear cross-entropy: the ``[tokens, vocab]`` logits are never
    formed. ``check_targets=False`` skips the range check (its host sync) for targets validated once already."""
    return _kernels().linear_cross_entropy(hidden, head.weight, targets, ignore_index=ignore_index,
                                           label_smoothing=label_smoothing, z_loss=z_loss, check_targets=check_targets,
                                           softcap=softcap)


class TransformerBlock(_Block):
    """The shared block assembly, defaulting to ``backend="triton"``."""

    def __init__(self, *args, backend: str = "triton", **kwargs):
        super().__init__(*args, backend=backend, **kwargs)


class TransformerLM(_LM):
    """The shared LM assembly, defaulting to ``backend="triton"``."""

    def __init__(self, *args, backend: str = "triton", **kwargs):
        super().__init__(*args, backend=backend, **kwargs)


_FUSED = {
    _ref.RMSNorm: RMSNorm,
    _ref.RMSNormGated: RMSNormGated,
    _ref.RotaryPositionalEmbedding: RotaryPositionalEmbedding,
    _ref.SwiGLU: SwiGLU,
    _ref.GeGLU: GeGLU,
    _ref.MultiHeadSelfAttention: MultiHeadSelfAttention,
    _ref.MultiHeadLatentAttention: MultiHeadLatentAttention,
    _ref.MoEExperts: MoEExperts,
    _ref.MoEFFN: MoEFFN,
    _ref.GatedDeltaNet: GatedDeltaNet,
}
_UNFUSED = {v: k for k, v in _FUSED.items()}


def _convert(model: nn.Module, table: dict, backend: str) -> nn.Module:
    for module in model.modules():
        cls = table.get(type(module))
        if cls is not None:
            module.__class__ = cls  # same attributes and parameters, different forward
        if isinstance(module, (_Block, _LM)):
            module.backend = backend
    return model


def fuse(model: nn.Module) -> nn.Module:
    """Swap the reference components of ``model`` for fused ones, in place, keeping every parameter."""
    return _convert(model, _FUSED, "triton")


def unfuse(model: nn.Module) -> nn.Module:
    """Swap fused components back to the reference ones, in place."""
    return _convert(model, _UNFUSED, "reference")


# the assembly builds its components from this namespace for backend="triton"
register_components("triton", sys.modules[__name__])
