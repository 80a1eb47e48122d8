"""Helpers shared by the ops that read logits ``[rows, vocab]`` (cross-entropy, log-probs, distillation) or
make them chunk by chunk from an lm-head weight: the softcap, one tile's load, and the chunk matmuls. A module of
its own so that those ops can build on each other without importing each other both ways."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------------
# kernel helpers (inlined into each op's kernels)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """``softcap · tanh(x / softcap)``; tanh(y) = 1 - 2 / (exp(2y) + 1) saturates cleanly at ±1."""
    if HAS_SOFTCAP:
        return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))
    return x


@triton.jit
def load_logit_tile(logit_rows, row_mask, cols, start, n_vocab, softcap, HAS_SOFTCAP: tl.constexpr,
                    MASK_COLS: tl.constexpr):
    """``(vocab, mask, z)`` of the tile at column ``start``: z the (softcapped) fp32 logits. Whole tiles
    (``MASK_COLS=False``) need no column mask, so their loads stay 128-bit vectors."""
    vocab = start + cols
    if MASK_COLS:
        mask = row_mask[:, None] & (vocab[None, :] < n_vocab)
    else:
        mask = row_mask[:, None] & (vocab[None, :] >= 0)
    x = tl.load(logit_rows + vocab[None, :], mask=mask, other=0.0).to(tl.float32)
    return vocab, mask, capped(x, softcap, HAS_SOFTCAP)


# ----------------------------------------------------------------------------------------------------
# chunk matmuls of the fused lm-head ops
# ----------------------------------------------------------------------------------------------------
_MM_OUT_DTYPE = [True]  # whether torch.mm takes out_dtype on CUDA (torch >= 2.8); found out on first use
_ADDMM_OUT_DTYPE = [True]  # whether torch.addmm takes out_dtype (accumulating into an fp32 out) here


def accumulate_weight_grad(dweight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``dweight (fp32) += grad_logitsᵀ @ hidden`` in place (no ``[vocab, d]`` temporary); on CUDA a low-precision
    product accumulates straight into the fp32 buffer."""
    if grad_logits.dtype == torch.float32:
        dweight.addmm_(grad_logits.t(), hidden)
        return
    if grad_logits.device.type in ("cuda", "meta") and _ADDMM_OUT_DTYPE[0]:
        try:  # beta = 1: cuBLAS adds the product into the buffer it reads
            torch.addmm(dweight, grad_logits.t(), hidden, out_dtype=torch.float32, out=dweight)
            return
        except (TypeError, RuntimeError):
            _ADDMM_OUT_DTYPE[0] = False
    # (older torch: the product as an fp32 temporary, then added)
    if grad_logits.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            dweight += torch.mm(grad_logits.t(), hidden, out_dtype=torch.float32)
            return
        except (TypeError, RuntimeError):
            _MM_OUT_DTYPE[0] = False
    dweight += (grad_logits.t() @ hidden).float()


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.getautocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    except RuntimeError:  # a device type without autocast (meta)
        pass
    return None
