"""Attention launch: tile tables, the launchers of the forward and backward kernels, the custom ops
(opaque to ``torch.compile``) and the autograd Function.

Tile sizes and warps (:func:`_fwd_config`, :func:`_bwd_config` for dK/dV, :func:`_bwd_dq_config` for dQ) are a table
by head dim and dtype, adjusted per kernel variant (:data:`VARIANTS`), chosen so the sm_90/sm_80 builds use tensor
cores without spilling (``tritonlm kernels --report`` prints the evidence); causal query tiles are scheduled
longest-first (the last query tiles see the most keys) so the tail of the grid is short tiles. A tuned table measured
on a GPU (``kernels/tuned``) may replace them per GPU, dtype, head dim and variant (:func:`config_key`). Few queries
against a long cache go to :mod:`.decode`. On sm_90 the 16-bit dense forward at d 128 loads K / V through TMA
descriptors made on the host (:func:`_tma_selected`); the TMA backward kernels run only when a tuned table asks for
them.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import tuned
from .._common import (
    MAX_GRID_AXIS1,
    check_device,
    check_float,
    first_order_backward,
    gpu_capability,
    grid_axis1_launches,
    next_pow2,
    on_gpu,
    use_custom_op,
)
from .._ranges import kernel_range
from . import decode
from .backward import (
    _bwd_dkdv_kernel,
    _bwd_dkdv_kernel_tma,
    _bwd_dq_kernel,
    _bwd_dq_kernel_tma,
    _bwd_preprocess,
)
from .forward import _fwd_kernel, _fwd_kernel_tma
from .layout import _as_4d, _block_d, _dot_precision, _empty_4d_like, _has_window, _strides3, _window
from .tiles import LOG2E


def score_scales(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """``(qk_scale, softcap)`` kernel arguments (:func:`.tiles._scores`): without a cap the scale in log2 units;
    with a cap ``c`` the tanh's input scale ``softmax_scale / c`` and the cap in log2 units ``c · log2(e)``."""
    if softcap:
        return softmax_scale / softcap, softcap * LOG2E
    return softmax_scale * LOG2E, 1.0

# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward; sm_90 takes 128-key tiles at d 128 (_fwd_config)
FWD_CONFIGS = {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3),
               256: (64, 32, 8, 2)}
#: fp32 under torch's "highest" matmul precision (IEEE dots, FMA units): measured spill-free at d <= 64 with
#: 64x16 tiles (sm_90 222 registers, sm_80 128). At d 128 every tile tried spills on sm_90 (16x32: 184 B, the
#: least; 32x32: 408 B; 64x32: 7 KB) and none on sm_80 -- "high" (TF32) is the fast fp32 setting there.
IEEE_FWD_CONFIGS = {16: (64, 16, 4, 2), 32: (64, 16, 4, 2), 64: (64, 16, 4, 2), 128: (16, 32, 4, 2)}
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) shipped for both backward kernels (each a tunable of its own: the
#: dK/dV kernel holds K, V, dK, dV for BLOCK_N keys, the dQ kernel Q, dO, dQ for BLOCK_M queries).
#: Evidence (profiles/sass/REPORT.md, bf16, seq 4096, sm_90 (HGMMA) / sm_80 (HMMA)): d 64 -> fwd 255 / 255,
#: dK/dV 225 / 181, dQ 166 / 124 (sm_80 with 32-row tiles), no spills; d 128 with 8 warps -> fwd 255 (128-key tiles) / 223 (32-bit
#: K / V row offsets; 197 / 218 with 64-bit ones),
#: dK/dV 243 / 244, dQ 174 / 173, no spills. d 256: 64-row wgmma tiles spill heavily in the backward (hundreds of LDL/STL), so it keeps
#: 32-row tiles, spill-free, on mma (HMMA) even on sm_90.
BWD_CONFIGS = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 8, 2),
               256: (32, 32, 8, 1)}
#: Ampere (sm_80) overrides: at d 64 the 64x64 backward tiles need all 255 registers and spill a little
#: there (16-40 bytes of stack); 32-query tiles are spill-free (sm_90 keeps 64 rows for wgmma).
BWD_CONFIGS_SM80 = {64: (32, 64, 4, 2)}
#: MLA (V's head dim apart from Q/K's: DeepSeek-V3's d_qk 192 = 128 + 64 rotary, padded to 256, d_v 128), keyed by
#: the padded (d_qk, d_v): see the SASS report's attention.mla_* rows for the evidence.
MLA_FWD_CONFIGS = {(256, 128): (128, 64, 8, 2)}
MLA_BWD_CONFIGS = {(256, 128): (64, 32, 8, 2)}
#: The interpreter runs whole tiles as numpy ops: larger tiles are fewer, faster steps.
INTERPRETER_CONFIG = (32, 32, 4, 1)
#: GQA packing (few queries): at most this many rows (group x queries) in the one query tile of a kv head's group.
PACK_GQA_MAX_ROWS = 64


_CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
#: the kernel variants a tuned key names, in key order: each compiles to a different kernel (other constexprs,
#: other registers), so a tile shape measured on one says nothing about another
VARIANTS = ("gqa", "varlen", "window", "softcap", "atomic", "decode")


def config_key(d: int, dtype: torch.dtype, variant: tuple[str, ...] = (), d_v: int | None = None) -> str:
    """The tuned-table key of a launch: ``"bf16-d128"`` for the plain kernel, ``"bf16-d128-gqa-window"`` for a
    variant (its names in :data:`VARIANTS` order), ``"bf16-d256v128"`` when V's padded head dim differs from Q/K's
    (MLA). The sweep times and keys every variant separately."""
    unknown = set(variant) - set(VARIANTS)
    if unknown:
        raise ValueError(f"attention config key: unknown variant(s) {sorted(unknown)} (known: {VARIANTS})")
    dims = f"d{_block_d(d)}" + (f"v{_block_d(d_v)}" if d_v is not None and _block_d(d_v) != _block_d(d) else "")
    return "-".join((tuned.dtype_name(dtype), dims, *(v for v in VARIANTS if v in variant)))


def parse_key(key: str) -> tuple[int, tuple[str, ...], int]:
    """``(padded head dim, variant, padded value head dim)`` of a :func:`config_key` (the sweep's view of a key)."""
    parts = key.split("-")
    d, _, d_v = parts[1][1:].partition("v")
    return int(d), tuple(parts[2:]), int(d_v or d)


def _variant(gqa: bool = False, varlen: bool = False, window: bool = False, softcap: bool = False,
             atomic: bool = False, decode: bool = False) -> tuple[str, ...]:
    flags = dict(gqa=gqa, varlen=varlen, window=window, softcap=softcap, atomic=atomic, decode=decode)
    return tuple(name for name in VARIANTS if flags[name])


def _tuned(kernel: str, d: int, dtype: torch.dtype, device: torch.device, shipped: tuple,
           variant: tuple[str, ...] = (), d_v: int | None = None) -> tuple[int, int, int, int]:
    """The shipped ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, unless a tuned table (``kernels/tuned``, from a
    GPU run of the suite's sweep) or a sweep override has an entry for this GPU, dtype, head dims and variant."""
    cfg = tuned.choose(kernel, config_key(d, dtype, variant, d_v), device, dict(zip(_CONFIG_FIELDS, shipped)))
    return tuple(cfg[f] for f in _CONFIG_FIELDS)


def _fold_scale(d: int, dtype: torch.dtype, device: torch.device, variant: tuple[str, ...] = (),
                d_v: int | None = None) -> bool:
    """Whether the forward applies the softmax scale in the exponent's FMA (``FOLD_SCALE``): shipped on, as the
    SASS report shows fewer FP instructions with no spills or occupancy change (sm_90 bf16 d 128: FMUL + FADD
    506 -> 414 static, FFMA 60 -> 92, 195 -> 197 registers); a tuned entry ``"FOLD_SCALE": 0`` turns it off."""
    key = config_key(d, dtype, variant, d_v)
    return bool(tuned.choose("attention_fwd", key, device, {"FOLD_SCALE": 1})["FOLD_SCALE"])


def _tma_selected(d: int, dtype: torch.dtype, device: torch.device, kernel: str = "attention_fwd",
                  variant: tuple[str, ...] = ()) -> bool:
    """Whether ``kernel`` runs its TMA variant here: by default the forward on sm_90 for 16-bit inputs at d 128
    (:func:`_tma_default`), otherwise when a tuned table (or the sweep) asks for it (``"TMA": 0`` turns the default
    off). Hopper (sm_90+) or the interpreter (which emulates descriptors) only."""
    default = int(kernel == "attention_fwd" and _tma_default(d, dtype, device))
    chosen = tuned.choose(kernel, config_key(d, dtype, variant), device, {"TMA": default})["TMA"]
    # cuda: the device's capability; meta (the SASS report): the assumed target; cpu: the interpreter
    hopper = device.type == "cpu" or gpu_capability(device) >= 90
    return bool(chosen) and hopper


def _tma_default(d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """The forward's shipped choice: TMA descriptor loads on sm_90 for fp16 / bf16 at d 128, where the SASS wins
    with both the local compiler and the GPU machine's (sm_90 bf16, main-loop instructions per key against the
    cp.async kernel: Triton 3.9 4.03 vs 4.43, 219 vs 255 registers; Triton 3.6 3.85 vs 4.18, 247 registers
    spill-free vs 255 with 24 B of spills). At d 64 they tie (3.71 vs 3.72 with 3.9, 3.61 vs 3.56 with 3.6): the
    cp.async kernel stays. Only the dense forward has a TMA form (no window, softcap, packing or cache)."""
    return (on_gpu(device) and gpu_capability(device) == 90 and dtype in (torch.float16, torch.bfloat16)
            and _block_d(d) == 128)


def _tma_ready(*views: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned base addresses and strides (the last stride 1)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1
               and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]) for t in views)


