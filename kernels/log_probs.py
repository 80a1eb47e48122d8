"""Per-token log-probabilities and entropy of a softmax over a vocabulary: the post-training head (GRPO, DPO, KTO,
distillation trainers need ``log p(chosen token)`` and often the entropy, at a temperature, for every token).

Per row of logits ``x[vocab]`` with chosen token ``t``, temperature ``T`` and an optional softcap ``c`` (fp32 math
whatever the logits' dtype)::

    z        = cap(x) / T                     cap(x) = c · tanh(x / c), or x without a softcap
    lse      = log Σ_j exp(z_j)
    log p_t  = z_t - lse
    H        = lse - Σ_j p_j z_j  =  -Σ_j p_j log p_j          p = softmax(z)
    argmax   = the first j with z_j = max z

and, with upstream gradients ``g`` (of log p_t) and ``h`` (of H) per row::

    dL/dz_j  = g ([j = t] - p_j) - h p_j (log p_j + H)
    dL/dx_j  = dL/dz_j / T · (1 - (cap(x_j) / c)²)

Two kernels walk a row's vocabulary in ``BLOCK_V``-wide tiles: :func:`_stats_kernel` once (an online max, sum of
exponentials and, for the entropy, sum of ``exp(z - m) · (z - m)``, so ``H = log s - q / s`` never subtracts two
large numbers; the chosen logit is read once per row), :func:`_grad_kernel` once more, writing ``dL/dx`` -- over the
logits themselves when the caller owns them (:func:`linear_log_probs`' chunk buffer). Rows whose target is
``ignore_index`` give 0 and no gradient.

Entry points: :func:`selective_log_softmax` and :func:`entropy_from_logits` on logits (TRL's
``trl.trainer.utils`` semantics, fp32 results, no fp32 copy of the logits), and :func:`linear_log_probs` from hidden
states, chunked over tokens like :func:`~tritonlm.kernels.linear_cross_entropy` so the ``[tokens, vocab]`` logits are
never formed: a chunk's logits live in one buffer (one weight read per chunk in the forward), and the backward
recomputes them (the per-token gradients are only known then) and turns them into their gradient in place, with
``dhidden = dlogits · W`` and ``dW += dlogitsᵀ · hidden`` in cuBLAS. Peak extra memory: one chunk of logits plus the
fp32 weight gradient, whatever the number of tokens.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, first_order_backward, next_pow2, on_gpu
from ._ranges import kernel_range
from ._vocab import accumulate_weight_grad, autocast_dtype, capped, load_logit_tile, matmul_into

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # (a jit global must be a constexpr)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _tile(logit_rows, row_mask, cols, start, n_vocab, inv_temp, softcap, HAS_SOFTCAP: tl.constexpr,
          MASK_COLS: tl.constexpr):
    """``(vocab, mask, z)`` of the tile at column ``start``: z = cap(x) / T in fp32 (-inf outside the row)."""
    vocab, mask, capped = load_logit_tile(logit_rows, row_mask, cols, start, n_vocab, softcap, HAS_SOFTCAP, MASK_COLS)
    return vocab, mask, tl.where(mask, capped * inv_temp, float("-inf"))


@triton.jit
def _fold_tile(m, s, q, best, best_at, logit_rows, row_mask, cols, start, n_vocab, inv_temp, softcap,
               HAS_SOFTCAP: tl.constexpr, WANT_ENTROPY: tl.constexpr, WANT_ARGMAX: tl.constexpr,
               MASK_COLS: tl.constexpr):
    """Fold one tile into the running max ``m``, ``s = Σ exp(z - m)``, ``q = Σ exp(z - m) · (z - m)`` (entropy) and
    the running argmax (the first index of the largest z: a later tile must be strictly larger to replace it)."""
    vocab, mask, z = _tile(logit_rows, row_mask, cols, start, n_vocab, inv_temp, softcap, HAS_SOFTCAP, MASK_COLS)
    tile_max = tl.max(z, axis=1)
    if WANT_ARGMAX:
        tile_at = tl.argmax(z, axis=1, tie_break_left=True) + start
        better = tile_max > best
        best_at = tl.where(better, tile_at, best_at)
        best = tl.where(better, tile_max, best)
    m_new = tl.maximum(m, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (padding rows see only -inf)
    shift = tl.where(m == float("-inf"), 0.0, m - m_safe)  # (<= 0: the old terms' exponent moves by it)
    alpha = tl.math.exp2(shift * LOG2E)
    d = z - m_safe[:, None]
    e = tl.where(mask, tl.math.exp2(d * LOG2E), 0.0)
    if WANT_ENTROPY:
        # q was relative to the old max: Σ e (z - m_old) = Σ e ((z - m_new) + (m_new - m_old))
        q = alpha * (q + shift * s) + tl.sum(e * tl.where(mask, d, 0.0), axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, q, best, best_at


@triton.jit
def _stats_kernel(
    LOGITS, TARGETS, LSE, LOGP, ENT, ARGMAX,
    stride_row, n_rows, n_vocab, ignore_index, inv_temp, softcap,
    HAS_TARGETS: tl.constexpr, WANT_ENTROPY: tl.constexpr, WANT_ARGMAX: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # ---- which rows: BLOCK_T consecutive rows per program
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    logit_rows = LOGITS + rows64[:, None] * stride_row
    full_end = n_vocab // BLOCK_V * BLOCK_V  # whole tiles end here; [full_end, n_vocab) is the ragged tail

    # ---- one pass: online max, sums, argmax; the ragged tail is one masked tile after the loop
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    q = tl.zeros([BLOCK_T], dtype=tl.float32)
    best = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    best_at = tl.zeros([BLOCK_T], dtype=tl.int64)
    for start in range(0, full_end, BLOCK_V):
        m, s, q, best, best_at = _fold_tile(m, s, q, best, best_at, logit_rows, row_mask, cols, start, n_vocab,
                                            inv_temp, softcap, HAS_SOFTCAP, WANT_ENTROPY, WANT_ARGMAX, False)
    if full_end < n_vocab:
        m, s, q, best, best_at = _fold_tile(m, s, q, best, best_at, logit_rows, row_mask, cols, full_end, n_vocab,
                                            inv_temp, softcap, HAS_SOFTCAP, WANT_ENTROPY, WANT_ARGMAX, True)
    m = tl.where(row_mask, m, 0.0)
    s = tl.where(row_mask, s, 1.0)
    log_s = tl.math.log2(s) * LN2
    lse = m + log_s
    valid = row_mask
    if HAS_TARGETS:
        target = tl.load(TARGETS + rows64, mask=row_mask, other=ignore_index)
        valid = row_mask & (target != ignore_index)
        in_range = valid & (target >= 0) & (target < n_vocab)
        x_t = tl.load(LOGITS + rows64 * stride_row + target, mask=in_range, other=0.0).to(tl.float32)
        z_t = capped(x_t, softcap, HAS_SOFTCAP) * inv_temp
        # log p_t = (z_t - m) - log s: the max comes off first, so large logits keep their precision
        tl.store(LOGP + rows64, tl.where(valid, (z_t - m) - log_s, 0.0), mask=row_mask)
    tl.store(LSE + rows64, lse, mask=row_mask)
    if WANT_ENTROPY:
        # H = lse - Σ p z = log s - Σ e (z - m) / s
        tl.store(ENT + rows64, tl.where(valid, log_s - q / s, 0.0), mask=row_mask)
    if WANT_ARGMAX:
        tl.store(ARGMAX + rows64, best_at, mask=row_mask)


@triton.jit
def _grad_tile(logit_rows, grad_rows, row_mask, cols, start, n_vocab, lse, ent, g_p, h, inv_temp, softcap,
               HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, MASK_COLS: tl.constexpr):
    """``dL/dx`` of one tile without the chosen token's ``+g`` (added once per row after the loop): ``-g p_j - h
    p_j (log p_j + H)``, through the temperature and the softcap."""
    vocab, mask, z = _tile(logit_rows, row_mask, cols, start, n_vocab, inv_temp, softcap, HAS_SOFTCAP, MASK_COLS)
    log_p = z - lse[:, None]
    p = tl.math.exp2(log_p * LOG2E)
    dz = -p * g_p[:, None]
    if HAS_ENTROPY_GRAD:
        dz -= h[:, None] * p * (log_p + ent[:, None])
    dx = dz * inv_temp
    if HAS_SOFTCAP:
        capped = z / (inv_temp * softcap)
        dx = dx * (1.0 - capped * capped)
    tl.store(grad_rows + vocab[None, :], dx.to(grad_rows.dtype.element_ty), mask=mask)


@triton.jit
def _grad_kernel(
    LOGITS, GRAD, TARGETS, LSE, ENT, G_LOGP, G_ENT,
    stride_logits, stride_grad, stride_g, stride_h, n_rows, n_vocab, ignore_index, inv_temp, softcap,
    HAS_TARGETS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    valid = row_mask
    target = tl.zeros([BLOCK_T], dtype=tl.int64)
    if HAS_TARGETS:
        target = tl.load(TARGETS + rows64, mask=row_mask, other=ignore_index)
        valid = row_mask & (target != ignore_index)
    # ---- the row's statistics and upstream gradients (0 for ignored rows: no gradient at all)
    lse = tl.load(LSE + rows64, mask=row_mask, other=0.0)
    g_p = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_TARGETS:
        g_p = tl.where(valid, tl.load(G_LOGP + rows64 * stride_g, mask=row_mask, other=0.0).to(tl.float32), 0.0)
    ent = tl.zeros([BLOCK_T], dtype=tl.float32)
    h = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_ENTROPY_GRAD:
        ent = tl.load(ENT + rows64, mask=row_mask, other=0.0)
        h = tl.where(valid, tl.load(G_ENT + rows64 * stride_h, mask=row_mask, other=0.0).to(tl.float32), 0.0)
    logit_rows = LOGITS + rows64[:, None] * stride_logits
    grad_rows = GRAD + rows64[:, None] * stride_grad
    full_end = n_vocab // BLOCK_V * BLOCK_V
    # the chosen logit, read before the loop: GRAD may be LOGITS itself, overwritten tile by tile below
    in_range = valid & (target >= 0) & (target < n_vocab)
    x_t = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_TARGETS:
        x_t = tl.load(LOGITS + rows64 * stride_logits + target, mask=in_range, other=0.0).to(tl.float32)
    for start in range(0, full_end, BLOCK_V):
        _grad_tile(logit_rows, grad_rows, row_mask, cols, start, n_vocab, lse, ent, g_p, h, inv_temp, softcap,
                   HAS_SOFTCAP, HAS_ENTROPY_GRAD, False)
    if full_end < n_vocab:
        _grad_tile(logit_rows, grad_rows, row_mask, cols, full_end, n_vocab, lse, ent, g_p, h, inv_temp, softcap,
                   HAS_SOFTCAP, HAS_ENTROPY_GRAD, True)
    if HAS_TARGETS:
        # ---- the chosen token's column once per row: its whole gradient, over what the loop stored there (after a
        # barrier, so that store comes first)
        z_t = capped(x_t, softcap, HAS_SOFTCAP) * inv_temp
        log_p_t = z_t - lse
        p_t = tl.math.exp2(log_p_t * LOG2E)
        dz_t = g_p * (1.0 - p_t)
        if HAS_ENTROPY_GRAD:
            dz_t -= h * p_t * (log_p_t + ent)
        dx_t = dz_t * inv_temp
        if HAS_SOFTCAP:
            capped_t = z_t / (inv_temp * softcap)
            dx_t = dx_t * (1.0 - capped_t * capped_t)
        tl.debug_barrier()
        tl.store(GRAD + rows64 * stride_grad + target, dx_t.to(GRAD.dtype.element_ty), mask=in_range)


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------
#: GPU: one row per program over 8K-wide tiles and 16 warps (16 logits per thread per tile); interpreter: many rows
#: per tile (each tile is one numpy step there)
GPU_CONFIG = dict(BLOCK_T=1, BLOCK_V=8192, num_warps=16)
INTERPRETER_CONFIG = dict(BLOCK_T=16, BLOCK_V=1024, num_warps=4)
#: an ``ignore_index`` no id equals (TRL's selective_log_softmax has no ignored positions)
_NO_IGNORE = -(1 << 62)


def _config(n_vocab: int, device: torch.device) -> dict:
    cfg = dict(GPU_CONFIG if on_gpu(device) else INTERPRETER_CONFIG)
    cfg["BLOCK_V"] = min(cfg["BLOCK_V"], max(16, next_pow2(n_vocab)))
    if on_gpu(device):
        cfg["num_warps"] = max(1, min(cfg["num_warps"], cfg["BLOCK_V"] // 256))
    return cfg


def log_prob_stats(logits: torch.Tensor, targets: torch.Tensor | None, *, temperature: float = 1.0,
                   softcap: float | None = None, ignore_index: int = -100, entropy: bool = False,
                   argmax: bool = False):
    """``(lse, log_probs, entropy, argmax)`` of ``logits[rows, vocab]`` (unit column stride): fp32 ``[rows]``
    (log_probs with ``targets[rows]``, entropy with ``entropy``; None otherwise) and int64 argmax with ``argmax``."""
    n_rows, n_vocab = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, **f32)
    logp = torch.empty(n_rows, **f32) if targets is not None else None
    ent = torch.empty(n_rows, **f32) if entropy else None
    best = torch.empty(n_rows, dtype=torch.int64, device=logits.device) if argmax else None
    if n_rows:
        cfg = _config(n_vocab, logits.device)
        _stats_kernel[(triton.cdiv(n_rows, cfg["BLOCK_T"]),)](
            logits, targets if targets is not None else lse, lse, logp if logp is not None else lse,
            ent if ent is not None else lse, best if best is not None else lse,
            logits.stride(0), n_rows, n_vocab, int(ignore_index), 1.0 / float(temperature), float(softcap or 0.0),
            HAS_TARGETS=targets is not None, WANT_ENTROPY=entropy, WANT_ARGMAX=argmax, HAS_SOFTCAP=softcap is not None,
            **cfg)
    return lse, logp, ent, best


def log_prob_grad(logits: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor | None, lse: torch.Tensor,
                  ent: torch.Tensor | None, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, *,
                  temperature: float = 1.0, softcap: float | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Write ``dL/dlogits`` into ``grad[rows, vocab]`` (which may be ``logits`` itself) from the per-row upstream
    gradients ``g_logp`` (of the log-probs; with ``targets``) and ``g_ent`` (of the entropy; with ``ent``)."""
    n_rows, n_vocab = logits.shape
    if n_rows:
        cfg = _config(n_vocab, logits.device)
        _grad_kernel[(triton.cdiv(n_rows, cfg["BLOCK_T"]),)](
            logits, grad, targets if targets is not None else lse, lse, ent if ent is not None else lse,
            g_logp if g_logp is not None else lse, g_ent if g_ent is not None else lse,
            logits.stride(0), grad.stride(0), 0 if g_logp is None else g_logp.stride(0),
            0 if g_ent is None else g_ent.stride(0), n_rows, n_vocab, int(ignore_index), 1.0 / float(temperature),
            float(softcap or 0.0), HAS_TARGETS=targets is not None, HAS_ENTROPY_GRAD=g_ent is not None,
            HAS_SOFTCAP=softcap is not None, **cfg)
    return grad


