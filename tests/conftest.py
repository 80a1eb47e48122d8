"""Test configuration: Triton kernels run on CPU through the interpreter.

``TRITON_INTERPRET`` must be set before Triton is imported anywhere, which is why it is set here, at
import time of the first conftest, before any test module imports tritonlm.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
