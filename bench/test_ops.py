"""Per-op benchmarks: RMSNorm, RoPE, SwiGLU gate and causal attention; forward, backward and both.

Each group is one comparison measured in one process: reference eager, torch.compile(reference) (GPU),
PyTorch built-ins (F.rms_norm, SDPA's flash / efficient / cuDNN backends), Liger-Kernel when installed,
and ours. ``extra_info`` carries GB/s and % of the copy bandwidth measured this session (memory-bound ops),
TFLOP/s and % of the measured matmul peak (attention), and peak memory.
"""



import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import apply_rope, flash_attention, rms_norm, swiglu_gate
from tritonlm.modules import functional as F
from tritonlm.modules import reference

from benchutil import DEVICE, MACHINE, ON_GPU, compiled, liger_impls, peak_bytes, run

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
ROWS_HIDDEN = [(4096, 768), (16384, 4096), (65536, 8192)] if ON_GPU else [(64, 256)]
MODES = ["fwd", "bwd", "fwd+bwd"]


def _timed(benchmark, mode, forward, inputs, bytes_by_mode, flops_by_mode=None):
    """Time ``forward(*inputs)`` in ``mode`` and record throughput figures."""
    grad = None
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                forward(*inputs)
    elif mode == "bwd":
        out = forward(*inputs)
        grad = torch.randn_like(out)

        def fn():
            out.backward(grad, retain_graph=True)
    else:
        def fn():
            out = forward(*inputs)
            out.backward(torch.ones_like(out))
    mean = run(benchmark, fn)
    m = MACHINE.get()
    info = benchmark.extra_info
    info["device"] = m["device"]
    if bytes_by_mode:
        gbps = bytes_by_mode[mode] / mean / 1e9
        info["GB/s"] = round(gbps, 2)
        info["% copy bandwidth"] = round(100 * gbps / m["copy_GBps"], 1)
    if flops_by_mode:
        tflops = flops_by_mode[mode] / mean / 1e12
        info["TFLOP/s"] = round(tflops, 2)
        info["% matmul peak"] = round(100 * tflops / m["matmul_TFLOPs"], 1)
    info["peak_bytes"] = peak_bytes(fn)
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.grad is not None:
            t.grad = None


# ---------------------------------------------------------------------------------------------------- RMSNorm
def _rmsnorm_impls():
    def reference_plain(x, w):  # the reference module's math, as a function (compilable)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)

    impls = {"reference": reference_plain, "torch F.rms_norm": lambda x, w: TF.rms_norm(x, (x.shape[-1],), w, 1e-5),
             "tritonlm": lambda x, w: rms_norm(x, w, 1e-5)}
    if ON_GPU:
        impls["torch.compile(reference)"] = compiled(reference_plain)
        if "rmsnorm" in (liger := liger_impls()):
            impls["liger-kernel"] = liger["rmsnorm"]
    return impls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,hidden", ROWS_HIDDEN)
@pytest.mark.parametrize("impl", list(_rmsnorm_impls()))
def test_rmsnorm(benchmark, impl, rows, hidden, mode):
    benchmark.group = f"rmsnorm {mode} {rows}x{hidden} {str(DTYPE)[6:]}"
    x = torch.randn(rows, hidden, device=DEVICE, dtype=DTYPE, requires_grad=mode != "fwd")
    w = torch.ones(hidden, device=DEVICE, dtype=DTYPE, requires_grad=mode != "fwd")
    n = x.numel() * x.element_size()
    # compulsory traffic: fwd reads x, writes y; bwd reads x, dy, writes dx
    _timed(benchmark, mode, _rmsnorm_impls()[impl], (x, w), {"fwd": 2 * n, "bwd": 3 * n, "fwd+bwd": 5 * n})


# ---------------------------------------------------------------------------------------------------- SwiGLU
def _swiglu_impls():
    plain = lambda a, b: F.silu(a) * b  # noqa: E731
    impls = {"reference": plain, "tritonlm": swiglu_gate}
    if ON_GPU:
        impls["torch.compile(reference)"] = compiled(plain)
        if "swiglu" in (liger := liger_impls()):
            impls["liger-kernel"] = liger["swiglu"]
    return impls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,hidden", ROWS_HIDDEN)
