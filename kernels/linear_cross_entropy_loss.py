"""Linear layer + cross-entropy without ever holding the ``[tokens, vocab]`` logits.

``loss = cross_entropy(hidden @ weightᵀ, targets)`` computed chunk by chunk over tokens. Per chunk of
``chunk_rows`` tokens (``CHUNK_BYTES`` = 256 MiB of logits, at least ``CHUNK_MIN_ROWS`` = 1024 tokens)::

    logits_c  = hidden_c @ weightᵀ                      cuBLAS, fp32 accumulation, compute dtype out
    loss_c    = cross-entropy kernel on logits_c       Triton (.cross_entropy): lse, loss, and dL/dlogits_c
                                                        written over logits_c in place
    dhidden_c = dlogits_c @ weight                      cuBLAS
    dweight  += dlogits_cᵀ @ hidden_c                   cuBLAS, accumulated in an fp32 [vocab, d] buffer

so the only vocabulary-sized activations alive are one chunk's logits (reused as their own gradient, in one
buffer whose rows are padded to 16 elements for aligned, vectorised loads) and
the fp32 weight-gradient accumulator: peak extra memory O(chunk · vocab + vocab · d), whatever the
number of tokens. For ``reduction="mean"``/``"sum"`` the gradients are finished in the forward (three
matmuls per chunk in all, as eager's forward + backward) and the backward only scales them by
``grad_output``; for ``"none"`` the per-token gradient scales are only known in backward, which then
recomputes each chunk's logits (one extra matmul). Without gradients the forward does one matmul per chunk.

Traffic model, per chunk of ``c`` tokens (vocab ``V``, width ``d``, compute element size ``e``): W is read twice
(the logits and dhidden matmuls, ``2·V·d·e``), the chunk's logits are written once, read and overwritten by the loss
kernel and read by both gradient matmuls (about ``4·c·V·e``), and the fp32 weight gradient is read and written once
(``8·V·d``) -- accumulated in place: ``addmm`` into the one fp32 buffer with ``beta = 1`` (on CUDA a bf16 / fp16
product goes straight into it through ``out_dtype``), so no ``[V, d]`` temporary is ever made, whatever the number
of chunks. The three matmuls do ``6·c·V·d`` flops, so a chunk's arithmetic intensity is about
``6·c·d / ((2·e + 8)·d + 4·c·e)`` flop/byte: in bf16 at d = 4096, 63 at c = 128 (memory-bound: the old 16M-logit
chunks gave 128 tokens at Llama 3's vocabulary) and 439 at c = 1024, above an H100's ~295 (989 dense bf16 TFLOP/s
over 3.35 TB/s). Hence chunks sized by bytes with a floor of 1024 tokens: GPT-2's vocabulary gets 1280 tokens in
fp32 and 2560 in bf16, Llama 3's 1024, and the head + loss peak at 8K x 50257 x 768 fp32 stays under a tenth of
eager's (``profiles/lm_head_loss_memory.md``). ``tests/test_loss.py`` checks the model on meta tensors by recording
the aten ops of a forward + backward: chunk rows, W bytes read, and no ``[V, d]`` result per chunk.

Mixed dtypes: the matmuls run in the autocast dtype when autocast is on, else in ``hidden``'s dtype (a
weight of another dtype is cast once per call); the loss, logsumexp and weight gradient accumulate in fp32
and the gradients come back in each input's own dtype.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from ._common import check_device, check_float, first_order_backward
from ._ranges import kernel_range
from ._vocab import accumulate_weight_grad, autocast_dtype, matmul_into
from .cross_entropy_loss import (
    check_loss_options,
    cross_entropy_rows,
    mean_scale,
    metrics_output,
    reduce_loss,
)
from .cross_entropy_loss import check_targets as _check_targets
from .log_probs import log_prob_stats

#: bytes of logits held at once (one chunk, reused as its own gradient): 256 MiB
CHUNK_BYTES = 1 << 28
#: tokens per chunk at least, whatever the vocabulary: W is read twice per chunk, so fewer, larger chunks
CHUNK_MIN_ROWS = 1024
#: chunk rows are a multiple of this (cuBLAS / tensor-core tiles) when the budget allows more than the minimum
CHUNK_ROW_MULTIPLE = 128


def chunk_rows(n_rows: int, n_vocab: int, element_size: int = 4) -> int:
    """Tokens per chunk: as many as fit ``CHUNK_BYTES`` of logits (rows padded to 16 elements) in the compute dtype
    of ``element_size`` bytes, rounded down to a multiple of ``CHUNK_ROW_MULTIPLE``, at least ``CHUNK_MIN_ROWS``.

    GPT-2 (vocab 50257): 1280 tokens in fp32, 2560 in bf16; Llama 3 (128256): 1024 in bf16 and fp32."""
    row_bytes = triton.cdiv(max(1, n_vocab), 16) * 16 * element_size
    rows = CHUNK_BYTES // row_bytes // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE
    return max(1, min(n_rows, max(CHUNK_MIN_ROWS, rows)))


def _chunks(n_rows: int, n_vocab: int, element_size: int):
    step = chunk_rows(n_rows, n_vocab, element_size)
    return [(start, min(n_rows, start + step)) for start in range(0, n_rows, step)]


def _weight_grad_buffer(weight: torch.Tensor) -> torch.Tensor:
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def linear_cross_entropy_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None,
                                 grad_scale: torch.Tensor, need_dh: bool, need_dw: bool,
                                 compute_dtype: torch.dtype, want_argmax: bool = False, want_entropy: bool = False):
    """Chunked forward. Returns fp32 per-row ``(loss, z_term)``, when asked ``dhidden`` (hidden's dtype) and the fp32
    ``dweight`` of ``sum(loss · grad_scale)``, and with ``want_argmax`` / ``want_entropy`` each row's predicted token
    (int64) and the entropy of its softmax (fp32) from the same chunk of logits (one more read of the chunk, by the
    log-prob statistics kernel, before the loss kernel turns it into its gradient); empty tensors when not asked."""
    opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    n_rows, n_vocab = hidden.shape[0], weight.shape[0]
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    loss = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    z_term = torch.empty_like(loss)
    dh = torch.empty_like(hidden) if need_dh else None
    dw = _weight_grad_buffer(weight) if need_dw else None
    autocast_off = torch.autocast(hidden.device.type, enabled=False) if hidden.device.type in ("cuda", "cpu") \
        else contextlib.nullcontext()  # (meta tensors: shape-only accounting runs, no autocast there)
    # one chunk buffer, rows padded to a multiple of 16 elements so that every row starts 16-byte aligned
    # and the loss kernel's loads vectorise (GPT-2's 50257 columns would not)
    padded = triton.cdiv(n_vocab, 16) * 16
    element_size = torch.finfo(compute_dtype).bits // 8
    buffer = torch.empty(chunk_rows(n_rows, n_vocab, element_size), padded, dtype=compute_dtype,
                         device=hidden.device)
    predicted = torch.empty(n_rows if want_argmax else 0, dtype=torch.int64, device=hidden.device)
    entropy = torch.empty(n_rows if want_entropy else 0, dtype=torch.float32, device=hidden.device)
    with autocast_off:
        for lo, hi in _chunks(n_rows, n_vocab, element_size):
            # ---- this chunk's logits; the kernel overwrites them with their gradient when one is wanted
            logits = torch.mm(h[lo:hi], w.t(), out=buffer[:hi - lo, :n_vocab])
            grad = logits if (need_dh or need_dw) else None
            scale = grad_scale if grad_scale.numel() == 1 else grad_scale[lo:hi]  # one for all, or per row
            if want_argmax or want_entropy:  # (the metrics read the logits before they become their gradient)
                _, _, c_ent, c_best = log_prob_stats(logits, None, softcap=softcap, entropy=want_entropy,
                                                     argmax=want_argmax)
                if want_argmax:
                    predicted[lo:hi] = c_best
                if want_entropy:
                    entropy[lo:hi] = c_ent
            loss[lo:hi], _, z_term[lo:hi] = cross_entropy_rows(logits, targets[lo:hi], grad=grad,
                                                               grad_scale=scale, **opts)
            # ---- dhidden_c = dlogits_c W ; dW += dlogits_cᵀ hidden_c
            if dh is not None:
                matmul_into(dh[lo:hi], logits, w)
            if dw is not None:
                accumulate_weight_grad(dw, logits, h[lo:hi])
            del logits, grad
    del buffer
    empty = hidden.new_empty(0)
    return loss, z_term, (dh if dh is not None else empty), (dw if dw is not None else empty), predicted, entropy


def linear_cross_entropy_backward(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                  targets: torch.Tensor, ignore_index: int, label_smoothing: float,
                                  z_loss: float, softcap: float | None, need_dh: bool, need_dw: bool,
                                  compute_dtype: torch.dtype):
    """Backward of ``reduction="none"``: recompute each chunk's logits, scale row i's gradient by
    ``grad_rows[i]``. Returns ``(dhidden, dweight fp32)`` (empty tensors when not asked)."""
    _, _, dh, dw, _, _ = linear_cross_entropy_forward(hidden, weight, targets, ignore_index, label_smoothing, z_loss,
                                                      softcap, grad_rows.float(), need_dh, need_dw, compute_dtype)
    return dh, dw


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile; shapes on meta tensors)
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::linear_cross_entropy_fwd", mutates_args=())
def _lce_fwd_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                label_smoothing: float, z_loss: float, softcap: float | None, grad_scale: torch.Tensor,
                need_dh: bool, need_dw: bool, compute_dtype: torch.dtype, want_argmax: bool, want_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return linear_cross_entropy_forward(hidden, weight, targets, ignore_index, label_smoothing, z_loss, softcap,
                                        grad_scale, need_dh, need_dw, compute_dtype, want_argmax, want_entropy)


@_lce_fwd_op.register_fake
def _(hidden, weight, targets, ignore_index, label_smoothing, z_loss, softcap, grad_scale, need_dh, need_dw,
      compute_dtype, want_argmax, want_entropy):
    rows = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape, dtype=torch.float32) if need_dw else hidden.new_empty(0)
    n = hidden.shape[0]
    return (rows, torch.empty_like(rows), dh, dw, hidden.new_empty(n if want_argmax else 0, dtype=torch.int64),
            hidden.new_empty(n if want_entropy else 0, dtype=torch.float32))


@torch.library.custom_op("tritonlm::linear_cross_entropy_bwd", mutates_args=())
def _lce_bwd_op(grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None, need_dh: bool,
                need_dw: bool, compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_cross_entropy_backward(grad_rows, hidden, weight, targets, ignore_index, label_smoothing,
                                         z_loss, softcap, need_dh, need_dw, compute_dtype)


@_lce_bwd_op.register_fake
def _(grad_rows, hidden, weight, targets, ignore_index, label_smoothing, z_loss, softcap, need_dh, need_dw,
      compute_dtype):
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape, dtype=torch.float32) if need_dw else hidden.new_empty(0)
    return dh, dw


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``hidden[rows, d]``, ``weight[vocab, d]``, ``targets[rows]`` -> (loss, z-loss term), reduced.

    "mean"/"sum": gradients finished in the forward and scaled by ``grad_output`` in backward.
    "none": the backward recomputes the chunks with ``grad_output[row]`` as each row's scale.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, label_smoothing, z_loss, softcap, reduction,
                compute_dtype, want_argmax=False, want_entropy=False):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads_now = reduction != "none"
        n_valid, scale = mean_scale(targets, ignore_index, reduction)
        # (meta tensors run the real chunk loop too, so memory accounting sees every chunk buffer)
        fwd = _lce_fwd_op if torch.compiler.is_compiling() else linear_cross_entropy_forward
        with kernel_range("tritonlm::linear_cross_entropy_fwd"):
            loss, z_term, dh, dw, predicted, entropy = fwd(
                hidden, weight, targets, ignore_index, label_smoothing, z_loss, softcap, scale,
                grads_now and need_dh, grads_now and need_dw, compute_dtype, want_argmax, want_entropy)
        ctx.reduction, ctx.compute_dtype, ctx.weight_dtype = reduction, compute_dtype, weight.dtype
        ctx.opts = (ignore_index, label_smoothing, z_loss, softcap)
        if grads_now:
            ctx.save_for_backward(dh, dw)
        else:
            ctx.save_for_backward(hidden, weight, targets)
        ctx.mark_non_differentiable(z_term, predicted, entropy)
        return (reduce_loss(loss, n_valid, reduction, loss.shape), reduce_loss(z_term, n_valid, reduction, loss.shape),
                predicted, entropy)

    @staticmethod
    @first_order_backward
    def backward(ctx, grad_loss, _grad_z, _grad_predicted=None, _grad_entropy=None):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.reduction != "none":
            # the finished gradients are private buffers: scaled in place (no second [vocab, d] fp32 copy),
            # which is why a second backward through the same graph is refused
            if getattr(ctx, "consumed", False):
                raise RuntimeError("linear_cross_entropy: backward through the same graph twice (retain_graph=True) "
                                   "is not supported; run the forward again")
            ctx.consumed = True
            dh, dw = ctx.saved_tensors
            g = grad_loss.reshape(())
        else:
            hidden, weight, targets = ctx.saved_tensors
            bwd = _lce_bwd_op if torch.compiler.is_compiling() else linear_cross_entropy_backward
            with kernel_range("tritonlm::linear_cross_entropy_bwd"):
                dh, dw = bwd(grad_loss.reshape(-1), hidden, weight, targets, *ctx.opts, need_dh, need_dw,
                             ctx.compute_dtype)
            g = None
        if need_dh and g is not None:
            dh = dh.mul_(g.to(dh.dtype))
        if need_dw:
            dw = (dw.mul_(g) if g is not None else dw).to(ctx.weight_dtype)
        return (dh if need_dh else None), (dw if need_dw else None), None, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float | None = None, reduction: str = "mean", return_z_loss: bool = False,
                         check_targets: bool = True, return_token_accuracy: bool = False,
                         return_predicted_tokens: bool = False, return_entropy: bool = False):
    """``cross_entropy(hidden @ weightᵀ, targets)`` without materialising the ``[tokens, vocab]`` logits.

    Args:
        hidden: ``[..., d]`` final hidden states (fp32, fp16 or bf16).
        weight: ``[vocab, d]`` LM-head weight (may differ in dtype from ``hidden``; see the module docstring).
        targets: ``[...]`` integer ids in ``[0, vocab)`` or ``ignore_index``.
        label_smoothing, z_loss, softcap, reduction: as :func:`tritonlm.kernels.cross_entropy`.
        return_z_loss: also return the z-loss term, reduced like the loss and not differentiable.
        check_targets: verify every target is in range or ``ignore_index`` (one host sync); pass False for targets
            already validated (a training loop whose data was checked once), keeping the step free of syncs.
        return_token_accuracy, return_predicted_tokens, return_entropy: return a
            :class:`~tritonlm.kernels.cross_entropy_loss.CrossEntropyOutput` with these metrics (Liger's fields, plus
            each token's entropy), read from each chunk of logits before the loss kernel turns it into its gradient;
            not differentiable.

    Returns the exact loss (not an approximation); gradients flow to ``hidden`` and ``weight``.
    """
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"linear_cross_entropy: expected hidden[..., d] and weight[vocab, d], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden has d={hidden.shape[-1]} but weight is "
                         f"{tuple(weight.shape)} (expected [vocab, {hidden.shape[-1]}])")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} "
                         "disagree: expected hidden[..., d] and targets[...]")
    if weight.shape[0] == 0:
        raise ValueError("linear_cross_entropy: the vocabulary (weight rows) is empty")
    check_float("linear_cross_entropy", hidden, weight)
    check_device("linear_cross_entropy", hidden, weight, targets)
    check_loss_options("linear_cross_entropy", ignore_index, label_smoothing, z_loss, softcap, reduction)
    if check_targets:
        _check_targets("linear_cross_entropy", targets, weight.shape[0], ignore_index)
    compute_dtype = autocast_dtype(hidden.device.type) or hidden.dtype
    loss, z_term, predicted, entropy = LinearCrossEntropyFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), int(ignore_index),
        float(label_smoothing), float(z_loss), None if softcap is None else float(softcap), reduction,
        compute_dtype, bool(return_token_accuracy or return_predicted_tokens), bool(return_entropy))
    if reduction == "none":
        loss, z_term = loss.view(targets.shape), z_term.view(targets.shape)
    return metrics_output(loss, z_term, predicted, entropy, targets, ignore_index, return_z_loss=return_z_loss,
                          return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens,
                          return_entropy=return_entropy)
