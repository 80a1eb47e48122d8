"""Launchers, custom ops, the autograd Function and flash-linear-attention's two entry points."""

from __future__ import annotations

import torch
import triton

from .._common import check_device, check_float, dot_precision, first_order_backward, use_custom_op
from .._ranges import kernel_range
from .backward import _dqk_kernel, _dv_kernel, _state_bwd_kernel, _wy_bwd_kernel
from .forward import _output_kernel, _recurrent_kernel, _state_kernel, _wy_kernel

CHUNK = 64  # tokens per chunk of the forward (the WY transform's size)
CHUNK_BWD = 32  # tokens per chunk of the backward, which recomputes its own chunking: the result is the same for
                # any chunk size, and 32 keeps its kernels spill-free (SASS report)
BLOCK_V = 16  # state columns per program of the output and per step of the chunk backwards' loops
DQK_BLOCK_V = 16  # state columns per step of the dq / dk backward's loop (spill-free at 16: SASS report)
STATE_BLOCK_V = 16  # state columns per program of the two sequential state passes (more programs to fill the GPU
                    # with: batch x HV x V / 16; and no spills in the backward pass: SASS report)
MAX_HEAD_DIM = 256
WARPS = 8  # the chunk kernels hold several [chunk, 128] fp32 tiles: 8 warps halve each thread's share (SASS report)
STAGES = 1  # no software pipelining: a stage of the fp32 [64, 128] w / u / v_new tiles is 32 KiB of shared memory


def _blocks(x: torch.Tensor, d_k: int, d_v: int, block_v: int = BLOCK_V, chunk: int = CHUNK) -> dict:
    """Tile sizes, and ``OFFS_64`` where a token's element offset in ``x [tokens, heads, d]`` (or any of its
    siblings) could pass 2³¹."""
    tokens, heads = x.shape[0], x.shape[1]
    return dict(BLOCK_C=chunk, BLOCK_K=max(16, triton.next_power_of_2(d_k)),
                BLOCK_V=min(block_v, max(16, triton.next_power_of_2(d_v))),
                OFFS_64=(tokens + chunk) * max(heads, 1) * max(d_k, d_v) >= 2**31)


