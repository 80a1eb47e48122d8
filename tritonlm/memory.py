"""Activation memory: bytes autograd saves for backward, measured with ``saved_tensors_hooks``.

Counting is by storage, once each (a tensor saved by three projections counts once), and parameters
are excluded: what remains is what a training step keeps alive between forward and backward. Blocks
are built on the ``meta`` device, so any width and sequence length is measured instantly on any machine
(the fused kernels' custom ops have shape-only implementations for meta tensors).
"""

from __future__ import annotations

import contextlib

import torch

from .config import ModelConfig


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_activation_bytes(module: torch.nn.Module, *inputs, **kwargs) -> int:
    """Bytes of distinct non-parameter storages autograd saves during ``module(*inputs, **kwargs)``."""
    params = {_storage_key(p) for p in module.parameters()} | {_storage_key(b) for b in module.buffers()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        key = _storage_key(t)
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs, **kwargs)
    return sum(saved.values())


def block_activation_bytes(cfg: ModelConfig, seq_len: int, batch_size: int = 1,
                           dtype: torch.dtype = torch.float32) -> dict:
    """Saved-for-backward bytes of one reference and one fused TransformerBlock of ``cfg``'s width."""
    from .modules import reference
    from .modules.fused import TransformerBlock as FusedBlock

    out = {}
    for name, cls in (("reference", reference.TransformerBlock), ("fused", FusedBlock)):
        block = cls(cfg.d_model, cfg.num_heads, cfg.d_ff, max(seq_len, cfg.context_length),
                    cfg.rope_theta if cfg.position == "rope" else None, device="meta", dtype=dtype,
                    norm=cfg.norm, ffn=cfg.ffn, norm_position=cfg.norm_position, num_kv_heads=cfg.num_kv_heads)
        x = torch.empty(batch_size, seq_len, cfg.d_model, device="meta", dtype=dtype, requires_grad=True)
        out[name] = saved_activation_bytes(block, x)
    out["ratio"] = out["fused"] / out["reference"]
    return out


