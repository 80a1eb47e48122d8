"""Attention's registration: what the SASS report, the sweep and the GPU suite need (``kernels/_registry.py``)."""

from __future__ import annotations

import contextlib

import torch

from .. import _registry, tuned
from ..attention.interface import flash_attn_func, flash_attn_varlen_func
from ..attention.launch import (
    _CONFIG_FIELDS,
    _bwd_config,
    _bwd_dq_config,
    _fwd_config,
    _tma_selected,
    config_key,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    parse_key,
)


def L(kernel: str, index: int = 0, flops: int = 0) -> _registry.SassLaunch:
    """A report row with its unit of work: a key per main-loop step of the forward, dQ and decode kernels (BLOCK_N
    keys a step), a query for the dK/dV kernels (BLOCK_M queries a step); none for the combine and preprocess."""
    if kernel.endswith(("combine", "preprocess")):
        return _registry.SassLaunch(kernel, index, flops)
    if "dkdv" in kernel:
        return _registry.SassLaunch(kernel, index, flops, "query", lambda c: c["BLOCK_M"])
    return _registry.SassLaunch(kernel, index, flops, "key", lambda c: c["BLOCK_N"])


def _causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


@contextlib.contextmanager
def _fp32_matmul_precision(setting: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _sass_cases(quick: bool) -> list[_registry.SassCase]:
    """Causal batch 1 x 16 heads x 4096 at d 64 / 128, forward and each backward kernel (bf16; fp32 too in the full
    report); the fp32 forward under both matmul precisions (quick); then, bf16 d 128: GQA, the TMA variants, the
    logit softcap, gpt-oss's attention sinks (forward, decoding's combine), packed documents, a sliding window, and
    split-KV decoding with its combine kernel."""
    meta = torch.device("meta")
    cases = []
    for dtype in _registry.SASS_DTYPES:
        if quick and dtype != torch.bfloat16:
            continue
        for d in (64, 128):
            b, h, n = 1, 16, 4096
            case = f"{b}x{h}x{n}x{d} causal {_registry.dtype_label(dtype)}"
            q = torch.empty(b, h, n, d, dtype=dtype, device=meta)
            lse = torch.empty(b, h, n, dtype=torch.float32, device=meta)
            flops = b * h * _causal_pairs(n) * d  # times 4 (forward), 8 (dK/dV), 6 (dQ), 10 (dK/dV + atomic dQ)
            cases += [
                _registry.SassCase(case, lambda q=q: flash_attention_forward(q, q, q, True, 0.1),
                                   (L("attention.fwd", 0, 4 * flops),)),
                _registry.SassCase(case, lambda q=q, lse=lse: flash_attention_backward(q, q, q, q, q, lse, True, 0.1),
                                   (L("attention.bwd_preprocess", 0), L("attention.bwd_dkdv", 1, 8 * flops),
                                    L("attention.bwd_dq", 2, 6 * flops))),
                # the non-deterministic backward: dQ added with atomics inside the dK/dV kernel, no dQ kernel
                _registry.SassCase(case, lambda q=q, lse=lse: flash_attention_backward(
                    q, q, q, q, q, lse, True, 0.1, deterministic=False),
                    (L("attention.bwd_dkdv_atomic_dq", 1, 10 * flops),)),
            ]
    if quick:
        # fp32 forward at both precisions torch's fp32 matmul setting selects: IEEE (no TF32 MMA may appear in its
        # SASS) and TF32 (where they must: the check can see them)
        q32 = torch.empty(1, 16, 4096, 64, dtype=torch.float32, device=meta)
        for setting in ("highest", "high"):
            cases.append(_registry.SassCase(
                f"1x16x4096x64 causal float32 ({setting})", lambda: flash_attention_forward(q32, q32, q32, True, 0.1),
                (L("attention.fwd", 0, 4 * 16 * _causal_pairs(4096) * 64),),
                context=lambda s=setting: _fp32_matmul_precision(s)))
    # variants, bf16 d 128: GQA 32 q heads on 8 kv heads (4K), packed documents (8 x 1K in 8K tokens), a 1K sliding
    # window, and split-KV decoding of 1 query against a 32K cache (batch 4)
    dtype, d = torch.bfloat16, 128
    q = torch.empty(1, 32, 4096, d, dtype=dtype, device=meta)
    kv = torch.empty(1, 8, 4096, d, dtype=dtype, device=meta)
    lse = torch.empty(1, 32, 4096, dtype=torch.float32, device=meta)
    flops = 32 * _causal_pairs(4096) * d
    gqa = "1x32(8kv)x4096x128 causal bf16"
    cases += [
        _registry.SassCase(gqa, lambda: flash_attention_forward(q, kv, kv, True, 0.1),
                           (L("attention.gqa_fwd", 0, 4 * flops),)),
        # the Hopper TMA backward (only a tuned table selects it; the forward's TMA kernel is sm_90's default at
        # d 128, in the rows above): descriptor loads, UTMALDG in the sm_90 SASS
        _registry.SassCase(gqa, lambda: flash_attention_backward(q, q, kv, kv, q, lse, True, 0.1),
                           (L("attention.tma_bwd_dkdv", 1, 8 * flops), L("attention.tma_bwd_dq", 2, 6 * flops)),
                           context=lambda: tuned.override("attention_bwd", TMA=1)),
        _registry.SassCase(gqa, lambda: flash_attention_backward(q, q, kv, kv, q, lse, True, 0.1),
                           (L("attention.gqa_bwd_dkdv", 1, 8 * flops),)),
    ]
    # the sweep's alternatives at d 128 (16 heads), as evidence beside the shipped rows: the cp.async forward (TMA 0:
    # sm_90's default before its TMA forward; on sm_80 the same kernel as shipped) with 128- and 64-key tiles (on
    # sm_80 the latter is the shipped shape again), the shipped forward with the scores scaled first (FOLD_SCALE 0),
    # the dQ kernel with 128-query tiles, and the atomic-dQ backward's dK/dV kernel with 64-query tiles (dS K on wgmma)
    q16 = torch.empty(1, 16, 4096, d, dtype=dtype, device=meta)
    lse16 = torch.empty(1, 16, 4096, dtype=torch.float32, device=meta)
    flops16 = 16 * _causal_pairs(4096) * d
    plain = "1x16x4096x128 causal bf16"
    fwd16 = lambda: flash_attention_forward(q16, q16, q16, True, 0.1)  # noqa: E731
    bwd16 = lambda: flash_attention_backward(q16, q16, q16, q16, q16, lse16, True, 0.1)  # noqa: E731
    atomic16 = lambda: flash_attention_backward(q16, q16, q16, q16, q16, lse16, True, 0.1, deterministic=False)  # noqa: E731
    cases += [
        _registry.SassCase(plain + " (cp.async)", fwd16, (L("attention.fwd_cp_async", 0, 4 * flops16),),
                           context=lambda: tuned.override("attention_fwd", TMA=0), shipped=False),
        _registry.SassCase(plain + " (cp.async, BLOCK_N 64)", fwd16, (L("attention.fwd_n64", 0, 4 * flops16),),
                           context=lambda: tuned.override("attention_fwd", TMA=0, BLOCK_N=64, num_stages=3),
                           shipped=False),
        _registry.SassCase(plain + " (FOLD_SCALE 0)", fwd16, (L("attention.fwd_scaled_first", 0, 4 * flops16),),
                           context=lambda: tuned.override("attention_fwd", FOLD_SCALE=0), shipped=False),
        _registry.SassCase(plain + " (dQ 128x64)", bwd16, (L("attention.bwd_dq_m128", 2, 6 * flops16),),
                           context=lambda: tuned.override("attention_bwd_dq", BLOCK_M=128, BLOCK_N=64), shipped=False),
        _registry.SassCase(plain + " (64x32)", atomic16, (L("attention.bwd_dkdv_atomic_dq_m64n32", 1, 10 * flops16),),
                           context=lambda: tuned.override("attention_bwd", BLOCK_M=64, BLOCK_N=32), shipped=False),
        _registry.SassCase(plain + " (64x64)", atomic16, (L("attention.bwd_dkdv_atomic_dq_m64n64", 1, 10 * flops16),),
                           context=lambda: tuned.override("attention_bwd", BLOCK_M=64, BLOCK_N=64), shipped=False),
    ]
    # Gemma 2's attention logit softcap (tanh of every score, and 1 - tanh² in the backward), 16 heads
    cases += [
        _registry.SassCase("1x16x4096x128 causal softcap 50 bf16",
                           lambda: flash_attention_forward(q16, q16, q16, True, 0.1, softcap=50.0),
                           (L("attention.softcap_fwd", 0, 4 * flops16),)),
        _registry.SassCase("1x16x4096x128 causal softcap 50 bf16",
                           lambda: flash_attention_backward(q16, q16, q16, q16, q16, lse16, True, 0.1, softcap=50.0),
                           (L("attention.softcap_bwd_dkdv", 1, 8 * flops16), L("attention.softcap_bwd_dq", 2, 6 * flops16))),
    ]
    # gpt-oss's attention sinks (one extra logit per head in each row's softmax, folded in at the epilogue; the
    # backward's kernels are unchanged: lse carries the sink), 64 query heads on 8 kv heads at d 64, and the sink in
    # split-KV decoding's combine kernel
    q64 = torch.empty(1, 64, 4096, 64, dtype=dtype, device=meta)
    kv64 = torch.empty(1, 8, 4096, 64, dtype=dtype, device=meta)
    sinks = torch.empty(64, dtype=torch.float32, device=meta)
    cases.append(_registry.SassCase(
        "1x64(8kv)x4096x64 causal sinks bf16", lambda: flash_attention_forward(q64, kv64, kv64, True, 0.1, sinks=sinks),
        (L("attention.sinks_fwd", 0, 4 * 64 * _causal_pairs(4096) * 64),)))
    q1s = torch.empty(4, 64, 1, 64, dtype=dtype, device=meta)
    cache64 = torch.empty(4, 8, 32768, 64, dtype=dtype, device=meta)
    cases.append(_registry.SassCase(
        "4x64 heads, 1 query, sinks", lambda: flash_attention_forward(q1s, cache64, cache64, True, 0.1, sinks=sinks),
        (L("attention.sinks_decode_combine", 1),)))
    # MLA (DeepSeek-V3): queries and keys 192 wide (128 + 64 rotary; Q·Kᵀ padded to a 256 tile), values 128, 16
    # heads: forward, both backward kernels, and split-KV decoding of 1 query against a 32K cache
    q_mla = torch.empty(1, 16, 4096, 192, dtype=dtype, device=meta)
    v_mla = torch.empty(1, 16, 4096, 128, dtype=dtype, device=meta)
    pairs = 16 * _causal_pairs(4096)  # forward 2·(192 + 128) flops per pair, dK/dV 2·(2·192 + 2·128), dQ 2·(2·192 + 128)
    mla = "1x16x4096 d_qk 192 d_v 128 causal bf16"
    cases += [
        _registry.SassCase(mla, lambda: flash_attention_forward(q_mla, q_mla, v_mla, True, 0.1),
                           (L("attention.mla_fwd", 0, 2 * 320 * pairs),)),
        _registry.SassCase(mla, lambda: flash_attention_backward(v_mla, q_mla, q_mla, v_mla, v_mla, lse16, True, 0.1),
                           (L("attention.mla_bwd_dkdv", 1, 2 * 640 * pairs), L("attention.mla_bwd_dq", 2, 2 * 512 * pairs))),
    ]
    q1_mla = torch.empty(4, 16, 1, 192, dtype=dtype, device=meta)
    k_mla, v_cache_mla = (torch.empty(4, 16, 32768, w, dtype=dtype, device=meta) for w in (192, 128))
    cases.append(_registry.SassCase(
        "4x16 1 query x 32768 cache, d_qk 192 d_v 128 bf16",
        lambda: flash_attention_forward(q1_mla, k_mla, v_cache_mla, True, 0.1),
        (L("attention.mla_decode_split", 0, 2 * 4 * 16 * 32768 * 320),),
        bytes_moved=_registry.nbytes(k_mla) + _registry.nbytes(v_cache_mla)))
    packed = torch.empty(8192, 16, d, dtype=dtype, device=meta)
    cu = torch.empty(9, dtype=torch.int32, device=meta)
    cases.append(_registry.SassCase(
        "8x1024 packed, 16 heads, d 128 causal bf16",
        lambda: flash_attention_forward(packed, packed, packed, True, 0.1, (-1, -1), cu, cu, 1024, 1024),
        (L("attention.varlen_fwd", 0, 4 * 16 * 8 * _causal_pairs(1024) * d),)))
    cases.append(_registry.SassCase(
        "1x32x4096x128 window 1024 bf16", lambda: flash_attention_forward(q, q, q, True, 0.1, (1024, 0)),
        (L("attention.window_fwd", 0, 4 * 32 * 4096 * 1025 * d),)))
    # (GQA decoding packs each kv head's 4 query heads into one program's 16-row tile: K/V read once per group)
    q1 = torch.empty(4, 32, 1, d, dtype=dtype, device=meta)
    cache = torch.empty(4, 8, 32768, d, dtype=dtype, device=meta)
    decode = lambda: flash_attention_forward(q1, cache, cache, True, 0.1)  # noqa: E731
    cases.append(_registry.SassCase("4x32(8kv) 1 query x 32768 cache bf16", decode,
                                    (L("attention.decode_split", 0, 4 * 4 * 32 * 32768 * d),),
                                    bytes_moved=2 * _registry.nbytes(cache)))  # K and V read once
    cases.append(_registry.SassCase("4x32 heads, 1 query", decode, (L("attention.decode_combine", 1),)))
    # flash_attn_with_kvcache's decoding: ragged lengths from the device, keys through a paged pool's block table
    # (256-row blocks, 32K positions per sequence)
    pool = torch.empty(1, 8, 4 * 32768, d, dtype=dtype, device=meta)
    lengths = torch.empty(4, dtype=torch.int32, device=meta)
    table = torch.empty(4, 128, dtype=torch.int32, device=meta)
    cases.append(_registry.SassCase(
        "4x32(8kv) 1 query, paged 256-row blocks, 32768 positions bf16",
        lambda: flash_attention_forward(q1, pool, pool, True, 0.1, max_seqlen_k=32768, seqused_k=lengths,
                                        block_table=table, page_size=256),
        (L("attention.paged_decode_split", 0, 4 * 4 * 32 * 32768 * d),),
        bytes_moved=2 * 4 * 32768 * 8 * d * 2))  # K and V of every sequence read once
    return cases


def _sweep_cases(device: torch.device, smoke: bool) -> list[_registry.SweepCase]:
    """Causal ``[4, 16, 4096, d]`` at d 64 and 128 (smoke: ``[1, 4, 64, 16]``): the forward, the dK/dV kernel and the
    dQ kernel, each timed through forward + backward with its own candidates (the Hopper TMA kernels compete on
    sm_90+ and in the smoke run). Then each variant at d 128 under its own key (:func:`.launch.config_key`): GQA
    (4 query heads per kv head), packed documents (4 per sequence), a sliding window (1/4 of the sequence), the
    logit softcap, the atomic-dQ (5-matmul) backward, and split-KV decoding (1 query against an 8K GQA cache)."""
    dtype = torch.float32 if smoke else torch.bfloat16
    b, h, n = (1, 4, 64) if smoke else (4, 16, 4096)
    hopper = smoke or torch.cuda.get_device_capability(device)[0] >= 9
    tma = (dict(TMA=1),) if hopper else ()
    def fwd_tma(d):
        """The forward's TMA kernel against the cp.async one: whichever of them does not ship for this key (sm_90:
        TMA at d 128 in 16 bits) is the candidate."""
        return (dict(TMA=int(not _tma_selected(d, dtype, device))),) if hopper else ()
    few = 1 if smoke else 3  # candidates per variant (the plain kernels get them all)

    def inputs(shape, kv_shape=None, grad=True):
        q = torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)
        k, v = (torch.randn(*(kv_shape or shape), device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
        return q, k, v

    def training(attend, *tensors):
        """Forward + backward (a candidate's forward must not change what the backward sees)."""
        grad = torch.randn_like(tensors[0])
        return lambda: torch.autograd.grad(attend(*tensors), tensors, grad)

    def dense(d, kv_heads=None, window=None, softcap=0.0, deterministic=True, train=True):
        def make():
            q, k, v = inputs((b, n, h, d), (b, n, kv_heads or h, d), grad=train)
            attend = lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=window or (-1, -1),  # noqa: E731
                                                     softcap=softcap, deterministic=deterministic)
            return training(attend, q, k, v) if train else (lambda: attend(q, k, v))
        return make

    def packed(d, train=True):
        def make():
            lens = [n // 4] * (4 * b)  # 4 documents per sequence's worth of tokens
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
            q, k, v = inputs((sum(lens), h, d), grad=train)
            attend = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, n // 4, n // 4, causal=True,  # noqa: E731
                                                                deterministic=True)
            return training(attend, q, k, v) if train else (lambda: attend(q, k, v))
        return make

    def decoding(d):
        def make():
            q = torch.randn(b, h, 1, d, device=device, dtype=dtype)
            cache = torch.randn(b, max(1, h // 4), 2048 if smoke else 8192, d, device=device, dtype=dtype)
            return lambda: flash_attention(q, cache, cache, True)
        return make

    cases = []
    for d in ((16,) if smoke else (64, 128)):
        key = config_key(d, dtype)
        cases += [_registry.SweepCase("attention_fwd", key, dense(d, train=False), fwd_tma(d) + _FWD_CANDIDATES),
                  _registry.SweepCase("attention_bwd", key, dense(d), tma + _BWD_CANDIDATES),
                  _registry.SweepCase("attention_bwd_dq", key, dense(d), _DQ_CANDIDATES)]
    d = 16 if smoke else 128
    gqa, window, cap = dict(kv_heads=h // 4), dict(window=(n // 4, 0)), dict(softcap=50.0)
    for variant, make_fwd, make_train in (
            (("gqa",), dense(d, train=False, **gqa), dense(d, **gqa)),
            (("varlen",), packed(d, train=False), packed(d)),
            (("window",), dense(d, train=False, **window), dense(d, **window)),
            (("softcap",), dense(d, train=False, **cap), dense(d, **cap))):
        key = config_key(d, dtype, variant)
        cases += [_registry.SweepCase("attention_fwd", key, make_fwd, _FWD_CANDIDATES[:few]),
                  _registry.SweepCase("attention_bwd", key, make_train, _BWD_CANDIDATES[:few]),
                  _registry.SweepCase("attention_bwd_dq", key, make_train, _DQ_CANDIDATES[:few])]
    cases += [_registry.SweepCase("attention_bwd", config_key(d, dtype, ("atomic",)),
                                  dense(d, deterministic=False), _ATOMIC_CANDIDATES),
              _registry.SweepCase("attention_fwd", config_key(d, dtype, ("gqa", "decode")), decoding(d),
                                  _DECODE_CANDIDATES)]
    return cases


def _shipped(pick):
    def shipped(key: str, device: torch.device, dtype: torch.dtype) -> dict:
        d, variant, d_v = parse_key(key)
        return dict(zip(_CONFIG_FIELDS, pick(d, dtype, device, variant, d_v)))
    return shipped


_FWD_CANDIDATES = (
    # the scores scaled first (FOLD_SCALE 0) against the shipped scale-in-the-exponent FMA
    dict(FOLD_SCALE=0),
    # (64-key tiles at 8 warps: the shape sm_90 shipped before 128-key tiles, and sm_80's)
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3), dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4), dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    # two CTAs per sm_90 SM at d 128 (SASS report with this config: 174 registers x 128 threads, 80 KB dynamic
    # shared memory, spill-free)
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2))
_BWD_CANDIDATES = (
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2), dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3))
_DQ_CANDIDATES = (
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2), dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2))
#: the atomic-dQ backward's dK/dV kernel at d 128: 64-query tiles put dS K on wgmma (sm_90 SASS: 8 warps x
#: 64 keys spill 96 B; 8 warps x 32 keys are spill-free at 254 registers), the shipped 32-query tiles run it on mma
_ATOMIC_CANDIDATES = (
    dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2), dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2))