def chunk_table(cu_seqlens: torch.Tensor, n_tokens: int, chunk: int = CHUNK) -> tuple:
    """``(chunk_start, chunk_end, chunk_offset, n_programs, chunk)`` for documents ``cu_seqlens [docs + 1]`` on the
    packed token axis, made on the device without reading it back (no host sync): document ``n``'s chunks are
    numbered from ``chunk_offset[n]``; the grid has ``n_programs`` (an upper bound of the chunk count: ``Σ ceil(len /
    C) <= (tokens + docs·(C − 1)) / C``), and a program past the last chunk sees ``start == end`` and returns."""
    n_docs = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int64)
    per_doc = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    chunk_offset = torch.cat([cu.new_zeros(1), per_doc.cumsum(0)])
    n_programs = max(1, (n_tokens + n_docs * (chunk - 1)) // chunk)
    index = torch.arange(n_programs, device=cu.device)
    doc = torch.searchsorted(chunk_offset[1:], index, right=True).clamp_(max=n_docs - 1)
    start = cu[doc] + (index - chunk_offset[doc]) * chunk
    end = torch.minimum(start + chunk, cu[doc + 1])
    valid = index < chunk_offset[-1]
    start, end = torch.where(valid, start, 0), torch.where(valid, end, 0)
    return start.to(torch.int32), end.to(torch.int32), chunk_offset.to(torch.int32), n_programs, chunk


def _dense_cu_seqlens(batch: int, seq: int, device) -> torch.Tensor:
    return torch.arange(batch + 1, device=device, dtype=torch.int32) * seq


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, ...]`` as a contiguous ``[batch·seq, ...]``."""
    return x.reshape(-1, *x.shape[2:]).contiguous()


def _wy(k, v, g, beta, table, store_t: bool, precision: dict):
    """Launch the WY kernel: ``(w, u, gcum, t or None)``."""
    tokens, n_heads, d_k = k.shape
    n_v_heads, d_v = v.shape[1:]
    start, end, _, n_programs, chunk = table
    w = torch.empty(tokens, n_v_heads, d_k, dtype=torch.float32, device=k.device)
    u = torch.empty(tokens, n_v_heads, d_v, dtype=torch.float32, device=k.device)
    gcum = torch.empty(tokens, n_v_heads, dtype=torch.float32, device=k.device)
    t = (torch.empty(n_programs, n_v_heads, chunk, chunk, dtype=torch.float32, device=k.device) if store_t
         else None)
    _wy_kernel[(n_programs, n_v_heads)](k, v, g, beta, start, end, w, u, gcum, t if store_t else w, n_heads,
                                        n_v_heads, d_k, d_v, STORE_T=store_t, **precision,
                                        **_blocks(v, d_k, d_v, chunk=chunk),
                                        num_warps=WARPS, num_stages=STAGES)
    return w, u, gcum, t


def _states(k, w, u, gcum, cu, table, initial_state, store_final: bool, precision: dict):
    """Launch the state pass: ``(h, v_new, final or None)``."""
    tokens, n_heads, d_k = k.shape
    n_v_heads, d_v = u.shape[1:]
    n_docs = cu.numel() - 1
    _, _, chunk_offset, n_programs, chunk = table
    blocks = _blocks(u, d_k, d_v, STATE_BLOCK_V, chunk)
    h = torch.empty(n_programs, n_v_heads, d_k, d_v, dtype=torch.float32, device=k.device)
    v_new = torch.empty_like(u)
    final = (torch.empty(n_docs, n_v_heads, d_k, d_v, dtype=torch.float32, device=k.device) if store_final
             else None)
    grid = (n_docs, n_v_heads, triton.cdiv(d_v, blocks["BLOCK_V"]))
    _state_kernel[grid](k, w, u, gcum, cu, chunk_offset, initial_state if initial_state is not None else h, h, v_new,
                        final if store_final else h, n_heads, n_v_heads, d_k, d_v,
                        HAS_S0=initial_state is not None, STORE_FINAL=store_final, **precision, **blocks,
                        num_warps=WARPS, num_stages=STAGES)
    return h, v_new, final


def gated_delta_forward(q, k, v, g, beta, scale: float, initial_state, cu_seqlens, output_final_state: bool,
                        recurrent: bool = False, l2norm: bool = False):
    """Packed-token launcher: ``q, k [tokens, H, K]``, ``v [tokens, HV, V]``, ``g, beta [tokens, HV]`` (contiguous),
    documents ``cu_seqlens``. Returns ``(o [tokens, HV, V]`` in v's dtype, the final state fp32 ``[docs, HV, K, V]``
    or None). ``recurrent`` runs the token-by-token kernel (``l2norm``: it normalises q and k itself)."""
    tokens, n_heads, d_k = q.shape
    n_v_heads, d_v = v.shape[1:]
    n_docs = cu_seqlens.numel() - 1
    o = torch.empty(tokens, n_v_heads, d_v, dtype=v.dtype, device=v.device)
    if tokens == 0:
        final = (initial_state.float().clone() if initial_state is not None
                 else q.new_zeros(n_docs, n_v_heads, d_k, d_v, dtype=torch.float32))
        return o, (final if output_final_state else None)
    blocks = _blocks(v, d_k, d_v)
    if recurrent:
        final = (torch.empty(n_docs, n_v_heads, d_k, d_v, dtype=torch.float32, device=v.device)
                 if output_final_state else None)
        grid = (n_docs, n_v_heads, triton.cdiv(d_v, blocks["BLOCK_V"]))
        _recurrent_kernel[grid](q, k, v, g, beta, cu_seqlens, initial_state if initial_state is not None else o, o,
                                final if output_final_state else o, scale, n_heads, n_v_heads, d_k, d_v,
                                HAS_S0=initial_state is not None, STORE_FINAL=output_final_state, L2NORM=l2norm,
                                BLOCK_K=blocks["BLOCK_K"], BLOCK_V=blocks["BLOCK_V"], OFFS_64=blocks["OFFS_64"])
        return o, final
    precision = dot_precision(v.dtype)
    table = chunk_table(cu_seqlens, tokens)
    w, u, gcum, _ = _wy(k, v, g, beta, table, False, precision)
    h, v_new, final = _states(k, w, u, gcum, cu_seqlens, table, initial_state, output_final_state, precision)
    start, end, _, n_programs, _ = table
    _output_kernel[(n_programs, n_v_heads, triton.cdiv(d_v, blocks["BLOCK_V"]))](
        q, k, g, h, v_new, o, start, end, scale, n_heads, n_v_heads, d_k, d_v, **precision, **blocks,
        num_warps=WARPS, num_stages=STAGES)
    return o, final


def gated_delta_backward(d_o, d_final, q, k, v, g, beta, scale: float, initial_state, cu_seqlens):
    """Gradients ``(dq, dk, dv, dg, dbeta, d_initial_state or None)`` of the packed-token forward (``d_final`` may
    be None). The forward's intermediates are recomputed first."""
    tokens, n_heads, d_k = q.shape
    n_v_heads, d_v = v.shape[1:]
    n_docs = cu_seqlens.numel() - 1
    if tokens == 0:
        d_s0 = None
        if initial_state is not None:
            d_s0 = (d_final.float().clone() if d_final is not None
                    else torch.zeros_like(initial_state, dtype=torch.float32))
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), d_s0)
    precision = dot_precision(v.dtype)
    blocks = _blocks(v, d_k, d_v, chunk=CHUNK_BWD)
    table = chunk_table(cu_seqlens, tokens, CHUNK_BWD)
    start, end, chunk_offset, n_programs, _ = table
    w, u, gcum, t = _wy(k, v, g, beta, table, True, precision)
    h, v_new, _ = _states(k, w, u, gcum, cu_seqlens, table, initial_state, False, precision)
    # 1. the state's gradient, chunk by chunk backwards
    dh = torch.empty_like(h)
    dv_new = torch.empty_like(v_new)
    d_s0 = (torch.empty(n_docs, n_v_heads, d_k, d_v, dtype=torch.float32, device=v.device)
            if initial_state is not None else None)
    d_o = d_o.contiguous()
    d_final = d_final.contiguous() if d_final is not None else None
    state_blocks = _blocks(v, d_k, d_v, STATE_BLOCK_V, CHUNK_BWD)
    n_state_blocks = triton.cdiv(d_v, state_blocks["BLOCK_V"])
    state_dot = torch.empty(n_state_blocks, n_programs, n_v_heads, dtype=torch.float32, device=v.device)
    _state_bwd_kernel[(n_docs, n_v_heads, n_state_blocks)](
        q, k, w, gcum, d_o, cu_seqlens, chunk_offset, d_final if d_final is not None else h, h, dh, dv_new, state_dot,
        d_s0 if d_s0 is not None else h, scale, n_programs, n_heads, n_v_heads, d_k, d_v,
        HAS_DS_FINAL=d_final is not None, STORE_DS0=d_s0 is not None, **precision, **state_blocks, num_warps=WARPS,
        num_stages=STAGES)
    # 2. through the output and the chunk-end state; 3. through v_new = u − w S and u; 4. through w and the WY
    # transform (adding to dk, dβ and dΓ)
    dq = torch.empty(tokens, n_v_heads, d_k, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(dq)
    dw = torch.empty_like(dq)
    dv = torch.empty(tokens, n_v_heads, d_v, dtype=torch.float32, device=v.device)
    d_gamma = torch.empty(tokens, n_v_heads, dtype=torch.float32, device=g.device)
    dg = torch.empty_like(d_gamma)
    dbeta = torch.empty_like(d_gamma)
    dt = torch.empty_like(t)
    grid = (n_programs, n_v_heads)
    block_dv = max(16, triton.next_power_of_2(d_v))
    state_dot = state_dot.sum(0)  # Σ S ⊙ dS_end per chunk and head, in a fixed order
    _dqk_kernel[grid](q, k, v, g, beta, h, dh, v_new, dv_new, d_o, state_dot, start, end, dq, dk, d_gamma, dt, scale,
                      n_heads, d_k, d_v, **precision, **_blocks(v, d_k, d_v, DQK_BLOCK_V, CHUNK_BWD),
                      BLOCK_DV=block_dv, num_warps=WARPS, num_stages=STAGES)
    _dv_kernel[grid](v, g, beta, t, h, dv_new, start, end, dv, dw, dbeta, d_k, d_v, **precision, **blocks,
                     BLOCK_DV=block_dv, num_warps=WARPS, num_stages=STAGES)
    wy_blocks = {key: blocks[key] for key in ("BLOCK_C", "BLOCK_K", "OFFS_64")}
    _wy_bwd_kernel[grid](k, g, beta, t, dw, dt, start, end, dk, d_gamma, dg, dbeta, n_heads, d_k, **precision,
                         **wy_blocks, num_warps=WARPS, num_stages=STAGES)
    group = n_v_heads // n_heads
    # GVA: a key head's gradient is the sum over the value heads that read it
    dq = dq.view(tokens, n_heads, group, d_k).sum(2)
    dk = dk.view(tokens, n_heads, group, d_k).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), d_s0


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::gated_delta_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor, output_final_state: bool, recurrent: bool,
            l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    o, final = gated_delta_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                                   recurrent, l2norm)
    return o, final if final is not None else q.new_empty(0, dtype=torch.float32)


