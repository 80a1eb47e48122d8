"""Triton kernels, one op per file, each behind a ``torch.autograd.Function``.

Functional entry points: :func:`rms_norm`, :func:`add_rms_norm`, :func:`qk_rms_norm` (an attention layer's q and
k norms in one launch), :func:`rms_norm_gated` (Qwen3.5's norm before the gate),
:func:`causal_conv1d_fn` / :func:`causal_conv1d_update` (Gated DeltaNet's short convolution),
:func:`chunk_gated_delta_rule` / :func:`fused_recurrent_gated_delta_rule` (Gated DeltaNet itself), :func:`apply_rope`, :func:`swiglu_gate`,
:func:`flash_attention`; losses :func:`cross_entropy` (on logits) and :func:`linear_cross_entropy` (LM head +
loss without materialising the logits); post-training heads :func:`linear_log_probs` (per-token log-probabilities and
entropy from hidden states), :func:`selective_log_softmax` / :func:`entropy_from_logits` (TRL's, on logits), and the
distillation divergences :func:`jsd`, :func:`kl_div`, :func:`fused_linear_jsd`.
Attention Functions: :class:`FlashAttention` (Triton) and :class:`FlashAttentionTorch` (tiled PyTorch), both with
grouped-query attention; flash-attn 2's entry points :func:`flash_attn_func` and :func:`flash_attn_varlen_func`
(windows, packed sequences); few queries against a long cache take the split-KV (flash-decoding) path.

Kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before Triton was
imported (the test suite does this). Under the interpreter shims make ``tl.dot`` correct on bfloat16 and let
Triton 3.6's interpreter index with kernel-made scalars under NumPy 2.
"""

from ._common import INTERPRETING, install_interpreter_bf16_dot_shim, install_interpreter_index_shim

if INTERPRETING:
    install_interpreter_bf16_dot_shim()
    install_interpreter_index_shim()

# import order = registration order = the order of the SASS report and the op suite
# isort: off
from .rmsnorm import AddRMSNormFunction, RMSNormFunction, add_rms_norm, rms_norm  # noqa: E402,F401
from .qk_norm import QKNormFunction, qk_rms_norm  # noqa: E402,F401
from .rms_norm_gated import RMSNormGatedFunction, rms_norm_gated  # noqa: E402,F401
from .causal_conv1d import CausalConv1dFunction, causal_conv1d_fn, causal_conv1d_update  # noqa: E402,F401
from .swiglu import SwiGLUGateFunction, geglu_gate, swiglu_gate  # noqa: E402,F401
from .rope import RoPEFunction, apply_rope, rope_tables  # noqa: E402,F401
from .cross_entropy_loss import CrossEntropyFunction, cross_entropy  # noqa: E402,F401
from .linear_cross_entropy_loss import LinearCrossEntropyFunction, linear_cross_entropy  # noqa: E402,F401
from .log_probs import (  # noqa: E402,F401
    LinearLogProbsFunction,
    LogProbsFunction,
    entropy_from_logits,
    linear_log_probs,
    selective_log_softmax,
)
from .distill import DivergenceFunction, FusedLinearJSDFunction, fused_linear_jsd, jsd, kl_div  # noqa: E402,F401
from .attention import (  # noqa: E402,F401
    FlashAttention,
    FlashAttentionTorch,
    flash_attention,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from .moe import MoEExpertsFunction, moe_experts  # noqa: E402,F401
from .gated_delta import GatedDeltaRuleFunction, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402,F401
from . import registrations  # noqa: E402,F401  (every op's registration: kernels/_registry.py)
# isort: on

from . import _registry  # noqa: E402

#: the public names: every registered op's entry points (kernels/registrations/), and whether the interpreter runs them
__all__ = [*_registry.entry_points(), "INTERPRETING"]
