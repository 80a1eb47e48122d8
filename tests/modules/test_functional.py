import math

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.modules import functional as F


def test_softmax_matches_torch_any_dim():
    x = torch.randn(3, 4, 5)
    for dim in (0, 1, -1):
        torch.testing.assert_close(F.softmax(x, dim), torch.softmax(x, dim))


def test_softmax_is_stable_on_huge_inputs():
    # the seeds' example: exp(10000) overflows without the max subtraction
    out = F.softmax(torch.tensor([1.0, 5.0, 100.0, 10000.0]), dim=-1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, 1.0]))


def test_silu_matches_torch():
    x = torch.randn(100)
    torch.testing.assert_close(F.silu(x), TF.silu(x))


@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 7, 16)])
def test_sdpa_matches_torch_with_mask(shape):
    q = torch.randn(*shape)
    k = torch.randn(*shape[:-2], 9, shape[-1])
    v = torch.randn(*shape[:-2], 9, 4)
    mask = torch.rand(*shape[:-1], 9) > 0.3
    mask[..., 0] = True  # torch's SDPA gives NaN on fully masked rows
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, mask),
                               TF.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v),
                               TF.scaled_dot_product_attention(q, k, v))


def test_sdpa_fully_masked_row_is_zero_not_nan():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    out = F.scaled_dot_product_attention(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert (out[:, 1] == 0).all()


def test_sdpa_bad_inputs():
    with pytest.raises(ValueError):
        F.scaled_dot_product_attention(torch.randn(2, 4), torch.randn(3, 5), torch.randn(3, 5))
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(torch.randn(2, 4), torch.randn(3, 4), torch.randn(3, 4),
                                       torch.ones(2, 3))


def test_causal_mask_bottom_right():
    m = F.causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert torch.equal(F.causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_cross_entropy_matches_torch_and_is_stable():
    logits = torch.randn(2, 3, 11) * 5
    targets = torch.randint(0, 11, (2, 3))
    torch.testing.assert_close(F.cross_entropy(logits, targets),
                               TF.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1)))
    big = torch.tensor([[1e4, 0.0, -1e4]])
    assert math.isclose(F.cross_entropy(big, torch.tensor([1])).item(), 1e4, rel_tol=1e-6)


def test_cross_entropy_bad_shapes():
    with pytest.raises(ValueError):
        F.cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError):
        F.cross_entropy(torch.randn(4, 5), torch.zeros(4))
