"""Gated DeltaNet's kernels (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``) against the
recurrence run token by token in fp64 (``modules.functional.gated_delta_rule``, itself checked against a loop
written here from the definition) and against transformers' own torch implementations (qwen3_next's
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``, when installed). Criteria as
flash-linear-attention's tests of these functions: relative RMS error of the output, the final state and every
gradient; lengths that are not multiples of the chunk (and 1); packed documents against each document alone."""

import inspect

import pytest
import torch

from tritonlm.kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from tritonlm.modules import functional

from helpers import transformers_or_skip

#: relative RMS error bounds per dtype (flash-linear-attention's tests use 0.005-0.008 for 16-bit)
RMS = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 8e-3}
DTYPES = [pytest.param(d, id=str(d).replace("torch.", "")) for d in RMS]


def rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).pow(2).mean().sqrt()
            / expected.double().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def _inputs(batch, seq, n_heads, n_v_heads, d_k, d_v, dtype, seed, with_state=True, n_docs=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, n_heads, d_k, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(batch, seq, n_heads, d_k, generator=gen), dim=-1)
    v = torch.randn(batch, seq, n_v_heads, d_v, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(batch, seq, n_v_heads, generator=gen) + 2)  # decays near 1
    beta = torch.rand(batch, seq, n_v_heads, generator=gen)
    s0 = torch.randn(n_docs or batch, n_v_heads, d_k, d_v, generator=gen) * 0.5 if with_state else None
    cast = [t.to(dtype) for t in (q, k, v, g, beta)]
    return cast + [s0]


