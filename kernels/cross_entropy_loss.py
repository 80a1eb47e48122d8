"""Cross-entropy on given logits in one Triton kernel: loss, logsumexp and (optionally) the gradient.

Per row ``x[vocab]`` with target ``t`` (fp32 math whatever the logits' dtype)::

    z       = softcap · tanh(x / softcap)          (or z = x without a softcap)
    lse     = log Σ_j exp(z_j)
    loss    = lse - (1 - ε) z_t - (ε / V) Σ_j z_j  +  z_loss · lse²
    dL/dz_j = p_j (1 + 2 z_loss · lse) - (1 - ε)[j = t] - ε / V,     p = softmax(z)
    dL/dx_j = dL/dz_j · (1 - (z_j / softcap)²)

with ε the label smoothing (``F.cross_entropy``'s definition: a mix of the one-hot target and the uniform
distribution) and ``z_loss · lse²`` PaLM's auxiliary term. A row whose target is ``ignore_index`` has loss 0
and gradient 0. The kernel walks the vocabulary in ``BLOCK_V``-wide tiles twice: pass 1 keeps an online
max / sum of exponentials (so logits of ±1e4 never overflow), the target's logit and the sum of logits;
pass 2, only when a gradient is wanted, rereads the tile, forms ``dL/dx`` times the row's gradient scale
(``1 / n_valid`` for a mean, ``grad_output[row]`` for ``reduction="none"``) and writes it — into the
logits' own storage when the caller allows it, so the gradient costs no second ``[rows, vocab]`` buffer.

Each option compiles a kernel of its own (``HAS_SMOOTHING``, ``HAS_ZLOSS``, ``HAS_SOFTCAP`` constexprs): the plain
loss carries only the running max and sum of exponentials through pass 1 and one exponential and one store per
logit through pass 2; the target's logit is read once per row, its ``-(1 - ε)`` added once per row after pass 2,
and the ragged last tile is straight-line code after each loop. SASS report (sm_90, bf16, 4096 rows x 128256):
0.61 warp-instructions per logit counting every loop the kernel holds (was 2.71 with four reductions per tile and
a compiled second loop per pass), 58 registers, 1 CTA of 32 warps per SM. Liger-Kernel 0.8.5's kernel, compiled
beside it in the report's peers section: 0.30 (one row per CTA of 32 warps over 32K-wide tiles, 1 CTA per SM).

Rows in flight: pass 2 rereads the row pass 1 just streamed, which hits L2 only if the rows every other program
streams meanwhile fit there. On a GPU one program takes one row, so ``CTAs/SM x SMs`` rows are in flight: with the
earlier 4K-wide tiles over 8 warps (32 registers, 8 CTAs per SM) that was 8 x 132 rows of Llama 3's vocabulary in
bf16 (250.5 KiB a row) on an H100 / H200, 258 MiB against their 50 MiB L2. The launch now takes 16K-wide tiles over
32 warps (:data:`GPU_CONFIG`), and pass 1 loads them through shared-memory buffers of async copies sized so that
two CTAs cannot share an SM where the rows need it (:func:`_load_stages`: 128 KiB on sm_90 from 4 whole tiles, bf16
vocabularies >= 65536): one CTA per SM whatever the registers (a bound from the registers alone failed with Triton
3.6, which compiles the bf16 kernel at 128256 to 32 registers: two CTAs per SM). So 132 rows are in flight, and each CTA keeps two to four tiles of loads in flight for HBM. SASS
report, sm_90: 54-64 registers, spill-free, 0.54-0.62 warp-instructions per logit over every loop. Bytes in flight
between a row's two passes, 132 rows (the gradient is written over the logits, into the same L2 lines):

- bf16 at GPT-2's 50257: 98.2 KiB a row, 12.7 MiB;
- bf16 at Llama 3's 128256: 250.5 KiB a row, 32.3 MiB;
- fp32 at 50257: 196.3 KiB a row, 25.3 MiB;
- fp32 at 128256: 501.0 KiB a row, 64.6 MiB (over L2: pass 2 partly from HBM).

Tile, warps and pipeline depth are a tunable (``"cross_entropy"``, keyed by dtype) that the GPU sweep times against
the earlier launch; no GPU has measured either yet.

:func:`cross_entropy` is the public entry point on logits; :mod:`.linear_cross_entropy` calls
:func:`cross_entropy_rows` on chunks of logits it forms itself and never keeps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _registry, tuned
from ._common import (
    as_rows,
    check_device,
    check_float,
    first_order_backward,
    gpu_capability,
    next_pow2,
    on_gpu,
    use_custom_op,
)
from ._ranges import kernel_range
from ._vocab import capped, load_logit_tile
from .log_probs import log_prob_stats

REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _stats_tile(m, s, z_sum, logit_rows, row_mask, cols, start, n_vocab, softcap, HAS_SOFTCAP: tl.constexpr,
                HAS_SMOOTHING: tl.constexpr, MASK_COLS: tl.constexpr):
    """Fold the tile at ``start`` into the running max ``m`` and sum of exponentials ``s`` (``Σ exp(z - m)``), and
    with label smoothing the sum of logits. ``z - m`` is formed first (exact for nearby values, so logits of ±1e4
    keep their precision), then scaled into ``exp2``."""
    _, mask, z = load_logit_tile(logit_rows, row_mask, cols, start, n_vocab, softcap, HAS_SOFTCAP, MASK_COLS)
    if HAS_SMOOTHING:
        z_sum += tl.sum(tl.where(mask, z, 0.0), axis=1)
    if MASK_COLS:
        z = tl.where(mask, z, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see only -inf
    s = s * tl.math.exp2((m - m_safe) * 1.4426950408889634) + \
        tl.sum(tl.math.exp2((z - m_safe[:, None]) * 1.4426950408889634), axis=1)
    return m_new, s, z_sum


@triton.jit
def _grad_tile(logit_rows, grad_rows, row_mask, cols, start, n_vocab, m, log2_s, p_scale, smooth, softcap,
               HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, MASK_COLS: tl.constexpr):
    """``dL/dx`` of the tile at ``start`` without the target's ``-(1 - ε)`` (added once per row after the loop),
    times the row's scale (folded into ``p_scale``), stored to the gradient rows. ``p = 2^((z - m)·log2(e) -
    log2(s))``: one subtraction, one FMA, one exponential per logit."""
    vocab, mask, z = load_logit_tile(logit_rows, row_mask, cols, start, n_vocab, softcap, HAS_SOFTCAP, MASK_COLS)
    dz = tl.math.exp2((z - m[:, None]) * 1.4426950408889634 - log2_s[:, None]) * p_scale[:, None]
    if HAS_SMOOTHING:
        dz -= smooth[:, None]
    if HAS_SOFTCAP:
        capped = z / softcap
        dz = dz * (1.0 - capped * capped)
    tl.store(grad_rows + vocab[None, :], dz.to(grad_rows.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_kernel(
    LOGITS, TARGETS, LOSS, LSE, ZLOSS, GRAD, GRAD_SCALE,
    stride_logits_row, stride_grad_row, stride_scale, n_rows, n_vocab,
    ignore_index, label_smoothing, z_loss, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, LOAD_STAGES: tl.constexpr,
):
    # HAS_SMOOTHING / HAS_ZLOSS / HAS_SOFTCAP: each option compiles its own kernel, so the plain loss carries only
    # the max and the sum of exponentials through its loops (the other options' work is not even branched over)
    # ---- which rows: BLOCK_T consecutive rows per program
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(TARGETS + rows64, mask=row_mask, other=ignore_index)
    valid = row_mask & (target != ignore_index)
    logit_rows = LOGITS + rows64[:, None] * stride_logits_row
    full_end = n_vocab // BLOCK_V * BLOCK_V  # whole tiles end here; [full_end, n_vocab) is the ragged tail
    # the target's logit, read once per row (no per-tile compare); an out-of-range target reads nothing
    in_range = valid & (target >= 0) & (target < n_vocab)
    z_target = capped(tl.load(LOGITS + rows64 * stride_logits_row + target, mask=in_range, other=0.0)
                       .to(tl.float32), softcap, HAS_SOFTCAP)

    # ---- pass 1: online max and sum of exp (base 2), the sum of logits with label smoothing; the ragged tail is
    # one masked tile after the loop (straight-line code, not a second loop). Its tiles arrive through
    # LOAD_STAGES - 1 shared-memory buffers of async copies: HBM traffic kept in flight by one CTA per SM, and the
    # buffers' size keeps a second CTA off the SM (the launcher's _load_stages)
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    z_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in tl.range(0, full_end, BLOCK_V, num_stages=LOAD_STAGES):
        m, s, z_sum = _stats_tile(m, s, z_sum, logit_rows, row_mask, cols, start, n_vocab, softcap, HAS_SOFTCAP,
                                  HAS_SMOOTHING, False)
    if full_end < n_vocab:
        m, s, z_sum = _stats_tile(m, s, z_sum, logit_rows, row_mask, cols, full_end, n_vocab, softcap, HAS_SOFTCAP,
                                  HAS_SMOOTHING, True)
    m = tl.where(row_mask, m, 0.0)
    log2_s = tl.math.log2(tl.where(row_mask, s, 1.0))
    log_s = log2_s * 0.6931471805599453
    lse = m + log_s

    # ---- per-row loss (0 for ignored rows), the z-loss part on its own for logging. The max is subtracted
    # from the logits before log(s) is added: at |logits| ~ 1e4, lse itself carries fp32's 1e-3 spacing
    loss = (m - z_target) + log_s
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * (m - z_target) + label_smoothing * (m - z_sum / n_vocab) + log_s
    z_term = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_ZLOSS:
        z_term = z_loss * lse * lse
        loss += z_term
    tl.store(LOSS + rows64, tl.where(valid, loss, 0.0), mask=row_mask)
    tl.store(ZLOSS + rows64, tl.where(valid, z_term, 0.0), mask=row_mask)
    tl.store(LSE + rows64, lse, mask=row_mask)

    # ---- pass 2: dL/dx, scaled per row, written over the tile it was computed from when GRAD aliases LOGITS
    if WRITE_GRAD:
        scale = tl.load(GRAD_SCALE + rows64 * stride_scale, mask=row_mask, other=0.0).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        p_scale = scale  # p · (1 + 2 z_loss · lse) · scale
        if HAS_ZLOSS:
            p_scale = scale * (1.0 + 2.0 * z_loss * lse)
        smooth = scale * (label_smoothing / n_vocab)
        grad_rows = GRAD + rows64[:, None] * stride_grad_row
        for start in range(0, full_end, BLOCK_V):
            _grad_tile(logit_rows, grad_rows, row_mask, cols, start, n_vocab, m, log2_s, p_scale, smooth, softcap,
                       HAS_SOFTCAP, HAS_SMOOTHING, False)
        if full_end < n_vocab:
            _grad_tile(logit_rows, grad_rows, row_mask, cols, full_end, n_vocab, m, log2_s, p_scale, smooth, softcap,
                       HAS_SOFTCAP, HAS_SMOOTHING, True)
        # ---- the target's column once per row: its full gradient, over what the loop stored there (after a
        # barrier, so the loop's store of that element, by whichever thread, comes first)
        dz_t = tl.math.exp2((z_target - m) * 1.4426950408889634 - log2_s) * p_scale - scale * (1.0 - label_smoothing)
        if HAS_SMOOTHING:
            dz_t -= smooth
        if HAS_SOFTCAP:
            capped_t = z_target / softcap
            dz_t = dz_t * (1.0 - capped_t * capped_t)
        tl.debug_barrier()
        tl.store(GRAD + rows64 * stride_grad_row + target, dz_t.to(GRAD.dtype.element_ty), mask=in_range)


# ----------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------
#: GPU: one row per program, 16K-wide vocab tiles over 32 warps (16 logits per thread), pass 1 pipelined through
#: ``LOAD_STAGES - 1`` shared-memory buffers (:func:`_load_stages`): one CTA per SM, so 132 rows in flight on an
#: H100 / H200, whose reread in pass 2 fits L2 up to Llama 3's vocabulary in bf16 (module docstring).
#: Interpreter: many rows per tile, since each tile is one numpy step there.
GPU_CONFIG = dict(BLOCK_T=1, BLOCK_V=16384, num_warps=32)
INTERPRETER_CONFIG = dict(BLOCK_T=16, BLOCK_V=2048, num_warps=4, LOAD_STAGES=1)
#: (shared memory per SM, the most one CTA may take) by compute capability, bytes; others take the smallest
_SHARED_MEMORY = {90: (228 << 10, 227 << 10), 100: (228 << 10, 227 << 10), 80: (164 << 10, 163 << 10),
                  87: (164 << 10, 163 << 10)}
_SHARED_MEMORY_DEFAULT = (100 << 10, 99 << 10)  # sm_86 / sm_89 / sm_120


def _load_stages(tile_bytes: int, whole_tiles: int, capability: int) -> int:
    """Pass 1's pipeline depth: enough buffers of ``tile_bytes`` that two CTAs cannot share an SM's shared memory
    (so one CTA per SM whatever the compiler makes of the registers: rows in flight = SMs), as long as one CTA can
    hold them, at most 7, and no more than the row's whole tiles (a deeper pipeline than the loop would only take
    shared memory). sm_90, 16K-wide tiles: bf16 (32 KiB) 4 buffers, 128 KiB, from 4 whole tiles (vocab >= 65536);
    fp32 (64 KiB) 2, 128 KiB; sm_80: bf16 3 (96 KiB), fp32 2 (128 KiB); 100 KiB parts (sm_86 / 89 / 120): bf16 2,
    fp32 1. With fewer whole tiles the rows are short enough that two CTAs' rows fit L2 too (bf16 at GPT-2's 50257,
    3 tiles: 96 KiB, 2 x 132 rows = 25.9 MiB)."""
    per_sm, per_block = _SHARED_MEMORY.get(capability, _SHARED_MEMORY_DEFAULT)
    want = per_sm // 2 // tile_bytes + 1
    fit = (per_block - (4 << 10)) // tile_bytes  # (a few KiB for the reductions' scratch)
    return max(1, min(want, fit, 7, whole_tiles)) + 1


def _launch_config(n_vocab: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tiles and warps; a tuned table (``kernels/tuned``, keyed by dtype) may replace the GPU's. A vocabulary
    narrower than the tile takes a tile of its own width, with a warp per 256 logits at most (512 logits: 2)."""
    cfg = tuned.choose("cross_entropy", tuned.dtype_name(dtype), device,
                       dict(GPU_CONFIG if on_gpu(device) else INTERPRETER_CONFIG))
    cfg["BLOCK_V"] = min(cfg["BLOCK_V"], max(16, next_pow2(n_vocab)))
    if on_gpu(device):
        cfg["num_warps"] = max(1, min(cfg["num_warps"], cfg["BLOCK_V"] // 256))
        if "LOAD_STAGES" not in cfg:  # (a tuned entry may set it)
            cfg["LOAD_STAGES"] = _load_stages(cfg["BLOCK_V"] * dtype.itemsize, n_vocab // cfg["BLOCK_V"],
                                              gpu_capability(device))
    return cfg


#: The GPU launch a tuned table may replace, and the sweep's alternatives: the earlier 4K-wide tiles over 8 warps
#: without the pipeline (8 CTAs per SM: every row's reread from HBM at large vocabularies), no pipeline (registers
#: decide the CTAs per SM), a shallower one, 16 warps on the same tiles, 8K tiles, and 32K-wide tiles over 32 warps
#: (Liger-Kernel's shape; it spilled 40-184 B on sm_90 at some of the report's shapes).
TUNABLE = _registry.Tunable(
    "cross_entropy", ("BLOCK_V", "num_warps", "LOAD_STAGES"),
    (dict(BLOCK_V=4096, num_warps=8, LOAD_STAGES=1), dict(LOAD_STAGES=1), dict(LOAD_STAGES=3),
     dict(BLOCK_V=16384, num_warps=16), dict(BLOCK_V=8192, num_warps=16), dict(BLOCK_V=32768, num_warps=32)),
    lambda key, device, dtype: {k: v for k, v in _launch_config(1 << 20, dtype, device).items()
                                if k in ("BLOCK_V", "num_warps", "LOAD_STAGES")})


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                       label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                       grad: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None):
    """Launch on ``logits[rows, vocab]`` (unit column stride) and ``targets[rows]``.

    Returns fp32 ``(loss, lse, z_term)``, each ``[rows]``. With ``grad`` (``[rows, vocab]``, may be
    ``logits`` itself) it also writes ``dL/dlogits · grad_scale`` there; ``grad_scale`` is a 1-element
    tensor (one scale for all rows) or ``[rows]``.
    """
    n_rows, n_vocab = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    z_term = torch.empty_like(loss)
    if n_rows == 0:
        return loss, lse, z_term
    write_grad = grad is not None
    if write_grad:
        stride_scale = 0 if grad_scale.numel() == 1 else grad_scale.stride(0)
    else:
        grad, grad_scale, stride_scale = logits, loss, 0  # unused pointers
    cfg = _launch_config(n_vocab, logits.dtype, logits.device)
    grid = (triton.cdiv(n_rows, cfg["BLOCK_T"]),)
    _cross_entropy_kernel[grid](
        logits, targets, loss, lse, z_term, grad, grad_scale,
        logits.stride(0), grad.stride(0), stride_scale, n_rows, n_vocab,
        int(ignore_index), float(label_smoothing), float(z_loss), float(softcap or 0.0),
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=float(label_smoothing) != 0.0, HAS_ZLOSS=float(z_loss) != 0.0,
        WRITE_GRAD=write_grad, **cfg)
    return loss, lse, z_term


# ----------------------------------------------------------------------------------------------------
# checks shared with linear_cross_entropy
# ----------------------------------------------------------------------------------------------------
def check_loss_options(op: str, ignore_index, label_smoothing, z_loss, softcap, reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if float(z_loss) < 0.0:
        raise ValueError(f"{op}: z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"{op}: softcap must be > 0 (or None), got {softcap}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")


def check_targets(op: str, targets: torch.Tensor, n_vocab: int, ignore_index: int) -> None:
    """Integer targets in ``[0, n_vocab)`` or equal to ``ignore_index`` (one host sync)."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"{op}: targets must be integer class ids, got {targets.dtype}")
    if targets.numel() == 0 or targets.device.type == "meta" or torch.compiler.is_compiling():
        return  # (no data, or a traced graph: no host sync inside torch.compile)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= n_vocab))
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise ValueError(f"{op}: target {value} is outside [0, {n_vocab}) and is not ignore_index "
                         f"({ignore_index})")


def reduce_loss(loss_rows: torch.Tensor, n_valid: torch.Tensor, reduction: str, shape) -> torch.Tensor:
    """Mean over non-ignored rows (0 when every row is ignored), sum, or the per-row losses in ``shape``."""
    if reduction == "mean":
        return loss_rows.sum() / n_valid.clamp(min=1).reshape(())
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.view(shape)


def mean_scale(targets: torch.Tensor, ignore_index: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n_valid, scale)``: the count of non-ignored targets and the gradient scale of a mean or sum,
    both 1-element fp32 tensors (no host sync)."""
    n_valid = (targets != ignore_index).sum().to(torch.float32).reshape(1)
    scale = 1.0 / n_valid.clamp(min=1) if reduction == "mean" else torch.ones_like(n_valid)
    return n_valid, scale


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile; shapes on meta tensors) and the autograd Function
# ----------------------------------------------------------------------------------------------------
def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float,
                          z_loss: float, softcap: float | None, grad_scale: torch.Tensor, write_grad: bool):
    """Per-row fp32 ``(loss, z_term)`` and, with ``write_grad``, a fresh ``[rows, vocab]`` gradient of
    ``sum(loss · grad_scale)`` (else an empty tensor)."""
    grad = torch.empty_like(logits) if write_grad else None
    loss, _, z_term = cross_entropy_rows(logits, targets, ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                         grad=grad, grad_scale=grad_scale)
    return loss, z_term, (grad if grad is not None else logits.new_empty(0))


@torch.library.custom_op("tritonlm::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float,
               z_loss: float, softcap: float | None, grad_scale: torch.Tensor, write_grad: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cross_entropy_forward(logits, targets, ignore_index, label_smoothing, z_loss, softcap, grad_scale,
                                 write_grad)


@_ce_fwd_op.register_fake
def _(logits, targets, ignore_index, label_smoothing, z_loss, softcap, grad_scale, write_grad):
    rows = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return rows, torch.empty_like(rows), (torch.empty_like(logits) if write_grad else logits.new_empty(0))


class CrossEntropyFunction(torch.autograd.Function):
    """Fused cross-entropy on ``logits[rows, vocab]``. For "mean"/"sum" the gradient is formed in the forward
    (one read of the logits), scaled by ``grad_output`` in backward; for "none" the backward reruns the
    kernel with ``grad_output`` as the per-row scale."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss, softcap, reduction,
                overwrite_logits):
        opts = (ignore_index, label_smoothing, z_loss, softcap)
        n_valid, scale = mean_scale(targets, ignore_index, reduction)
        grads_now = ctx.needs_input_grad[0] and reduction != "none"
        with kernel_range("tritonlm::cross_entropy_fwd"):
            if use_custom_op(logits):
                loss, z_term, grad = _ce_fwd_op(logits, targets, *opts, scale, grads_now)
            elif grads_now and overwrite_logits:
                # the gradient replaces the logits in their own storage: no second [rows, vocab] buffer
                grad = logits
                loss, _, z_term = cross_entropy_rows(logits, targets, ignore_index=ignore_index,
                                                     label_smoothing=label_smoothing, z_loss=z_loss,
                                                     softcap=softcap, grad=grad, grad_scale=scale)
            else:
                loss, z_term, grad = cross_entropy_forward(logits, targets, *opts, scale, grads_now)
        ctx.reduction, ctx.opts = reduction, opts
        if reduction == "none":
            ctx.save_for_backward(logits, targets)
        else:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(z_term)
        return reduce_loss(loss, n_valid, reduction, loss.shape), reduce_loss(z_term, n_valid, reduction,
                                                                              loss.shape)

    @staticmethod
    @first_order_backward
    def backward(ctx, grad_loss, _grad_z):
        if ctx.reduction == "none":
            logits, targets = ctx.saved_tensors
            fwd = _ce_fwd_op if use_custom_op(logits) else cross_entropy_forward
            with kernel_range("tritonlm::cross_entropy_bwd"):
                _, _, grad = fwd(logits, targets, *ctx.opts, grad_loss.reshape(-1).float(), True)
        else:
            (grad,) = ctx.saved_tensors
            grad = grad * grad_loss.to(grad.dtype)
        return grad, None, None, None, None, None, None, None


class CrossEntropyOutput(NamedTuple):
    """What :func:`cross_entropy` / :func:`~tritonlm.kernels.linear_cross_entropy` return when a metric is asked
    for (Liger's ``CrossEntropyOutput`` fields, plus the entropy): the loss, the z-loss term, the fraction of
    non-ignored tokens whose argmax is the target, each token's argmax (``[...]``, int64) and each token's softmax
    entropy (``[...]``, fp32); the metrics are not differentiable, and None where not asked."""
    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def metrics_output(loss, z_term, predicted, entropy, targets, ignore_index: int, *, return_z_loss: bool,
                   return_token_accuracy: bool, return_predicted_tokens: bool, return_entropy: bool):
    """The loss alone, ``(loss, z_loss)``, or a :class:`CrossEntropyOutput` with the metrics asked for."""
    if not (return_token_accuracy or return_predicted_tokens or return_entropy):
        return (loss, z_term) if return_z_loss else loss
    accuracy = None
    if return_token_accuracy:
        keep = targets != ignore_index
        accuracy = ((predicted.view(targets.shape) == targets) & keep).sum() / keep.sum().clamp_min(1)
    return CrossEntropyOutput(loss, z_term if return_z_loss else None, accuracy,
                              predicted.view(targets.shape) if return_predicted_tokens else None,
                              entropy.view(targets.shape) if return_entropy else None)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                  reduction: str = "mean", return_z_loss: bool = False, overwrite_logits: bool = False,
                  return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                  return_entropy: bool = False):
    """Fused cross-entropy of ``logits[..., vocab]`` against integer ``targets[...]``.

    Same semantics as ``F.cross_entropy(logits.float(), targets, ignore_index=..., label_smoothing=...,
    reduction=...)``, plus ``z_loss · lse²`` per non-ignored target and an optional ``softcap`` on the
    logits (``softcap · tanh(logits / softcap)``). "mean" divides by the number of non-ignored targets
    (0 when there are none, not NaN). fp32 math for any logits dtype; one read of the logits.

    ``return_z_loss=True`` returns ``(loss, z_loss_term)``, the second reduced like the first and not
    differentiable (for logging). ``overwrite_logits=True`` writes the gradient into the logits' storage
    instead of a fresh ``[..., vocab]`` buffer: the logits' values are gone after the forward, so only use
    it when nothing reads them afterwards.

    ``return_token_accuracy`` / ``return_predicted_tokens`` / ``return_entropy`` return a :class:`CrossEntropyOutput`
    with those metrics (computed by one more read of the logits, before the loss; not differentiable).
    """
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "disagree: expected logits[..., vocab] and targets[...]")
    if logits.shape[-1] == 0:
        raise ValueError("cross_entropy: the vocabulary (last dim of logits) is empty")
    check_float("cross_entropy", logits)
    check_device("cross_entropy", logits, targets)
    check_loss_options("cross_entropy", ignore_index, label_smoothing, z_loss, softcap, reduction)
    check_targets("cross_entropy", targets, logits.shape[-1], ignore_index)
    rows = as_rows(logits)
    if overwrite_logits and rows.data_ptr() != logits.data_ptr():
        overwrite_logits = False  # as_rows had to copy: the copy is private anyway
    predicted = entropy = None
    if return_token_accuracy or return_predicted_tokens or return_entropy:
        with torch.no_grad():
            _, _, entropy, predicted = log_prob_stats(rows.detach(), None, softcap=softcap, entropy=return_entropy,
                                                      argmax=return_token_accuracy or return_predicted_tokens)
    loss, z_term = CrossEntropyFunction.apply(rows, targets.reshape(-1), int(ignore_index),
                                              float(label_smoothing), float(z_loss),
                                              None if softcap is None else float(softcap), reduction,
                                              bool(overwrite_logits))
    if reduction == "none":
        loss, z_term = loss.view(targets.shape), z_term.view(targets.shape)
    return metrics_output(loss, z_term, predicted, entropy, targets, ignore_index, return_z_loss=return_z_loss,
                          return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens,
                          return_entropy=return_entropy)
