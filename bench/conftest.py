"""Benchmark session setup: `pytest bench/ --benchmark-only`.

On a CUDA machine the benchmarks run at real sizes against every available baseline. Without a GPU the same
command runs a small smoke version (tiny shapes, reference and interpreter paths) so that every code path
is exercised in CI; its timings are not GPU figures and are labelled as such.
"""

import os
import sys
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # the Triton kernels run on CPU through the interpreter; must be set before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the repository root (put on sys.path by ``python -m pytest``) holds ``kernels/``, which would shadow the unrelated
# top-level ``kernels`` package transformers probes for; tritonlm comes from its install
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402

from benchutil import MACHINE  # noqa: E402


def pytest_report_header(config):
    if ON_GPU:
        return f"tritonlm bench on {torch.cuda.get_device_name()} (torch {torch.__version__})"
    return ("tritonlm bench: NO GPU -- smoke run with tiny shapes on the reference and Triton-interpreter paths; "
            "these timings are NOT GPU figures")


def pytest_terminal_summary(terminalreporter):
    m = MACHINE.get()
    if m:
        terminalreporter.write_line(
            f"machine ceilings measured this run: copy {m['copy_GBps']:.1f} GB/s, matmul {m['matmul_TFLOPs']:.2f} "
            f"TFLOP/s ({m['matmul_dtype']}){'' if ON_GPU else ' -- CPU smoke run, not GPU figures'}")


@pytest.fixture(scope="session")
def machine():
    return MACHINE.get()