def _loop_fp64(q, k, v, g, beta, scale, s0):
    """The definition, one scalar formula per line (batch of one document per row)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    batch, seq, n_heads, d_k = q.shape
    n_v_heads = v.shape[2]
    out = torch.zeros(v.shape, dtype=torch.float64)
    finals = torch.zeros(batch, n_v_heads, d_k, v.shape[3], dtype=torch.float64)
    for b in range(batch):
        for j in range(n_v_heads):
            head = j // (n_v_heads // n_heads)
            state = s0[b, j].double().clone() if s0 is not None else torch.zeros(d_k, v.shape[3], dtype=torch.float64)
            for t in range(seq):
                state = state * torch.exp(g[b, t, j])
                error = v[b, t, j] - state.T @ k[b, t, head]
                state = state + beta[b, t, j] * torch.outer(k[b, t, head], error)
                out[b, t, j] = scale * state.T @ q[b, t, head]
            finals[b, j] = state
    return out, finals


def test_the_readable_twin_is_the_definition():
    q, k, v, g, beta, s0 = _inputs(2, 9, 2, 4, 8, 6, torch.float64, 1)
    out, final = functional.gated_delta_rule(q, k, v, g, beta, 0.4, s0, True)
    loop_out, loop_final = _loop_fp64(q, k, v, g, beta, 0.4, s0)
    torch.testing.assert_close(out, loop_out)
    torch.testing.assert_close(final, loop_final)


def _check_against_fp64(entry, dtype, shape, l2norm=False, with_state=True, seed=0):
    batch, seq, n_heads, n_v_heads, d_k, d_v = shape
    inputs = _inputs(batch, seq, n_heads, n_v_heads, d_k, d_v, dtype, seed, with_state)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    o, final = entry(*leaves[:5], initial_state=leaves[5], output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert o.shape == (batch, seq, n_v_heads, d_v) and o.dtype == dtype
    assert final.shape == (batch, n_v_heads, d_k, d_v) and final.dtype == torch.float32
    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    ref_o, ref_final = functional.gated_delta_rule(*ref_leaves[:5], initial_state=ref_leaves[5],
                                                   output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert rms_error(o, ref_o) < RMS[dtype]
    assert rms_error(final, ref_final) < RMS[dtype]
    gen = torch.Generator().manual_seed(seed + 1)
    d_o, d_final = torch.randn(o.shape, generator=gen).to(dtype), torch.randn(final.shape, generator=gen)
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad((o.float() * d_o.float()).sum() + (final * d_final).sum(), wrt)
    ref_grads = torch.autograd.grad((ref_o * d_o.double()).sum() + (ref_final * d_final.double()).sum(),
                                    [t for t in ref_leaves if t is not None])
    for name, a, e in zip(["q", "k", "v", "g", "beta", "initial_state"], grads, ref_grads):
        assert a.dtype == (torch.float32 if name == "initial_state" else dtype)
        assert rms_error(a, e) < 2 * RMS[dtype], name


# (batch, seq, H, HV, K, V): GVA, a partial last chunk, T = 1, odd head sizes, several chunks
SHAPES = [(2, 70, 2, 4, 16, 32), (1, 1, 1, 1, 8, 8), (1, 130, 1, 2, 24, 40), (3, 64, 2, 2, 32, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chunked_forward_and_gradients_against_fp64(dtype, shape):
    _check_against_fp64(chunk_gated_delta_rule, dtype, shape, seed=sum(shape))


@pytest.mark.parametrize("dtype", DTYPES)
def test_recurrent_forward_and_gradients_against_fp64(dtype):
    _check_against_fp64(fused_recurrent_gated_delta_rule, dtype, (2, 37, 2, 4, 16, 24), l2norm=True, seed=5)


@pytest.mark.parametrize("entry", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule])
def test_l2norm_and_no_initial_state(entry):
    _check_against_fp64(entry, torch.float32, (1, 90, 2, 2, 16, 16), l2norm=True, with_state=False, seed=9)


def test_recurrent_in_kernel_norm_without_gradients_matches():
    q, k, v, g, beta, s0 = _inputs(2, 20, 2, 4, 16, 16, torch.float32, 3)
    q, k = q * 3, k * 0.2  # far from unit norm
    with torch.no_grad():
        o, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    ref_o, ref_final = _loop_fp64(functional.l2_normalize(q.double()), functional.l2_normalize(k.double()), v, g,
                                  beta, 16 ** -0.5, s0)
    assert rms_error(o, ref_o) < RMS[torch.float32] and rms_error(final, ref_final) < RMS[torch.float32]


@pytest.mark.parametrize("entry", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule])
def test_packed_documents_equal_each_document_alone(entry):
    """cu_seqlens: lengths 5, 64 (a whole chunk), 1 and 70; the state restarts per document (from its own initial
    state); output, final states and every gradient equal the documents run apart."""
    lengths = [5, 64, 1, 70]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, g, beta, s0 = _inputs(1, sum(lengths), 2, 4, 16, 16, torch.float32, 11, n_docs=len(lengths))
    packed = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    o, final = entry(*packed[:5], initial_state=packed[5], output_final_state=True, cu_seqlens=cu)
    d_o = torch.randn(o.shape)
    grads = torch.autograd.grad((o * d_o).sum() + final.square().sum(), packed)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = [t[:, start:end].clone().requires_grad_() for t in (q, k, v, g, beta)]
        alone.append(s0[n:n + 1].clone().requires_grad_())
        o_n, final_n = chunk_gated_delta_rule(*alone[:5], initial_state=alone[5], output_final_state=True)
        torch.testing.assert_close(o[:, start:end], o_n, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(final[n:n + 1], final_n, atol=2e-5, rtol=2e-5)
        grads_n = torch.autograd.grad((o_n * d_o[:, start:end]).sum() + final_n.square().sum(), alone)
        for a, e in zip(grads[:5], grads_n[:5]):
            torch.testing.assert_close(a[:, start:end], e, atol=5e-5, rtol=5e-5)
        torch.testing.assert_close(grads[5][n:n + 1], grads_n[5], atol=5e-5, rtol=5e-5)


def test_non_contiguous_inputs_from_one_projection():
    """q, k, v split out of one ``[batch, seq, 2·H·K + HV·V]`` projection (strided views), as a layer makes them."""
    gen = torch.Generator().manual_seed(4)
    batch, seq, n_heads, n_v_heads, d = 2, 33, 2, 4, 16
    mixed = torch.randn(batch, seq, 2 * n_heads * d + n_v_heads * d, generator=gen, requires_grad=True)
    q, k, v = torch.split(mixed, [n_heads * d, n_heads * d, n_v_heads * d], dim=-1)
    q, k, v = q.view(batch, seq, n_heads, d), k.view(batch, seq, n_heads, d), v.view(batch, seq, n_v_heads, d)
    g = -torch.rand(n_v_heads, seq, batch, generator=gen).permute(2, 1, 0)  # a transposed layout
    beta = torch.rand(batch, seq, n_v_heads, generator=gen)
    assert not q.is_contiguous() and not g.is_contiguous()
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    ref, _ = functional.gated_delta_rule(q.double(), k.double(), v.double(), g, beta, use_qk_l2norm_in_kernel=True)
    assert rms_error(o, ref) < RMS[torch.float32]
    (grad,) = torch.autograd.grad(o.sum(), mixed)
    (ref_grad,) = torch.autograd.grad(ref.sum(), mixed)
    assert rms_error(grad, ref_grad) < 2 * RMS[torch.float32]


def test_strong_decay_stays_finite():
    """A decay of e^-40 per token (g = -40): every exponent the chunked form takes is <= 0, nothing overflows."""
    q, k, v, g, beta, s0 = _inputs(1, 70, 1, 1, 16, 16, torch.float32, 2)
    g = torch.full_like(g, -40.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    o, final = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    ref_o, ref_final = _loop_fp64(q, k, v, g, beta, 0.25, s0)
    assert rms_error(o, ref_o) < RMS[torch.float32] and rms_error(final, ref_final) < RMS[torch.float32]
    assert all(torch.isfinite(t).all() for t in torch.autograd.grad(o.sum() + final.sum(), leaves))


def test_against_transformers_torch_implementations():
    transformers_or_skip()
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, s0 = _inputs(2, 100, 2, 4, 16, 32, torch.float32, 7)
    q, k = q * 2, k * 3  # the l2norm has work to do
    # (unwrapped: transformers binds these names to flash-linear-attention's kernels when fla is importable)
    for theirs, ours in ((inspect.unwrap(hf.torch_chunk_gated_delta_rule), chunk_gated_delta_rule),
                         (inspect.unwrap(hf.torch_recurrent_gated_delta_rule), fused_recurrent_gated_delta_rule)):
        ref_o, ref_final = theirs(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        o, final = ours(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, ref_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, ref_final, atol=1e-4, rtol=1e-4)


def test_compiles_fullgraph():
    q, k, v, g, beta, s0 = _inputs(1, 20, 1, 2, 16, 16, torch.float32, 6)
    for entry in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        eager = entry(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        torch._dynamo.reset()
        compiled = torch.compile(lambda *a, entry=entry: entry(*a[:5], initial_state=a[5], output_final_state=True),
                                 fullgraph=True, backend="aot_eager")
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
        o, final = compiled(*leaves)
        torch.testing.assert_close(o, eager[0])
        torch.testing.assert_close(final, eager[1])
        (o.sum() + final.sum()).backward()
        assert all(t.grad is not None for t in leaves)


def test_bad_inputs_are_one_line_errors():
    q, k, v, g, beta, s0 = _inputs(2, 8, 2, 4, 16, 16, torch.float32, 0)
    cases = [
        (dict(k=k[..., :8]), ValueError, "q and k"),
        (dict(v=v[:, :, :3]), ValueError, "multiple of 2"),
        (dict(g=g[..., :2]), ValueError, "g must be"),
        (dict(beta=beta[:, :4]), ValueError, "beta must be"),
        (dict(initial_state=s0[:1]), ValueError, "initial_state must be"),
        (dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)), ValueError, "batch must be 1"),
        (dict(q=q.long(), k=k.long()), TypeError, "float32, float16 or bfloat16"),
        (dict(head_first=False), TypeError, "head_first"),
        (dict(q=torch.randn(2, 8, 2, 512), k=torch.randn(2, 8, 2, 512), initial_state=None), ValueError,
         "up to 256"),
    ]
    base = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0)
    for entry in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        for change, error, match in cases:
            with pytest.raises(error, match=match):
                entry(**{**base, **change})
    one = dict(q=q.reshape(1, 16, 2, 16), k=k.reshape(1, 16, 2, 16), v=v.reshape(1, 16, 4, 16),
               g=g.reshape(1, 16, 4), beta=beta.reshape(1, 16, 4))
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        chunk_gated_delta_rule(**one, cu_seqlens=torch.tensor([0.0, 16.0]))
