"""Registrations of the single-file ops (kernels/_registry.py): per op, the SASS cases, sweep cases, op-suite rows,
opcheck and double-backward cases the tooling and the tests read. The kernel file keeps only its tunable (beside its
launcher); op packages (``attention/``, ``moe/``) keep theirs in ``registration.py``. Imported by
``tritonlm.kernels`` after the kernel files, in the order of the SASS report and the op suite."""

from . import rmsnorm, qk_norm, rms_norm_gated, causal_conv1d, swiglu, rope, cross_entropy, linear_cross_entropy, log_probs  # noqa: F401,I001
