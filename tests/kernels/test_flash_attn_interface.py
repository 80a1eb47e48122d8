"""flash-attn 2 entry points (windows, packed documents, GQA) and split-KV decoding, against PyTorch's
``F.scaled_dot_product_attention`` with an explicit boolean mask (``enable_gqa``) in fp64."""


import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import FlashAttention, flash_attn_func, flash_attn_varlen_func
from tritonlm.kernels.attention import backward as attention_backward
from tritonlm.kernels.attention import decode as attention_decode

from helpers import FP32_ATTENTION_TOL, flash_visibility, record_launches

TOL = {torch.float32: FP32_ATTENTION_TOL, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _sdpa_bshd(q, k, v, causal, window):
    """fp64 reference on [batch, seq, heads, d]; a query that sees no key outputs 0 (flash-attn's convention)."""
    mask = flash_visibility(q.shape[1], k.shape[1], causal, window)
    out = TF.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          enable_gqa=True)
    return torch.where(mask.any(-1)[None, None, :, None], out, 0.0).transpose(1, 2)


def _compare(out, ref, grads, ref_grads, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q, n_k, causal, window", [
    (37, 37, True, (-1, -1)), (37, 37, True, (5, -1)), (19, 70, False, (3, 2)), (70, 19, True, (-1, -1)),
    (33, 33, False, (0, 0)), (33, 50, True, (7, 0)), (45, 45, False, (-1, 6))])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_flash_attn_func_vs_sdpa(dtype, n_q, n_k, causal, window, heads):
    h_q, h_kv = heads
    q = torch.randn(2, n_q, h_q, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, n_k, h_kv, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, n_k, h_kv, 16, dtype=dtype, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert out.shape == q.shape and out.dtype == dtype
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _sdpa_bshd(q64, k64, v64, causal, window)
    _compare(out, ref, grads, torch.autograd.grad(ref, (q64, k64, v64), do.double()), dtype)


def test_flash_attn_func_positional_call_and_scale():
    """flash-attn 2's positional order: (q, k, v, dropout_p, softmax_scale, causal, window_size, ...)."""
    q, k, v = (torch.randn(1, 9, 2, 8) for _ in range(3))
    out = flash_attn_func(q, k, v, 0.0, 0.5, True, (-1, -1))
    mask = flash_visibility(9, 9, True, (-1, -1))
    ref = TF.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=FP32_ATTENTION_TOL, rtol=FP32_ATTENTION_TOL)


def _packed(lengths_q, lengths_k, h_q, h_kv, d, dtype=torch.float32):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), h_q, d, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), h_kv, d, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), h_kv, d, dtype=dtype, requires_grad=True)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (True, (4, -1)), (False, (2, 3))])
def test_flash_attn_varlen_func_vs_per_document_sdpa(dtype, causal, window):
    """Ragged documents, including empty and length-1 ones, more keys than queries in some, GQA 4:2."""
    lengths_q, lengths_k = [5, 0, 37, 1, 20, 1], [5, 3, 37, 9, 20, 1]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 4, 2, 16, dtype)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                 window_size=window)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    pieces = []
    for i in range(len(lengths_q)):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe > qs:
            pieces.append(_sdpa_bshd(q64[None, qs:qe], k64[None, ks:ke], v64[None, ks:ke], causal, window)[0])
    ref = torch.cat(pieces)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double(), allow_unused=True)
    ref_grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(ref_grads, (q64, k64, v64))]
    _compare(out, ref, grads, ref_grads, dtype)


