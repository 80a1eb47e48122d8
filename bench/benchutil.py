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
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return {}

    def rope(cos, sin, dtype):
        cos_hf, sin_hf = (torch.cat([t, t], dim=-1).to(dtype) for t in (cos, sin))
        return lambda q, k: torch.cat(LigerRopeFunction.apply(q, k, cos_hf, sin_hf))

    return {"rmsnorm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5), "swiglu": LigerSiLUMulFunction.apply,
            "rope": rope}


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
