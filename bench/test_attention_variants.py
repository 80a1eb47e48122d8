"""Llama-family attention: grouped-query attention, packed documents (varlen) and split-KV decoding.

Each group is one comparison in one process, forward + backward (decoding: forward only):
- GQA (32 query heads on 8 kv heads) vs MHA with the same query heads, vs SDPA (``enable_gqa``), and
  flash-attn's ``flash_attn_func`` when importable. Target: GQA at the speed of MHA.
- packed documents: ``flash_attn_varlen_func`` vs the padded batch of the same documents through the same
  kernel, vs SDPA with an explicit block-diagonal mask, and flex-attention's document mask when importable.
  Target: varlen no slower than padded.
- softcap: Gemma 2's attention logit softcap (50) vs none, forward + backward. Target: <= 1.15x the time.
- mla: DeepSeek-V3's attention shape (queries / keys 192 wide, values 128, 16 heads) vs d 128 at the same heads,
  forward + backward; ``extra_info`` carries each shape's TFLOP/s. Target: MLA at the TFLOP/s of d 128.
- sinks: gpt-oss's attention sinks (one logit per head) vs none, forward + backward, and decoding against a cache
  (split-KV: the sink in the combine). Target: <= 1.05x the time.
- decoding: one query against an 8K / 32K KV cache (batch 1 / 4 / 8) through the split-KV path vs SDPA;
  ``extra_info`` carries the bandwidth of reading the cache once. Target: >= 70% of the copy bandwidth.
"""

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import FlashAttention, flash_attention, flash_attn_varlen_func, flash_attn_with_kvcache

from benchutil import DEVICE, MACHINE, ON_GPU, run

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
D = 128 if ON_GPU else 16
SEQ = 4096 if ON_GPU else 64
HEADS = (32, 8) if ON_GPU else (4, 2)
DOC_LENGTHS = [3000, 120, 1800, 900, 77, 1500, 700, 96] if ON_GPU else [40, 1, 23]
DECODE = [(1, 8192), (4, 8192), (8, 8192), (1, 32768), (4, 32768)] if ON_GPU else [(1, 2100)]


def _fwd_bwd(fn, tensors):
    def step():
        out = fn(*tensors)
        out.backward(torch.ones_like(out))
    return step


def _sdpa_gqa(q, k, v):
    return TF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _flash_attn_gqa():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return lambda q, k, v: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           causal=True).transpose(1, 2)


@pytest.mark.parametrize("impl", ["tritonlm-gqa", "tritonlm-mha", "sdpa-gqa", "flash-attn-gqa"])
def test_gqa_fwd_bwd(benchmark, impl):
    h_q, h_kv = HEADS
    kv_heads = h_q if impl == "tritonlm-mha" else h_kv
    fns = {"tritonlm-gqa": lambda q, k, v: FlashAttention.apply(q, k, v, True),
           "tritonlm-mha": lambda q, k, v: FlashAttention.apply(q, k, v, True),
           "sdpa-gqa": _sdpa_gqa, "flash-attn-gqa": _flash_attn_gqa()}
    if fns[impl] is None:
        pytest.skip("flash-attn is not installed")
    q = torch.randn(2, h_q, SEQ, D, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, SEQ, D, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    mean = run(benchmark, _fwd_bwd(fns[impl], (q, k, v)))
    flops = 3.5 * 4 * 2 * h_q * SEQ * SEQ * D / 2  # causal half; backward 2.5x the forward
    benchmark.extra_info.update({"device": MACHINE.get()["device"], "TFLOP/s": round(flops / mean / 1e12, 3)})


def _documents():
    lengths = torch.tensor(DOC_LENGTHS)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).to(DEVICE)
    return lengths.tolist(), cu


