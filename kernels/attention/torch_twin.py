"""FlashAttention-2 written tile by tile in plain PyTorch: the readable, debuggable twin of the Triton
kernel. Same algorithm, same saved tensors (q, k, v, O and the fp32 logsumexp L), same bottom-right
causal alignment; slow (Python loops over tiles)."""

from __future__ import annotations

import math

import torch

from .._common import first_order_backward
from .launch import check_attention_inputs

TILE_Q = 16
TILE_K = 16


def _visible(q_start: int, n_rows: int, k_start: int, n_cols: int, shift: int, device) -> torch.Tensor:
    """Causal mask of a [rows, cols] tile: key j visible to query i when j <= i + shift."""
    rows = torch.arange(q_start, q_start + n_rows, device=device)[:, None]
    cols = torch.arange(k_start, k_start + n_cols, device=device)[None, :]
    return cols <= rows + shift


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """GQA without copies: ``q[..., h_q, n, d]`` as ``[..., h_kv, group, n, d]`` and k, v as
    ``[..., h_kv, 1, n, d]``, so every tile product broadcasts one kv head over its group of query heads."""
    if q.dim() < 3 or q.shape[-3] == k.shape[-3]:
        return q, k, v
    h_kv = k.shape[-3]
    return q.unflatten(-3, (h_kv, q.shape[-3] // h_kv)), k.unsqueeze(-3), v.unsqueeze(-3)


class FlashAttentionTorch(torch.autograd.Function):
    """``FlashAttentionTorch.apply(q, k, v, is_causal=False, softmax_scale=None)``; ``q[..., n_q, d]``,
    ``k, v[..., n_k, d]`` (v may have a head dim of its own: MLA), any leading dims; k and v may have fewer heads (dim -3) than q (GQA/MQA: each kv
    head serves ``h_q / h_kv`` consecutive query heads, broadcast, never repeated); fp32 accumulation."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, softmax_scale=None):
        check_attention_inputs("FlashAttentionTorch", q, k, v)
        q_shape, ctx.k_shape, ctx.v_shape = q.shape, k.shape, v.shape
        q, k, v = _grouped(q, k, v)
        n_q, d = q.shape[-2], q.shape[-1]
        n_k = k.shape[-2]
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
        shift = n_k - n_q
        o = q.new_empty((*q.shape[:-1], v.shape[-1]))  # (MLA: V's head dim may differ from Q/K's)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for qs in range(0, n_q, TILE_Q):
            q_tile = q[..., qs:qs + TILE_Q, :].float()
            rows = q_tile.shape[-2]
            m = torch.full(q_tile.shape[:-1], float("-inf"), device=q.device)
            l = torch.zeros_like(m)
            acc = q_tile.new_zeros((*q_tile.shape[:-1], v.shape[-1]))
            # with causality, key tiles past the last visible key of this query tile are skipped
            key_end = min(n_k, qs + rows + shift) if is_causal else n_k
            for ks in range(0, max(key_end, 0), TILE_K):
                k_tile = k[..., ks:ks + TILE_K, :].float()
                v_tile = v[..., ks:ks + TILE_K, :].float()
                s = q_tile @ k_tile.transpose(-1, -2) * scale
                if is_causal:
                    s = s.masked_fill(~_visible(qs, rows, ks, k_tile.shape[-2], shift, q.device), float("-inf"))
                m_new = torch.maximum(m, s.amax(dim=-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + p @ v_tile
                m = m_new
            empty = l == 0
            l_safe = torch.where(empty, torch.ones_like(l), l)
            o[..., qs:qs + TILE_Q, :] = (acc / l_safe[..., None]).to(q.dtype)
            lse[..., qs:qs + TILE_Q] = torch.where(empty, torch.full_like(l, float("-inf")), m + torch.log(l_safe))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale, ctx.q_shape = bool(is_causal), scale, q_shape
        return o.reshape(*q_shape[:-1], v.shape[-1])

    @staticmethod
    @first_order_backward
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        scale, is_causal = ctx.scale, ctx.is_causal
        k_shape = ctx.k_shape
        do = do.reshape(*q.shape[:-1], v.shape[-1])
        n_q, n_k = q.shape[-2], k.shape[-2]
        shift = n_k - n_q
        delta = (do.float() * o.float()).sum(dim=-1)  # D = rowsum(dO ∘ O)
        # rows that saw no key have L = -inf; +inf makes their P = exp(S - L) zero
        lse = torch.where(torch.isinf(lse) & (lse < 0), torch.full_like(lse, float("inf")), lse)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for ks in range(0, n_k, TILE_K):
            k_tile = k[..., ks:ks + TILE_K, :].float()
            v_tile = v[..., ks:ks + TILE_K, :].float()
            cols = k_tile.shape[-2]
            q_start = max(0, ks - shift) // TILE_Q * TILE_Q if is_causal else 0
            for qs in range(q_start, n_q, TILE_Q):
                q_tile = q[..., qs:qs + TILE_Q, :].float()
                do_tile = do[..., qs:qs + TILE_Q, :].float()
                rows = q_tile.shape[-2]
                s = q_tile @ k_tile.transpose(-1, -2) * scale
                p = torch.exp(s - lse[..., qs:qs + rows, None])                      # P = exp(S - L)
                if is_causal:
                    p = p.masked_fill(~_visible(qs, rows, ks, cols, shift, q.device), 0.0)
                dv[..., ks:ks + cols, :] += _group_sum(p.transpose(-1, -2) @ do_tile, dv)  # dV += Pᵀ dO
                dp = do_tile @ v_tile.transpose(-1, -2)                              # dP = dO Vᵀ
                ds = p * (dp - delta[..., qs:qs + rows, None])                       # dS = P (dP - D)
                dq[..., qs:qs + rows, :] += ds @ k_tile * scale                      # dQ += dS K
                dk[..., ks:ks + cols, :] += _group_sum(ds.transpose(-1, -2) @ q_tile * scale, dk)  # dK += dSᵀ Q
        # (grouped views: dK, dV come back with k's and v's own shapes, dQ with q's)
        return (dq.to(q.dtype).reshape(ctx.q_shape), dk.to(k.dtype).reshape(k_shape), dv.to(v.dtype).reshape(ctx.v_shape),
                None, None)


def _group_sum(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a per-query-head contribution over the group dim when ``like`` (a grouped dK/dV) broadcasts there."""
    if like.dim() >= 3 and like.shape[-3] == 1 and x.shape[-3] != 1:
        return x.sum(dim=-3, keepdim=True)
    return x