def activation_table(cfg: ModelConfig, seq_lens=(512, 1024, 2048, 4096), batch_size: int = 1,
                     dtype: torch.dtype = torch.float32) -> str:
    """A text table: per-layer saved bytes, reference vs fused, by sequence length."""
    rows = []
    for s in seq_lens:
        r = block_activation_bytes(cfg, s, batch_size, dtype)
        rows.append((s, r["reference"], r["fused"], r["ratio"]))
    lines = [f"{'seq':>6}  {'reference':>12}  {'fused':>12}  {'fused/ref':>9}", "-" * 46]
    for s, ref, fz, ratio in rows:
        lines.append(f"{s:>6}  {ref / 2**20:>9.1f} MiB  {fz / 2**20:>9.1f} MiB  {ratio:>9.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# peak live tensor bytes of a computation (any device, CPU included)
# ----------------------------------------------------------------------------------------------------
def peak_live_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak)``: the most bytes of tensor storage created
    during the call that were alive at one time (storages existing before the call do not count).

    Every aten op's outputs are seen through a ``TorchDispatchMode`` (autograd's backward ops too), each new
    storage is counted once when it appears and uncounted when PyTorch frees it (a finalizer on the storage
    object, which PyTorch keeps as long as the storage lives). Works on meta tensors too (sizes without
    data). Memory a Triton kernel uses internally (registers, or the interpreter's numpy temporaries on CPU)
    is not tensor storage and is not counted.
    """
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    state = {"live": 0, "peak": 0}
    counted: set[int] = set()
    before = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}

    def release(key: int, nbytes: int):
        counted.discard(key)
        state["live"] -= nbytes

    class Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, f_args=(), f_kwargs=None):
            out = func(*f_args, **(f_kwargs or {}))
            # views, in-place and out= results alias an input's storage (their schema returns carry alias
            # info): that storage is counted already, or existed before
            if any(r.alias_info is not None for r in func._schema.returns):
                return out
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()  # one Python object per live storage, so id() names it
                key, nbytes = id(storage), storage.nbytes()
                if key in counted or key in before or nbytes == 0:
                    continue
                counted.add(key)
                state["live"] += nbytes
                state["peak"] = max(state["peak"], state["live"])
                weakref.finalize(storage, release, key, nbytes)
            return out

    with Tracker():
        result = fn(*args, **kwargs)
    return result, state["peak"]


@contextlib.contextmanager
def _skip_triton_launches():
    """Triton launches become no-ops (meta tensors have no data to compute on), compiled or interpreted."""
    from .kernels._common import INTERPRETING, capture_launches

    if not INTERPRETING:
        with capture_launches(keep=False):
            yield
        return
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = original


def _eager_and_fused_peaks(eager, fused, leaves, device) -> dict:
    """``{"eager", "fused", "ratio"}``: the peak live bytes of each (gradients of ``leaves`` cleared before each)."""
    out = {}
    for name, fn in (("eager", eager), ("fused", fused)):
        for t in leaves:
            t.grad = None
        with _skip_triton_launches() if torch.device(device).type == "meta" else contextlib.nullcontext():
            out[name] = peak_live_bytes(fn)[1]
    out["ratio"] = out["fused"] / out["eager"]
    return out


def lm_head_loss_peak_bytes(n_tokens: int, d_model: int, vocab_size: int, dtype: torch.dtype = torch.float32,
                            device="meta") -> dict:
    """Peak live tensor bytes of forward + backward of LM head + loss: eager (``hidden @ Wᵀ`` then
    ``F.cross_entropy``) vs fused ``linear_cross_entropy``, hidden and weight requiring gradients.

    On ``device="meta"`` (any size, instantly, no kernel needed) the fused path runs its real chunk loop with
    the Triton launches recorded instead of executed, so every buffer it allocates is counted; on CPU (with
    ``TRITON_INTERPRET=1``) or CUDA it runs for real.
    """
    import torch.nn.functional as F

    from .kernels import linear_cross_entropy

    hidden = torch.randn(n_tokens, d_model, dtype=dtype, device=device, requires_grad=True)
    weight = torch.randn(vocab_size, d_model, dtype=dtype, device=device, requires_grad=True)
    targets = torch.randint(0, vocab_size, (n_tokens,), device=device)

    def eager():
        F.cross_entropy((hidden @ weight.t()).float(), targets).backward()

    def fused():
        linear_cross_entropy(hidden, weight, targets).backward()

    return _eager_and_fused_peaks(eager, fused, (hidden, weight), device)


def log_probs_peak_bytes(n_tokens: int, d_model: int, vocab_size: int, dtype: torch.dtype = torch.float32,
                         device="meta") -> dict:
    """Peak live tensor bytes of forward + backward of per-token log-probabilities and entropy (the post-training
    head): the materialised-logits torch path (``log_softmax(hidden @ Wᵀ)``, gather, ``-Σ p log p``) vs fused
    ``linear_log_probs(..., return_entropy=True)``, hidden and weight requiring gradients. ``device`` as in
    :func:`lm_head_loss_peak_bytes` (meta: any size, instantly)."""
    from .kernels import linear_log_probs

    hidden = torch.randn(n_tokens, d_model, dtype=dtype, device=device, requires_grad=True)
    weight = torch.randn(vocab_size, d_model, dtype=dtype, device=device, requires_grad=True)
    targets = torch.randint(0, vocab_size, (n_tokens,), device=device)

    def eager():
        z = torch.log_softmax((hidden @ weight.t()).float(), -1)
        (z.gather(-1, targets[:, None])[:, 0].sum() - (z.exp() * z).sum()).backward()

    def fused():
        log_p, entropy = linear_log_probs(hidden, weight, targets, return_entropy=True)
        (log_p.sum() + entropy.sum()).backward()

    return _eager_and_fused_peaks(eager, fused, (hidden, weight), device)
