"""Test configuration: Triton kernels run on CPU through the interpreter. (Helpers tests import live in
``helpers.py``; this file holds pytest's configuration and fixtures only.)

``TRITON_INTERPRET`` must be set before Triton is imported anywhere, which is why it is set here, at
import time of the first conftest, before any test module imports tritonlm.

``TRITONLM_TEST_DEVICE=cuda`` reruns the kernel tests on a GPU instead (the one-shot GPU suite does):
no interpreter, tensors created on CUDA by default. fp32 attention keeps the fp32 tolerance there too: under
torch's default "highest" matmul precision every ``tl.dot`` is IEEE fp32 (``input_precision="ieee"``).
"""

import os
import sys

# ``python -m pytest`` puts the repository root on sys.path, where this checkout's ``kernels/`` folder (installed
# as ``tritonlm.kernels``) would shadow the unrelated top-level ``kernels`` package that transformers probes for.
# tritonlm itself is imported from its install, so the root entry is not needed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

if not os.environ.get("TRITONLM_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import DEVICE, ON_CUDA, SHARED_DATA  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if ON_CUDA:
    torch.set_default_device(DEVICE)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shared_data():
    """``../shared/data`` beside the checkout; tests that need it skip on a fresh machine without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present (only on the project's development machines)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def stream_cut_every_chunk():
    """Streaming normally gathers ~8K characters before cutting; cut after every chunk instead so that the
    cut logic (held-back pre-tokens and special tokens) is exercised at every chunk boundary."""
    import tritonlm.tokenizer as T

    saved, T.STREAM_BUFFER_CHARS = T.STREAM_BUFFER_CHARS, 1
    yield
    T.STREAM_BUFFER_CHARS = saved
