"""Post-training losses (``tritonlm.losses``) over the fused head, each against its formula written out here in torch
on materialised fp64 logits: GRPO for every supported ``loss_type`` and both importance-sampling levels (loss, every
gradient, TRL's clip-ratio and KL metrics), Liger's GRPO / DPO / SimPO / JSD classes in their call shapes, refusals of
unsupported options; and ``tritonlm.hf.log_probs_from_model`` against a transformers model's own logits."""

import pytest
import torch
import torch.nn.functional as F

from tritonlm import losses

from helpers import tiny_llama, transformers_or_skip

B, T, D, V = 3, 6, 16, 97


@pytest.fixture
def batch():
    torch.manual_seed(0)
    hidden = (torch.randn(B, T, D) * 0.6).requires_grad_()
    weight = (torch.randn(V, D) * 0.6).requires_grad_()
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    advantages = torch.tensor([1.3, -0.7, 0.4])
    return hidden, weight, ids, mask, advantages


def _fp64_logps(hidden, weight, ids, temperature=1.0):
    logits = hidden.double() @ weight.double().t() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]


def _fp64_grpo(logps, old, ref, mask, adv, beta, eps_low, eps_high, loss_type, max_len, level, tau_pos=1.0,
               tau_neg=1.05):
    """TRL's GRPOTrainer._compute_loss, written out (SAPO's gate per token, by the advantage's sign)."""
    mask = mask.double()
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    coef_1 = torch.exp(log_ratio)
    adv = adv.double()[:, None]
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * logps
    elif loss_type == "sapo":
        coef_1 = coef_1.expand_as(logps)
        per_token = torch.empty_like(coef_1)
        for i in range(coef_1.shape[0]):
            tau = tau_pos if adv[i, 0] > 0 else tau_neg
            per_token[i] = -torch.sigmoid(tau * (coef_1[i] - 1)) * 4 / tau * adv[i, 0]
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logps) - (ref - logps) - 1)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * max_len)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@pytest.mark.parametrize("loss_type", losses.GRPO_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_matches_trl_formula(batch, loss_type, level):
    hidden, weight, ids, mask, adv = batch
    torch.manual_seed(1)
    old = (_fp64_logps(hidden.detach(), weight.detach(), ids, 0.9) + 0.3 * torch.randn(B, T)).float()  # (past the clip)
    ref_hidden = hidden.detach() + 0.2 * torch.randn(B, T, D)
    module = losses.LigerFusedLinearGRPOLoss(beta=0.05, epsilon_low=0.2, epsilon_high=0.28 if loss_type != "cispo"
                                             else 5.0, loss_type=loss_type, max_completion_length=8,
                                             importance_sampling_level=level, temperature=0.9,
                                             sapo_temperature_pos=0.9, sapo_temperature_neg=1.3)
    loss, metrics = module(hidden, weight, ids, mask, adv, old_per_token_logps=old, ref_input=ref_hidden,
                           ref_weight=weight.detach())
    r_h, r_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logps = _fp64_logps(r_h, r_w, ids, 0.9)
    ref = _fp64_logps(ref_hidden, weight.detach(), ids, 0.9)
    expected = _fp64_grpo(logps, old.double(), ref, mask, adv, 0.05, 0.2, module.epsilon_high, loss_type, 8, level,
                          0.9, 1.3)
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    _assert_grads(loss, expected, (hidden, weight), (r_h, r_w))
    # Liger's metrics: [kl, clip_ratio]; TRL's definitions
    kl, clip_ratio = metrics
    m = mask.double()
    diff = ref - logps.detach()
    torch.testing.assert_close(kl.double(), ((torch.exp(diff) - diff - 1) * m).sum() / m.sum(), atol=1e-6, rtol=1e-5)
    ratio = torch.exp(logps.detach() - old.double())
    if level == "sequence":
        ratio = torch.exp(((logps.detach() - old.double()) * m).sum(-1) / m.sum(-1))[:, None].expand(B, T)
    a = adv.double()[:, None]
    region = ((ratio < 0.8) & (a < 0)) | ((ratio > 1 + module.epsilon_high) & (a > 0))
    if loss_type == "sapo":
        region = torch.zeros_like(region)  # (a soft gate: nothing is clipped)
    elif level == "token":
        assert region.any()  # (the shifted old log-probs put some tokens past the clip)
    torch.testing.assert_close(clip_ratio.double(), (region.double() * m).sum() / m.sum())


def test_grpo_without_old_log_probs_is_one_update_per_rollout(batch):
    """old_per_token_logps None: the ratio is 1 (its gradient still flows), as TRL computes it."""
    hidden, weight, ids, mask, adv = batch
    loss, metrics = losses.LigerFusedLinearGRPOLoss(beta=0.0, loss_type="grpo")(hidden, weight, ids, mask, adv)
    assert len(metrics) == 1 and metrics[0] == 0
    r_h = hidden.detach().double().requires_grad_()
    logps = _fp64_logps(r_h, weight.detach(), ids)
    expected = _fp64_grpo(logps, logps.detach(), None, mask, adv, 0.0, 0.2, 0.2, "grpo", None, "token")
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(loss, hidden)[0].double(), torch.autograd.grad(expected, r_h)[0],
                               atol=1e-6, rtol=1e-4)


