"""Model configuration (re-exported): :class:`ModelConfig` and the presets live beside the model that reads them,
in :mod:`tritonlm.modules.config`."""

from .modules.config import (  # noqa: F401
    FFNS,
    NORM_POSITIONS,
    NORMS,
    POSITIONS,
    PRESETS,
    ROPE_SCALING_FIELDS,
    ModelConfig,
    check_rope_scaling,
    default_d_ff,
)

__all__ = ["ModelConfig", "PRESETS", "NORMS", "FFNS", "POSITIONS", "NORM_POSITIONS", "ROPE_SCALING_FIELDS",
           "check_rope_scaling", "default_d_ff"]
