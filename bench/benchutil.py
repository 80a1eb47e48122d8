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


def liger():
    """The Liger-Kernel ops module when installed (and usable here), else None."""
    if not ON_GPU:
        return None
    try:
        import liger_kernel.ops as ops  # noqa: F401

        return ops
    except Exception:
        return None


@functools.cache
def compiled(fn):
    return torch.compile(fn)
