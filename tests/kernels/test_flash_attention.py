"""Both FlashAttention Functions against an fp64 einsum reference: O, L and all three gradients."""

import math

import pytest
import torch
from einops import einsum
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonlm.kernels import FlashAttention, FlashAttentionTorch, flash_attention

from helpers import FP32_ATTENTION_TOL, GPU_FP32_ATTENTION_TOL, cpu_only, emulated_tf32_dots, record_launches

FUNCTIONS = [FlashAttentionTorch, FlashAttention]
TOL = {torch.float32: FP32_ATTENTION_TOL, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _fp64_attention(q, k, v, is_causal, scale=None):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    s = einsum(q, k, "... i d, ... j d -> ... i j") * scale
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        visible = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no visible key: zeros
    return (q, k, v), einsum(p, v, "... i j, ... j d -> ... i d"), lse


def _saved_lse(out, q_shape):
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == q_shape[:-1]]
    assert len(saved) == 1 and saved[0].dtype == torch.float32
    return saved[0]


def _check(fn, q_shape, n_k, is_causal, dtype, scale=None, tol=None):
    q = torch.randn(q_shape, dtype=dtype, requires_grad=True)
    k = torch.randn(*q_shape[:-2], n_k, q_shape[-1], dtype=dtype, requires_grad=True)
    v = torch.randn(*q_shape[:-2], n_k, q_shape[-1], dtype=dtype, requires_grad=True)
    out = fn.apply(q, k, v, is_causal, scale) if scale is not None else fn.apply(q, k, v, is_causal)
    lse = _saved_lse(out, q.shape)
    do = torch.randn_like(out)
    out.backward(do)
    (q64, k64, v64), out64, lse64 = _fp64_attention(q, k, v, is_causal, scale)
    out64.backward(do.double())
    tol = tol or TOL[dtype]
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), out64, atol=tol, rtol=tol)
    finite = torch.isfinite(lse64)
    torch.testing.assert_close(lse.double()[finite], lse64[finite], atol=max(1e-4, tol), rtol=max(1e-4, tol))
    assert (lse[~finite] == float("-inf")).all()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=tol * 2, rtol=tol * 2)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seq,d", [(1, 16), (17, 64), (130, 16), (128, 80)])
def test_fp32_square(fn, is_causal, seq, d):
    _check(fn, (2, seq, d), seq, is_causal, torch.float32)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_batch_heads(fn, dtype):
    _check(fn, (2, 3, 45, 64), 45, True, dtype)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("n_q,n_k", [(1, 37), (5, 70), (40, 20), (33, 47)])
def test_uneven_query_key_lengths(fn, n_q, n_k):
    # n_q > n_k with causality leaves early queries with no visible key: zeros, never NaN
    _check(fn, (1, 2, n_q, 32), n_k, True, torch.float32)
    _check(fn, (1, 2, n_q, 32), n_k, False, torch.float32)


def test_triton_head_dim_128_and_custom_scale():
    _check(FlashAttention, (1, 2, 33, 128), 33, True, torch.float32, scale=0.3)


@cpu_only
@pytest.mark.parametrize("q_shape,n_k,is_causal,scale", [((1, 2, 33, 128), 33, True, 0.3), ((2, 128, 80), 128, False, None),
                                                        ((1, 2, 40, 64), 20, True, None)])
def test_fp32_gpu_tolerance_holds_with_tf32_operands(q_shape, n_k, is_causal, scale):
    # what the GPU rerun of these tests asserts for fp32 (TF32 dots), checked here with TF32-truncated operands
    with emulated_tf32_dots():
        _check(FlashAttention, q_shape, n_k, is_causal, torch.float32, scale, tol=GPU_FP32_ATTENTION_TOL)
        with pytest.raises(AssertionError):  # the emulation is in effect: the exact-fp32 tolerance fails
            _check(FlashAttention, q_shape, n_k, is_causal, torch.float32, scale, tol=1e-4)


