"""Reference components: plain PyTorch with named-axis einsum, the numerical spec of the library.

Constructors, parameter names and ``state_dict`` keys follow CS336's reference implementation, so a
checkpoint trained with course code loads unchanged. Besides the default model's parts (RMSNorm, RoPE,
SwiGLU, causal multi-head attention) this file carries the seeds' alternatives for ablations:
LayerNorm, BatchNorm, sinusoidal absolute positions, the ReLU FFN and a non-gated SiLU FFN.
"""

from __future__ import annotations

import math
import sys

import torch
from einops import einsum, rearrange, repeat
from torch import nn

from . import functional as F
from .cache import Documents, KVCache, PagedLayerCache, RecurrentCache  # noqa: F401  (re-exported)
from .config import check_rope_scaling, default_d_ff
from .model import TransformerBlock, TransformerLM, register_components  # noqa: F401  (the one shared assembly)

__all__ = [
    "Linear", "Embedding", "RMSNorm", "LayerNorm", "BatchNorm", "RotaryPositionalEmbedding",
    "SinusoidalPositionalEncoding", "SwiGLU", "GeGLU", "ReLUFFN", "SiLUFFN", "MoEExperts", "MoEFFN", "MultiHeadSelfAttention",
    "MultiHeadLatentAttention", "RMSNormGated", "GatedDeltaNet",
    "KVCache", "RecurrentCache", "TransformerBlock", "TransformerLM", "lm_head_loss",
]


def _check_last_dim(x: torch.Tensor, expected: int, who: str) -> None:
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(f"{who} expects input [..., {expected}], got {tuple(x.shape)}")


def _check_float(x: torch.Tensor, who: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{who} expects a floating-point tensor, got {x.dtype}")


def _inspectable(t: torch.Tensor) -> bool:
    """Whether values of ``t`` may be read on the host for validation (not while tracing, not on meta)."""
    return t.numel() > 0 and t.device.type != "meta" and not torch.compiler.is_compiling()


def _trunc_normal_(t: torch.Tensor, std: float) -> torch.Tensor:
    return nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)


