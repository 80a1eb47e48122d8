"""Every op's registration (kernels/_registry.py), one module per op, single-file ops and op packages alike: per op,
the SASS cases, sweep cases, op-suite rows, opcheck and double-backward cases the tooling and the tests read. The
kernel files keep only their tunables (beside their launchers). Imported by ``tritonlm.kernels`` after every kernel,
in the order of the SASS report and the op suite."""

from . import rmsnorm, qk_norm, rms_norm_gated, causal_conv1d, swiglu, rope, cross_entropy, linear_cross_entropy, log_probs  # noqa: F401,I001
from . import attention, moe, gated_delta  # noqa: F401,I001
