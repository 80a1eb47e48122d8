"""Hugging Face interop (optional extra: ``pip install 'tritonlm[hf]'`` for ``transformers`` + ``safetensors``).

* :func:`from_pretrained` / :func:`save_pretrained`: local ``LlamaForCausalLM`` / ``MistralForCausalLM``
  directories <-> :class:`~tritonlm.modules.TransformerLM` (RoPE rows permuted between HF's half-split layout
  and this library's interleaved pairs).
* :func:`apply_kernels` / :func:`remove_kernels`: patch an HF model instance in place with the fused kernels.
* :func:`model_config_from_hf`: the :class:`~tritonlm.config.ModelConfig` of an HF config dict (plain JSON,
  no optional dependency).

Tokenizers: :meth:`tritonlm.tokenizer.Tokenizer.from_hf` reads byte-level BPE ``tokenizer.json`` files.
"""

from .checkpoint import from_pretrained, model_config_from_hf, read_hf_config, save_pretrained
from .patch import apply_kernels, remove_kernels

__all__ = ["from_pretrained", "save_pretrained", "apply_kernels", "remove_kernels", "model_config_from_hf",
           "read_hf_config"]