@_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, recurrent, l2norm):
    shape = (cu_seqlens.shape[0] - 1, v.shape[1], k.shape[2], v.shape[2]) if output_final_state else (0,)
    return v.new_empty(v.shape), q.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("tritonlm::gated_delta_bwd", mutates_args=())
def _bwd_op(d_o: torch.Tensor, d_final: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            g: torch.Tensor, beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
            cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
    dq, dk, dv, dg, dbeta, d_s0 = gated_delta_backward(d_o, d_final, q, k, v, g, beta, scale, initial_state,
                                                       cu_seqlens)
    return dq, dk, dv, dg, dbeta, d_s0 if d_s0 is not None else q.new_empty(0, dtype=torch.float32)


@_bwd_op.register_fake
def _(d_o, d_final, q, k, v, g, beta, scale, initial_state, cu_seqlens):
    d_s0 = (initial_state.new_empty(initial_state.shape, dtype=torch.float32) if initial_state is not None
            else q.new_empty(0, dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), d_s0)


class GatedDeltaRuleFunction(torch.autograd.Function):
    """``(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, recurrent, l2norm) -> (o,
    final_state)`` on packed tokens (:func:`gated_delta_forward`). Saves only the inputs; the backward is the
    chunked one whichever forward ran (``l2norm`` in the kernel is for forward-only calls)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, recurrent, l2norm):
        fwd = _fwd_op if use_custom_op(v) else gated_delta_forward
        with kernel_range("tritonlm::gated_delta_fwd"):
            o, final = fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, recurrent, l2norm)
        if final is not None and final.numel() == 0 and not output_final_state:
            final = None
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, *(() if initial_state is None else (initial_state,)))
        ctx.scale, ctx.has_s0, ctx.l2norm = scale, initial_state is not None, l2norm
        return o, final

    @staticmethod
    @first_order_backward
    def backward(ctx, d_o, d_final):
        if ctx.l2norm:
            raise RuntimeError("gated delta rule: the in-kernel L2 normalisation has no backward here; the entry "
                               "points normalise outside the kernel when gradients are needed")
        q, k, v, g, beta, cu_seqlens, *rest = ctx.saved_tensors
        initial_state = rest[0] if ctx.has_s0 else None
        bwd = _bwd_op if use_custom_op(v) else gated_delta_backward
        with kernel_range("tritonlm::gated_delta_bwd"):
            dq, dk, dv, dg, dbeta, d_s0 = bwd(d_o, d_final, q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens)
        return dq, dk, dv, dg, dbeta, (d_s0 if ctx.has_s0 else None), None, None, None, None, None


# ----------------------------------------------------------------------------------------------------
# flash-linear-attention's entry points
# ----------------------------------------------------------------------------------------------------
def _check(op: str, q, k, v, g, beta, initial_state, cu_seqlens, unsupported: dict):
    if unsupported:
        raise TypeError(f"{op}: {', '.join(sorted(unsupported))} not supported")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"{op}: q and k must be [batch, seq, heads, d_k] of one shape, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    batch, seq, n_heads, d_k = q.shape
    if v.dim() != 4 or v.shape[:2] != (batch, seq) or v.shape[2] % n_heads:
        raise ValueError(f"{op}: v must be [{batch}, {seq}, v_heads, d_v] with v_heads a multiple of {n_heads}, got "
                         f"{tuple(v.shape)}")
    n_v_heads, d_v = v.shape[2:]
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (batch, seq, n_v_heads):
            raise ValueError(f"{op}: {name} must be [{batch}, {seq}, {n_v_heads}], got {tuple(t.shape)}")
    if max(d_k, d_v) > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head sizes up to {MAX_HEAD_DIM} are supported, got d_k {d_k}, d_v {d_v}")
    tensors = [q, k, v, g, beta] + ([initial_state] if initial_state is not None else [])
    check_float(op, *tensors)
    check_device(op, *tensors)
    n_docs = batch
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"{op}: with cu_seqlens the batch must be 1 (packed documents), got {batch}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor [docs + 1], got "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"{op}: cu_seqlens is on {cu_seqlens.device}, the inputs on {q.device}")
        n_docs = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n_docs, n_v_heads, d_k, d_v):
        raise ValueError(f"{op}: initial_state must be [{n_docs}, {n_v_heads}, {d_k}, {d_v}], got "
                         f"{tuple(initial_state.shape)}")


def _run(op, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
         recurrent, unsupported):
    _check(op, q, k, v, g, beta, initial_state, cu_seqlens, unsupported)
    batch, seq, _, d_k = q.shape
    scale = d_k ** -0.5 if scale is None else float(scale)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    in_kernel_norm = use_qk_l2norm_in_kernel and recurrent and not needs_grad
    if use_qk_l2norm_in_kernel and not in_kernel_norm:
        # in fp32 (as transformers' and flash-linear-attention's l2norm), differentiable through autograd
        q, k = (t.float() * torch.rsqrt(t.float().square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    cu = (cu_seqlens.to(torch.int32).contiguous() if cu_seqlens is not None
          else _dense_cu_seqlens(batch, seq, q.device))
    o, final = GatedDeltaRuleFunction.apply(_flat(q), _flat(k), _flat(v), _flat(g), _flat(beta),
                                            initial_state.contiguous() if initial_state is not None else None, cu,
                                            scale, bool(output_final_state), recurrent, in_kernel_norm)
    return o.view(batch, seq, *o.shape[1:]), final


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, **unsupported) -> tuple[torch.Tensor,
                                                                                           torch.Tensor | None]:
    """Gated DeltaNet, chunked (training and prefill): ``q, k [batch, seq, H, K]``, ``v [batch, seq, HV, V]`` (``HV``
    a multiple of ``H``), ``g`` (log decay) and ``beta [batch, seq, HV]``; ``scale`` defaults to ``K ** -0.5``;
    ``initial_state [docs, HV, K, V]``; ``cu_seqlens [docs + 1]`` with batch 1 packs documents (the state restarts
    at each). Returns ``(o [batch, seq, HV, V]`` in v's dtype, the final state fp32 or None), differentiable in q, k,
    v, g, beta and the initial state. Other flash-linear-attention keyword arguments are one-line errors."""
    return _run("chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, False, unsupported)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
                                     **unsupported) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same function as :func:`chunk_gated_delta_rule`, one token at a time (decoding): each program keeps a
    block of one value head's state in registers, reading and writing it once per call. Differentiable (the
    gradient is the chunked backward's)."""
    return _run("fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, True, unsupported)
