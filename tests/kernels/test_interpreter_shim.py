"""The interpreter shim (kernels/_common.py) makes bf16 kernels on CPU compute what they compute on GPUs: ``tl.dot``
on bf16 operands multiplies values (not bit patterns), and ``x.to(tl.bfloat16)`` rounds to nearest even (the
interpreter alone truncates). Checked against PyTorch's own conversions and matmul. And Triton 3.6's interpreter may
index with scalars a kernel computed (``range`` bounds from ``tl.maximum`` / ``tl.where``) under NumPy 2."""

import pytest
import torch
import triton
import triton.language as tl

import tritonlm.kernels  # noqa: F401  (importing the kernels installs the shim under the interpreter)

from helpers import cpu_only


@triton.jit
def _cast_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, x.to(tl.bfloat16), mask=offs < n)


@triton.jit
def _dot_kernel(A, B, C, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    a = tl.load(A + rows[:, None] * BLOCK + rows[None, :])
    b = tl.load(B + rows[:, None] * BLOCK + rows[None, :])
    tl.store(C + rows[:, None] * BLOCK + rows[None, :], tl.dot(a, b))


@cpu_only
def test_fp32_to_bf16_rounds_to_nearest_even_like_torch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen) * torch.logspace(-30, 30, 1000)
    # halfway cases (ties go to even), values that round up across a power of two, and specials
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 2 - 2**-9, -(1 + 2**-8), 0.0, -0.0, float("inf"), float("-inf")])
    x = torch.cat([x, ties])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, x.numel(), BLOCK=2048)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    nan = torch.tensor([float("nan")])
    out = torch.empty(1, dtype=torch.bfloat16)
    _cast_kernel[(1,)](nan, out, 1, BLOCK=16)
    assert out.isnan().all()


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dot_on_16_bit_operands_multiplies_values(dtype):
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(2))
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, BLOCK=16)
    torch.testing.assert_close(c, a.float() @ b.float(), atol=1e-5, rtol=1e-5)


@triton.jit
def _count_kernel(OUT, n, lo_cut, BLOCK: tl.constexpr):
    # loop bounds computed in the kernel, as the attention launchers' key ranges are
    lo = tl.maximum(n - lo_cut, 0)
    hi = tl.where(n > 5, tl.minimum(n, 40), n + 1)
    steps = 0
    for _ in range(lo, hi, BLOCK):
        steps += 1
    tl.store(OUT, steps)


@cpu_only
@pytest.mark.parametrize("n, lo_cut, block", [(10, 3, 1), (100, 90, 4), (3, 7, 2), (6, 6, 5)])
def test_kernel_made_scalars_bound_loops(n, lo_cut, block):
    out = torch.zeros(1, dtype=torch.int32)
    _count_kernel[(1,)](out, n, lo_cut, BLOCK=block)
    lo, hi = max(n - lo_cut, 0), (min(n, 40) if n > 5 else n + 1)
    assert out.item() == len(range(lo, hi, block))