def test_grpo_refusals(batch):
    hidden, weight, ids, mask, adv = batch
    with pytest.raises(ValueError, match="loss_type 'gspo' is not supported"):
        losses.LigerFusedLinearGRPOLoss(loss_type="gspo")
    with pytest.raises(ValueError, match="sapo_temperature_pos .* must be > 0"):
        losses.grpo_loss(torch.zeros(B, T), mask, adv, beta=0.0, loss_type="sapo", sapo_temperature_pos=0.0)
    with pytest.raises(ValueError, match="needs ref_per_token_logps or ref_input and ref_weight"):
        losses.LigerFusedLinearGRPOLoss(beta=0.1)(hidden, weight, ids, mask, adv)
    with pytest.raises(ValueError, match="importance_sampling_level 'batch'"):
        losses.grpo_loss(torch.zeros(B, T), mask, adv, beta=0.0, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="advantages must be"):
        losses.grpo_loss(torch.zeros(B, T), mask, adv[:2], beta=0.0)


def _assert_grads(loss, expected, inputs, references):
    """Every gradient of ``loss`` in ``inputs`` against ``expected``'s in the fp64 ``references``."""
    for g, w in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(expected, references)):
        torch.testing.assert_close(g.double(), w, atol=1e-6, rtol=1e-4)


def _pairs():
    torch.manual_seed(2)
    hidden = (torch.randn(2 * B, T, D) * 0.6).requires_grad_()
    weight = (torch.randn(V, D) * 0.6).requires_grad_()
    target = torch.randint(0, V, (2 * B, T))
    target[:, :2] = -100  # the prompt
    target[1, 5:] = -100
    return hidden, weight, target


def _fp64_seq_logps(hidden, weight, target, average):
    token = _fp64_logps(hidden, weight, torch.where(target == -100, 0, target))
    keep = (target != -100).double()
    total = (token * keep).sum(-1)
    return (total / keep.sum(-1) if average else total), token, keep