class Linear(nn.Module):
    """``y = x Wᵀ`` (+ ``b`` with ``bias=True``); ``weight`` is ``[out_features, in_features]``, ``bias``
    ``[out_features]``.

    Init: truncated normal, std = sqrt(2 / (in + out)), cut at ±3 std; the bias (Qwen2's q/k/v) starts at zero.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, *, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        _trunc_normal_(self.weight, math.sqrt(2.0 / (in_features + out_features)))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., in_features] -> [..., out_features]``."""
        _check_last_dim(x, self.in_features, "Linear")
        y = einsum(x, self.weight, "... d_in, d_out d_in -> ... d_out")
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    """Lookup table ``weight[num_embeddings, embedding_dim]``; init truncated normal std 1, cut at ±3.

    Out-of-range ids raise a ``ValueError`` (a host-side check, i.e. a device sync per call); a caller that
    has validated its data once (the trainer does) can switch it off with ``check_ids = False``.
    """

    check_ids = True

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        _trunc_normal_(self.weight, 1.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids[...] -> [..., embedding_dim]``."""
        if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
            raise TypeError(f"Embedding expects integer token ids, got {token_ids.dtype}")
        if self.check_ids and _inspectable(token_ids):
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise ValueError(f"token id out of range [0, {self.num_embeddings}): saw {lo if lo < 0 else hi}")
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dim, computed in fp32, returned in x's dtype.

    ``offset=True`` (Gemma): ``x̂ · (1 + weight)`` with the weight starting at 0."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None, *, offset: bool = False):
        super().__init__()
        self.d_model, self.eps, self.offset = d_model, eps, 1.0 if offset else 0.0
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., d_model] -> [..., d_model]``."""
        _check_last_dim(x, self.d_model, "RMSNorm")
        _check_float(x, "RMSNorm")
        in_dtype = x.dtype
        x = x.float()
        rms = torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x / rms * (self.offset + self.weight.float())).to(in_dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm seam: ``h = x + residual`` and ``(self(h), h)``. The fused twin does it in one pass."""
        h = x + residual
        return self(h), h

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class RMSNormGated(nn.Module):
    """Gated RMSNorm (Qwen3.5 / Qwen3-Next's norm before the gate): ``(weight · x̂) · silu(gate)`` over the last dim,
    ``x̂ = x / sqrt(mean(x²) + eps)`` in fp32 rounded to x's dtype, ``weight · x̂`` in their promoted dtype, the gate's
    SiLU in fp32, the product returned in x's dtype (transformers' casting). ``weight`` (d_model,) starts at 1."""

    def __init__(self, d_model: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x, gate [..., d_model] -> [..., d_model]``."""
        _check_last_dim(x, self.d_model, "RMSNormGated")
        _check_float(x, "RMSNormGated")
        if gate.shape != x.shape:
            raise ValueError(f"RMSNormGated: gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
        work = torch.promote_types(x.dtype, torch.float32)  # (fp32, or fp64 for an fp64 recomputation)
        xf = x.to(work)
        x_hat = (xf / torch.sqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
        gated = self.weight * x_hat * F.silu(gate.to(work))
        return gated.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class LayerNorm(nn.Module):
    """Per-row ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance), over the last dim."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.d_model, "LayerNorm")
        _check_float(x, "LayerNorm")
        in_dtype = x.dtype
        x = x.float()
        mean = x.mean(dim=-1, keepdim=True)
        var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + self.eps)
        return (y * self.weight.float() + self.bias.float()).to(in_dtype)


class BatchNorm(nn.Module):
    """Normalises each feature (last dim) over every other position (batch and sequence).

    Training: batch statistics (biased variance to normalise; running estimates updated with the
    unbiased variance, ``momentum`` as in ``torch.nn.BatchNorm1d``). Eval: running statistics.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, momentum: float = 0.1, device=None, dtype=None):
        super().__init__()
        self.d_model, self.eps, self.momentum = d_model, eps, momentum
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))
        self.register_buffer("running_mean", torch.zeros(d_model, device=device, dtype=torch.float32))
        self.register_buffer("running_var", torch.ones(d_model, device=device, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.d_model, "BatchNorm")
        _check_float(x, "BatchNorm")
        in_dtype = x.dtype
        rows = x.float().reshape(-1, self.d_model)
        if self.training:
            n = rows.shape[0]
            if n < 2:
                raise ValueError("BatchNorm in training needs more than one position to take statistics over")
            mean = rows.mean(dim=0)
            var = (rows - mean).pow(2).mean(dim=0)
            with torch.no_grad():
                self.running_mean.lerp_(mean.detach(), self.momentum)
                self.running_var.lerp_(var.detach() * n / (n - 1), self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        y = (rows - mean) / torch.sqrt(var + self.eps) * self.weight.float() + self.bias.float()
        return y.reshape(x.shape).to(in_dtype)


class RotaryPositionalEmbedding(nn.Module):
    """RoPE on interleaved pairs ``(x0, x1), (x2, x3), …``: pair ``i`` at position ``m`` is rotated by
    ``m * theta**(-2i / d_k)``.

    The cos/sin tables (``[max_seq_len, d_k / 2]``, fp32) are non-persistent buffers: no state_dict keys.
    ``scaling`` rescales the frequencies as Hugging Face's ``rope_scaling`` does (``"llama3"``; see
    :func:`scaled_inv_freq`).
    """

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None, *, scaling: dict | None = None):
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE rotates pairs of features, so d_k must be even; got {d_k}")
        if max_seq_len is None or max_seq_len <= 0:
            raise ValueError(f"RoPE needs a positive max_seq_len, got {max_seq_len}")
        self.theta, self.d_k, self.max_seq_len, self.scaling = float(theta), d_k, max_seq_len, scaling
        inv_freq = scaled_inv_freq(
            self.theta ** (-torch.arange(0, d_k, 2, device=device, dtype=torch.float64) / d_k), scaling, self.theta)
        angles = einsum(torch.arange(max_seq_len, device=device, dtype=torch.float64), inv_freq,
                        "pos, pair -> pos pair")
        # (YaRN's attention factor scales cos and sin, so q·k by its square, as transformers applies it)
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos_cached", (torch.cos(angles) * factor).float(), persistent=False)
        self.register_buffer("sin_cached", (torch.sin(angles) * factor).float(), persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x[..., seq, d_k]``, ``token_positions[..., seq]`` (broadcast against x's leading dims) or
        None for ``0..seq-1`` -> same shape and dtype as x."""
        _check_last_dim(x, self.d_k, "RotaryPositionalEmbedding")
        _check_float(x, "RotaryPositionalEmbedding")
        seq = x.shape[-2]
        if token_positions is None:
            if seq > self.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds RoPE max_seq_len {self.max_seq_len}")
            token_positions = torch.arange(seq, device=x.device)
        elif token_positions.shape[-1] != seq:
            raise ValueError(f"token_positions {tuple(token_positions.shape)} must end in seq={seq}")
        elif _inspectable(token_positions):
            lo, hi = int(token_positions.min()), int(token_positions.max())
            if lo < 0 or hi >= self.max_seq_len:
                raise ValueError(f"token position out of range [0, {self.max_seq_len}): saw {lo if lo < 0 else hi}")
        return self.rotate(x, token_positions)

    def rotate(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        """The rotation itself, for positions already known to be in range (no host-side check)."""
        cos = self.cos_cached[token_positions]  # [..., seq, pair]
        sin = self.sin_cached[token_positions]
        pairs = rearrange(x.float(), "... seq (pair two) -> ... seq pair two", two=2)
        x_even, x_odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rearrange(rotated, "... seq pair two -> ... seq (pair two)").to(x.dtype)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict | None, theta: float | None = None) -> torch.Tensor:
    """RoPE frequencies ``[d_k / 2]`` after ``scaling`` (None or ``"default"``: unchanged).

    ``"llama3"`` (Llama 3.1's long-context recipe): with ``L = original_max_position_embeddings``, a frequency
    whose wavelength ``2π / f`` exceeds ``L / low_freq_factor`` is divided by ``factor``, one shorter than
    ``L / high_freq_factor`` is kept, and those between interpolate linearly in ``L / wavelength`` from
    ``f / factor`` to ``f``. ``"linear"`` (position interpolation; Gemma 3's global layers): every frequency divided
    by ``factor``. ``"yarn"`` (gpt-oss, DeepSeek-V3; needs the base ``theta``): pairs between the dims where a
    frequency makes ``beta_fast`` and ``beta_slow`` turns over ``L`` ramp linearly from the original frequency
    (fast ones) to the one divided by ``factor`` (slow ones); ``truncate`` rounds the ramp's ends outward.
    """

    if scaling is None:
        return inv_freq
    kind = check_rope_scaling(scaling).get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, theta)
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    # 0 for long wavelengths (fully scaled), 1 for short ones (kept), linear in between
    keep = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return keep * inv_freq + (1 - keep) * inv_freq / factor


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, theta: float | None) -> torch.Tensor:
    """YaRN's frequencies (:func:`scaled_inv_freq`): the ramp between the correction dims of ``beta_fast`` and
    ``beta_slow`` turns, as transformers' ``_compute_yarn_parameters`` computes it (in fp32)."""
    if theta is None:
        raise ValueError("rope_scaling 'yarn' needs the RoPE base theta")
    dim = 2 * inv_freq.shape[-1]
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dim whose frequency turns ``rotations`` times over L
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (a zero-width ramp)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=inv_freq.device) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolated), 0: divided by factor (interpolated)
    return ((1 / (factor * base)) * (1 - keep) + (1 / base) * keep).to(inv_freq.dtype)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · m · ln(scale) + 1`` (1 without a scale-up), as transformers computes it."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by: ``attention_factor`` when given, else ``0.1·ln(factor) + 1``
    (with ``mscale`` and ``mscale_all_dim``: their ratio, DeepSeek-V3's); 1 for every other scaling."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, float(scaling["mscale"])) / yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


class SinusoidalPositionalEncoding(nn.Module):
    """The original Transformer's absolute positions: ``p[i, 2j] = sin(i / 10000^(2j/d))``,
    ``p[i, 2j+1] = cos(…)``, added to the token embeddings. Non-persistent buffer, no parameters."""

    def __init__(self, d_model: int, max_seq_len: int, base: float = 10000.0, device=None):
        super().__init__()
        if d_model % 2:
            raise ValueError(f"sinusoidal encoding needs an even d_model, got {d_model}")
        self.d_model, self.max_seq_len = d_model, max_seq_len
        inv_freq = base ** (-torch.arange(0, d_model, 2, device=device, dtype=torch.float64) / d_model)
        angles = einsum(torch.arange(max_seq_len, device=device, dtype=torch.float64), inv_freq,
                        "pos, pair -> pos pair")
        table = rearrange(torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1),
                          "pos pair two -> pos (pair two)")
        self.register_buffer("table", table.float(), persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x[..., seq, d_model]`` -> x + encoding of its positions."""
        seq = x.shape[-2]
        if token_positions is None:
            token_positions = torch.arange(seq, device=x.device)
        return x + self.table[token_positions].to(x.dtype)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``; ``d_ff=None`` -> 8/3·d_model rounded to the nearest multiple of 64; ``bias=True``
    adds a bias to each projection."""

    def __init__(self, d_model: int, d_ff: int | None = None, device=None, dtype=None, *, bias: bool = False):
        super().__init__()
        self.d_model = d_model
        self.d_ff = default_d_ff(d_model) if d_ff is None else d_ff
        # (bias: ERNIE 4.5's biased projections; the CS336 FFN has none)
        self.w1 = Linear(d_model, self.d_ff, device=device, dtype=dtype, bias=bias)
        self.w2 = Linear(self.d_ff, d_model, device=device, dtype=dtype, bias=bias)
        self.w3 = Linear(d_model, self.d_ff, device=device, dtype=dtype, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., d_model] -> [..., d_model]``."""
        return self.w2(self.gate(self.w1(x), self.w3(x)))

    def gate(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The elementwise part, ``silu(a) * b`` (the fused module runs it as one Triton kernel)."""
        return F.silu(a) * b


class GeGLU(SwiGLU):
    """``w2(gelu(w1 x) * w3 x)`` with the tanh-approximate GELU (Gemma's FFN); same parameters as :class:`SwiGLU`."""

    def gate(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(a, approximate="tanh") * b


class ReLUFFN(nn.Module):
    """The original Transformer FFN, ``w2(relu(w1 x))`` (no biases)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class SiLUFFN(ReLUFFN):
    """A non-gated SiLU FFN, ``w2(silu(w1 x))``: the ablation that isolates SwiGLU's gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class MoEExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked, in transformers 5's layout: ``gate_up_proj [E, 2I, d_model]``
    (each expert's gate rows, then its up rows) and ``down_proj [E, d_model, I]``; each matrix initialised like a
    :class:`Linear` of its shape. gpt-oss's options: ``bias`` (``gate_up_bias [E, 2I]``, ``down_bias [E, d_model]``,
    starting at zero) and ``activation="swiglu_clamped"`` with ``alpha`` and ``limit``
    (:func:`functional.moe_experts`)."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, device=None, dtype=None, *, bias: bool = False,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.activation, self.alpha, self.limit = activation, alpha, limit
        std_in, std_out = math.sqrt(2.0 / (d_model + d_ff)), math.sqrt(2.0 / (d_ff + d_model))
        self.gate_up_proj = nn.Parameter(_trunc_normal_(
            torch.empty(num_experts, 2 * d_ff, d_model, device=device, dtype=dtype), std_in))
        self.down_proj = nn.Parameter(_trunc_normal_(
            torch.empty(num_experts, d_model, d_ff, device=device, dtype=dtype), std_out))
        self.gate_up_bias = self.down_bias = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * d_ff, device=device, dtype=dtype))
            self.down_bias = nn.Parameter(torch.zeros(num_experts, d_model, device=device, dtype=dtype))

    def options(self) -> dict:
        """The experts' keyword arguments of ``moe_experts`` (both implementations take the same)."""
        return dict(activation=self.activation, gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                    alpha=self.alpha, limit=self.limit)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``x [tokens, d_model]``, routing ``[tokens, K]`` -> ``[tokens, d_model]``: one expert at a time."""
        return F.moe_experts(x, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, **self.options())


class MoEFFN(nn.Module):
    """A mixture-of-experts FFN: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token
    (:func:`functional.moe_router`: fp32 softmax, top-k, renormalised with ``norm_topk_prob``); the token's output
    is their outputs weighted by those probabilities. With ``shared_d_ff`` a shared SwiGLU expert every token runs is
    added, scaled by a sigmoid gate (Qwen2-MoE), or as it is without ``shared_gate`` (DeepSeek-V3, GLM-4.5, whose
    router is ``scoring="sigmoid"`` with a ``choice_bias`` buffer ``[E]``, groups and a scaling factor:
    :func:`functional.moe_router`). gpt-oss: ``router_bias`` (``router.bias [E]``),
    ``softmax_after_topk`` (the chosen logits' softmax are the weights), ``expert_bias`` and the clamped
    ``activation`` of :class:`MoEExperts`. Parameters: ``router.weight [E, d_model]``, ``experts.*``,
    ``shared_expert.w1/w2/w3``, ``shared_expert_gate.weight [1, d_model]``.

    After each forward, ``router_logits [tokens, E]`` and ``top_k_index [tokens, K]`` hold that call's routing, read
    by the model for the load-balancing loss and the log (``expert_tokens``: pairs routed to each expert).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, norm_topk_prob: bool = True,
                 shared_d_ff: int | None = None, device=None, dtype=None, *, router_bias: bool = False,
                 softmax_after_topk: bool = False, expert_bias: bool = False, activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0, scoring: str = "softmax", choice_bias: bool = False,
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 shared_gate: bool = True):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.softmax_after_topk = softmax_after_topk
        self.routing = dict(scoring=scoring, n_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=routed_scaling_factor)
        # (DeepSeek-V3's e_score_correction_bias: a buffer, not trained by the loss, saved with the model)
        self.register_buffer("choice_bias", torch.zeros(num_experts, device=device, dtype=torch.float32)
                             if choice_bias else None)
        self.router = Linear(d_model, num_experts, device=device, dtype=dtype, bias=router_bias)
        self.experts = MoEExperts(num_experts, d_model, d_ff, device=device, dtype=dtype, bias=expert_bias,
                                  activation=activation, alpha=alpha, limit=limit)
        self.shared_expert = self.shared_expert_gate = None
        if shared_d_ff:
            self.shared_expert = SwiGLU(d_model, shared_d_ff, device=device, dtype=dtype)
            if shared_gate:
                self.shared_expert_gate = Linear(d_model, 1, device=device, dtype=dtype)
        self.router_logits: torch.Tensor | None = None
        self.top_k_index: torch.Tensor | None = None

    @property
    def expert_tokens(self) -> torch.Tensor:
        """``[E]``: how many (token, slot) pairs the last forward routed to each expert (counted when asked, not on
        every forward)."""
        index = self.top_k_index.reshape(-1)
        return torch.zeros(self.num_experts, dtype=torch.int64, device=index.device).scatter_add_(
            0, index, torch.ones_like(index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., d_model] -> [..., d_model]``."""
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, index = F.moe_router(flat, self.router.weight, self.top_k, self.norm_topk_prob,
                                              logit_bias=self.router.bias, softmax_after_topk=self.softmax_after_topk,
                                              choice_bias=self.choice_bias, **self.routing)
        self.router_logits, self.top_k_index = logits, index
        out = self.experts(flat, index, weights)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        elif self.shared_expert is not None:  # (DeepSeek-V3 / GLM-4.5: the shared experts ungated)
            out = out + self.shared_expert(flat)
        return out.reshape(x.shape)


def lm_head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, check_targets: bool = True,
                 softcap: float | None = None) -> torch.Tensor:
    """The LM loss of ``hidden[..., d_model]`` through ``head`` (its ``[..., vocab]`` logits formed whole, then
    :func:`functional.cross_entropy`, with a logit ``softcap`` when given); the fused twin never forms them.
    ``check_targets`` is the fused path's (here an out-of-range target fails in the indexing)."""
    return F.cross_entropy(head(hidden), targets, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           z_loss=z_loss, softcap=softcap)


class MultiHeadSelfAttention(nn.Module):
    """Causal multi-head self-attention with optional RoPE on queries and keys.

    ``q_proj`` is ``[num_heads·d_k, d_model]``, ``k_proj``/``v_proj`` ``[num_kv_heads·d_k, d_model]``, ``output_proj``
    ``[d_model, num_heads·d_k]`` with ``d_k = head_dim`` (default ``d_model / num_heads``; ``num_kv_heads`` defaults
    to ``num_heads``; fewer is grouped-query attention), rows grouped by head (head ``h`` owns rows
    ``h*d_k:(h+1)*d_k``). RoPE is applied when ``theta`` is given. Options real checkpoints need: ``qkv_bias``
    (biases on q, k, v: Qwen2) and ``qk_norm="head"`` (an RMSNorm of each head's q and k over ``d_k`` before RoPE,
    weights ``q_norm.weight`` / ``k_norm.weight``: Qwen3; ``"projection"``: over the whole q and k projections,
    OLMo 2), with ``norm_eps`` (and ``norm_offset``: Gemma 3's
    ``x̂ · (1 + w)``). Gemma 2 / 3: ``softmax_scale`` (default ``1 / sqrt(d_k)``), ``softcap`` (scores become
    ``softcap · tanh(s / softcap)``) and ``window`` (a query sees its ``window`` most recent positions). Phi-3:
    ``rotary_dim`` (RoPE on each head's first ``rotary_dim`` features only). ``out_bias``: a bias on the output
    projection (ERNIE 4.5, Seed-OSS). ``sinks``: a learned attention-sink logit per query head (``sinks [num_heads]``,
    gpt-oss), one more entry of each row's softmax that carries no value. ``output_gate``: the attention output
    times ``sigmoid(gate_proj(x))`` before the output projection (``gate_proj [num_heads·d_k, d_model]``: Qwen3.5).
    """

    def __init__(self, d_model: int, num_heads: int, max_seq_len: int | None = None,
                 theta: float | None = None, device=None, dtype=None, *, num_kv_heads: int | None = None,
                 rope_scaling: dict | None = None, head_dim: int | None = None, qkv_bias: bool = False,
                 qk_norm: str | None = None, norm_eps: float = 1e-5, norm_offset: bool = False,
                 softmax_scale: float | None = None, softcap: float | None = None, window: int | None = None,
                 rotary_dim: int | None = None, out_bias: bool = False, sinks: bool = False,
                 output_gate: bool = False):
        super().__init__()
        if head_dim is None and d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm must be None, 'head' or 'projection', got {qk_norm!r}")
        self.d_model, self.num_heads, self.d_k = d_model, num_heads, head_dim or d_model // num_heads
        self.num_kv_heads = num_kv_heads
        self.max_seq_len = max_seq_len
        self.q_proj = Linear(d_model, num_heads * self.d_k, device=device, dtype=dtype, bias=qkv_bias)
        # grouped-query attention: fewer key/value heads, each shared by num_heads / num_kv_heads query heads
        self.k_proj = Linear(d_model, num_kv_heads * self.d_k, device=device, dtype=dtype, bias=qkv_bias)
        self.v_proj = Linear(d_model, num_kv_heads * self.d_k, device=device, dtype=dtype, bias=qkv_bias)
        self.output_proj = Linear(num_heads * self.d_k, d_model, device=device, dtype=dtype, bias=out_bias)
        # (Qwen3.5, Qwen3-Next) the attention output times sigmoid(gate_proj(x)), feature by feature
        self.gate_proj = Linear(d_model, num_heads * self.d_k, device=device, dtype=dtype) if output_gate else None
        self.q_norm = self.k_norm = None
        if qk_norm == "head":
            self.q_norm = RMSNorm(self.d_k, norm_eps, device=device, dtype=dtype, offset=norm_offset)
            self.k_norm = RMSNorm(self.d_k, norm_eps, device=device, dtype=dtype, offset=norm_offset)
        elif qk_norm == "projection":  # (OLMo 2) over all heads of the projection at once
            self.q_norm = RMSNorm(num_heads * self.d_k, norm_eps, device=device, dtype=dtype, offset=norm_offset)
            self.k_norm = RMSNorm(num_kv_heads * self.d_k, norm_eps, device=device, dtype=dtype, offset=norm_offset)
        self.qk_norm = qk_norm
        self.softmax_scale, self.softcap, self.window = softmax_scale, softcap, window
        # (gpt-oss) one learned logit per query head in every row's softmax, carrying no value
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype)) if sinks else None
        if theta is not None:
            if max_seq_len is None:
                raise ValueError("RoPE (theta given) needs max_seq_len")
            rotary_dim = self.d_k if rotary_dim is None else rotary_dim
            if not (0 < rotary_dim <= self.d_k and rotary_dim % 2 == 0):
                raise ValueError(f"rotary_dim must be even and in (0, {self.d_k}], got {rotary_dim}")
            self.rope = RotaryPositionalEmbedding(theta, rotary_dim, max_seq_len, device=device, scaling=rope_scaling)
        else:
            self.rope = None

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, documents: Documents | None = None) -> torch.Tensor:
        """``x[..., seq, d_model]``, ``token_positions[..., seq]`` (default: ``0..seq-1``, after the cached
        positions when ``kv_cache`` holds some) -> ``[..., seq, d_model]``."""
        _check_last_dim(x, self.d_model, "MultiHeadSelfAttention")
        seq = x.shape[-2]
        past = kv_cache.length if kv_cache is not None else 0
        if self.max_seq_len is not None and past + seq > self.max_seq_len:
            raise ValueError(f"sequence length {past + seq} exceeds max_seq_len {self.max_seq_len}")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm is not None:  # before RoPE
            q, k = self.norm_qk(q, k)
        q = rearrange(q, "... seq (heads d_k) -> ... heads seq d_k", heads=self.num_heads)
        k, v = (rearrange(t, "... seq (kv_heads d_k) -> ... kv_heads seq d_k", kv_heads=self.num_kv_heads)
                for t in (k, v))
        if self.rope is not None:
            positions, trusted = self._positions(seq, past, token_positions, kv_cache, documents, x.device)
            q, k = self.rotate(q, k, positions, trusted=trusted)
        out = rearrange(self._attend_cached(q, k, v, kv_cache, documents), "... heads seq d_k -> ... seq (heads d_k)")
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(x))
        return self.output_proj(out)

    @staticmethod
    def _positions(seq, past, token_positions, kv_cache, documents, device):
        """``(positions [..., 1, seq], trusted)``: the given positions, or the next ``seq`` after the cache (a paged
        cache: each sequence of the batch from its own length), with a heads axis that broadcasts over ``[...,
        heads, seq, d_k]``; positions made here or per document (all < seq <= max_seq_len) are trusted (no range
        check)."""
        generated = token_positions is None
        if generated:
            paged = isinstance(kv_cache, PagedLayerCache)
            token_positions = kv_cache.positions(seq) if paged else torch.arange(past, past + seq, device=device)
        elif token_positions.shape[-1] != seq:
            raise ValueError(f"token_positions {tuple(token_positions.shape)} must end in seq={seq}")
        return token_positions.unsqueeze(-2), generated or documents is not None

    def _attend_cached(self, q, k, v, kv_cache, documents):
        """Attention of ``q [..., heads, seq, d_k]`` over the keys and values so far: a paged cache, a dense cache
        (the new ``k, v`` appended first), packed documents, or causal attention over ``k, v`` alone."""
        if isinstance(kv_cache, PagedLayerCache):
            return self.attend_paged(q, k, v, kv_cache)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        return self.attend(q, k, v) if documents is None else self.attend_documents(q, k, v, documents)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k norms on the projections ``q[..., seq, heads·d_k]``, ``k[..., seq, kv_heads·d_k]``: over each head's
        ``d_k`` (``qk_norm="head"``) or over the whole projection (``"projection"``)."""
        if self.qk_norm == "projection":
            return self.q_norm(q), self.k_norm(k)
        q = rearrange(self.q_norm(rearrange(q, "... (heads d_k) -> ... heads d_k", d_k=self.d_k)),
                      "... heads d_k -> ... (heads d_k)")
        k = rearrange(self.k_norm(rearrange(k, "... (kv_heads d_k) -> ... kv_heads d_k", d_k=self.d_k)),
                      "... kv_heads d_k -> ... (kv_heads d_k)")
        return q, k

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, trusted: bool = False):
        """RoPE on ``q`` and ``k`` (``[..., heads, seq, d_k]``) at ``positions[..., 1, seq]``; ``trusted``
        positions were generated here and need no range check. With a partial rotary dim (Phi-3) only each head's
        first ``rotary_dim`` features turn; the rest pass through."""
        rotary_dim = self.rope.d_k
        if rotary_dim < self.d_k:
            q_rot, k_rot = self.rotate_features(q[..., :rotary_dim], k[..., :rotary_dim], positions, trusted)
            return torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)
        return self.rotate_features(q, k, positions, trusted)

    def rotate_features(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, trusted: bool = False):
        """RoPE on all of ``q``'s and ``k``'s last dim (the RoPE module's ``d_k``)."""
        if trusted:  # generated here: skip the per-layer host-side range check (a device sync)
            return self.rope.rotate(q, positions), self.rope.rotate(k, positions)
        return self.rope(q, positions), self.rope(k, positions)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention (bottom-right aligned when there are more keys than queries). With GQA each
        key/value head is repeated for its group of query heads first: the readable spec."""
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = (repeat(t, "... kv_heads seq d_k -> ... (kv_heads group) seq d_k", group=group) for t in (k, v))
        mask = F.causal_mask(q.shape[-2], k.shape[-2], device=q.device, window=self.window)
        return F.scaled_dot_product_attention(q, k, v, mask, scale=self.softmax_scale, softcap=self.softcap or 0.0,
                                              sinks=self._sinks)

    @property
    def _sinks(self):
        """The sinks as the readable attention takes them: ``[heads, 1]`` against ``[..., heads, queries]``."""
        return None if self.sinks is None else self.sinks[:, None]

    def attend_documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents):
        """Causal attention within each packed document: an explicit block-diagonal causal mask."""
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k, v = (repeat(t, "... kv_heads seq d_k -> ... (kv_heads group) seq d_k", group=group) for t in (k, v))
        mask = documents.mask()
        if self.window is not None:  # (within a document, flat index differences are position differences)
            seq = mask.shape[-1]
            mask = mask & F.causal_mask(seq, seq, device=q.device, window=self.window)
        return F.scaled_dot_product_attention(q, k, v, mask, scale=self.softmax_scale, softcap=self.softcap or 0.0,
                                              sinks=self._sinks)

    def attend_paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedLayerCache):
        """A batch of sequences of different lengths against a paged cache (``q[batch, heads, seq, d_k]``, the
        new ``k, v[batch, kv_heads, seq, d_k]``): the new keys are written at each sequence's next positions, then
        every sequence's keys are gathered (padded) and query ``i`` of sequence ``b``, at position
        ``cache_seqlens[b] + i``, attends to the keys at or before it."""
        pool, index = cache.cache, cache.index
        pool.write(index, k, v)
        keys, values, _ = pool.gather(index)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            keys, values = (repeat(t, "... kv_heads seq d_k -> ... (kv_heads group) seq d_k", group=group)
                            for t in (keys, values))
        query_pos = cache.positions(q.shape[-2])                            # [batch, seq]
        key_pos = torch.arange(keys.shape[-2], device=q.device)
        visible = key_pos[None, None, :] <= query_pos[:, :, None]           # [batch, seq, keys]
        if self.window is not None:
            visible &= key_pos[None, None, :] > query_pos[:, :, None] - self.window
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), visible[:, None],
                                              scale=self.softmax_scale, softcap=self.softcap or 0.0, sinks=self._sinks)


class MultiHeadLatentAttention(MultiHeadSelfAttention):
    """DeepSeek-V2/V3's multi-head latent attention (MLA), transformers' ``DeepseekV3Attention`` as the spec.

    Queries: ``q_proj`` (``[heads·(nope + rope), d_model]``), or with ``q_lora_rank`` the bottleneck ``q_b_proj(
    q_a_norm(q_a_proj(x)))``. Keys and values: ``kv_a_proj`` gives a compressed latent of ``kv_lora_rank`` features
    plus one rotary key of ``rope`` features shared by every head; ``kv_b_proj(kv_a_norm(latent))`` expands the latent
    into each head's ``nope`` key features and ``v_head_dim`` values. Each head's key is its own nope features then the
    shared rotary ones; RoPE (interleaved pairs) turns the last ``rope`` features of queries and keys. Attention
    runs with query/key heads ``nope + rope`` wide and value heads ``v_head_dim`` wide (``softmax_scale``: the
    family's, YaRN's mscale included); ``output_proj`` maps ``heads·v_head_dim`` back.

    The KV cache (dense or paged) holds the compressed latent after its norm and the rotated shared key:
    ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer, whatever the heads (DeepSeek-V3: 576, against
    128 x (192 + 128) = 40960 for expanded keys and values), as transformers caches it. Each step expands every cached
    latent through ``kv_b_proj`` again before attending: exact, the same products as without a cache.
    """

    def __init__(self, d_model: int, num_heads: int, max_seq_len: int, theta: float, device=None, dtype=None, *,
                 q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, rope_scaling: dict | None = None, latent_norm_eps: float = 1e-6,
                 softmax_scale: float | None = None, qkv_bias: bool = False, out_bias: bool = False):
        nn.Module.__init__(self)
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_heads
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.d_k, self.kv_lora_rank, self.max_seq_len = qk_nope_head_dim + qk_rope_head_dim, kv_lora_rank, max_seq_len
        self.q_proj = self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        if q_lora_rank is None:
            self.q_proj = Linear(d_model, num_heads * self.d_k, device=device, dtype=dtype)
        else:
            self.q_a_proj = Linear(d_model, q_lora_rank, device=device, dtype=dtype, bias=qkv_bias)
            self.q_a_norm = RMSNorm(q_lora_rank, latent_norm_eps, device=device, dtype=dtype)
            self.q_b_proj = Linear(q_lora_rank, num_heads * self.d_k, device=device, dtype=dtype)
        self.kv_a_proj = Linear(d_model, kv_lora_rank + qk_rope_head_dim, device=device, dtype=dtype, bias=qkv_bias)
        self.kv_a_norm = RMSNorm(kv_lora_rank, latent_norm_eps, device=device, dtype=dtype)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), device=device, dtype=dtype)
        self.output_proj = Linear(num_heads * v_head_dim, d_model, device=device, dtype=dtype, bias=out_bias)
        self.q_norm = self.k_norm = self.qk_norm = self.sinks = None
        self.softmax_scale, self.softcap, self.window = softmax_scale, None, None
        self.rope = RotaryPositionalEmbedding(theta, qk_rope_head_dim, max_seq_len, device=device, scaling=rope_scaling)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, documents: Documents | None = None) -> torch.Tensor:
        """``x[..., seq, d_model]`` -> ``[..., seq, d_model]`` (the parent's arguments)."""
        _check_last_dim(x, self.d_model, "MultiHeadLatentAttention")
        seq = x.shape[-2]
        past = kv_cache.length if kv_cache is not None else 0
        if past + seq > self.max_seq_len:
            raise ValueError(f"sequence length {past + seq} exceeds max_seq_len {self.max_seq_len}")
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = rearrange(q, "... seq (heads d_k) -> ... heads seq d_k", heads=self.num_heads)
        latent, k_rot = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        positions, trusted = self._positions(seq, past, token_positions, kv_cache, documents, x.device)
        # RoPE on the queries' last rope features and on the one shared rotary key ([..., 1, seq, rope])
        q_rot, k_rot = self.rotate_features(q[..., self.nope:], k_rot.unsqueeze(-3), positions, trusted)
        q = torch.cat((q[..., :self.nope], q_rot), dim=-1)
        latent = self.kv_a_norm(latent).unsqueeze(-3)  # [..., 1, seq, kv_lora]: what a cache keeps
        if isinstance(kv_cache, PagedLayerCache):
            out = self.attend_paged_latent(q, latent, k_rot, kv_cache)
        elif kv_cache is not None:
            out = self.attend(q, *self.expand(*kv_cache.update(latent, k_rot)))
        else:
            k, v = self.expand(latent, k_rot)
            out = self.attend(q, k, v) if documents is None else self.attend_documents(q, k, v, documents)
        return self.output_proj(rearrange(out, "... heads seq d_v -> ... seq (heads d_v)"))

    def expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's keys and values from the normed latents ``[..., 1, n, kv_lora]`` and rotated shared keys
        ``[..., 1, n, rope]``: ``k [..., heads, n, nope + rope]`` (its nope features, then the shared rotary ones),
        ``v [..., heads, n, v_head_dim]``."""
        kv = rearrange(self.kv_b_proj(latent.squeeze(-3)), "... n (heads d) -> ... heads n d", heads=self.num_heads)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat((k_nope, k_rot.expand(*k_nope.shape[:-1], self.rope_dim)), dim=-1), v

    def attend_paged_latent(self, q: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                            cache: PagedLayerCache) -> torch.Tensor:
        """A batch of sequences of different lengths against a paged latent cache: the new latents and rotary keys
        are written at each sequence's next positions, every sequence's are gathered (padded) and expanded, and
        query ``i`` of sequence ``b`` (position ``cache_seqlens[b] + i``) attends to the keys at or before it."""
        pool, index = cache.cache, cache.index
        pool.write(index, latent, k_rot)
        latents, rotary, lengths = pool.gather(index)
        k, v = self.expand(latents.to(q.dtype), rotary.to(q.dtype))
        return self.attend_padded(q, k, v, lengths, cache)

    def attend_padded(self, q, k, v, lengths, cache):
        """Causal attention of each sequence's queries (its last ``seq`` positions) over its first ``lengths[b]``
        keys of the padded ``k, v [batch, heads, max_keys, d]``."""
        query_pos = cache.positions(q.shape[-2])                            # [batch, seq]
        key_pos = torch.arange(k.shape[-2], device=q.device)
        visible = key_pos[None, None, :] <= query_pos[:, :, None]           # [batch, seq, keys]
        return F.scaled_dot_product_attention(q, k, v, visible[:, None], scale=self.softmax_scale)


# the assembly builds its components from this namespace for backend="reference"
register_components("reference", sys.modules[__name__])


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next's ``linear_attention`` layers), the readable spec.

    ``x [batch, seq, d_model]``: ``in_proj_qkv`` gives the q, k, v features (``[2·H·d_k + HV·d_v]``, q's heads then
    k's then v's), which a depthwise causal conv (``conv1d_weight [channels, 1, W]``, no bias) and SiLU mix over the
    last ``W`` positions; then per value head the gated delta rule (:func:`functional.gated_delta_rule`, q and k
    L2-normalised, scale ``d_k^-1/2``) with ``beta = sigmoid(in_proj_b x)`` and the log decay ``g = -exp(A_log) ·
    softplus(in_proj_a x + dt_bias)``; the output per head through a gated RMSNorm (``norm``, gate ``in_proj_z x``)
    and ``out_proj``. Value head ``j`` reads q/k head ``j // (HV / H)``.

    Packed ``documents`` restart the conv and the state per document; a :class:`RecurrentCache` (or a paged cache's
    layer) carries the conv's last ``W - 1`` inputs and the state ``[batch, HV, d_k, d_v]`` (fp32) between calls:
    fixed size whatever the length.
    """

    rope = None  # (no positions: the model's RoPE sharing skips this layer)

    def __init__(self, d_model: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int = 4, norm_eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.d_model, self.num_k_heads, self.num_v_heads = d_model, num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_kernel = head_k_dim, head_v_dim, conv_kernel
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = Linear(d_model, self.conv_dim, device=device, dtype=dtype)
        self.in_proj_z = Linear(d_model, self.value_dim, device=device, dtype=dtype)
        self.in_proj_b = Linear(d_model, num_v_heads, device=device, dtype=dtype)
        self.in_proj_a = Linear(d_model, num_v_heads, device=device, dtype=dtype)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel, device=device, dtype=dtype))
        nn.init.uniform_(self.conv1d_weight, -conv_kernel ** -0.5, conv_kernel ** -0.5)  # (nn.Conv1d's init)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, device=device, dtype=dtype))
        # log of a per-head decay rate in [1, 16] (transformers' init draws it from [0.01, 16])
        self.A_log = nn.Parameter(torch.empty(num_v_heads, device=device, dtype=dtype).uniform_(1, 16).log_())
        self.norm = RMSNormGated(head_v_dim, norm_eps, device=device, dtype=dtype)
        self.out_proj = Linear(self.value_dim, d_model, device=device, dtype=dtype)

    # ---- the pieces both backends share
    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta)`` ``[batch, seq, HV]``: the log decay (fp32, as transformers computes it) and the rate."""
        beta = torch.sigmoid(self.in_proj_b(x))
        work = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(work).exp() * F.softplus(self.in_proj_a(x).to(work) + self.dt_bias)
        return g, beta

    def split_heads(self, mixed: torch.Tensor):
        """The conv's output ``[batch, seq, channels]`` as ``q, k [batch, seq, H, d_k]``, ``v [batch, seq, HV, d_v]``."""
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (rearrange(q, "... (heads d) -> ... heads d", d=self.head_k_dim),
                rearrange(k, "... (heads d) -> ... heads d", d=self.head_k_dim),
                rearrange(v, "... (heads d) -> ... heads d", d=self.head_v_dim))

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The delta rule's output ``[batch, seq, HV, d_v]`` through the gated norm and the output projection."""
        z = rearrange(self.in_proj_z(x), "... (heads d) -> ... heads d", d=self.head_v_dim)
        return self.out_proj(rearrange(self.norm(o, z), "... heads d -> ... (heads d)"))

    @staticmethod
    def cache_states(kv_cache, batch: int):
        """``(conv_state, state)`` of the layer's cache for this call (None: a new sequence)."""
        if isinstance(kv_cache, PagedLayerCache):
            return kv_cache.cache.recurrent_states(kv_cache.index)
        return kv_cache.conv_state, kv_cache.state

    @staticmethod
    def store_states(kv_cache, conv_state: torch.Tensor, state: torch.Tensor, seq: int) -> None:
        if isinstance(kv_cache, PagedLayerCache):
            kv_cache.cache.store_recurrent(kv_cache.index, conv_state, state)
        else:
            kv_cache.conv_state, kv_cache.state = conv_state, state
            kv_cache.length += seq

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, kv_cache=None,
                documents: Documents | None = None) -> torch.Tensor:
        """``x [batch, seq, d_model] -> [batch, seq, d_model]`` (positions play no part)."""
        _check_last_dim(x, self.d_model, "GatedDeltaNet")
        squeeze = x.dim() == 2
        if squeeze:
            x = x.unsqueeze(0)
        batch, seq, _ = x.shape
        mixed = self.in_proj_qkv(x).transpose(-1, -2)                      # [batch, channels, seq]
        weight = self.conv1d_weight.squeeze(1)
        g, beta = self.gates(x)
        if kv_cache is not None:
            conv_state, state = self.cache_states(kv_cache, batch)
            if conv_state is None:
                conv_state = mixed.new_zeros(batch, self.conv_dim, self.conv_kernel - 1)
            joined = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1)
            conv = F.causal_conv1d(joined, weight, None, "silu")[..., -seq:]
            q, k, v = self.split_heads(conv.transpose(-1, -2))
            o, state = F.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
            self.store_states(kv_cache, joined[..., -(self.conv_kernel - 1):], state, seq)
        elif documents is not None:  # each document alone: its own zero history for the conv and the state
            bounds = documents.cu_seqlens.tolist()
            flat = mixed.transpose(0, 1).reshape(self.conv_dim, batch * seq)
            conv = torch.cat([F.causal_conv1d(flat[None, :, a:b], weight, None, "silu")[0]
                              for a, b in zip(bounds[:-1], bounds[1:])], dim=-1)
            q, k, v = self.split_heads(conv.T[None])
            o, _ = F.gated_delta_rule(q, k, v, g.reshape(1, batch * seq, -1), beta.reshape(1, batch * seq, -1),
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=documents.cu_seqlens)
            o = o.reshape(batch, seq, *o.shape[2:])
        else:
            q, k, v = self.split_heads(F.causal_conv1d(mixed, weight, None, "silu").transpose(-1, -2))
            o, _ = F.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        out = self.finish(o, x)
        return out[0] if squeeze else out

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, heads={self.num_k_heads}/{self.num_v_heads}, "
                f"head_dims={self.head_k_dim}/{self.head_v_dim}, conv_kernel={self.conv_kernel}")
