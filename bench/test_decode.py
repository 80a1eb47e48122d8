"""Inference: decoding against KV caches and batched generation of ragged prompts.

- ``flash_attn_with_kvcache``, one new token per sequence against dense vs paged caches of ragged lengths (GQA 32 on
  8, d 128 on a GPU; batch 1-64, context 4K-128K): ``extra_info`` carries the bandwidth of reading K/V once and
  its share of the copy bandwidth. Targets: >= 70% of it; paged <= 1.1x dense.
- ``TransformerLM.generate`` on a ragged batch (paged cache): tokens/s and the cache's bytes vs a dense cache
  sized to the context for every sequence, by batch size.
CPU runs are smoke runs (the interpreter): the same code paths at tiny sizes, not figures.
"""

import time

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM
from tritonlm.kernels import flash_attn_with_kvcache

from benchutil import DEVICE, MACHINE, ON_GPU, ragged_kv_caches, run

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
D, HEADS, PAGE = (128, (32, 8), 256) if ON_GPU else (16, (4, 2), 16)
CASES = [(1, 4096), (1, 32768), (1, 131072), (16, 32768), (64, 4096), (64, 32768)] if ON_GPU else [(2, 300)]
GENERATE_BATCHES = (1, 8, 32) if ON_GPU else (1, 3)


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("batch, ctx", CASES, ids=lambda x: str(x))
def test_decode_kvcache(benchmark, layout, batch, ctx):
    lengths, dense, paged = ragged_kv_caches(batch, ctx, HEADS[1], D, PAGE, DTYPE, DEVICE)
    k, v, table = dense if layout == "dense" else paged
    q = torch.randn(batch, 1, HEADS[0], D, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        mean = run(benchmark, lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table,
                                                              causal=True))
    gbps = 2 * int(lengths.sum()) * HEADS[1] * D * k.element_size() / mean / 1e9
    m = MACHINE.get()
    benchmark.extra_info.update({"device": m["device"], "K/V GB/s": round(gbps, 3),
                                 "% copy bandwidth": round(100 * gbps / m["copy_GBps"], 1)})


@pytest.mark.parametrize("batch", GENERATE_BATCHES)
def test_generate_ragged_batch(benchmark, batch):
    cfg = (ModelConfig.preset("small", num_kv_heads=4, context_length=2048) if ON_GPU
           else ModelConfig.preset("tiny", vocab_size=97, num_layers=1))
    model = TransformerLM.from_config(cfg, device=DEVICE, dtype=DTYPE, backend="triton").eval()
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(64, 1024, (batch,), generator=gen).tolist() if ON_GPU else [5, 9, 2][:batch]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(DEVICE) for n in lengths]
    new = 128 if ON_GPU else 3
    t0 = time.perf_counter()
    mean = run(benchmark, lambda: model.generate(prompts, new, temperature=0))
    stats = model.last_generation_cache
    per_position = stats["pool_bytes"] / stats["pool_blocks"] / stats["page_size"]
    benchmark.extra_info.update({"device": MACHINE.get()["device"], "tokens/s": round(batch * new / mean, 1),
                                 "paged cache MiB": round(stats["pool_bytes"] / 2**20, 2),
                                 "dense cache at context MiB": round(per_position * batch * cfg.context_length / 2**20, 2),
                                 "wall s": round(time.perf_counter() - t0, 1)})