@pytest.mark.parametrize("impl", ["tritonlm-varlen", "tritonlm-padded", "sdpa-block-mask", "flex-document-mask"])
def test_packed_documents_fwd_bwd(benchmark, impl):
    lengths, cu = _documents()
    total, longest, h = sum(lengths), max(lengths), HEADS[0]
    if impl == "tritonlm-varlen":
        qkv = [torch.randn(total, h, D, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3)]
        fn = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)  # noqa: E731
    elif impl == "tritonlm-padded":  # every document padded to the longest, one per batch row
        qkv = [torch.randn(len(lengths), h, longest, D, device=DEVICE, dtype=DTYPE, requires_grad=True)
               for _ in range(3)]
        fn = lambda q, k, v: FlashAttention.apply(q, k, v, True)  # noqa: E731
    else:
        ids = torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE),
                                      torch.tensor(lengths, device=DEVICE))
        qkv = [torch.randn(1, h, total, D, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3)]
        if impl == "sdpa-block-mask":
            mask = (ids[:, None] == ids[None, :]) & torch.ones(total, total, dtype=torch.bool, device=DEVICE).tril()
            fn = lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
        else:
            if not ON_GPU:
                pytest.skip("flex-attention compiles for GPUs")
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            except ImportError:
                pytest.skip("flex-attention is not available in this torch")
            block = create_block_mask(lambda b, hh, qi, ki: (ids[qi] == ids[ki]) & (ki <= qi), None, None, total,
                                      total, device=DEVICE)
            flex = torch.compile(flex_attention)
            fn = lambda q, k, v: flex(q, k, v, block_mask=block)  # noqa: E731
    mean = run(benchmark, _fwd_bwd(fn, qkv))
    useful = sum(n * (n + 1) // 2 for n in lengths)  # causal pairs inside documents: the work that matters
    benchmark.extra_info.update({"device": MACHINE.get()["device"], "tokens": total,
                                 "useful TFLOP/s": round(3.5 * 4 * h * useful * D / mean / 1e12, 3)})


@pytest.mark.parametrize("softcap", [0.0, 50.0], ids=["no-softcap", "softcap-50"])
def test_softcap_fwd_bwd(benchmark, softcap):
    h = HEADS[0]
    q, k, v = (torch.randn(2, h, SEQ, D, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    mean = run(benchmark, _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, True, softcap=softcap), (q, k, v)))
    flops = 3.5 * 4 * 2 * h * SEQ * SEQ * D / 2
    benchmark.extra_info.update({"device": MACHINE.get()["device"], "TFLOP/s": round(flops / mean / 1e12, 3)})


@pytest.mark.parametrize("impl", ["tritonlm-mla", "tritonlm-d128", "sdpa-mla"])
def test_mla_fwd_bwd(benchmark, impl):
    """Values narrower than queries / keys (never padded in memory) against the plain d 128 kernel at 16 heads."""
    heads = 16 if ON_GPU else 4
    d_qk, d_v = ((192, 128) if ON_GPU else (24, 16)) if impl != "tritonlm-d128" else (D, D)
    q, k = (torch.randn(2, heads, SEQ, d_qk, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    v = torch.randn(2, heads, SEQ, d_v, device=DEVICE, dtype=DTYPE, requires_grad=True)
    fn = (lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True)) if impl == "sdpa-mla" \
        else (lambda q, k, v: flash_attention(q, k, v, True))
    mean = run(benchmark, _fwd_bwd(fn, (q, k, v)))
    flops = 3.5 * 2 * (d_qk + d_v) * 2 * heads * SEQ * SEQ / 2  # (fwd+bwd, QKᵀ and PV, batch 2, causal)
    benchmark.extra_info.update({"device": MACHINE.get()["device"], "TFLOP/s": round(flops / mean / 1e12, 3)})


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_sinks_fwd_bwd(benchmark, sinks):
    h_q, h_kv = HEADS
    q = torch.randn(2, h_q, SEQ, D, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k, v = (torch.randn(2, h_kv, SEQ, D, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    logits = torch.randn(h_q, device=DEVICE, requires_grad=True) if sinks else None
    mean = run(benchmark, _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, True, sinks=logits), (q, k, v)))
    flops = 3.5 * 4 * 2 * h_q * SEQ * SEQ * D / 2
    benchmark.extra_info.update({"device": MACHINE.get()["device"], "TFLOP/s": round(flops / mean / 1e12, 3)})


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_sinks_decode(benchmark, sinks):
    h_q, h_kv = HEADS
    batch, cache = DECODE[0]
    q = torch.randn(batch, 1, h_q, D, device=DEVICE, dtype=DTYPE)
    k, v = (torch.randn(batch, cache, h_kv, D, device=DEVICE, dtype=DTYPE) for _ in range(2))
    logits = torch.randn(h_q, device=DEVICE) if sinks else None
    with torch.no_grad():
        mean = run(benchmark, lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=cache, causal=True, sinks=logits))
    gbps = 2 * k.numel() * k.element_size() / mean / 1e9
    benchmark.extra_info.update({"device": MACHINE.get()["device"], "cache GB/s": round(gbps, 2)})


@pytest.mark.parametrize("impl", ["tritonlm-split-kv", "sdpa"])
@pytest.mark.parametrize("batch, cache", DECODE, ids=lambda x: str(x))
def test_decode_one_query(benchmark, impl, batch, cache):
    h_q, h_kv = HEADS
    q = torch.randn(batch, h_q, 1, D, device=DEVICE, dtype=DTYPE)
    k, v = (torch.randn(batch, h_kv, cache, D, device=DEVICE, dtype=DTYPE) for _ in range(2))
    if impl == "sdpa":
        def fn():
            TF.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    else:
        def fn():
            FlashAttention.apply(q, k, v, True)
    with torch.no_grad():
        mean = run(benchmark, fn)
    m = MACHINE.get()
    gbps = 2 * k.numel() * k.element_size() / mean / 1e9  # K and V read once
    benchmark.extra_info.update({"device": m["device"], "cache GB/s": round(gbps, 2),
                                 "% copy bandwidth": round(100 * gbps / m["copy_GBps"], 1)})
