"""Helpers for the pytest-benchmark suites."""

from __future__ import annotations

import functools

import torch

from tritonlm.benchmarking import measure_copy_bandwidth, measure_matmul_peak

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
ROUNDS = dict(rounds=20, warmup_rounds=3) if ON_GPU else dict(rounds=2, warmup_rounds=1)


class _Machine:
    @functools.cache  # noqa: B019  (one measurement per session)
    def get(self) -> dict:
        copy = measure_copy_bandwidth(DEVICE)
        dtype = torch.bfloat16 if ON_GPU else torch.float32
        peak = measure_matmul_peak(DEVICE, dtype)
        return {"copy_GBps": copy / 1e9, "matmul_TFLOPs": peak / 1e12, "matmul_dtype": str(dtype).split(".")[-1],
                "device": torch.cuda.get_device_name() if ON_GPU else "cpu (smoke run, not GPU figures)"}


MACHINE = _Machine()


def run(benchmark, fn):
    """Benchmark ``fn`` with a device sync after each call; returns the mean seconds."""
    if ON_GPU:
        def call():
            fn()
            torch.cuda.synchronize()
    else:
        call = fn
    benchmark.pedantic(call, iterations=1, **ROUNDS)
    return benchmark.stats.stats.mean


def peak_bytes(fn) -> int | None:
    if not ON_GPU:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@functools.cache
def liger_impls() -> dict:
    """Liger-Kernel's RMSNorm, SwiGLU gate and RoPE with the signatures our benchmarks call, when Liger-Kernel is
    installed and a GPU is present (its kernels do not run in Triton's interpreter); else an empty dict.

    ``"rope"`` is a factory: given our pair tables ``cos, sin`` ``[seq, d/2]`` it returns ``fn(q, k)``. Liger
    follows the Hugging Face convention (rotate the two halves of a head, not adjacent pairs), so its tables
    repeat each angle twice, ``[seq, d]``, in q's dtype as HF passes them: the same work and bytes, another
    pairing. Liger rotates q and k in place; the outputs are concatenated like every other implementation's.
    """
    if not torch.cuda.is_available():
        return {}
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return {}

    def rope(cos, sin, dtype):
        cos_hf, sin_hf = (torch.cat([t, t], dim=-1).to(dtype) for t in (cos, sin))
        return lambda q, k: torch.cat(LigerRopeFunction.apply(q, k, cos_hf, sin_hf))

    return {"rmsnorm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5), "swiglu": LigerSiLUMulFunction.apply,
            "geglu": LigerGELUMulFunction.apply, "rope": rope}


def liger_version() -> str:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return "not installed"


@functools.cache
def compiled(fn):
    return torch.compile(fn)


def fused_loss_baselines() -> dict:
    """Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy as ``fn(hidden, weight, targets) -> loss``,
    for those importable here (both need a GPU), keyed by name."""
    out = {}
    if not torch.cuda.is_available():
        return out
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger-kernel"] = lambda h, w, t: liger(w, h, t)  # Liger takes the weight first
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        out["cut-cross-entropy"] = lambda h, w, t: cce(h, w, t)
    except ImportError:
        pass
    return out