def _descriptor(t4: torch.Tensor, rows: int, block_d: int) -> TensorDescriptor:
    """A host-made TMA descriptor over a ``[batch, heads, rows, d]`` tensor whose box is one ``[rows, block_d]`` tile
    of one (batch, head): the kernels receive it as an argument, so they neither build descriptors nor need the
    global scratch memory in-kernel construction takes."""
    return TensorDescriptor(t4, list(t4.shape), list(t4.stride()), [1, 1, rows, block_d])


def _fwd_config(d: int, dtype: torch.dtype, device: torch.device,
                variant: tuple[str, ...] = (), d_v: int | None = None) -> tuple[int, int, int, int]:
    """Forward tiles of a variant (:data:`VARIANTS`): the shipped table with its per-variant adjustments, then a
    tuned entry for exactly this key, which replaces them. ``d_v``: V's head dim where it differs (MLA)."""
    if not on_gpu(device):
        return _tuned("attention_fwd", d, dtype, device, INTERPRETER_CONFIG, variant, d_v)
    mla = _mla_dims(d, d_v)
    block_m, block_n, warps, stages = MLA_FWD_CONFIGS.get(mla, FWD_CONFIGS[_block_d(d)])
    if dtype == torch.float32:
        if _dot_precision(dtype)["DOT_PRECISION"] == "ieee":
            # IEEE fp32 dots run on FMA units, not tensor cores: smaller tiles (SASS report rows)
            return _tuned("attention_fwd", d, dtype, device, IEEE_FWD_CONFIGS.get(_block_d(d), (16, 32, 4, 2)),
                          variant, d_v)
        block_n = max(16, block_n // 2)
    if (gpu_capability(device) >= 90 and _block_d(d) == 128 and not mla and "window" not in variant
            and dtype != torch.float32):
        # Hopper, 16-bit, d 128: 128-key tiles halve the per-key share of the accumulator's rescale and the K / V
        # address arithmetic (SASS report, sm_90 bf16: 5.86 -> 4.43 instructions per key in the main loop, 255
        # registers, spill-free, 1 CTA per SM as with 64-key tiles; plain, GQA, packed and softcapped forwards).
        # Not with a window (88 B of spills), not on sm_80 (24 B): 64-key tiles there
        block_n, stages = 128, 2
    if gpu_capability(device) >= 90 and _block_d(d) == 64 and not mla and dtype != torch.float32:
        # Hopper, 16-bit, d 64: 8 warps on 128 x 128 tiles (16 query rows per warp, not 32): sm_90 bf16 main loop
        # 8.27 -> 3.72 instructions per key (one warp's) and 33.1 -> 29.8 summed over the warps, 248 registers,
        # spill-free, 8 warps per SM as before (one CTA, not two of 4 warps); the window forward too (it spilled
        # 56 B with 4 warps x 64 keys), GQA, packed, softcap and sinks spill-free (Triton 3.9 and 3.6 alike)
        block_n, warps, stages = 128, 8, 2
    if ("varlen" in variant or "window" in variant) and gpu_capability(device) < 90 and d > 64:
        # sm_80 at d 128: the packed / windowed forward's extra range bookkeeping spills with 64-key tiles
        # (40 / 16 bytes in the SASS report); 32-key tiles are spill-free
        block_n = min(block_n, 32)
    return _tuned("attention_fwd", d, dtype, device, (block_m, block_n, warps, stages), variant, d_v)


def _needs_64bit_rows(*views: torch.Tensor) -> bool:
    """Whether a key / value row offset (row x row stride, within the rows of one ``[batch, heads, rows, d]`` view:
    a sequence, a packed batch or a paged pool) might not fit in a signed 32-bit int; then the forward computes them
    in 64 bits (``OFFS_64``)."""
    return any((t.shape[2] + 1) * abs(t.stride(2)) + t.shape[3] >= 2**31 for t in views)


def _mla_dims(d: int, d_v: int | None) -> tuple[int, int] | None:
    """``(padded d_qk, padded d_v)`` when V's padded head dim differs from Q/K's (MLA's own tile tables), else None."""
    if d_v is None or _block_d(d_v) == _block_d(d):
        return None
    return _block_d(d), _block_d(d_v)


def _bwd_shipped(d: int, dtype: torch.dtype, device: torch.device,
                 d_v: int | None = None) -> tuple[int, int, int, int]:
    table = BWD_CONFIGS_SM80 if gpu_capability(device) < 90 else {}
    mla = _mla_dims(d, d_v)
    if mla:
        block_m, block_n, warps, stages = MLA_BWD_CONFIGS.get(mla, BWD_CONFIGS[mla[0]])
    else:
        block_m, block_n, warps, stages = table.get(_block_d(d), BWD_CONFIGS[_block_d(d)])
    if dtype == torch.float32:
        block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
    return block_m, block_n, warps, stages


def _bwd_config(d: int, dtype: torch.dtype, device: torch.device,
                variant: tuple[str, ...] = (), d_v: int | None = None) -> tuple[int, int, int, int]:
    """Tiles of the dK/dV kernel (``BLOCK_N`` keys held, ``BLOCK_M`` queries a step) for a variant; ``"atomic"``
    is the 5-matmul backward, whose dK/dV kernel also adds dS K into the fp32 dQ buffer."""
    if not on_gpu(device):
        return _tuned("attention_bwd", d, dtype, device, INTERPRETER_CONFIG, variant, d_v)
    block_m, block_n, warps, stages = _bwd_shipped(d, dtype, device, d_v)
    if "atomic" in variant and _block_d(d) >= 128:
        # the atomic variant holds a dQ tile besides dK/dV: 64-query tiles at 8 warps spill at d 128 (80 B on
        # sm_90); 32-query tiles do not (but run on mma, not wgmma: the sweep's 64-row candidates are the
        # alternative, SASS report rows attention.bwd_dkdv_atomic_dq*)
        block_m = min(block_m, 32)
    if "softcap" in variant and _block_d(d) >= 128 and gpu_capability(device) >= 90:
        # the softcap's tanh tile on top of 64-query tiles spills on sm_90 at d 128 (64 B, 255 registers);
        # 32-query tiles in the dK/dV kernel are spill-free on wgmma (203 registers; SASS report softcap rows)
        block_m = min(block_m, 32)
    return _tuned("attention_bwd", d, dtype, device, (block_m, block_n, warps, stages), variant, d_v)


def _bwd_dq_config(d: int, dtype: torch.dtype, device: torch.device,
                   variant: tuple[str, ...] = (), d_v: int | None = None) -> tuple[int, int, int, int]:
    """Tiles of the dQ kernel (``BLOCK_M`` queries held, ``BLOCK_N`` keys a step), tuned apart from the dK/dV
    kernel's: it holds Q, dO and dQ, not K, V, dK and dV, so its best shape differs."""
    if not on_gpu(device):
        return _tuned("attention_bwd_dq", d, dtype, device, INTERPRETER_CONFIG, variant, d_v)
    return _tuned("attention_bwd_dq", d, dtype, device, _bwd_shipped(d, dtype, device, d_v), variant, d_v)


def flash_attention_forward(q, k, v, is_causal: bool, softmax_scale: float, window=(-1, -1),
                            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0, *,
                            seqused_k=None, kv_batch=None, block_table=None, page_size: int = 0,
                            num_splits: int = 0, softcap: float = 0.0, leftpad=None, sinks=None):
    """Returns ``(o, lse)``: ``o`` like ``q``; ``lse`` fp32 ``q.shape[:-1]`` for batches, ``[heads, total_q]``
    for packed sequences (``cu_seqlens_*`` given, ``q[total_q, heads, d]``).

    KV caches (:func:`.kvcache.flash_attn_with_kvcache`): ``seqused_k`` (int32 ``[batch]``) gives each sequence's
    key count and ``max_seqlen_k`` the capacity; the keys of sequence b are row ``kv_batch[b]`` of ``k[rows, kv_heads,
    positions, d]`` (dense), or with ``block_table`` the rows of ``k[1, kv_heads, pool_rows, d]`` its table lists,
    ``page_size`` per block. ``num_splits``: 0 chooses, 1 none, more splits the keys over that many programs.
    ``softcap > 0`` caps the scaled scores at ``softcap · tanh(s / softcap)`` (flash-attn's softcap). ``leftpad``
    (int32 ``[batch]``, dense caches): sequence b's keys are cache positions ``[leftpad[b], seqused_k[b])``.
    ``sinks`` (``[heads]``, fp32): each head's attention-sink logit joins every row's softmax without a value
    (gpt-oss); ``lse`` then includes it."""
    if not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        # (the kernels take the row max of the raw products before scaling: valid for a positive scale only)
        raise ValueError(f"attention: softmax_scale must be a finite number > 0, got {softmax_scale}")
    packed = cu_seqlens_q is not None
    cache = seqused_k is not None
    paged = block_table is not None
    q4, k4, v4 = (_as_4d(t, packed) for t in (q, k, v))
    b, h, n_q, d = q4.shape
    d_v = v4.shape[-1]  # (MLA: V's own head dim; the output has it)
    n_k, group = (max_seqlen_k if cache else k4.shape[2]), h // k4.shape[1]
    o, o4 = _empty_4d_like(q, packed, last=d_v)
    if packed:
        b, n_q, n_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse = torch.empty(h, q.shape[0], dtype=torch.float32, device=q.device)
        lse_strides = (0, lse.stride(0))
    else:
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        lse_strides = (h * n_q, n_q)
    if q.numel() == 0 or b == 0:
        return o, lse
    if sinks is not None:
        sinks = sinks.float().contiguous()
    if n_k == 0 or k.numel() == 0:
        o.zero_()  # (no key: the output is 0; the normalizer is the sink's alone where there is one)
        if sinks is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(sinks.view(h, 1).expand(lse.shape))  # (lse: [..., heads, rows]; packed [heads, total])
        return o, lse
    win_left, win_right = _window(is_causal, window, n_q, n_k)
    cu_q = cu_seqlens_q if packed else lse  # (unused pointers for batches / dense caches)
    cu_k = cu_seqlens_k if packed else (leftpad if leftpad is not None else lse)
    common = dict(CAUSAL=is_causal, WINDOW=_has_window(is_causal, window), VARLEN=packed, BLOCK_D=_block_d(d),
                  EVEN_D=d == _block_d(d), BLOCK_DV=_block_d(d_v), EVEN_DV=d_v == _block_d(d_v),
                  # (32-bit row offsets for 16-bit tiles only: fp32 IEEE tiles spilled more with them, sm_90 d 128)
                  OFFS_64=q.dtype == torch.float32 or _needs_64bit_rows(k4, v4), SEQUSED_K=cache, PAGED=paged, SOFTCAP=bool(softcap),
                  LEFTPAD=leftpad is not None, HAS_SINKS=sinks is not None, **_dot_precision(q.dtype))
    # GQA with few queries (decoding): one program per (batch, kv head) holds its whole group's queries in one
    # tile, so each K/V tile is read once per group instead of once per query head
    pack = not packed and group > 1 and n_q <= decode.DECODE_MAX_QUERIES and group * n_q <= PACK_GQA_MAX_ROWS
    grid_heads = h // group if pack else h
    common["PACK_GQA"] = pack
    qk_scale, cap = score_scales(softmax_scale, softcap)
    cache_args = (block_table.stride(0) if paged else 0, page_size, cap)
    args = lambda o_arg, lse_arg, o_strides, l_strides: (  # noqa: E731
        q4, k4, v4, o_arg, lse_arg, cu_q, cu_k, seqused_k if cache else lse,
        kv_batch if kv_batch is not None else lse, block_table if paged else lse,
        sinks if sinks is not None else lse, *_strides3(q4, packed),
        *_strides3(k4, packed), *_strides3(v4, packed), *o_strides, *l_strides)
    # a paged tile must not cross a block: key tiles of at most page_size rows (both powers of two x 16)
    max_block_n = (page_size & -page_size) if paged else None
    # the tuned-table key names the variant this launch compiles to (config_key)
    variant = _variant(gqa=group > 1, varlen=packed, window=common["WINDOW"], softcap=bool(softcap))
    common["FOLD_SCALE"] = not softcap and _fold_scale(d, q.dtype, q.device, variant, d_v)
    few_queries = not (num_splits == 1 or packed or n_q > decode.DECODE_MAX_QUERIES)
    # (the split kernel's tiles, looked up only where a split is possible: its own "-decode" key)
    split_config = _tuned("attention_fwd", d, q.dtype, q.device, decode.DECODE_CONFIG if on_gpu(q.device)
                          else decode.DECODE_INTERPRETER_CONFIG, variant + ("decode",), d_v) if few_queries else None
    if not few_queries:
        splits = 1
    elif num_splits > 1:
        splits = min(num_splits, triton.cdiv(n_k, 16))
    else:
        splits = decode._decode_splits(b * grid_heads, n_q, n_k, split_config[1], q.device)
    if splits > 1:
        # ---- flash-decoding: keys split over programs, partials combined by their logsumexps
        decode.split_kv_forward(args, o4, lse, lse_strides, splits, grid_heads, group, n_q, n_k, d, qk_scale, win_left,
                                win_right, common, q.device, cache_args, max_block_n, split_config, sinks)
        return o, lse
    block_m, block_n, warps, stages = _fwd_config(d, q.dtype, q.device, variant, d_v)
    if paged:
        block_n = min(block_n, max_block_n)
    if (not packed and not cache and not pack and not common["WINDOW"] and not softcap
            and d_v == d and _tma_selected(d, q.dtype, q.device, "attention_fwd", variant)
            and b * h <= MAX_GRID_AXIS1 and _tma_ready(q4, k4, v4, o4)):
        # ---- Hopper TMA variant (sm_90's 16-bit d 128 default, or a tuned table's choice): dense attention (GQA
        # and sinks included), descriptor loads; descriptors index whole tensors, so it runs as one launch (more
        # batch x heads, or views TMA cannot address, take the cp.async kernel below: the same results)
        bd = _block_d(d)
        _fwd_kernel_tma[(triton.cdiv(n_q, block_m), b * h)](
            _descriptor(q4, block_m, bd), _descriptor(k4, block_n, bd), _descriptor(v4, block_n, bd),
            _descriptor(o4, block_m, bd), lse, sinks if sinks is not None else lse, *lse_strides, h, group, n_q, n_k,
            softmax_scale * LOG2E, CAUSAL=is_causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=bd,
            FOLD_SCALE=common["FOLD_SCALE"], HAS_SINKS=sinks is not None, num_warps=warps, num_stages=stages,
            **_dot_precision(q.dtype))
        return o, lse
    tile_rows = group * n_q if pack else n_q
    if tile_rows < block_m or pack:  # few queries (decoding against a short cache): a smaller query tile wastes
        block_m = max(16, next_pow2(tile_rows))  # less; a packed group is always one tile
    for bh_start, n_bh in grid_axis1_launches(b * grid_heads):
        _fwd_kernel[(triton.cdiv(tile_rows, block_m), n_bh)](
            *args(o4, lse, _strides3(o4, packed), lse_strides), grid_heads, group, bh_start, n_q, n_k, d,
            d_v, qk_scale, win_left, win_right, 0, *cache_args, SPLIT_KV=False, BLOCK_M=block_m,
            BLOCK_N=block_n,
            **common, num_warps=warps, num_stages=stages)
    return o, lse


def flash_attention_backward(do, q, k, v, o, lse, is_causal: bool, softmax_scale: float, window=(-1, -1),
                             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                             deterministic: bool = True, softcap: float = 0.0, sinks=None):
    """Returns ``(dq, dk, dv, dsinks)`` laid out like q, k, v (and the sinks; None without them).
    ``deterministic=False`` accumulates dQ with fp32 atomics inside the dK/dV kernel instead of running the dQ
    kernel (fewer matmuls; summation order varies by run). ``softcap``: the forward's logit cap (the gradient goes
    through ``1 - tanh²``). ``sinks``: the forward's sink logits. The kernels need nothing for them (``lse`` holds
    each row's sink, so P is right); their gradient is a per-head sum over rows, ``dsink = -Σ_rows exp(sink - L) ·
    D`` with ``D = rowsum(dO · O)`` (the sink's probability times the gradient of a logit that carries no value),
    summed in a fixed order."""
    packed = cu_seqlens_q is not None
    q4, k4, v4, o4, do4 = (_as_4d(t, packed) for t in (q, k, v, o, do))
    b, h, n_q, d = q4.shape
    d_v = v4.shape[-1]  # (MLA: V's, dO's and dV's own head dim)
    n_k, h_kv = k4.shape[2], k4.shape[1]
    group = h // h_kv
    dq, dq4 = _empty_4d_like(q, packed)
    dk, dk4 = _empty_4d_like(k, packed)
    dv, dv4 = _empty_4d_like(v, packed)
    if packed:
        b, n_q, n_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse_strides = (0, lse.stride(0))
    else:
        lse_strides = (h * n_q, n_q)
    if q.numel() == 0 or k.numel() == 0 or b == 0 or n_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None if sinks is None else torch.zeros_like(sinks)
    if packed:
        dk.zero_()  # keys of empty or unseen packed sequences get no program that writes them
        dv.zero_()
    win_left, win_right = _window(is_causal, window, n_q, n_k)
    cu_q = cu_seqlens_q if packed else lse
    cu_k = cu_seqlens_k if packed else lse
    block_d = _block_d(d)
    delta = torch.empty_like(lse)
    pre_m = 64
    window_on = _has_window(is_causal, window)
    # the dK/dV and dQ kernels have tile shapes of their own, each keyed by the variant it compiles to
    variant = _variant(gqa=group > 1, varlen=packed, window=window_on, softcap=bool(softcap))
    dkdv_variant = variant + (() if deterministic else ("atomic",))
    block_m, block_n, warps, stages = _bwd_config(d, q.dtype, q.device, dkdv_variant, d_v)
    dq_m, dq_n, dq_warps, dq_stages = _bwd_dq_config(d, q.dtype, q.device, variant, d_v)
    common = dict(BLOCK_D=block_d, BLOCK_DV=_block_d(d_v), EVEN_DV=d_v == _block_d(d_v), VARLEN=packed, CAUSAL=is_causal, WINDOW=window_on, SOFTCAP=bool(softcap),
                  **_dot_precision(q.dtype))
    dkdv_tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common)
    dq_tiles = dict(BLOCK_M=dq_m, BLOCK_N=dq_n, num_warps=dq_warps, num_stages=dq_stages, **common)
    qk_scale, cap = score_scales(softmax_scale, softcap)
    q_s, k_s, v_s, do_s = (_strides3(t, packed) for t in (q4, k4, v4, do4))
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _bwd_preprocess[(triton.cdiv(n_q, pre_m), n_bh)](
            o4, do4, delta, cu_q, cu_k, *_strides3(o4, packed), *do_s, *lse_strides, h, bh_start, n_q, d_v,
            VARLEN=packed, BLOCK_M=pre_m, BLOCK_D=_block_d(d_v))
    dsinks = None
    if sinks is not None:  # lse, delta: [..., heads, rows] (packed: [heads, total])
        weight = torch.exp(sinks.float().view(h, 1) - lse) * delta
        dsinks = -weight.reshape(-1, h, weight.shape[-1]).sum(dim=(0, 2)).to(sinks.dtype)
    if (deterministic and not packed and not window_on and not softcap and d_v == d
            and _tma_selected(d, q.dtype, q.device, "attention_bwd", variant)
            and b * max(h, h_kv) <= MAX_GRID_AXIS1 and _tma_ready(q4, k4, v4, do4, dq4, dk4, dv4)):
        # ---- Hopper TMA variant (chosen only by a tuned table / the sweep): descriptor loads, same math
        tma = dict(CAUSAL=is_causal, BLOCK_D=block_d, **_dot_precision(q.dtype))  # (the TMA kernels never cap)
        _bwd_dkdv_kernel_tma[(triton.cdiv(n_k, block_n), b * h_kv)](
            _descriptor(q4, block_m, block_d), _descriptor(k4, block_n, block_d), _descriptor(v4, block_n, block_d),
            _descriptor(do4, block_m, block_d), lse, delta, _descriptor(dk4, block_n, block_d),
            _descriptor(dv4, block_n, block_d), *lse_strides, h_kv, group, n_q, n_k, qk_scale, softmax_scale,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **tma)
        _bwd_dq_kernel_tma[(triton.cdiv(n_q, dq_m), b * h)](
            _descriptor(q4, dq_m, block_d), _descriptor(k4, dq_n, block_d), _descriptor(v4, dq_n, block_d),
            _descriptor(do4, dq_m, block_d), lse, delta, _descriptor(dq4, dq_m, block_d), *lse_strides, h, group,
            n_q, n_k, qk_scale, softmax_scale, BLOCK_M=dq_m, BLOCK_N=dq_n, num_warps=dq_warps,
            num_stages=dq_stages, **tma)
        return dq, dk, dv, dsinks
    # dK/dV: one program per (key tile, batch, kv head), summing its group of query heads (needs every D above);
    # non-deterministic variant: an fp32 dQ buffer laid out [b, h, rows, d] like q4 that the dK/dV kernel adds into
    dq_acc = torch.zeros(q4.shape, dtype=torch.float32, device=q.device) if not deterministic else dq4
    for bh_start, n_bh in grid_axis1_launches(b * h_kv):
        _bwd_dkdv_kernel[(triton.cdiv(n_k, block_n), n_bh)](
            q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc, cu_q, cu_k, *q_s, *k_s, *v_s, *do_s,
            *_strides3(dk4, packed), *_strides3(dv4, packed), *lse_strides, *_strides3(dq_acc, packed),
            h_kv, group, bh_start, n_q, n_k, d, d_v, qk_scale, softmax_scale, win_left, win_right, cap, GQA=group > 1,
            ATOMIC_DQ=not deterministic, EVEN_D=d == block_d, **dkdv_tiles)
    if not deterministic:
        dq4.copy_(dq_acc.mul_(softmax_scale))
        return dq, dk, dv, dsinks
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _bwd_dq_kernel[(triton.cdiv(n_q, dq_m), n_bh)](
            q4, k4, v4, do4, lse, delta, dq4, cu_q, cu_k, *q_s, *k_s, *v_s, *do_s, *_strides3(dq4, packed),
            *lse_strides, h, group, bh_start, n_q, n_k, d, d_v, qk_scale, softmax_scale, win_left, win_right, cap,
            EVEN_D=d == block_d, **dq_tiles)
    return dq, dk, dv, dsinks


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::flash_attention_fwd", mutates_args=())
def _fa_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, softmax_scale: float,
               window_left: int, window_right: int, cu_seqlens_q: torch.Tensor | None,
               cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_forward(q, k, v, is_causal, softmax_scale, (window_left, window_right), cu_seqlens_q,
                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, softcap=softcap, sinks=sinks)


