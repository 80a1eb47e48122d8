"""Gated DeltaNet linear attention as a mixer (Qwen3.5 / Qwen3-Next's ``linear_attention`` layers): a depthwise
causal conv over q/k/v, the gated delta rule with a learned decay, a gated RMSNorm. Builds ``GatedDeltaNet``; its
cache (:class:`RecurrentCache`) is fixed-size per sequence whatever the length."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import RecurrentCache
from .base import Part

#: ours -> Hugging Face names inside the layer (transformers' Qwen3.5 spelling, under ``linear_attn.``)
HF_NAMES = {
    "in_proj_qkv.weight": "in_proj_qkv.weight", "in_proj_z.weight": "in_proj_z.weight",
    "in_proj_b.weight": "in_proj_b.weight", "in_proj_a.weight": "in_proj_a.weight", "conv1d_weight": "conv1d.weight",
    "dt_bias": "dt_bias", "A_log": "A_log", "norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}


@dataclass(frozen=True)
class GatedDeltaNetSpec(Part):
    """``num_k_heads`` query/key heads of ``head_k_dim``, ``num_v_heads`` (a multiple) value heads of ``head_v_dim``,
    a conv of ``conv_kernel`` taps; the gated norm's ``norm_eps``."""

    kind = "gated_deltanet"
    component = "GatedDeltaNet"
    flop_categories = ("linear_attention",)

    d_model: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6

    @property
    def conv_channels(self) -> int:
        """The q, k and v features the conv mixes."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    def new_cache(self, context_length: int, reserve: int | None = None) -> RecurrentCache:
        return RecurrentCache()

    def hf_names(self) -> dict[str, str]:
        return {ours: f"linear_attn.{theirs}" for ours, theirs in HF_NAMES.items()}

    def param_count(self, active: bool = False) -> int:
        # the q/k/v, z, beta and decay projections, the conv taps, dt_bias and A_log, the gated norm's weight (one
        # head's width, shared by the heads) and the output projection
        channels, value, heads = self.conv_channels, self.value_dim, self.num_v_heads
        return (self.d_model * (channels + value + 2 * heads) + channels * self.conv_kernel + 2 * heads
                + self.head_v_dim + value * self.d_model)

    def forward_flops(self, batch: int, seq: int) -> dict[str, int]:
        # the projections and conv taps (every weight but the per-head vectors and the norm's: one multiply-add per
        # token), and the delta rule at its recurrent count, 6·d_k·d_v per token and value head (Sᵀk, the rank-1
        # update and Sᵀq)
        weights = self.param_count() - 2 * self.num_v_heads - self.head_v_dim
        return {"linear_attention": batch * seq * (2 * weights + 6 * self.num_v_heads * self.head_k_dim
                                                   * self.head_v_dim)}

    def cache_bytes(self, batch: int, seq: int, element_bytes: int) -> int:
        # the fp32 state [HV, d_k, d_v] and the conv's last W - 1 inputs, per sequence (no growth with seq)
        return batch * (self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
                        + self.conv_channels * (self.conv_kernel - 1) * element_bytes)

    def saved_elements(self, batch: int, seq: int) -> int:
        # per token: the projections' outputs (q/k/v channels, z, beta and decay logits), the conv's output, the
        # delta rule's output and the gated norm's, the output projection's
        channels, value = self.conv_channels, self.value_dim
        return batch * seq * (2 * channels + 3 * value + 2 * self.num_v_heads + self.d_model)
