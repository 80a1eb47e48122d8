"""Hugging Face interop (optional extra: ``pip install 'tritonlm[hf]'`` for ``transformers`` + ``safetensors``).

* :func:`from_pretrained` / :func:`save_pretrained`: local checkpoint directories of the families in
  :data:`SUPPORTED_MODELS` <-> :class:`~tritonlm.modules.TransformerLM` (RoPE rows permuted between HF's
  half-split layout and this library's interleaved pairs where a family uses the former). One record per family,
  in :mod:`tritonlm.hf.families` (:mod:`tritonlm.hf.family`: what a record holds).
* :func:`apply_kernels` / :func:`remove_kernels`: patch an HF model instance in place with the fused kernels.
* :func:`log_probs_from_model`: per-token log-probabilities / entropy of a causal LM without its logits.
* :func:`model_config_from_hf`: the :class:`~tritonlm.config.ModelConfig` of an HF config dict (plain JSON,
  no optional dependency).

Tokenizers: :meth:`tritonlm.tokenizer.Tokenizer.from_hf` reads byte-level BPE and SentencePiece-style BPE
``tokenizer.json`` files.
"""

import os as _os
import sys as _sys


def _unshadow_kernels_package() -> None:
    """In a source checkout run from its root (``python -m ...``), the root is on ``sys.path`` and its ``kernels/``
    folder (installed as ``tritonlm.kernels``) would be found as the unrelated top-level ``kernels`` package that
    transformers probes for at import, failing there. Drop just that path entry: tritonlm is imported from its
    install, never through it."""
    ours = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    checkout = (_os.path.isfile(_os.path.join(ours, "pyproject.toml"))
                and _os.path.isfile(_os.path.join(ours, "kernels", "_registry.py")))
    if "transformers" in _sys.modules or not checkout:  # an installed tritonlm: nothing shadows anything
        return
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != ours]


_unshadow_kernels_package()

from .checkpoint import (  # noqa: E402
    from_pretrained,
    model_config_from_hf,
    read_hf_config,
    readme_table,
    save_pretrained,
    supported_models,
)
from .heads import log_probs_from_model  # noqa: E402
from .patch import apply_kernels, remove_kernels  # noqa: E402

#: model_type -> what works with it: architecture, from/save_pretrained, apply_kernels, tokenizer.json kind, notes
#: (generated from the family records of :mod:`tritonlm.hf.families`; README's "Supported models" table is
#: :func:`readme_table`, and a test reads one against the other).
SUPPORTED_MODELS = supported_models()

__all__ = ["from_pretrained", "save_pretrained", "apply_kernels", "remove_kernels", "model_config_from_hf",
           "read_hf_config", "SUPPORTED_MODELS", "readme_table", "log_probs_from_model"]