def test_triton_head_split_view_input():
    heads, d = 2, 16
    # [batch, seq, heads*d] projections viewed as [batch, heads, seq, d], as attention does
    q, k, v = (torch.randn(2, 19, heads * d).unflatten(-1, (heads, d)).transpose(1, 2).requires_grad_()
               for _ in range(3))
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, is_causal=True)
    out.sum().backward()
    (q64, k64, v64), out64, _ = _fp64_attention(q, k, v, True)
    out64.sum().backward()
    tol = FP32_ATTENTION_TOL
    torch.testing.assert_close(out.double(), out64, atol=tol, rtol=tol)
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=2 * tol, rtol=2 * tol)
    assert out.stride() == q.stride()  # the head-merge afterwards is a view


def test_saved_bytes_grow_linearly_with_seq():
    def saved_bytes(seq):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        q, k, v = (torch.randn(1, 2, seq, 16, requires_grad=True) for _ in range(3))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            FlashAttention.apply(q, k, v, True)
        return total

    b64, b128, b256 = saved_bytes(64), saved_bytes(128), saved_bytes(256)
    assert b128 == 2 * b64 and b256 == 2 * b128


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_bad_inputs(fn):
    q = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="head dims"):
        fn.apply(q, torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    with pytest.raises(TypeError, match="dtypes"):
        fn.apply(q, q.half(), q.half())
    with pytest.raises(TypeError, match="floating"):
        fn.apply(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match="leading"):
        fn.apply(q, torch.randn(3, 5, 16), torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match="keys"):
        fn.apply(q, torch.randn(2, 5, 16), torch.randn(2, 6, 16))
    with pytest.raises(ValueError, match="devices"):
        fn.apply(q, torch.randn(2, 5, 16, device="meta"), torch.randn(2, 5, 16, device="meta"))
    if fn is FlashAttention:
        with pytest.raises(ValueError, match="256"):
            fn.apply(torch.randn(1, 2, 512), torch.randn(1, 2, 512), torch.randn(1, 2, 512))


@settings(max_examples=8, deadline=None)
@given(n_q=st.integers(1, 70), n_k=st.integers(1, 70), d=st.sampled_from([8, 24, 48, 96]),
       is_causal=st.booleans(), heads=st.integers(1, 2))
def test_triton_random_shapes(n_q, n_k, d, is_causal, heads):
    _check(FlashAttention, (1, heads, n_q, d), n_k, is_causal, torch.float32)


def test_batch_times_heads_beyond_one_launch(monkeypatch):
    # CUDA caps grid axis 1 at 65535 (batch x head) programs; beyond it the launcher splits the work into
    # launches that start at an offset. A cap of 3 makes 2 x 5 pairs take four launches (3 + 3 + 3 + 1).
    import tritonlm.kernels._common as common

    monkeypatch.setattr(common, "MAX_GRID_AXIS1", 3)
    assert common.grid_axis1_launches(10) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    _check(FlashAttention, (2, 5, 37, 16), 37, True, torch.float32)


# ----------------------------------------------------------------------------------------------------
# grouped-query attention: k, v with fewer heads than q
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (6, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("n_q, n_k, is_causal", [(37, 37, True), (5, 70, True), (19, 33, False)])
def test_gqa_vs_sdpa_enable_gqa(fn, dtype, heads, n_q, n_k, is_causal):
    """Each kv head serves its group of query heads: against PyTorch's SDPA (enable_gqa, explicit boolean mask)
    in fp64, output and every gradient (dK, dV summed over the group)."""
    h_q, h_kv = heads
    q = torch.randn(2, h_q, n_q, 24, dtype=dtype, requires_grad=True)
    k = torch.randn(2, h_kv, n_k, 24, dtype=dtype, requires_grad=True)
    v = torch.randn(2, h_kv, n_k, 24, dtype=dtype, requires_grad=True)
    out = fn.apply(q, k, v, is_causal)
    do = torch.randn_like(out)
    out.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q) if is_causal else None
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    ref.backward(do.double())
    tol = TOL[dtype]
    assert out.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=4 * tol, rtol=4 * tol)


