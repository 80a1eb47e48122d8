"""Distillation divergences between a student ``Q`` and a teacher ``P`` per token: the generalised Jensen-Shannon
divergence of Liger-Kernel's ``LigerJSD`` / ``LigerFusedLinearJSD`` and the two KLs it reduces to.

Per row, with ``x = log q`` (student) and ``y = log p`` (teacher) over the vocabulary and ``β`` = ``beta``::

    β = 0 (forward KL):   D = Σ p (y - x)                                    = KL(P || Q)
    β = 1 (reverse KL):   D = Σ q (x - y)                                    = KL(Q || P)
    0 < β < 1 (JSD_β):    D = β Σ p (y - log m) + (1 - β) Σ q (x - log m),    m = β p + (1 - β) q

``log m`` is formed as a log-sum-exp of ``log β + y`` and ``log(1 - β) + x`` (no underflow for tiny probabilities).
With respect to the student's probabilities ``∂D/∂q_j = a_j``: ``-p_j / q_j`` (forward KL), ``x_j - y_j + 1``
(reverse), ``(1 - β)(x_j - log m_j)`` (JSD). So

* for log-probabilities given as they are (:func:`jsd`, :func:`kl_div`, Liger's log-space arguments):
  ``∂D/∂x_j = q_j a_j`` (``-p_j`` for the forward KL);
* for logits ``s`` the student's log-probabilities come from (:func:`fused_linear_jsd`, ``x = s / T - lse``):
  ``∂D/∂s_j = (q_j a_j - q_j Σ_k q_k a_k) / T`` (``(q_j - p_j) / T`` for the forward KL).

:func:`_divergence_kernel` walks each row in ``BLOCK_V``-wide tiles: for logits, a first pass finds both models'
log-sum-exp (online); then one pass sums ``D`` and ``Σ q a``, and, when a gradient is wanted, a last pass writes it
(for log-probabilities the gradient needs no row sum and is written in the same pass as ``D``). Rows whose label is
``ignore_index`` give 0 and no gradient; the losses average over the others, as Liger's do.

:func:`fused_linear_jsd` never forms either model's full logits: per chunk of tokens it forms the student's and the
teacher's logits (cuBLAS), the kernel turns the student's into their gradient in place, and ``dhidden = dlogits W``,
``dW += dlogitsᵀ hidden`` follow in cuBLAS -- one chunk of each model's logits alive at a time.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, first_order_backward, next_pow2, on_gpu
from ._ranges import kernel_range
from ._vocab import accumulate_weight_grad, autocast_dtype, matmul_into
from .log_probs import _chunk_buffer, _no_autocast

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # (a jit global must be a constexpr)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2


@triton.jit
def _tile_logs(S, T, row_s, row_t, row_mask, cols, start, n_vocab, inv_temp, lse_s, lse_t, LOGITS: tl.constexpr,
               MASK_COLS: tl.constexpr):
    """``(vocab, mask, x, y)``: the student's and teacher's log-probabilities of one tile (from logits: ``z / T -
    lse``), -inf outside the row."""
    vocab = start + cols
    if MASK_COLS:
        mask = row_mask[:, None] & (vocab[None, :] < n_vocab)
    else:
        mask = row_mask[:, None] & (vocab[None, :] >= 0)
    x = tl.load(S + row_s[:, None] + vocab[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(T + row_t[:, None] + vocab[None, :], mask=mask, other=0.0).to(tl.float32)
    if LOGITS:
        x = x * inv_temp - lse_s[:, None]
        y = y * inv_temp - lse_t[:, None]
    return vocab, mask, tl.where(mask, x, float("-inf")), tl.where(mask, y, float("-inf"))


@triton.jit
def _online_lse(m, s, X, row_x, row_mask, cols, start, n_vocab, inv_temp, MASK_COLS: tl.constexpr):
    vocab = start + cols
    if MASK_COLS:
        mask = row_mask[:, None] & (vocab[None, :] < n_vocab)
    else:
        mask = row_mask[:, None] & (vocab[None, :] >= 0)
    z = tl.load(X + row_x[:, None] + vocab[None, :], mask=mask, other=0.0).to(tl.float32) * inv_temp
    z = tl.where(mask, z, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.math.exp2((m - m_safe) * LOG2E) + tl.sum(tl.math.exp2((z - m_safe[:, None]) * LOG2E), axis=1)
    return m_new, s


@triton.jit
def _terms(x, y, mask, beta, log_beta, log_1m_beta, MODE: tl.constexpr):
    """``(d, q a, g_log)`` per element: the divergence's summand, ``q ∂D/∂q`` (the log-space gradient) and the
    teacher's probability (the forward KL's gradient term)."""
    q = tl.math.exp2(x * LOG2E)
    p = tl.math.exp2(y * LOG2E)
    if MODE == 0:
        d = p * (y - x)
        qa = -p
    elif MODE == 1:
        d = q * (x - y)
        qa = q * (x - y + 1.0)
    else:
        # log m = log(β p + (1 - β) q) as a log-sum-exp of (log β + y, log(1 - β) + x)
        u = log_beta + y
        v = log_1m_beta + x
        hi = tl.maximum(u, v)
        hi_safe = tl.where(hi == float("-inf"), 0.0, hi)
        log_m = hi_safe + tl.math.log2(tl.math.exp2((u - hi_safe) * LOG2E) + tl.math.exp2((v - hi_safe) * LOG2E)) * LN2
        d = beta * p * (y - log_m) + (1.0 - beta) * q * (x - log_m)
        qa = (1.0 - beta) * q * (x - log_m)
    d = tl.where(mask, d, 0.0)
    qa = tl.where(mask, qa, 0.0)
    return d, qa, tl.where(mask, q, 0.0), tl.where(mask, p, 0.0)


@triton.jit
def _divergence_kernel(
    S, T, LABELS, LOSS, GRAD, SCALE,
    stride_s, stride_t, stride_g, n_rows, n_vocab, ignore_index, inv_temp, beta, log_beta, log_1m_beta,
    MODE: tl.constexpr, LOGITS: tl.constexpr, HAS_LABELS: tl.constexpr, WRITE_GRAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # ---- which rows: BLOCK_T consecutive rows per program; labels decide which rows count
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    valid = row_mask
    if HAS_LABELS:
        label = tl.load(LABELS + rows64, mask=row_mask, other=ignore_index)
        valid = row_mask & (label != ignore_index)
    cols = tl.arange(0, BLOCK_V)
    row_s, row_t = rows64 * stride_s, rows64 * stride_t
    full_end = n_vocab // BLOCK_V * BLOCK_V
    zero = tl.zeros([BLOCK_T], dtype=tl.float32)

    # ---- pass 1 (logits only): both models' log-sum-exp of z / T
    lse_s, lse_t = zero, zero
    if LOGITS:
        m_s = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
        m_t = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
        s_s, s_t = zero, zero
        for start in range(0, full_end, BLOCK_V):
            m_s, s_s = _online_lse(m_s, s_s, S, row_s, row_mask, cols, start, n_vocab, inv_temp, False)
            m_t, s_t = _online_lse(m_t, s_t, T, row_t, row_mask, cols, start, n_vocab, inv_temp, False)
        if full_end < n_vocab:
            m_s, s_s = _online_lse(m_s, s_s, S, row_s, row_mask, cols, full_end, n_vocab, inv_temp, True)
            m_t, s_t = _online_lse(m_t, s_t, T, row_t, row_mask, cols, full_end, n_vocab, inv_temp, True)
        lse_s = tl.where(row_mask, m_s, 0.0) + tl.math.log2(tl.where(row_mask, s_s, 1.0)) * LN2
        lse_t = tl.where(row_mask, m_t, 0.0) + tl.math.log2(tl.where(row_mask, s_t, 1.0)) * LN2

    # ---- pass 2: the divergence and Σ q a; log-space inputs write their gradient q a (or -p) here
    scale = zero
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(SCALE + rows64 * 0, mask=row_mask, other=0.0).to(tl.float32), 0.0)
    d_sum, qa_sum = zero, zero
    grad_rows = GRAD + rows64[:, None] * stride_g
    for start in range(0, tl.cdiv(n_vocab, BLOCK_V) * BLOCK_V, BLOCK_V):
        vocab, mask, x, y = _tile_logs(S, T, row_s, row_t, row_mask, cols, start, n_vocab, inv_temp, lse_s, lse_t,
                                       LOGITS, True)
        d, qa, q, p = _terms(x, y, mask, beta, log_beta, log_1m_beta, MODE)
        d_sum += tl.sum(d, axis=1)
        qa_sum += tl.sum(qa, axis=1)
        if WRITE_GRAD and not LOGITS:
            tl.store(grad_rows + vocab[None, :], (qa * scale[:, None]).to(GRAD.dtype.element_ty), mask=mask)
    tl.store(LOSS + rows64, tl.where(valid, d_sum, 0.0), mask=row_mask)

    # ---- pass 3 (logits): dD/ds = (q a - q Σ q a) / T, or (q - p) / T for the forward KL
    if WRITE_GRAD and LOGITS:
        for start in range(0, tl.cdiv(n_vocab, BLOCK_V) * BLOCK_V, BLOCK_V):
            vocab, mask, x, y = _tile_logs(S, T, row_s, row_t, row_mask, cols, start, n_vocab, inv_temp, lse_s,
                                           lse_t, LOGITS, True)
            d, qa, q, p = _terms(x, y, mask, beta, log_beta, log_1m_beta, MODE)
            if MODE == 0:
                ds = q - p
            else:
                ds = qa - q * qa_sum[:, None]
            tl.store(grad_rows + vocab[None, :], (ds * (scale * inv_temp)[:, None]).to(GRAD.dtype.element_ty),
                     mask=mask)


def _mode(beta: float) -> int:
    return FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else JSD


def divergence_rows(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, *, beta: float,
                    logits: bool, temperature: float = 1.0, ignore_index: int = -100,
                    grad: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row fp32 divergence of ``student`` / ``teacher`` ``[rows, vocab]`` (log-probabilities, or logits with
    ``logits``); with ``grad`` (may be ``student`` itself) also writes ``∂D/∂student · scale`` there (``scale``: a
    one-element tensor)."""
    n_rows, n_vocab = student.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=student.device)
    if n_rows == 0:
        return loss
    cfg = dict(BLOCK_T=1, BLOCK_V=4096, num_warps=8) if on_gpu(student.device) else \
        dict(BLOCK_T=16, BLOCK_V=1024, num_warps=4)
    cfg["BLOCK_V"] = min(cfg["BLOCK_V"], max(16, next_pow2(n_vocab)))
    write = grad is not None
    _divergence_kernel[(triton.cdiv(n_rows, cfg["BLOCK_T"]),)](
        student, teacher, labels if labels is not None else loss, loss, grad if write else student,
        scale if write else loss, student.stride(0), teacher.stride(0), grad.stride(0) if write else 0, n_rows,
        n_vocab, int(ignore_index), 1.0 / float(temperature), float(beta),
        math.log(beta) if beta > 0 else 0.0, math.log(1.0 - beta) if beta < 1 else 0.0,
        MODE=_mode(beta), LOGITS=logits, HAS_LABELS=labels is not None, WRITE_GRAD=write, **cfg)
    return loss