@pytest.mark.parametrize("impl", list(_swiglu_impls()))
def test_swiglu_gate(benchmark, impl, rows, hidden, mode):
    benchmark.group = f"swiglu-gate {mode} {rows}x{hidden} {str(DTYPE)[6:]}"
    a = torch.randn(rows, hidden, device=DEVICE, dtype=DTYPE, requires_grad=mode != "fwd")
    b = torch.randn(rows, hidden, device=DEVICE, dtype=DTYPE, requires_grad=mode != "fwd")
    n = a.numel() * a.element_size()
    _timed(benchmark, mode, _swiglu_impls()[impl], (a, b), {"fwd": 3 * n, "bwd": 5 * n, "fwd+bwd": 8 * n})


# ---------------------------------------------------------------------------------------------------- RoPE
ROPE_SHAPES = [(8, 2048, 16, 128), (4, 8192, 32, 128)] if ON_GPU else [(1, 32, 2, 16)]


def _rope_impls(seq, d):
    # both sides concatenate their two outputs, so the extra copy is the same on each
    rope = reference.RotaryPositionalEmbedding(10000.0, d, seq, device=DEVICE)

    def ref(q, k):
        return torch.cat([rope(q), rope(k)])

    def ours(q, k):
        qr, kr = apply_rope(q, k, None, cos=rope.cos_cached, sin=rope.sin_cached)
        return torch.cat([qr, kr])  # one output to differentiate, as for the reference

    impls = {"reference": ref, "tritonlm": ours}
    if ON_GPU:
        impls["torch.compile(reference)"] = compiled(ref)
        if "rope" in (liger := liger_impls()):
            impls["liger-kernel"] = liger["rope"](rope.cos_cached, rope.sin_cached, DTYPE)
    return impls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("impl", list(_rope_impls(8, 16)))
def test_rope(benchmark, impl, shape, mode):
    b, seq, h, d = shape
    benchmark.group = f"rope q+k {mode} b{b} s{seq} h{h} d{d} {str(DTYPE)[6:]}"
    # the [batch, heads, seq, d] view of a [batch, seq, heads*d] projection, as attention uses it
    q = torch.randn(b, seq, h * d, device=DEVICE, dtype=DTYPE).unflatten(-1, (h, d)).transpose(1, 2)
    k = torch.randn(b, seq, h * d, device=DEVICE, dtype=DTYPE).unflatten(-1, (h, d)).transpose(1, 2)
    q.requires_grad_(mode != "fwd")
    k.requires_grad_(mode != "fwd")
    n = 2 * q.numel() * q.element_size()
    _timed(benchmark, mode, _rope_impls(seq, d)[impl], (q, k), {"fwd": 2 * n, "bwd": 2 * n, "fwd+bwd": 4 * n})


# ---------------------------------------------------------------------------------------------------- attention
ATTN_SHAPES = [(4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)] if ON_GPU else [(1, 2, 64, 16)]


def _attention_impls():
    def naive(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, F.causal_mask(q.shape[-2], k.shape[-2], q.device))

    impls = {"reference": naive, "tritonlm": lambda q, k, v: flash_attention(q, k, v, is_causal=True)}
    if ON_GPU:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(backend):
            def fn(q, k, v):
                with sdpa_kernel(backend):
                    return TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            return fn

        impls["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        impls["sdpa-efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
        impls["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        impls["torch.compile(reference)"] = compiled(naive)
    return impls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("impl", list(_attention_impls()))
def test_attention(benchmark, impl, shape, mode):
    b, h, n, d = shape
    benchmark.group = f"attention causal {mode} b{b} h{h} s{n} d{d} {str(DTYPE)[6:]}"
    qkv = [torch.randn(b, h, n, d, device=DEVICE, dtype=DTYPE, requires_grad=mode != "fwd") for _ in range(3)]
    causal_flops = 4 * b * h * n * n * d / 2  # two matmuls over the causal half
    flops = {"fwd": causal_flops, "bwd": 2.5 * causal_flops, "fwd+bwd": 3.5 * causal_flops}
    try:
        _timed(benchmark, mode, _attention_impls()[impl], qkv, None, flops)
    except torch.cuda.OutOfMemoryError:
        pytest.skip(f"out of memory: {impl} at b{b} h{h} s{n} d{d}")

