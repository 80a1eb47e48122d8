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
    """What autograd saves: the inputs, the [T·K, 3I] pre-activations with the gated unit beside them and int32
    routing metadata; never a [T·K, H] copy of the gathered tokens (H chosen unlike every other size)."""
    tokens, d_model, d_ff, experts, top_k = 12, 48, 20, 4, 2
    hidden, index, weights, gate_up, down = (t.float() for t in _problem(tokens, d_model, d_ff, experts, top_k))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        moe_experts(hidden.requires_grad_(), index.long(), weights, gate_up.requires_grad_(), down)
    assert (tokens * top_k, d_model) not in saved
    assert (tokens * top_k, 3 * d_ff) in saved


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


# ----------------------------------------------------------------------------------------------------
# gpt-oss's experts: biases, the clamped SwiGLU, interleaved gate / up rows read in place
# ----------------------------------------------------------------------------------------------------
def _gpt_oss_problem(tokens, d_model, d_ff, experts, top_k, seed=4):
    """A problem with biases, the gate_up weight held as gpt-oss holds it (``[E, H, 2I]``, gate / up columns
    interleaved), and a clamp limit that binds on both sides but lies in a gap of the routed pre-activations'
    magnitudes (none within 0.01 of it): a 16-bit rounding then cannot move a value across the clamp's kink, where the
    gradient jumps."""
    hidden, index, weights, gate_up, down = _problem(tokens, d_model, d_ff, experts, top_k, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    held = (3 * gate_up).transpose(1, 2).contiguous()  # [E, H, 2I]
    gate_up_bias = torch.randn(experts, 2 * d_ff, generator=gen, dtype=torch.float64)
    down_bias = torch.randn(experts, d_model, generator=gen, dtype=torch.float64)
    # the routed pairs' pre-activations
    pre = torch.cat([hidden[t] @ held[e] + gate_up_bias[e] for t, e in zip(
        torch.arange(tokens).repeat_interleave(top_k).tolist(), index.flatten().tolist())]).abs().sort().values
    middle = pre[len(pre) // 4: 3 * len(pre) // 4]
    gaps = middle[1:] - middle[:-1]
    widest = int(gaps.argmax())
    assert gaps[widest] > 0.02
    limit = float(middle[widest] + middle[widest + 1]) / 2
    return hidden, index, weights, held, down, gate_up_bias, down_bias, limit


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("layout", ["interleaved", "stacked"])
def test_biased_clamped_experts_vs_fp64(dtype, tol, layout):
    """Every output and gradient (hidden, routing weights, both weights, both biases) of the clamped, biased
    experts against the fp64 loop; the weight read through its transposed view (no copy)."""
    hidden, index, weights, held, down, gate_up_bias, down_bias, limit = _gpt_oss_problem(13, 24, 20, 5, 2)
    opts = dict(activation="swiglu_clamped", alpha=1.702, limit=limit, gate_up_layout=layout)
    ours = [t.to(dtype).requires_grad_() for t in (hidden, weights, held, down, gate_up_bias, down_bias)]
    ref = [t.to(dtype).double().requires_grad_() for t in (hidden, weights, held, down, gate_up_bias, down_bias)]
    out = moe_experts(ours[0], index, ours[1], ours[2].transpose(1, 2), ours[3], gate_up_bias=ours[4],
                      down_bias=ours[5], **opts)
    expected = F.moe_experts(ref[0], index, ref[1], ref[2].transpose(1, 2), ref[3], gate_up_bias=ref[4],
                             down_bias=ref[5], **opts)
    pre = ref[0] @ ref[2][0] + ref[4][0]  # (the clamp binds: pre-activations beyond ±limit on both sides)
    assert (pre > limit).any() and (pre < -limit).any()
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad.to(dtype))
    expected.backward(grad.to(dtype).double())
    names = ("d hidden", "d weights", "d gate_up", "d down", "d gate_up_bias", "d down_bias")
    for name, got, want in [("out", out, expected)] + [(n, a.grad, b.grad) for n, a, b in zip(names, ours, ref)]:
        size = want.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(got.double() / size, want / size, atol=tol["atol"] * 4, rtol=tol["rtol"] * 4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_gpt_oss_experts_module_is_the_spec():
    """transformers' own ``GptOssExperts`` (its eager loop) equals the readable spec with gpt-oss's options, and the
    fused kernel on the module's parameters as stored (gradients of every parameter included)."""
    transformers = pytest.importorskip("transformers", reason="the optional extra tritonlm[hf] is not installed")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=4, swiglu_limit=1.0)
    torch.manual_seed(5)
    module = GptOssExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.7)
    hidden = torch.randn(9, 16)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    expected = module(hidden, index, weights)
    opts = dict(activation="swiglu_clamped", alpha=config.swiglu_alpha, limit=config.swiglu_limit,
                gate_up_layout="interleaved", gate_up_bias=module.gate_up_proj_bias, down_bias=module.down_proj_bias)
    spec = F.moe_experts(hidden, index, weights, module.gate_up_proj.transpose(1, 2), module.down_proj.transpose(1, 2),
                         **opts)
    torch.testing.assert_close(spec, expected, atol=1e-5, rtol=1e-5)
    expected.square().sum().backward()
    theirs = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    fused = moe_experts(hidden, index, weights, module.gate_up_proj.transpose(1, 2), module.down_proj.transpose(1, 2),
                        **opts)
    torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4)
    fused.square().sum().backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name], atol=2e-4, rtol=2e-4, msg=name)


@pytest.mark.parametrize("kwargs, message", [
    (dict(activation="relu"), "activation must be one of"), (dict(gate_up_layout="split"), "gate_up_layout"),
    (dict(activation="swiglu_clamped", limit=0.0), "limit > 0"),
    (dict(gate_up_bias=torch.zeros(3, 47)), r"gate_up_bias must be torch.float32 \[3, 48\]"),
    (dict(down_bias=torch.zeros(3, 16, dtype=torch.float64)), "down_bias must be torch.float32"),
])
def test_bad_expert_options_are_one_line_errors(kwargs, message):
    hidden, index, weights, gate_up, down = (t.float() if t.is_floating_point() else t
                                             for t in _problem(4, 16, 24, 3, 2))
    with pytest.raises(ValueError, match=message):
        moe_experts(hidden, index, weights, gate_up, down, **kwargs)


def test_router_bias_and_softmax_after_topk_are_gpt_oss_router():
    """``moe_router(logit_bias=, softmax_after_topk=True)`` is transformers' ``GptOssTopKRouter``."""
    transformers = pytest.importorskip("transformers", reason="the optional extra tritonlm[hf] is not installed")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(transformers.GptOssConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=3))
    torch.manual_seed(6)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    hidden = torch.randn(11, 16)
    logits, scores, index = router(hidden)
    ours = F.moe_router(hidden, router.weight, 3, logit_bias=router.bias, softmax_after_topk=True)
    torch.testing.assert_close(ours[0], logits)
    assert torch.equal(ours[2], index)
    torch.testing.assert_close(ours[1], scores)