def _valid_count(labels: torch.Tensor | None, n_rows: int, ignore_index: int, device) -> torch.Tensor:
    if labels is None:
        return torch.full((), float(n_rows), device=device)
    return (labels != ignore_index).sum().float()


class DivergenceFunction(torch.autograd.Function):
    """``student_logp``, ``teacher_logp`` ``[rows, vocab]`` (log-space), ``labels[rows]`` or None -> the mean
    divergence over the counted rows; the gradient flows to the student (the teacher is a target)."""

    @staticmethod
    def forward(ctx, student, teacher, labels, beta, ignore_index):
        n = _valid_count(labels, student.shape[0], ignore_index, student.device)
        scale = (1.0 / n.clamp_min(1.0)).reshape(1)
        need = ctx.needs_input_grad[0]
        grad = torch.empty_like(student) if need else None
        with kernel_range("tritonlm::jsd_fwd"):
            rows = divergence_rows(student, teacher, labels, beta=beta, logits=False, ignore_index=ignore_index,
                                   grad=grad, scale=scale if need else None)
        ctx.save_for_backward(grad if need else rows)
        return rows.sum() * scale[0]

    @staticmethod
    @first_order_backward
    def backward(ctx, grad_loss):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None


def _check_beta(op: str, beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        raise ValueError(f"{op}: beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta!r}")


def _pair_rows(op: str, student: torch.Tensor, teacher: torch.Tensor, labels):
    if student.shape != teacher.shape or student.dim() < 1:
        raise ValueError(f"{op}: student {tuple(student.shape)} and teacher {tuple(teacher.shape)} must have one shape "
                         "[..., vocab] (one vocabulary)")
    check_float(op, student, teacher)
    check_device(op, student, teacher, *([labels] if labels is not None else []))
    if labels is not None and labels.shape != student.shape[:-1]:
        raise ValueError(f"{op}: shift_labels {tuple(labels.shape)} must be the inputs' shape without the vocabulary "
                         f"{tuple(student.shape[:-1])}")
    v = student.shape[-1]
    return (student.reshape(-1, v).contiguous(), teacher.reshape(-1, v).contiguous(),
            None if labels is None else labels.reshape(-1))


def jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5, *,
        shift_labels: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """The generalised Jensen-Shannon divergence ``JSD_β(P || Q)`` (module docstring; Liger's ``LigerJSD``): the
    student's and teacher's log-probabilities ``[..., vocab]`` -> the mean over tokens (those whose ``shift_labels``
    are not ``ignore_index``) of the per-token divergence summed over the vocabulary; differentiable in the student's.
    ``beta`` 0 and 1 are the forward and reverse KL."""
    _check_beta("jsd", beta)
    s, t, labels = _pair_rows("jsd", student_logp, teacher_logp, shift_labels)
    return DivergenceFunction.apply(s, t, labels, float(beta), int(ignore_index))


def kl_div(student_logp: torch.Tensor, teacher_logp: torch.Tensor, *, reverse: bool = False,
           shift_labels: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
    """``KL(P || Q)`` (forward: mode covering, ``F.kl_div(student_logp, teacher_logp, log_target=True)`` summed over
    the vocabulary) or, with ``reverse``, ``KL(Q || P)`` (mode seeking), averaged over the counted tokens."""
    return jsd(student_logp, teacher_logp, 1.0 if reverse else 0.0, shift_labels=shift_labels,
               ignore_index=ignore_index)


class FusedLinearJSDFunction(torch.autograd.Function):
    """Chunked ``JSD_β(softmax(t / T) || softmax(s / T))`` with ``s = h_s W_sᵀ``, ``t = h_t W_tᵀ`` (module
    docstring); the gradients, to the student's hidden states and weight only, are finished in the forward."""

    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, labels, beta, ignore_index, temperature, compute_dtype):
        n_rows, n_vocab = h_s.shape[0], w_s.shape[0]
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        hs, ws, ht, wt = (x.to(compute_dtype) for x in (h_s, w_s, h_t, w_t))
        n = _valid_count(labels, n_rows, ignore_index, h_s.device)
        scale = (1.0 / n.clamp_min(1.0)).reshape(1)
        dh = torch.empty_like(h_s) if need_dh else None
        dw = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device) if need_dw else None
        student = _chunk_buffer(n_rows, n_vocab, compute_dtype, h_s.device)
        teacher = torch.empty_like(student)
        total = torch.zeros((), dtype=torch.float32, device=h_s.device)
        step = student.shape[0]
        with _no_autocast(h_s.device), kernel_range("tritonlm::fused_linear_jsd"):
            for lo in range(0, n_rows, step):
                hi = min(n_rows, lo + step)
                s = torch.mm(hs[lo:hi], ws.t(), out=student[:hi - lo, :n_vocab])
                t = torch.mm(ht[lo:hi], wt.t(), out=teacher[:hi - lo, :n_vocab])
                rows = divergence_rows(s, t, None if labels is None else labels[lo:hi], beta=beta, logits=True,
                                       temperature=temperature, ignore_index=ignore_index,
                                       grad=s if (need_dh or need_dw) else None, scale=scale)
                total += rows.sum()
                if dh is not None:
                    matmul_into(dh[lo:hi], s, ws)
                if dw is not None:
                    accumulate_weight_grad(dw, s, hs[lo:hi])
        del student, teacher
        ctx.weight_dtype = w_s.dtype
        ctx.save_for_backward(*(x for x in (dh, dw) if x is not None))
        ctx.has = (dh is not None, dw is not None)
        return total * scale[0]

    @staticmethod
    @first_order_backward
    def backward(ctx, grad_loss):
        saved = list(ctx.saved_tensors)
        dh = saved.pop(0) if ctx.has[0] else None
        dw = saved.pop(0) if ctx.has[1] else None
        g = grad_loss.reshape(())
        return (None if dh is None else dh * g.to(dh.dtype), None if dw is None else (dw * g).to(ctx.weight_dtype),
                None, None, None, None, None, None, None)