@_fa_fwd_op.register_fake
def _(q, k, v, is_causal, softmax_scale, window_left, window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, softcap=0.0, sinks=None):
    packed = cu_seqlens_q is not None
    lse_shape = (q.shape[1], q.shape[0]) if packed else q.shape[:-1]
    out = torch.empty_like(q) if v.shape[-1] == q.shape[-1] else q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tritonlm::flash_attention_bwd", mutates_args=())
def _fa_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor, is_causal: bool, softmax_scale: float, window_left: int, window_right: int,
               cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
               max_seqlen_k: int, deterministic: bool = True, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsinks = flash_attention_backward(do, q, k, v, o, lse, is_causal, softmax_scale,
                                                  (window_left, window_right), cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, deterministic, softcap, sinks)
    # (a custom op returns tensors: no sinks, an empty gradient)
    return dq, dk, dv, dsinks if dsinks is not None else q.new_empty(0, dtype=torch.float32)


@_fa_bwd_op.register_fake
def _(do, q, k, v, o, lse, is_causal, softmax_scale, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, deterministic=True, softcap=0.0, sinks=None):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def check_sinks(op: str, sinks, heads: int, device) -> None:
    """Attention sinks: a floating-point ``[heads]`` tensor (one logit per query head) on the inputs' device."""
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.shape != (heads,):
        raise ValueError(f"{op}: sinks must be a floating-point [heads] tensor ({heads} query heads), got "
                         f"{getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))}")
    if sinks.device != device:
        raise ValueError(f"{op}: sinks are on {sinks.device} but q is on {device}")