def test_gqa_head_split_views_and_bad_head_counts():
    """k, v as [batch, heads, seq, d] views of [batch, seq, heads*d] projections (no copies), and clear errors
    when the heads do not divide."""
    b, n, h_q, h_kv, d = 2, 13, 4, 2, 16
    q = torch.randn(b, n, h_q * d).unflatten(-1, (h_q, d)).transpose(1, 2)
    k = torch.randn(b, n, h_kv * d).unflatten(-1, (h_kv, d)).transpose(1, 2)
    v = torch.randn(b, n, h_kv * d).unflatten(-1, (h_kv, d)).transpose(1, 2)
    out = FlashAttention.apply(q, k, v, True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=FP32_ATTENTION_TOL, rtol=FP32_ATTENTION_TOL)
    for fn in FUNCTIONS:
        with pytest.raises(ValueError, match="heads dim -3"):
            fn.apply(torch.randn(1, 3, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), True)
        with pytest.raises(ValueError, match="heads dim -3"):
            fn.apply(torch.randn(2, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), True)


def test_fp32_attention_follows_torch_matmul_precision(monkeypatch):
    """fp32 attention dots are IEEE under PyTorch's default ("highest") and TF32 only where PyTorch allows it
    ("high"): the DOT_PRECISION constexpr every tl.dot takes as input_precision (16-bit dots ignore it; they
    get the default "tf32"). Checked on the launch arguments the kernels receive."""
    from tritonlm.kernels.attention import backward, forward

    seen = record_launches(monkeypatch, forward._fwd_kernel, backward._bwd_dkdv_kernel, backward._bwd_dq_kernel,
                           record=lambda name, kwargs: kwargs.get("DOT_PRECISION"))
    q = torch.randn(1, 2, 7, 16, requires_grad=True)
    for precision, expected in (("highest", "ieee"), ("high", "tf32")):
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda p=precision: p)
        seen.clear()
        FlashAttention.apply(q, q, q, True).sum().backward()
        assert seen == [expected] * 3
    seen.clear()
    FlashAttention.apply(q.detach().half(), q.detach().half(), q.detach().half(), True)
    assert seen == ["tf32"]


def test_every_dot_takes_the_precision_constexpr():
    """Each tl.dot in the attention kernels passes input_precision=DOT_PRECISION (a compile option does not reach
    tl.dot): read from the kernel source, so a new dot without it fails here."""
    import inspect
    import re

    from tritonlm.kernels.attention import backward, decode, forward, tiles

    source = "".join(inspect.getsource(m) for m in (forward, backward, decode, tiles))
    dots = re.findall(r"tl\.dot\(", source)
    with_precision = re.findall(r"tl\.dot\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*input_precision=DOT_PRECISION\)", source)
    assert len(dots) >= 10 and len(with_precision) == len(dots)


def test_row_offsets_switch_to_64_bits_where_they_could_overflow():
    """The forward's K / V row offsets are 32-bit (fewer address instructions per tile) unless a view's rows x row
    stride could reach 2**31: a long sequence, a packed batch or a large paged pool (the SASS report's rows show the
    launcher's choice: test_kernel_sass)."""
    from tritonlm.kernels.attention.launch import _needs_64bit_rows

    meta = torch.device("meta")
    small = torch.empty(1, 8, 4096, 128, dtype=torch.bfloat16, device=meta)
    # [batch, seq, heads, d] viewed as [batch, heads, seq, d]: the row stride is heads x d = 4096
    long = torch.empty(1, 2**19, 32, 128, dtype=torch.bfloat16, device=meta).transpose(1, 2)
    shorter = torch.empty(1, 2**19 - 2, 32, 128, dtype=torch.bfloat16, device=meta).transpose(1, 2)
    assert not _needs_64bit_rows(small, small)
    assert _needs_64bit_rows(small, long)  # 2**19 rows x 4096 = 2**31
    assert not _needs_64bit_rows(shorter)
