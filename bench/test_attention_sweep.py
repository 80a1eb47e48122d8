"""The CS336 systems-assignment attention sweep: batch 8, no head dim, d in {16, 32, 64, 128}, seq from 256
to 16384, naive attention vs flash (forward and forward+backward), plus causal batch 1 up to 65536 for the
flash kernel alone. Out-of-memory cases are reported as skips that say so."""

import pytest
import torch

from tritonlm.kernels import flash_attention
from tritonlm.modules import functional as F

from benchutil import DEVICE, MACHINE, ON_GPU, peak_bytes, run

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
DIMS = [16, 32, 64, 128] if ON_GPU else [16]
SEQS = [256, 1024, 4096, 8192, 16384] if ON_GPU else [32, 64]
LONG = [16384, 32768, 65536] if ON_GPU else [128]
BATCH = 8 if ON_GPU else 1


def naive(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, F.causal_mask(q.shape[-2], k.shape[-2], q.device))


def flash(q, k, v):
    return flash_attention(q, k, v, is_causal=True)


def _bench(benchmark, fn, batch, seq, d, backward):
    qkv = [torch.randn(batch, seq, d, device=DEVICE, dtype=DTYPE, requires_grad=backward) for _ in range(3)]

    def step():
        out = fn(*qkv)
        if backward:
            out.backward(torch.ones_like(out))

    try:
        mean = run(benchmark, step)
    except torch.cuda.OutOfMemoryError:
        if ON_GPU:
            torch.cuda.empty_cache()
        pytest.skip(f"out of memory at batch {batch}, seq {seq}, d {d}")
    flops = 4 * batch * seq * seq * d / 2 * (3.5 if backward else 1.0)
    benchmark.extra_info.update({"TFLOP/s": round(flops / mean / 1e12, 3),
                                 "% matmul peak": round(100 * flops / mean / 1e12 / MACHINE.get()["matmul_TFLOPs"], 1),
                                 "peak_bytes": peak_bytes(step)})


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("impl", ["naive", "flash"])
def test_sweep(benchmark, impl, d, seq, backward):
    benchmark.group = f"sweep causal b{BATCH} d{d} s{seq} {'fwd+bwd' if backward else 'fwd'}"
    _bench(benchmark, naive if impl == "naive" else flash, BATCH, seq, d, backward)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("seq", LONG)
def test_long_context_flash_only(benchmark, seq, backward):
    benchmark.group = f"long causal b1 d64 s{seq} {'fwd+bwd' if backward else 'fwd'}"
    _bench(benchmark, flash, 1, seq, 64, backward)
