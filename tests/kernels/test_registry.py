"""The op registry (kernels/_registry.py): every op registers what the tooling reads, and the tools read only it."""

import ast
from pathlib import Path

import pytest
import torch

from tritonlm import kernels
from tritonlm.kernels import _registry, tuned

REPO = Path(__file__).resolve().parents[2]


def test_the_public_names_are_the_registered_entry_points():
    """``tritonlm.kernels.__all__`` is built from the registrations: a kernel is public by registering."""
    registered = [name for op in _registry.ops() for name in op.entry_points]
    assert len(registered) == len(set(registered))  # (no name claimed by two ops)
    assert set(kernels.__all__) - {"INTERPRETING"} == set(registered)
    assert all(hasattr(kernels, name) for name in registered)


def test_every_registration_lives_in_the_registrations_package():
    """One registration style: every op, a package too, registers in ``kernels/registrations/<op>.py``."""
    stray = [str(f.relative_to(REPO)) for f in (REPO / "kernels").rglob("*.py")
             if f.parent.name != "registrations" and f.name != "_registry.py"
             and ("register(_registry.Op" in f.read_text() or f.name == "registration.py")]
    assert stray == []


def test_every_op_names_a_reference_twin_and_how_it_is_benchmarked():
    for op in _registry.ops():
        twin = op.reference_twin()
        assert callable(twin), op.name
        assert op.bench_case is not None or op.bench_section, op.name


def test_the_launchers_read_exactly_the_registered_tunables():
    """Every tuned-table lookup the launchers make (over every op's smoke sweep cases) names a registered tunable, and
    every registered tunable is looked up: a table entry is validated against the fields of a kernel that reads it."""
    cpu = torch.device("cpu")
    with tuned.record_lookups() as seen:
        for op in _registry.ops():
            for case in op.sweep_cases(cpu, True) if op.sweep_cases else []:
                case.make_step()()
    assert {kernel for kernel, _ in seen} == set(tuned.fields())
    with pytest.raises(tuned.TunedTableError, match="unknown kernel 'paged_decode'"):
        tuned.validate({"version": 1, "kernels": {"paged_decode": {"bf16": {"BLOCK": 1024}}}})


def test_every_tunable_has_sweep_cases_and_a_shipped_configuration():
    cpu = torch.device("cpu")
    for op in _registry.ops():
        cases = op.sweep_cases(cpu, True) if op.sweep_cases else []
        for tunable in op.tunables:
            mine = [c for c in cases if c.tunable == tunable.name]
            assert mine, tunable.name
            shipped = tunable.shipped(mine[0].key, cpu, torch.float32)
            assert shipped and set(shipped) <= set(tunable.fields), (tunable.name, shipped)
            for candidate in tunable.candidates:  # every candidate is a table entry the launchers would accept
                tuned.validate({"version": 1, "kernels": {tunable.name: {"k": candidate}}})


def test_a_second_registration_of_a_name_is_an_error():
    op = _registry.op("swiglu")
    clone = _registry.Op(name="swiglu", entry_points=(), reference=op.reference)
    with pytest.raises(ValueError, match="registered twice"):
        _registry.register(clone)
    thief = _registry.Op(name="other", entry_points=(), reference=op.reference, tunables=op.tunables)
    with pytest.raises(ValueError, match="already registered"):
        _registry.register(thief)
    assert _registry.op("swiglu") is op and "other" not in {o.name for o in _registry.ops()}


def test_the_tools_read_the_registry_not_the_kernel_files():
    """kernel_report, the sweep and the op suite import no kernel file's private names."""
    for path in ("tritonlm/kernel_report.py", "bench/sweep.py", "bench/ops_suite.py", "bench/gpu_suite.py"):
        tree = ast.parse((REPO / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and "kernels" in node.module:
                assert all(alias.name == "_registry" or not alias.name.startswith("_") for alias in node.names), \
                    (path, node.module, [a.name for a in node.names])
                # the package, or the launch-capture helpers shared by every kernel (no op's own file)
                assert node.module in ("kernels", "tritonlm.kernels", "kernels._common", "tritonlm.kernels._common",
                                       "tritonlm.kernels.tuned"), (path, node.module)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                raise AssertionError(f"{path}: importlib.import_module around a kernel file")


@pytest.mark.parametrize("name", ["rmsnorm", "add_rmsnorm", "qk_norm", "swiglu", "geglu", "rope"])
def test_bench_cases_time_implementations_that_agree(name):
    """What the op suite times side by side computes the same thing: each bench case's reference and ours, forward
    and the input gradients, on a small fp32 shape."""
    case = _registry.op(name).bench_case(24, 256, torch.device("cpu"), torch.float32)
    results = []
    for impl in ("reference", "tritonlm"):
        out = case.impls[impl](*case.inputs)
        grads = torch.autograd.grad(out, case.inputs, torch.ones_like(out))
        results.append((out, *grads))
    for ref, ours in zip(*results):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
