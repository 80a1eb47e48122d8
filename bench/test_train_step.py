"""A whole training step (forward, loss, backward, AdamW) for the benchmarking presets at context 512:
reference eager vs fused vs torch.compile(reference), with tokens/s, MFU from tritonlm.accounting and
peak memory in extra_info."""

import pytest
import torch

from tritonlm import ModelConfig, accounting
from tritonlm.benchmarking import make_train_step

from benchutil import DEVICE, ON_GPU, ROUNDS, peak_bytes

if ON_GPU:
    CASES = [("small", 512, 8), ("medium", 512, 8), ("small", 2048, 2)]
    IMPLS = ["reference", "fused", "compiled-reference", "compiled-fused"]
else:
    CASES = [("tiny", 32, 2)]
    IMPLS = ["reference", "fused"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("preset,seq,batch", CASES)
def test_train_step(benchmark, preset, seq, batch, impl):
    benchmark.group = f"train step {preset} seq {seq} batch {batch}"
    cfg = ModelConfig.preset(preset)
    if not ON_GPU:
        cfg = cfg.replace(num_layers=1, vocab_size=256)
    try:
        step = make_train_step(cfg, impl, batch, seq, DEVICE)
        if ON_GPU:
            def call():
                step()
                torch.cuda.synchronize()
        else:
            call = step
        benchmark.pedantic(call, iterations=1, rounds=ROUNDS["rounds"], warmup_rounds=max(2, ROUNDS["warmup_rounds"]))
    except torch.cuda.OutOfMemoryError:
        pytest.skip(f"out of memory: {impl} {preset} seq {seq} batch {batch}")
    mean = benchmark.stats.stats.mean
    info = benchmark.extra_info
    info["tokens/s"] = round(batch * seq / mean, 1)
    peak = accounting.peak_flops(torch.cuda.get_device_name()) if ON_GPU else None
    if peak:
        info["MFU"] = round(accounting.training_flops(cfg, seq, batch) / mean / peak, 4)
    info["peak_bytes"] = peak_bytes(call)
