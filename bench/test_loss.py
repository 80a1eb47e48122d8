"""LM head + loss and the residual-add + RMSNorm seam: forward + backward time and peak memory.

Loss group (one process): eager ``hidden @ W.T`` + ``F.cross_entropy``, ``torch.compile`` of it (GPU), Liger's
``LigerFusedLinearCrossEntropyLoss`` and Cut Cross-Entropy's ``linear_cross_entropy`` when importable, and ours.
``extra_info`` carries peak memory (CUDA allocator on a GPU; live tensor storage on CPU). add_rms_norm group:
eager ``x + r`` then ``F.rms_norm``, ``torch.compile`` of it (GPU), ours; GB/s and % of the copy bandwidth.
"""

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import add_rms_norm, linear_cross_entropy
from tritonlm.memory import peak_live_bytes

from benchutil import MACHINE, ON_GPU, compiled, fused_loss_baselines, peak_bytes, run

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# (tokens, d_model, vocab): GPT-2 small's head at 8K tokens, a Llama-3-8B-like head at 4K
LOSS_SHAPES = [(8192, 768, 50257), (4096, 4096, 128256)] if ON_GPU else [(64, 32, 1000)]
NORM_SHAPES = [(4096, 768), (16384, 4096)] if ON_GPU else [(64, 256)]


def _eager_loss(h, w, t):
    return TF.cross_entropy((h @ w.t()).float(), t)


def _loss_impls():
    impls = {"eager": _eager_loss, "tritonlm": lambda h, w, t: linear_cross_entropy(h, w, t)}
    if ON_GPU:
        impls["compiled-eager"] = compiled(_eager_loss)
        impls.update(fused_loss_baselines())
    return impls


@pytest.mark.parametrize("impl", ["eager", "compiled-eager", "liger-kernel", "cut-cross-entropy", "tritonlm"])
@pytest.mark.parametrize("shape", LOSS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lm_head_loss_fwd_bwd(benchmark, shape, impl):
    fn = _loss_impls().get(impl)
    if fn is None:
        pytest.skip(f"{impl}: not importable here (or needs a GPU)")
    n, d, v = shape
    hidden = torch.randn(n, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
    weight = (torch.randn(v, d, device=DEVICE, dtype=DTYPE) / d**0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), device=DEVICE)

    def step():
        fn(hidden, weight, targets).backward()
        hidden.grad = weight.grad = None

    run(benchmark, step)
    info = benchmark.extra_info
    info["device"] = MACHINE.get()["device"]
    info["peak_bytes"] = peak_bytes(step) if ON_GPU else peak_live_bytes(step)[1]
    info["logits_bytes_fp32"] = n * v * 4


def _eager_add_norm(x, r, w):
    h = x + r
    return TF.rms_norm(h, (h.shape[-1],), w, 1e-5), h


@pytest.mark.parametrize("impl", ["eager", "compiled-eager", "tritonlm"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_add_rms_norm_fwd_bwd(benchmark, shape, impl):
    if impl == "compiled-eager" and not ON_GPU:
        pytest.skip("torch.compile baselines run on the GPU only")
    fn = {"eager": _eager_add_norm, "compiled-eager": compiled(_eager_add_norm), "tritonlm": add_rms_norm}[impl]
    rows, d = shape
    x = torch.randn(rows, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
    r = torch.randn(rows, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
    w = torch.ones(d, device=DEVICE, dtype=DTYPE, requires_grad=True)

    def step():
        y, h = fn(x, r, w)
        torch.autograd.backward((y, h), (torch.ones_like(y), torch.ones_like(h)))
        x.grad = r.grad = w.grad = None

    mean = run(benchmark, step)
    m = MACHINE.get()
    # compulsory traffic: forward reads x, r, writes y, h; backward reads dy, dh, h, writes dx (= dresidual)
    moved = 8 * rows * d * x.element_size()
    benchmark.extra_info.update({"device": m["device"], "GB/s": round(moved / mean / 1e9, 2),
                                 "% copy bandwidth": round(100 * moved / mean / 1e9 / m["copy_GBps"], 1)})