def test_varlen_programs_never_touch_other_documents():
    """NaN keys/values in one document leave every other document's outputs and gradients finite and exact:
    no program loads a key tile outside its own document."""
    lengths = [30, 41, 7]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 2, 2, 16)
    with torch.no_grad():
        k[30:71] = float("nan")
        v[30:71] = float("nan")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 41, 41, causal=True)
    dq, = torch.autograd.grad(out, (q,), torch.ones_like(out))
    keep = torch.cat([torch.arange(0, 30), torch.arange(71, 78)])
    assert torch.isfinite(out[keep]).all() and torch.isfinite(dq[keep]).all()
    for s, e in ((0, 30), (71, 78)):
        ref = _sdpa_bshd(q[None, s:e].detach(), k[None, s:e].detach(), v[None, s:e].detach(), True, (-1, -1))[0]
        torch.testing.assert_close(out[s:e], ref, atol=FP32_ATTENTION_TOL, rtol=FP32_ATTENTION_TOL)


def test_window_never_visits_key_tiles_left_of_it():
    """With a 2-key window, NaN keys two tiles (64 keys, interpreter tiles are 32) before a query tile cannot
    reach it: the kernel starts at the first tile the window touches."""
    n = 200
    q, k, v = (torch.randn(1, n, 1, 16) for _ in range(3))
    k[:, :64] = float("nan")
    v[:, :64] = float("nan")
    out = flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
    assert torch.isfinite(out[:, 128:]).all()
    ref = _sdpa_bshd(q.double(), k.nan_to_num(0).double(), v.nan_to_num(0).double(), True, (2, 0))
    torch.testing.assert_close(out[:, 128:].double(), ref[:, 128:], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# split-KV decoding
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def split_decoding(monkeypatch):
    """Let short test caches take the flash-decoding path, and record that they did."""
    monkeypatch.setattr(attention_decode, "DECODE_MIN_KEYS", 64)
    chosen = []
    original = attention_decode._decode_splits
    monkeypatch.setattr(attention_decode, "_decode_splits", lambda *a: chosen.append(original(*a)) or chosen[-1])
    return chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_split_kv_decoding_vs_sdpa(split_decoding, dtype, n_q, heads):
    h_q, h_kv = heads
    n_k = 333  # a long cache relative to the 32-key interpreter tiles: several splits, a ragged last one
    q = torch.randn(2, h_q, n_q, 32, dtype=dtype, requires_grad=True)
    k = torch.randn(2, h_kv, n_k, 32, dtype=dtype, requires_grad=True)
    v = torch.randn(2, h_kv, n_k, 32, dtype=dtype, requires_grad=True)
    out = FlashAttention.apply(q, k, v, True)
    assert split_decoding and split_decoding[0] > 1
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = flash_visibility(n_q, n_k, True, (-1, -1))
    ref = TF.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    _compare(out, ref, grads, torch.autograd.grad(ref, (q64, k64, v64), do.double()), dtype)


def test_split_kv_decoding_logsumexp_and_fused_generation(split_decoding):
    """The combined logsumexp is the full one (backward relies on it), and a fused model decoding against a
    long cache through the split path generates what the reference model does."""
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    out = FlashAttention.apply(q.requires_grad_(), k, v, True)
    lse = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1]][0]
    torch.testing.assert_close(lse.double(), torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / 4, -1),
                               atol=1e-5, rtol=1e-5)
    from tritonlm import ModelConfig, TransformerLM

    cfg = ModelConfig.preset("tiny", vocab_size=61, context_length=160, num_layers=1, num_kv_heads=2)
    ref = TransformerLM(**cfg.model_kwargs())
    fz = TransformerLM(**cfg.model_kwargs(), backend="triton")
    fz.load_state_dict(ref.state_dict())
    prompt = torch.randint(0, 61, (1, 140))
    split_decoding.clear()
    assert torch.equal(fz.generate(prompt, 5, temperature=0), ref.generate(prompt, 5, temperature=0))
    assert any(n > 1 for n in split_decoding)


