"""Test configuration: Triton kernels run on CPU through the interpreter.

``TRITON_INTERPRET`` must be set before Triton is imported anywhere, which is why it is set here, at
import time of the first conftest, before any test module imports tritonlm.

``TRITONLM_TEST_DEVICE=cuda`` reruns the kernel tests on a GPU instead (the one-shot GPU suite does):
no interpreter, tensors created on CUDA by default. fp32 attention keeps the fp32 tolerance there too: under
torch's default "highest" matmul precision every ``tl.dot`` is IEEE fp32 (``input_precision="ieee"``).
"""

import contextlib
import os
import sys

# ``python -m pytest`` puts the repository root on sys.path, where this checkout's ``kernels/`` folder (installed
# as ``tritonlm.kernels``) would shadow the unrelated top-level ``kernels`` package that transformers probes for.
# tritonlm itself is imported from its install, so the root entry is not needed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

DEVICE = os.environ.get("TRITONLM_TEST_DEVICE", "cpu")
ON_CUDA = DEVICE.startswith("cuda")
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if ON_CUDA:
    torch.set_default_device(DEVICE)

#: fp32 tolerance for results that go through attention's tl.dot: IEEE fp32 dots under torch's default "highest"
#: precision, in the interpreter and on GPUs alike.
FP32_ATTENTION_TOL = 1e-4
#: the tolerance of fp32 attention under "high" (TF32 tensor cores, 10-bit mantissa operands), checked on CPU
#: under ``emulated_tf32_dots``
GPU_FP32_ATTENTION_TOL = 5e-3
cpu_only = pytest.mark.skipif(ON_CUDA, reason="checks CPU/interpreter behaviour")


@contextlib.contextmanager
def emulated_tf32_dots():
    """Inside the block, the interpreter's ``tl.dot`` drops the low 13 mantissa bits of fp32 operands, the
    worst case of what TF32 tensor cores do with them, so GPU tolerances can be checked on a CPU."""
    import numpy as np
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    original = builder.create_dot

    def truncate(h):
        if h.dtype.scalar != interp.tl.float32:
            return h
        bits = np.ascontiguousarray(h.data, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return interp.TensorHandle(bits.view(np.float32), interp.tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, truncate(a), truncate(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the checkout; tests that need it skip on a fresh machine without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present (only on the project's development machines)")
    return SHARED_DATA


def tolerance(dtype: torch.dtype) -> dict:
    """Usual comparison tolerances of a low-precision result against an fp32/fp64 reference."""
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float64: dict(atol=1e-10, rtol=1e-10)}[dtype]


@pytest.fixture(scope="module")
def stream_cut_every_chunk():
    """Streaming normally gathers ~8K characters before cutting; cut after every chunk instead so that the
    cut logic (held-back pre-tokens and special tokens) is exercised at every chunk boundary."""
    import tritonlm.tokenizer as T

    saved, T.STREAM_BUFFER_CHARS = T.STREAM_BUFFER_CHARS, 1
    yield
    T.STREAM_BUFFER_CHARS = saved