def fused_linear_jsd(student_input: torch.Tensor, student_weight: torch.Tensor, teacher_input: torch.Tensor,
                     teacher_weight: torch.Tensor, shift_labels: torch.Tensor | None = None, jsd_beta: float = 0.5,
                     ignore_index: int = -100, temperature: float = 1.0) -> torch.Tensor:
    """Liger's ``LigerFusedLinearJSD`` call: ``JSD_β`` between the teacher's and the student's softmax at
    ``temperature``, from their hidden states ``[..., d_s]`` / ``[..., d_t]`` and LM-head weights ``[vocab, d_s]`` /
    ``[vocab, d_t]``, averaged over the tokens whose ``shift_labels`` are not ``ignore_index`` (all without labels),
    never forming either model's ``[tokens, vocab]`` logits. ``jsd_beta`` 0 / 1: forward / reverse KL. Gradients
    reach the student's input and weight; the teacher is a target."""
    op = "fused_linear_jsd"
    _check_beta(op, jsd_beta)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{op}: temperature must be a number > 0, got {temperature!r}")
    if student_weight.dim() != 2 or teacher_weight.dim() != 2 or student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"{op}: student_weight {tuple(student_weight.shape)} and teacher_weight "
                         f"{tuple(teacher_weight.shape)} must be [vocab, d] over one vocabulary")
    if student_input.shape[-1] != student_weight.shape[1] or teacher_input.shape[-1] != teacher_weight.shape[1]:
        raise ValueError(f"{op}: inputs [..., d] must match their weights' d: student {tuple(student_input.shape)} x "
                         f"{tuple(student_weight.shape)}, teacher {tuple(teacher_input.shape)} x "
                         f"{tuple(teacher_weight.shape)}")
    if student_input.shape[:-1] != teacher_input.shape[:-1]:
        raise ValueError(f"{op}: student_input {tuple(student_input.shape)} and teacher_input "
                         f"{tuple(teacher_input.shape)} must hold the same tokens")
    if shift_labels is not None and shift_labels.shape != student_input.shape[:-1]:
        raise ValueError(f"{op}: shift_labels {tuple(shift_labels.shape)} must be [...] = "
                         f"{tuple(student_input.shape[:-1])}")
    check_float(op, student_input, student_weight, teacher_input, teacher_weight)
    check_device(op, student_input, student_weight, teacher_input, teacher_weight,
                 *([shift_labels] if shift_labels is not None else []))
    compute_dtype = autocast_dtype(student_input.device.type) or student_input.dtype
    return FusedLinearJSDFunction.apply(
        student_input.reshape(-1, student_input.shape[-1]), student_weight,
        teacher_input.reshape(-1, teacher_input.shape[-1]).detach(), teacher_weight.detach(),
        None if shift_labels is None else shift_labels.reshape(-1), float(jsd_beta), int(ignore_index),
        float(temperature), compute_dtype)
