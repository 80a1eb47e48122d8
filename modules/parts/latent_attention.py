"""DeepSeek-V2/V3's multi-head latent attention (MLA) as a mixer: queries through an optional low-rank bottleneck,
keys and values expanded from one compressed latent plus a rotary key shared by every head. Builds
``MultiHeadLatentAttention``; its cache holds the latent and the rotary key, not the expanded keys and values."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import KVCache
from .base import Part


@dataclass(frozen=True)
class LatentAttentionSpec(Part):
    """One MLA layer: ``num_heads`` query/key heads ``qk_nope_head_dim + qk_rope_head_dim`` wide (RoPE on the last
    ``qk_rope_head_dim``), value heads ``v_head_dim`` wide; ``q_lora_rank=None``: one query projection."""

    kind = "latent_attention"
    component = "MultiHeadLatentAttention"
    flop_categories = ("attention_projections", "attention_matmuls")

    d_model: int
    num_heads: int
    max_seq_len: int
    theta: float
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_scaling: dict | None = None
    latent_norm_eps: float = 1e-6
    softmax_scale: float | None = None
    qkv_bias: bool = False  # (DeepSeek's attention_bias: on the two a-projections)
    out_bias: bool = False

    @property
    def d_qk(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def new_cache(self, context_length: int, reserve: int | None = None) -> KVCache:
        return KVCache(context_length, reserve)

    def hf_names(self) -> dict[str, str]:
        if self.q_lora_rank is None:
            names = {"q_proj.weight": "self_attn.q_proj.weight"}
        else:
            names = {"q_a_proj.weight": "self_attn.q_a_proj.weight", "q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                     "q_b_proj.weight": "self_attn.q_b_proj.weight"}
            if self.qkv_bias:
                names["q_a_proj.bias"] = "self_attn.q_a_proj.bias"
        names.update({"kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
                      "kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                      "kv_b_proj.weight": "self_attn.kv_b_proj.weight"})
        if self.qkv_bias:
            names["kv_a_proj.bias"] = "self_attn.kv_a_proj_with_mqa.bias"
        names["output_proj.weight"] = "self_attn.o_proj.weight"
        if self.out_bias:
            names["output_proj.bias"] = "self_attn.o_proj.bias"
        return names

    def _matrices(self) -> int:
        """Weight-matrix entries: the query path (one projection, or the low-rank pair), the latent + shared rotary
        key, the expansion into each head's nope keys and values, the output projection -- one multiply-add per token
        each."""
        d, h = self.d_model, self.num_heads
        query = d * h * self.d_qk if self.q_lora_rank is None else (d + h * self.d_qk) * self.q_lora_rank
        latent = d * (self.kv_lora_rank + self.qk_rope_head_dim)
        expand = self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return query + latent + expand + h * self.v_head_dim * d

    def param_count(self, active: bool = False) -> int:
        # + the latents' norm weights and the a-projections' biases (attention_bias), an output bias
        lora = self.q_lora_rank or 0
        vectors = lora + self.kv_lora_rank + (lora + self.kv_lora_rank + self.qk_rope_head_dim) * self.qkv_bias
        return self._matrices() + vectors + self.d_model * self.out_bias

    def forward_flops(self, batch: int, seq: int) -> dict[str, int]:
        h = self.num_heads
        return {"attention_projections": 2 * batch * seq * self._matrices(),
                # QKᵀ over the query/key heads' width, P·V over the values' own
                "attention_matmuls": 2 * batch * seq * seq * (h * self.d_qk + h * self.v_head_dim)}

    def cache_bytes(self, batch: int, seq: int, element_bytes: int) -> int:
        return batch * seq * (self.kv_lora_rank + self.qk_rope_head_dim) * element_bytes  # the latent + rotary key

    def saved_elements(self, batch: int, seq: int) -> int:
        b, s, h = batch, seq, self.num_heads
        return 4 * b * s * self.d_model + 2 * b * s * h * self.d_qk + 2 * b * h * s * s