# ----------------------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------------------
def test_unsupported_features_are_errors_naming_the_argument():
    q = torch.randn(1, 4, 2, 8)
    for kwargs, name in ((dict(dropout_p=0.1), "dropout_p"), (dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
                         (dict(return_attn_probs=True), "return_attn_probs")):
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_func(q, q, q, **kwargs)
    p, cu = torch.randn(4, 2, 8), torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):  # a paged prefill needs k, v as a [blocks, page, ...] pool
        flash_attn_varlen_func(p, p, p, cu, cu, 4, 4, block_table=torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.parametrize("cu_q, cu_k, max_q, match", [
    (torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8], dtype=torch.int32), 5, "int32"),
    (torch.tensor([0, 5, 3, 8], dtype=torch.int32), torch.tensor([0, 5, 3, 8], dtype=torch.int32), 5,
     "non-decreasing"),
    (torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32), 5, "ends at 7"),
    (torch.tensor([1, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32), 5, "start at 0"),
    (torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 5, "sequences"),
    (torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32), 4, "max_seqlen"),
])
def test_varlen_bad_cu_seqlens(cu_q, cu_k, max_q, match):
    p = torch.randn(8, 2, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        flash_attn_varlen_func(p, p, p, cu_q, cu_k, max_q, 8)


def test_bad_shapes_and_heads():
    with pytest.raises(ValueError, match="not a multiple"):
        flash_attn_func(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, d\]"):
        flash_attn_func(torch.randn(4, 3, 8), torch.randn(4, 3, 8), torch.randn(4, 3, 8))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), window_size=(-2, 0))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="tokens"):
        flash_attn_varlen_func(torch.randn(4, 2, 8), torch.randn(5, 2, 8), torch.randn(4, 2, 8), cu, cu, 4, 4)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_selects_the_backward(deterministic, monkeypatch):
    """flash-attn's meaning: deterministic=False (its default) adds dQ with atomics inside the dK/dV kernel and
    runs no dQ kernel; True runs the two-kernel backward. Both against fp64 SDPA, packed and batched."""
    launched = record_launches(monkeypatch, attention_backward._bwd_dkdv_kernel, attention_backward._bwd_dq_kernel,
                               record=lambda name, kwargs: (name, kwargs.get("ATOMIC_DQ")))
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 21, 4, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 21, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    expected = [("_bwd_dkdv_kernel", not deterministic)] + ([("_bwd_dq_kernel", None)] if deterministic else [])
    assert launched == expected
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _sdpa_bshd(q64, k64, v64, True, (-1, -1))
    _compare(out, ref, grads, torch.autograd.grad(ref, (q64, k64, v64), do.double()), torch.float32)
    launched.clear()
    lengths = [7, 1, 12]
    pq, pk, pv, cu, _ = _packed(lengths, lengths, 4, 2, 16, torch.float32)
    packed = flash_attn_varlen_func(pq, pk, pv, cu, cu, 12, 12, causal=True, deterministic=deterministic)
    torch.autograd.grad(packed, (pq, pk, pv), torch.randn_like(packed))
    assert launched == expected


def test_varlen_launches_without_a_host_sync(monkeypatch):
    """With max_seqlen_q/k given (flash-attn's contract), forward and backward never read a tensor's values on
    the host when they live on a device: every host read is counted (the CPU tensors here stand in for device
    ones, so the free CPU-side value check is off)."""
    import tritonlm.kernels.attention.interface as interface

    lengths = [5, 9, 2]
    q, k, v, cu_q, cu_k = _packed(lengths, lengths, 4, 2, 16, torch.float32)
    monkeypatch.setattr(interface, "_values_readable", lambda t: False)
    reads = []
    for method in ("tolist", "item", "__int__", "__bool__", "__float__", "__index__", "numpy", "cpu"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _m=method, _r=real, **kw: reads.append(
            (_m, tuple(self.shape))) or _r(self, *a, **kw))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    monkeypatch.undo()
    assert reads == []
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    pieces = [_sdpa_bshd(q64[None, a:b], k64[None, a:b], v64[None, a:b], True, (-1, -1))[0]
              for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:])]
    torch.testing.assert_close(out.double(), torch.cat(pieces), atol=1e-4, rtol=1e-4)
    assert all(g.isfinite().all() for g in grads)
