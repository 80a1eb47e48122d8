"""Fused MoE experts (Triton grouped GEMMs, interpreter) against the readable per-expert loop in fp64."""

import pytest
import torch

from tritonlm.kernels import moe_experts
from tritonlm.kernels.moe.routing import max_tiles, route
from tritonlm.modules import functional as F

from helpers import DTYPE_TOLERANCES


def _problem(tokens, d_model, d_ff, experts, top_k, index=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, d_model, generator=gen, dtype=torch.float64)
    if index is None:  # distinct experts per token, as top-k gives them
        index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * d_ff, d_model, generator=gen, dtype=torch.float64) / d_model**0.5
    down = torch.randn(experts, d_model, d_ff, generator=gen, dtype=torch.float64) / d_ff**0.5
    return hidden, index, weights, gate_up, down


def _compare(problem, dtype, tol, activation="silu", scale=1.0):
    """Forward and the four gradients of the kernel (in ``dtype``) against the fp64 per-expert loop, each compared
    relative to its largest element."""
    hidden, index, weights, gate_up, down = problem
    ours = [t.to(dtype).requires_grad_() for t in (hidden, weights, gate_up, down)]
    ref = [t.to(dtype).double().requires_grad_() for t in (hidden, weights, gate_up, down)]
    out = moe_experts(ours[0], index, ours[1], ours[2], ours[3], activation=activation)
    expected = F.moe_experts(ref[0], index, ref[1], ref[2], ref[3], activation=activation)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad.to(dtype))
    expected.backward(grad.to(dtype).double())
    assert out.dtype == dtype and out.shape == hidden.shape
    for name, got, want in [("out", out, expected)] + [(n, a.grad, b.grad) for n, a, b in zip(
            ("d hidden", "d weights", "d gate_up", "d down"), ours, ref)]:
        size = want.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(got.double() / size, want / size, atol=tol["atol"] * 4 * scale,
                                   rtol=tol["rtol"] * 4 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("shape", [(13, 24, 40, 5, 2), (7, 16, 20, 3, 1), (1, 40, 24, 6, 2), (33, 32, 17, 4, 3)],
                         ids=["odd", "top1", "one-token", "odd-ff"])
def test_forward_backward_vs_fp64(shape, dtype, tol):
    _compare(_problem(*shape), dtype, tol)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_activations(activation):
    _compare(_problem(11, 16, 24, 4, 2), torch.float32, DTYPE_TOLERANCES[0].values[1], activation)


def test_idle_experts_and_one_expert_taking_every_token():
    """Experts without a token get zero weight gradients; all pairs on one expert (more rows than one tile)."""
    problem = _problem(21, 16, 24, 6, 1, index=torch.full((21, 1), 4))
    _compare(problem, torch.float32, DTYPE_TOLERANCES[0].values[1])
    hidden, index, weights, gate_up, down = (t.float() for t in problem)
    gate_up.requires_grad_()
    moe_experts(hidden, index.long(), weights, gate_up, down).sum().backward()
    assert gate_up.grad[:4].abs().max() == 0 and gate_up.grad[5].abs().max() == 0 and gate_up.grad[4].abs().max() > 0


def test_repeated_experts_within_a_token_and_leading_dims():
    """A token may name one expert in two slots (weights add); ``[batch, seq, H]`` inputs keep their shape."""
    hidden, _, weights, gate_up, down = _problem(10, 16, 24, 3, 2)
    index = torch.tensor([[0, 0], [1, 2], [2, 2], [0, 1], [1, 1], [2, 0], [0, 0], [1, 2], [2, 1], [0, 2]])
    args = [t.float() for t in (hidden, weights, gate_up, down)]
    out = moe_experts(args[0].view(2, 5, 16), index.view(2, 5, 2), args[1].view(2, 5, 2), args[2], args[3])
    ref = F.moe_experts(hidden, index, weights, gate_up, down)
    assert out.shape == (2, 5, 16)
    torch.testing.assert_close(out.reshape(10, 16).double(), ref, atol=1e-5, rtol=1e-5)


def test_non_contiguous_inputs():
    """Weights stored transposed (``[E, H, 2I]`` viewed as ``[E, 2I, H]``), a strided hidden and strided routing."""
    hidden, index, weights, gate_up, down = _problem(9, 16, 24, 4, 2)
    h = torch.randn(9, 32, dtype=torch.float64)[:, ::2]
    h.copy_(hidden)
    gu = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    dn = down.transpose(1, 2).contiguous().transpose(1, 2)
    idx = torch.cat([index, index], 1)[:, ::2].clone().t().contiguous().t()
    w = torch.cat([weights, weights], 1)[:, ::2]
    _compare((h, idx, w, gu, dn), torch.float32, DTYPE_TOLERANCES[0].values[1])


def test_gradients_are_deterministic():
    problem = [t.float() for t in _problem(40, 16, 24, 3, 2)]
    grads = []
    for _ in range(2):
        args = [t.clone().requires_grad_() for t in (problem[0], problem[2], problem[3], problem[4])]
        moe_experts(args[0], problem[1].long(), args[1], args[2], args[3]).square().sum().backward()
        grads.append([a.grad for a in args])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_backward_keeps_no_gathered_token_matrix():
    """What autograd saves: the inputs, the [T·K, 2I] pre-activations and int32 routing metadata; never a
    [T·K, H] copy of the gathered tokens (H chosen unlike every other size)."""
    tokens, d_model, d_ff, experts, top_k = 12, 48, 20, 4, 2
    hidden, index, weights, gate_up, down = (t.float() for t in _problem(tokens, d_model, d_ff, experts, top_k))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        moe_experts(hidden.requires_grad_(), index.long(), weights, gate_up.requires_grad_(), down)
    assert (tokens * top_k, d_model) not in saved
    assert (tokens * top_k, 2 * d_ff) in saved


def test_routing_tile_map_against_a_loop():
    """Every expert's sorted rows are covered by its tiles exactly once, in order; tiles past the last are idle
    (expert E); the grid bound holds."""
    experts, block = 5, 4
    index = torch.tensor([3, 0, 3, 3, 1, 3, 0, 3, 3, 1, 3, 3, 3])
    r = route(index, experts, block)
    order = r.pair_of_row.long()
    assert torch.equal(index[order], index.sort(stable=True).values)
    assert torch.equal(order, torch.argsort(index, stable=True))
    counts = torch.bincount(index, minlength=experts)
    assert r.expert_start.tolist() == [0, *counts.cumsum(0).tolist()]
    expected = []
    for e in range(experts):
        lo, hi = int(r.expert_start[e]), int(r.expert_start[e + 1])
        expected += [(e, s, min(s + block, hi)) for s in range(lo, hi, block)]
    n = max_tiles(index.numel(), experts, block)
    got = list(zip(r.tile_expert.tolist(), r.tile_start.tolist(), r.tile_end.tolist()))
    assert got[:len(expected)] == expected and len(got) == n >= len(expected)
    assert all(e == experts for e, _, _ in got[len(expected):])


def test_bad_inputs():
    hidden, index, weights, gate_up, down = (t.float() for t in _problem(4, 16, 8, 3, 2))
    index = index.long()
    with pytest.raises(ValueError, match=r"top_k_index must be in \[0, 3\)"):
        moe_experts(hidden, index + 3, weights, gate_up, down)
    with pytest.raises(TypeError, match="integer expert ids"):
        moe_experts(hidden, index.float(), weights, gate_up, down)
    with pytest.raises(TypeError, match="dtypes differ"):
        moe_experts(hidden.half(), index, weights, gate_up, down)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe_experts(hidden, index, weights, gate_up[:, :, :8], down)
    with pytest.raises(ValueError, match="leading dims"):
        moe_experts(hidden, index[:3], weights[:3], gate_up, down)
    with pytest.raises(ValueError, match="activation"):
        moe_experts(hidden, index, weights, gate_up, down, activation="relu")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        moe_experts(hidden.double(), index, weights, gate_up.double(), down.double())


def test_no_tokens():
    """An empty batch: zero output of the right shape, zero weight gradients."""
    hidden, index, weights, gate_up, down = (t.float() for t in _problem(0, 16, 24, 3, 2, index=torch.zeros(0, 2)))
    gate_up.requires_grad_()
    out = moe_experts(hidden, index.long(), weights, gate_up, down)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert gate_up.grad.shape == gate_up.shape and gate_up.grad.abs().max() == 0