#: split-KV decoding: key tiles and pipeline depth (the query tile is the group's queries)
_DECODE_CANDIDATES = (
    dict(BLOCK_N=128, num_warps=4, num_stages=3), dict(BLOCK_N=32, num_warps=4, num_stages=4),
    dict(BLOCK_N=64, num_warps=8, num_stages=3), dict(BLOCK_N=128, num_warps=8, num_stages=2))
_FIELDS = (*_CONFIG_FIELDS, "TMA")
_FWD_FIELDS = (*_FIELDS, "FOLD_SCALE")

def _opcheck_cases() -> dict[str, list[tuple]]:
    q, lse = torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9)
    strided = torch.randn(2, 3, 9, 32)[..., ::2]  # last dim strided: the launchers copy, the fakes must agree
    window = (True, 0.25, -1, -1, None, None, 0, 0)
    return {"flash_attention_fwd": [(q, q, q, *window), (strided, strided, strided, *window)],
            "flash_attention_bwd": [(q, q, q, q, q, lse, *window)]}


def _double_backward_cases():
    from ..attention.launch import FlashAttention
    from ..attention.torch_twin import FlashAttentionTorch

    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    return [("FlashAttention", FlashAttention.apply(q, q, q, True), [q]),
            ("FlashAttentionTorch", FlashAttentionTorch.apply(q, q, q, True), [q])]


_registry.register(_registry.Op(
    name="attention", entry_points=("flash_attention", "FlashAttention", "flash_attn_func", "flash_attn_varlen_func",
                                    "flash_attn_with_kvcache", "FlashAttentionTorch"),
    reference="tritonlm.modules.functional.scaled_dot_product_attention",
    tunables=(_registry.Tunable("attention_fwd", _FWD_FIELDS, _FWD_CANDIDATES, _shipped(_fwd_config)),
              _registry.Tunable("attention_bwd", _FIELDS, _BWD_CANDIDATES, _shipped(_bwd_config)),
              _registry.Tunable("attention_bwd_dq", _CONFIG_FIELDS, _DQ_CANDIDATES, _shipped(_bwd_dq_config))),
    sass_cases=_sass_cases, sweep_cases=_sweep_cases, bench_section="attention", opcheck_cases=_opcheck_cases,
    double_backward_cases=_double_backward_cases,
    notes=("tiled PyTorch twin: FlashAttentionTorch", "variants timed in the GPU suite's attention_variants")))