def check_attention_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shared by both Functions: matching leading dims, head dims, dtypes and devices."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{op}: {name} must be [..., seq, d], got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if q.shape[-1] != k.shape[-1]:
        # (v may have a head dim of its own: MLA; the output then has v's)
        raise ValueError(f"{op}: head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{op}: k has {k.shape[-2]} keys but v has {v.shape[-2]}")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"{op}: k and v leading dims differ: {tuple(k.shape[:-2])} vs {tuple(v.shape[:-2])}")
    if q.shape[:-2] != k.shape[:-2]:
        # GQA / MQA: only the head dim (-3) may differ, and q's heads must be a multiple of k's
        gqa = (q.dim() >= 3 and q.dim() == k.dim() and q.shape[:-3] == k.shape[:-3] and k.shape[-3] > 0
               and q.shape[-3] % k.shape[-3] == 0)
        if not gqa:
            raise ValueError(f"{op}: leading dims differ: q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])}, "
                             f"v {tuple(v.shape[:-2])} (only the heads dim -3 may differ, q heads a multiple of "
                             "k/v heads)")


class FlashAttention(torch.autograd.Function):
    """Triton FlashAttention-2: ``FlashAttention.apply(q, k, v, is_causal=False, softmax_scale=None)``.

    ``q[..., n_q, d]``, ``k, v[..., n_k, d]``; k and v may have fewer heads (dim -3) than q (GQA / MQA: q heads
    a multiple of kv heads, each kv head serving consecutive query heads, never repeated in memory). Saves q, k,
    v, O and the logsumexp ``L`` (fp32, ``q.shape[:-1]``) and recomputes P from L in backward.

    Internal extras (used by :func:`flash_attn_func` / :func:`flash_attn_varlen_func`): ``window=(left, right)``
    (-1 = unbounded, flash-attn's convention) and packed sequences (``cu_seqlens_q/k`` with ``q[total, heads, d]``).
    ``deterministic=False`` (after ``max_seqlen_k``) selects the backward that adds dQ with atomics inside the dK/dV
    kernel (fewer matmuls, run-to-run summation order varies); the default keeps every gradient deterministic.
    ``softcap`` (after it): flash-attn's logit softcap, ``softcap · tanh(s / softcap)`` of the scaled scores.
    ``sinks`` (last): ``[heads]`` attention-sink logits (gpt-oss), one extra logit per row's softmax that carries
    no value; differentiable (their gradient a deterministic per-head sum).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, softmax_scale=None, window=None, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, deterministic=True, softcap=0.0, sinks=None):
        if cu_seqlens_q is None:
            check_attention_inputs("FlashAttention", q, k, v)
        if sinks is not None:
            heads = q.shape[-2] if cu_seqlens_q is not None else (q.shape[-3] if q.dim() >= 3 else 0)
            check_sinks("FlashAttention", sinks, heads, q.device)
        check_float("FlashAttention", q)
        check_device("FlashAttention", q, k, v)
        d = q.shape[-1]
        if d > 256 or v.shape[-1] > 256:
            raise ValueError(f"FlashAttention: head dims up to 256 are supported, got q/k {d}, v {v.shape[-1]}")
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
        window = (-1, -1) if window is None else (int(window[0]), int(window[1]))
        softcap = float(softcap or 0.0)
        if softcap < 0 or not math.isfinite(softcap):
            raise ValueError(f"FlashAttention: softcap must be a finite number >= 0 (0: no cap), got {softcap}")
        extra = (window[0], window[1], cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        with kernel_range("tritonlm::flash_attention_fwd"):
            if use_custom_op(q):
                o, lse = _fa_fwd_op(q, k, v, bool(is_causal), scale, *extra, softcap, sinks)
            else:
                o, lse = flash_attention_forward(q, k, v, bool(is_causal), scale, window, *extra[2:], softcap=softcap,
                                                 sinks=sinks)
        ctx.save_for_backward(q, k, v, o, lse, *(() if sinks is None else (sinks,)))
        ctx.is_causal, ctx.scale, ctx.extra, ctx.deterministic = bool(is_causal), scale, extra, bool(deterministic)
        ctx.softcap = softcap
        return o

    @staticmethod
    @first_order_backward
    def backward(ctx, do):
        q, k, v, o, lse, *sinks = ctx.saved_tensors
        sinks = sinks[0] if sinks else None
        extra = ctx.extra
        with kernel_range("tritonlm::flash_attention_bwd"):
            if use_custom_op(q):
                dq, dk, dv, dsinks = _fa_bwd_op(do, q, k, v, o, lse, ctx.is_causal, ctx.scale, *extra,
                                                ctx.deterministic, ctx.softcap, sinks)
            else:
                dq, dk, dv, dsinks = flash_attention_backward(do, q, k, v, o, lse, ctx.is_causal, ctx.scale, extra[:2],
                                                              *extra[2:], deterministic=ctx.deterministic,
                                                              softcap=ctx.softcap, sinks=sinks)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks if sinks is not None else None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    softmax_scale: float | None = None, *, deterministic: bool = True,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Functional entry point: ``softmax(q kᵀ · scale [+ causal mask]) v`` via :class:`FlashAttention`.
    ``deterministic=False``: the atomic-dQ backward (see :class:`FlashAttention`); ``softcap > 0``: scores
    ``softcap · tanh(s / softcap)`` (Gemma 2's attention logit cap); ``sinks[heads]``: gpt-oss's attention sinks."""
    return FlashAttention.apply(q, k, v, is_causal, softmax_scale, None, None, None, 0, 0, deterministic, softcap,
                                sinks)