# ----------------------------------------------------------------------------------------------------
# autograd: from logits
# ----------------------------------------------------------------------------------------------------
class LogProbsFunction(torch.autograd.Function):
    """``logits[rows, vocab]``, ``targets[rows]`` (or None) -> fp32 ``(log_probs or None, entropy or None)``.
    Saves the logits (the caller's tensor, no copy) and two fp32 numbers per row."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, softcap, ignore_index, want_entropy):
        with kernel_range("tritonlm::log_probs_fwd"):
            lse, logp, ent, _ = log_prob_stats(logits, targets, temperature=temperature, softcap=softcap,
                                               ignore_index=ignore_index, entropy=want_entropy)
        ctx.opts = dict(temperature=temperature, softcap=softcap, ignore_index=ignore_index)
        ctx.has_targets, ctx.want_entropy = targets is not None, want_entropy
        ctx.save_for_backward(logits, targets if targets is not None else lse, lse,
                              ent if ent is not None else lse)
        return logp, ent

    @staticmethod
    @first_order_backward
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 6
        targets = targets if ctx.has_targets else None
        ent = ent if ctx.want_entropy else None
        g_logp = (g_logp if g_logp is not None else torch.zeros_like(lse)) if targets is not None else None
        g_ent = g_ent if ent is not None else None
        grad = torch.empty_like(logits)
        with kernel_range("tritonlm::log_probs_bwd"):
            log_prob_grad(logits, grad, targets, lse, ent, g_logp, g_ent, **ctx.opts)
        return grad, None, None, None, None, None


def _check_temperature(op: str, temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{op}: temperature must be a number > 0, got {temperature!r}")


def _check_index(op: str, index: torch.Tensor, n_vocab: int, ignore_index: int | None) -> None:
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: index / targets must be int64 or int32 ids, got {index.dtype}")
    if index.device.type == "meta":  # (shape-only runs: memory accounting)
        return
    kept = index if ignore_index is None else index[index != ignore_index]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= n_vocab):
        raise ValueError(f"{op}: ids must be in [0, {n_vocab})"
                         + (f" or ignore_index={ignore_index}" if ignore_index is not None else "")
                         + f", got values in [{int(kept.min())}, {int(kept.max())}]")


def _rows(op: str, logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{op}: expected logits[..., vocab] with a vocabulary, got {tuple(logits.shape)}")
    check_float(op, logits)
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, index[..., None])[..., 0]`` (TRL's ``selective_log_softmax``): the
    log-probability of each chosen id, ``logits[..., vocab]``, ``index[...]`` -> fp32 ``[...]``, differentiable in the
    logits. One pass over each row, fp32 accumulation whatever the logits' dtype, no fp32 copy of them."""
    op = "selective_log_softmax"
    if index.shape != logits.shape[:-1]:
        raise ValueError(f"{op}: index {tuple(index.shape)} must be logits' shape without the vocabulary "
                         f"{tuple(logits.shape[:-1])}")
    rows = _rows(op, logits)
    check_device(op, rows, index)
    _check_index(op, index, logits.shape[-1], None)
    logp, _ = LogProbsFunction.apply(rows, index.reshape(-1).long(), 1.0, None, _NO_IGNORE, False)
    return logp.view(index.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """The entropy ``-Σ p log p`` of ``softmax(logits)`` per position (TRL's ``entropy_from_logits``):
    ``logits[..., vocab]`` -> fp32 ``[...]``, differentiable. ``chunk_size`` is TRL's argument (how many rows its
    torch code materialises at once); the kernel holds no softmax copy at all, so it only has to be positive."""
    op = "entropy_from_logits"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    rows = _rows(op, logits)
    check_device(op, rows)
    _, ent = LogProbsFunction.apply(rows, None, 1.0, None, _NO_IGNORE, True)
    return ent.view(logits.shape[:-1])


# ----------------------------------------------------------------------------------------------------
# autograd: from hidden states (the logits never formed)
# ----------------------------------------------------------------------------------------------------
def _chunk_logits(buffer: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lo: int, hi: int,
                  n_vocab: int) -> torch.Tensor:
    out = buffer[:hi - lo, :n_vocab]
    if b is None:
        return torch.mm(h[lo:hi], w.t(), out=out)
    return torch.addmm(b, h[lo:hi], w.t(), out=out)


#: the fused head's logits budget per chunk: half of linear_cross_entropy's ``CHUNK_BYTES``, so that a chunk and
#: its copy (Triton's interpreter holds one per launch on CPU) together stay under a tenth of one fp32
#: [8192, vocab] logits tensor
LOG_PROB_CHUNK_BYTES = 1 << 27  # 128 MiB
#: tokens per chunk at least: at Qwen's vocabulary (151,936) an fp32 chunk is then 148 MiB; in bf16 the byte budget
#: gives 384 rows there (each chunk's three matmuls still do ~270 flop per byte at d 4096: compute-bound on an H100)
LOG_PROB_CHUNK_MIN_ROWS = 256


def log_prob_chunk_rows(n_rows: int, n_vocab: int, element_size: int = 4) -> int:
    """Tokens per chunk of the fused head: :data:`LOG_PROB_CHUNK_BYTES` of logits (rounded down to 128 rows, as
    :func:`~tritonlm.kernels.linear_cross_entropy_loss.chunk_rows` does) with a floor of
    :data:`LOG_PROB_CHUNK_MIN_ROWS`."""
    row_bytes = triton.cdiv(max(1, n_vocab), 16) * 16 * element_size
    budget = LOG_PROB_CHUNK_BYTES // row_bytes // 128 * 128
    return max(1, min(n_rows, max(LOG_PROB_CHUNK_MIN_ROWS, budget)))


def _chunk_buffer(n_rows: int, n_vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
    """One chunk of logits, rows padded to a multiple of 16 elements (aligned, vectorised row loads)."""
    size = torch.finfo(dtype).bits // 8
    return torch.empty(log_prob_chunk_rows(n_rows, n_vocab, size), triton.cdiv(n_vocab, 16) * 16, dtype=dtype,
                       device=device)


def _no_autocast(device):
    return torch.autocast(device.type, enabled=False) if device.type in ("cuda", "cpu") else contextlib.nullcontext()


class LinearLogProbsFunction(torch.autograd.Function):
    """``hidden[rows, d]``, ``weight[vocab, d]``, ``bias[vocab]`` (or None), ``targets[rows]`` -> fp32
    ``(log_probs, entropy or None)`` of ``softmax((hidden Wᵀ + b) / T)``, chunked (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, ignore_index, want_entropy, compute_dtype):
        n_rows, n_vocab = hidden.shape[0], weight.shape[0]
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        logp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        lse, ent = torch.empty_like(logp), torch.empty_like(logp) if want_entropy else None
        opts = dict(temperature=temperature, softcap=softcap, ignore_index=ignore_index)
        buffer = _chunk_buffer(n_rows, n_vocab, compute_dtype, hidden.device)
        step = buffer.shape[0]
        with _no_autocast(hidden.device), kernel_range("tritonlm::linear_log_probs_fwd"):
            for lo in range(0, n_rows, step):
                hi = min(n_rows, lo + step)
                logits = _chunk_logits(buffer, h, w, b, lo, hi, n_vocab)
                c_lse, c_logp, c_ent, _ = log_prob_stats(logits, targets[lo:hi], entropy=want_entropy, **opts)
                lse[lo:hi], logp[lo:hi] = c_lse, c_logp
                if want_entropy:
                    ent[lo:hi] = c_ent
        del buffer
        ctx.opts, ctx.want_entropy, ctx.compute_dtype = opts, want_entropy, compute_dtype
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, bias if bias is not None else lse, targets, lse,
                              ent if ent is not None else lse)
        return logp, ent

    @staticmethod
    @first_order_backward
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_dh, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n_rows, n_vocab = hidden.shape[0], weight.shape[0]
        h, w = hidden.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
        b = bias.to(ctx.compute_dtype) if ctx.has_bias else None
        g_logp = g_logp if g_logp is not None else torch.zeros_like(lse)
        g_ent = g_ent if (ctx.want_entropy and g_ent is not None) else None
        ent = ent if g_ent is not None else None
        dh = torch.empty_like(hidden) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dw else None
        db = torch.zeros(n_vocab, dtype=torch.float32, device=weight.device) if need_db else None
        buffer = _chunk_buffer(n_rows, n_vocab, ctx.compute_dtype, hidden.device)
        step = buffer.shape[0]
        with _no_autocast(hidden.device), kernel_range("tritonlm::linear_log_probs_bwd"):
            for lo in range(0, n_rows, step):
                hi = min(n_rows, lo + step)
                # ---- the chunk's logits again, turned into their gradient in place
                logits = _chunk_logits(buffer, h, w, b, lo, hi, n_vocab)
                log_prob_grad(logits, logits, targets[lo:hi], lse[lo:hi], None if ent is None else ent[lo:hi],
                              g_logp[lo:hi], None if g_ent is None else g_ent[lo:hi], **ctx.opts)
                # ---- dhidden_c = dlogits_c W ; dW += dlogits_cᵀ hidden_c ; db += Σ_rows dlogits_c
                if dh is not None:
                    matmul_into(dh[lo:hi], logits, w)
                if dw is not None:
                    accumulate_weight_grad(dw, logits, h[lo:hi])
                if db is not None:
                    db += logits.float().sum(0)
        del buffer
        return (dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None, None, None)


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                     bias: torch.Tensor | None = None, temperature: float = 1.0, ignore_index: int = -100,
                     return_entropy: bool = False, softcap: float | None = None):
    """Per-token ``log softmax((hidden Wᵀ + b) / T)[target]`` (and, with ``return_entropy``, the distribution's
    entropy) without forming the ``[tokens, vocab]`` logits.

    Args:
        hidden: ``[..., d]`` hidden states (fp32, fp16 or bf16); weight ``[vocab, d]``; bias ``[vocab]`` or None.
        targets: ``[...]`` ids in ``[0, vocab)`` or ``ignore_index`` (those positions give 0 and no gradient).
        temperature: > 0; the softmax is over ``logits / temperature`` (the sampling temperature of an RL rollout).
        softcap: logits become ``softcap · tanh(logits / softcap)`` first (Gemma 2 / 3's final softcap).

    Returns fp32 ``log_probs[...]``, or ``(log_probs, entropy)``; both are differentiable in hidden, weight and bias
    (the entropy's gradient, ``-p (log p + H)`` per logit, in the same chunked backward). Matmuls run in the
    autocast dtype when autocast is on, else in hidden's dtype; statistics and the weight gradient in fp32.
    """
    op = "linear_log_probs"
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: expected hidden[..., d] and weight[vocab, d], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"{op}: hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: expected "
                         "hidden[..., d] and targets[...]")
    if weight.shape[0] == 0:
        raise ValueError(f"{op}: the vocabulary (weight rows) is empty")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [vocab] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    _check_temperature(op, temperature)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be > 0 or None, got {softcap!r}")
    check_float(op, hidden, weight, *([bias] if bias is not None else []))
    check_device(op, hidden, weight, targets, *([bias] if bias is not None else []))
    _check_index(op, targets, weight.shape[0], ignore_index)
    compute_dtype = autocast_dtype(hidden.device.type) or hidden.dtype
    logp, ent = LinearLogProbsFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(), float(temperature),
        None if softcap is None else float(softcap), int(ignore_index), bool(return_entropy), compute_dtype)
    logp = logp.view(targets.shape)
    return (logp, ent.view(targets.shape)) if return_entropy else logp