def moe_baselines(device) -> dict:
    """Expert-FFN implementations ``fn(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj) -> out`` to time
    beside ``kernels.moe_experts`` (the eager loop and ``_grouped_mm`` also take its gpt-oss keyword options): the eager per-expert loop (transformers' eager experts code does the same: a
    gather, two matmuls and an ``index_add`` per expert) everywhere; ``torch._grouped_mm`` (tokens sorted by expert,
    two grouped GEMMs) where this torch has it on a CUDA device; Liger-Kernel's fused MoE where the installed
    release has it (CUDA)."""
    from tritonlm.modules import functional as F

    out = {"eager-loop": F.moe_experts}
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is not None and torch.device(device).type == "cuda":
        def grouped(hidden, index, weights, gate_up, down, *, activation="silu", gate_up_bias=None, down_bias=None,
                    alpha=1.702, limit=7.0, gate_up_layout="stacked"):
            n_experts, d_ff = gate_up.shape[0], gate_up.shape[1] // 2
            flat = index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            tokens = order // index.shape[1]
            counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
                0, flat, torch.ones_like(flat))
            offs = counts.cumsum(0).to(torch.int32)
            expert = flat[order]
            gu = grouped_mm(hidden[tokens], gate_up.transpose(1, 2), offs=offs)
            if gate_up_bias is not None:
                gu = gu + gate_up_bias[expert]
            gate, up = (gu[:, 0::2], gu[:, 1::2]) if gate_up_layout == "interleaved" else (gu[:, :d_ff], gu[:, d_ff:])
            if activation == "swiglu_clamped":  # gpt-oss's gated unit (the eager expert code's)
                gate = gate.clamp(max=limit)
                h = (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)
            else:
                h = torch.nn.functional.silu(gate) * up
            y = grouped_mm(h, down.transpose(1, 2), offs=offs)
            if down_bias is not None:
                y = y + down_bias[expert]
            y = y * weights.reshape(-1)[order, None].to(h.dtype)
            return torch.zeros_like(hidden).index_add(0, tokens, y)

        out["torch._grouped_mm"] = grouped
    if torch.device(device).type == "cuda":
        try:  # Liger-Kernel's fused MoE (newer releases): (x, gate_up_proj, down_proj, int32 index, weights)
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

            out["liger-kernel"] = lambda h, i, w, gu, d: LigerFusedMoEFunction.apply(h, gu, d, i.to(torch.int32), w)
        except ImportError:
            pass
    return out


def ragged_kv_caches(batch: int, ctx: int, kv_heads: int, d: int, page: int, dtype, device):
    """Decoding inputs: ragged cached lengths in ``[ctx/2, ctx)`` (int32 ``[batch]``), a dense cache ``(k, v, None)``
    ``[batch, capacity, kv_heads, d]`` and the same keys as a shuffled paged pool ``(k, v, block_table)``
    ``[blocks, page, kv_heads, d]``."""
    gen = torch.Generator(device=device).manual_seed(batch)
    lengths = torch.randint(ctx // 2, ctx, (batch,), device=device, generator=gen, dtype=torch.int32)
    capacity = -(-ctx // page) * page
    k = torch.randn(batch, capacity, kv_heads, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    blocks = capacity // page
    table = torch.randperm(batch * blocks, device=device, generator=gen).view(batch, blocks).to(torch.int32)
    order = table.flatten().argsort()  # pool block table[b, i] holds sequence b's i-th block
    return lengths, (k, v, None), (k.view(-1, page, kv_heads, d)[order], v.view(-1, page, kv_heads, d)[order], table)


def gated_delta_baselines() -> dict:
    """Chunked gated delta rule baselines ``{name: fn(q, k, v, g, beta, ...) -> (o, state)}``: transformers' torch
    fallback (``torch_chunk_gated_delta_rule``, when transformers is installed) and flash-linear-attention's Triton
    kernel (when ``fla`` is installed and a GPU is present)."""
    out = {}
    try:
        import inspect

        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        # (transformers binds the name to flash-linear-attention's kernel when fla is importable: the torch function
        # itself is the one it wraps)
        out["transformers-torch"] = inspect.unwrap(torch_chunk_gated_delta_rule)
    except ImportError:
        pass
    if ON_GPU:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

            out["flash-linear-attention"] = fla_chunk
        except ImportError:
            pass
    return out


def post_training_baselines() -> dict:
    """Liger-Kernel's post-training classes, built for our benchmarks' calls, where Liger is installed and a GPU
    is present: ``grpo(h, w, ids, mask, adv) -> loss`` and ``jsd(hs, ws, ht, wt) -> loss``."""
    out = {}
    if not torch.cuda.is_available():
        return out
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        grpo = LigerFusedLinearGRPOLoss(beta=0.0, loss_type="bnpo")
        out["grpo"] = lambda h, w, ids, mask, adv: grpo(h, w, ids, mask, adv)[0]
    except Exception:
        pass
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        fljsd = LigerFusedLinearJSD(jsd_beta=0.5)
        out["jsd"] = lambda hs, ws, ht, wt: fljsd(hs, ws, ht, wt)
    except Exception:
        pass
    return out
