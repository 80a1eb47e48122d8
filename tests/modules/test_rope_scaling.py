"""RoPE scaling "yarn" (gpt-oss, DeepSeek-V3): the frequencies and the attention factor against transformers' own
``_compute_yarn_parameters``, and the reference RoPE's tables carrying the factor."""

import math

import pytest
import torch

from tritonlm.modules.reference import RotaryPositionalEmbedding, rope_attention_factor, scaled_inv_freq

YARNS = [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},  # gpt-oss
    {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096},  # DeepSeek-V3's (truncate by default, mscale ratio)
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "attention_factor": 1.25},
]


@pytest.mark.parametrize("scaling", YARNS, ids=["gpt-oss", "deepseek", "attention-factor"])
@pytest.mark.parametrize("theta, dim", [(150000.0, 64), (10000.0, 48)])
def test_yarn_against_transformers(scaling, theta, dim):
    transformers = pytest.importorskip("transformers", reason="the optional extra tritonlm[hf] is not installed")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    config = transformers.LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim,
                                      max_position_embeddings=4096 * 8,
                                      rope_parameters={**scaling, "rope_theta": theta})
    inv_freq, factor = _compute_yarn_parameters(config)
    ours = scaled_inv_freq(theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim), scaling, theta)
    torch.testing.assert_close(ours.float(), inv_freq, atol=0, rtol=1e-6)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    # the ramp moved something (between plain RoPE and plain interpolation)
    plain = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert (ours - plain).abs().max() > 0 and (ours - plain / scaling["factor"]).abs().max() > 0


def test_yarn_tables_carry_the_attention_factor():
    scaling = YARNS[0]
    rope = RotaryPositionalEmbedding(150000.0, 16, 64, scaling=scaling)
    plain_angles = torch.arange(64, dtype=torch.float64)[:, None] * scaled_inv_freq(
        150000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16), scaling, 150000.0)
    factor = 0.1 * math.log(32.0) + 1.0
    torch.testing.assert_close(rope.cos_cached.double(), torch.cos(plain_angles) * factor, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rope.sin_cached.double(), torch.sin(plain_angles) * factor, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RotaryPositionalEmbedding(1e4, 16, 64, scaling={"rope_type": "yarn", "factor": 4.0})
