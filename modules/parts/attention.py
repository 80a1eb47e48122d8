"""The attention mixer: causal multi-head attention with the options of the families people fine-tune (grouped
key/value heads, RoPE with scaling or partial rotary or none, q/k norms, softmax scale and softcap, a sliding window,
attention sinks, an output gate, biases). Builds ``MultiHeadSelfAttention`` and keeps a :class:`KVCache`."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import KVCache
from .base import Part


@dataclass(frozen=True)
class AttentionSpec(Part):
    """One attention layer. ``theta=None``: no RoPE (sinusoidal or no positions, or a NoPE layer); ``rotary_dim``:
    RoPE on the first that many features of each head (None: all); ``window``: a query sees that many most recent
    positions, its own included (None: the whole causal prefix)."""

    kind = "attention"
    component = "MultiHeadSelfAttention"
    flop_categories = ("attention_projections", "attention_matmuls")

    d_model: int
    num_heads: int
    max_seq_len: int | None = None
    theta: float | None = None
    num_kv_heads: int | None = None
    rope_scaling: dict | None = None
    head_dim: int | None = None
    qkv_bias: bool = False
    qk_norm: str | None = None  # "head" (Qwen3) or "projection" (OLMo 2)
    norm_eps: float = 1e-5
    norm_offset: bool = False
    softmax_scale: float | None = None
    softcap: float | None = None
    window: int | None = None
    rotary_dim: int | None = None
    out_bias: bool = False
    sinks: bool = False
    output_gate: bool = False

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def new_cache(self, context_length: int, reserve: int | None = None) -> KVCache:
        return KVCache(context_length, reserve)

    def hf_names(self) -> dict[str, str]:
        names = {f"{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in ("q", "k", "v")}
        names["output_proj.weight"] = "self_attn.o_proj.weight"
        if self.qkv_bias:
            names.update({f"{p}_proj.bias": f"self_attn.{p}_proj.bias" for p in ("q", "k", "v")})
        if self.out_bias:
            names["output_proj.bias"] = "self_attn.o_proj.bias"
        if self.qk_norm:
            names.update({f"{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in ("q", "k")})
        if self.output_gate:  # (Qwen3.5's file interleaves it with q_proj's rows: the family's Fused splits it out)
            names["gate_proj.weight"] = "self_attn.gate_proj.weight"
        if self.sinks:
            names["sinks"] = "self_attn.sinks"
        return names

    def param_count(self, active: bool = False) -> int:
        d, d_q, d_kv = self.d_model, self.num_heads * self.d_head, self.kv_heads * self.d_head
        # q and output projections d x (heads x d_head); k and v d x (kv heads x d_head) (smaller under GQA); Qwen2's
        # q/k/v biases, an output bias; q/k norm weights per head (Qwen3) or over the projections (OLMo 2); one sink
        # logit per query head (gpt-oss); Qwen3.5's output gate, as wide as the queries
        qk_norms = {None: 0, "head": 2 * self.d_head, "projection": d_q + d_kv}[self.qk_norm]
        return (2 * d * d_q + 2 * d * d_kv + (d_q + 2 * d_kv) * self.qkv_bias + d * self.out_bias + qk_norms
                + self.num_heads * self.sinks + d * d_q * self.output_gate)

    def forward_flops(self, batch: int, seq: int) -> dict[str, int]:
        tokens, d_q, d_kv = batch * seq, self.num_heads * self.d_head, self.kv_heads * self.d_head
        return {"attention_projections": 2 * tokens * self.d_model * (2 * d_q + 2 * d_kv + d_q * self.output_gate),
                # QKᵀ: [seq, d_head] x [d_head, seq] per head, then P·V: [seq, seq] x [seq, d_head] per head, over the
                # full square (the seeds' convention, though a causal kernel skips half)
                "attention_matmuls": 2 * batch * seq * seq * 2 * d_q}

    def cache_bytes(self, batch: int, seq: int, element_bytes: int) -> int:
        return batch * seq * 2 * self.kv_heads * self.d_head * element_bytes  # keys and values

    def saved_elements(self, batch: int, seq: int) -> int:
        # Q, the attention output, the output projection and its input (d_model wide each, the convention's
        # count), K and V, the scores and their softmax (heads x seq²)
        b, s = batch, seq
        return 4 * b * s * self.d_model + 2 * b * s * self.kv_heads * self.d_head + 2 * b * self.num_heads * s * s
