"""Every op's custom ops and autograd Functions, from the registrations (kernels/_registry.py): torch.library.opcheck
on each custom op, and double backward refused by each first-order Function."""

import pytest
import torch


def test_double_backward_is_a_clear_error_for_every_kernel_function():
    """The Triton backwards are first-order only: create_graph=True is refused up front instead of returning
    gradients whose second-order terms would silently be missing (e.g. from a gradient penalty). The calls come from
    each op's registration, and every op with an autograd Function entry point must declare some."""
    from tritonlm.kernels import _registry

    cases = []
    for op in _registry.ops():
        has_function = any(name.endswith("Function") for name in op.entry_points)
        declared = op.double_backward_cases() if op.double_backward_cases else []
        # (GeGLU shares SwiGLU's Function: its entry points name no Function of their own)
        assert declared or not has_function, f"op {op.name!r} declares no double-backward case"
        cases += declared
    assert {"rms_norm", "add_rms_norm", "swiglu_gate", "apply_rope", "FlashAttention", "FlashAttentionTorch",
            "cross_entropy", "linear_cross_entropy", "qk_rms_norm", "moe_experts"} <= {name for name, _, _ in cases}
    for name, out, inputs in cases:
        with pytest.raises(RuntimeError, match="double backward"):  # refused when the graph would be built
            torch.autograd.grad(out.sum(), inputs, create_graph=True)
        (grad,) = torch.autograd.grad(out.sum(), inputs)  # a plain backward still works
        assert torch.isfinite(grad).all(), name


def test_opcheck_every_custom_op():
    """torch.library.opcheck on every tritonlm custom op (schema, fake implementation vs the real one, AOT
    dispatch): what torch.compile relies on. The cases come from the op registrations (``opcheck_cases``) and must
    cover every custom op registered with torch."""
    from tritonlm.kernels import _registry  # (importing the kernels registers the custom ops)

    cases = {}
    for op in _registry.ops():
        for name, arg_sets in (op.opcheck_cases() if op.opcheck_cases else {}).items():
            assert name not in cases, f"custom op {name!r} has cases in two registrations"
            cases[name] = arg_sets
    registered = {name for name in dir(torch.ops.tritonlm) if not name.startswith("_") and name != "name"}
    assert registered == set(cases), registered ^ set(cases)
    for name, arg_sets in cases.items():
        for args in arg_sets:
            torch.library.opcheck(getattr(torch.ops.tritonlm, name), args,
                                  test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