@pytest.mark.parametrize("average, nll", [(False, False), (True, True)])
def test_dpo_matches_its_formula(average, nll):
    hidden, weight, target = _pairs()
    ref_hidden = hidden.detach() + 0.1 * torch.randn_like(hidden)
    module = losses.LigerFusedLinearDPOLoss(beta=0.3, compute_nll_loss=nll, average_log_prob=average)
    loss, (chosen, rejected, nll_loss, chosen_rewards, rejected_rewards) = module(
        weight, hidden, target, ref_input=ref_hidden, ref_weight=weight.detach())
    r_h, r_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logps, token, keep = _fp64_seq_logps(r_h, r_w, target, average)
    ref, _, _ = _fp64_seq_logps(ref_hidden, weight.detach(), target, average)
    logits = 0.3 * ((logps[:B] - ref[:B]) - (logps[B:] - ref[B:]))
    expected = -F.logsigmoid(logits).mean()
    expected_nll = -(token[:B] * keep[:B]).sum() / keep[:B].sum()
    if nll:
        expected = expected + expected_nll
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(chosen_rewards.double(), (0.3 * (logps[:B] - ref[:B])).detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(nll_loss.double(), expected_nll.detach(), atol=1e-6, rtol=1e-5)
    _assert_grads(loss, expected, (hidden, weight), (r_h, r_w))


def test_simpo_matches_its_formula():
    hidden, weight, target = _pairs()
    loss, aux = losses.LigerFusedLinearSimPOLoss(beta=2.0, gamma=0.4, label_smoothing=0.1, compute_nll_loss=True,
                                                 alpha=0.5)(weight, hidden, target)
    r_h, r_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logps, token, keep = _fp64_seq_logps(r_h, r_w, target, True)
    logits = 2.0 * (logps[:B] - logps[B:]) - 0.4
    expected = (-0.9 * F.logsigmoid(logits) - 0.1 * F.logsigmoid(-logits)).mean()
    expected = expected + 0.5 * -(token[:B] * keep[:B]).sum() / keep[:B].sum()
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    _assert_grads(loss, expected, (hidden, weight), (r_h, r_w))


def test_preference_refusals():
    hidden, weight, target = _pairs()
    with pytest.raises(ValueError, match="loss_type 'ipo' is not supported"):
        losses.LigerFusedLinearDPOLoss(loss_type="ipo")
    with pytest.raises(ValueError, match="needs ref_input and ref_weight"):
        losses.LigerFusedLinearDPOLoss()(weight, hidden, target)
    with pytest.raises(ValueError, match="an even count"):
        losses.LigerFusedLinearSimPOLoss()(weight, hidden[:5], target[:5])


def test_liger_jsd_classes_are_the_kernels():
    from tritonlm.kernels import fused_linear_jsd, jsd

    torch.manual_seed(3)
    hs, ws, ht, wt = torch.randn(5, 8), torch.randn(40, 8), torch.randn(5, 6), torch.randn(40, 6)
    assert losses.LigerFusedLinearJSD(0.3, temperature=2.0)(hs, ws, ht, wt) == fused_linear_jsd(
        hs, ws, ht, wt, jsd_beta=0.3, temperature=2.0)
    q, p = torch.log_softmax(torch.randn(5, 40), -1), torch.log_softmax(torch.randn(5, 40), -1)
    assert losses.LigerJSD(0.7)(q, p) == jsd(q, p, 0.7)


def test_log_probs_from_model_matches_the_models_logits():
    transformers_or_skip()
    from tritonlm import hf

    model = tiny_llama(seed=4).train()
    ids = torch.randint(0, 300, (2, 11))
    labels = ids.clone()
    labels[0, :4] = -100  # (the prompt: no log-prob, no gradient)
    logp, ent = hf.log_probs_from_model(model, ids, labels, temperature=0.7, return_entropy=True)
    logits = model(ids).logits[:, :-1].double() / 0.7
    log_p = torch.log_softmax(logits, -1)
    target = labels[:, 1:]
    keep = target != -100
    expected = torch.where(keep, log_p.gather(-1, torch.where(keep, target, 0)[..., None])[..., 0], 0.0)
    torch.testing.assert_close(logp.double(), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), torch.where(keep, -(log_p.exp() * log_p).sum(-1), 0.0), atol=2e-5,
                               rtol=1e-5)
    grads = torch.autograd.grad(logp.sum(), [model.lm_head.weight, model.model.embed_tokens.weight])
    model.zero_grad()
    want = torch.autograd.grad(expected.sum(), [model.lm_head.weight, model.model.embed_tokens.weight])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.double(), w.double(), atol=2e-5, rtol=1e-4)
