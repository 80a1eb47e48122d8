"""Post-training losses over the fused head (:func:`tritonlm.kernels.linear_log_probs`): the per-token log-probabilities
of the chosen tokens come from the hidden states without the ``[tokens, vocab]`` logits, and the losses are the
formulas below on top of them, in torch (fp32). Names and call shapes are Liger-Kernel's (``liger_kernel.chunked_loss``)
so a trainer that takes Liger's classes takes these: ``LigerFusedLinearGRPOLoss``, ``LigerFusedLinearDPOLoss``,
``LigerFusedLinearSimPOLoss``, ``LigerFusedLinearJSD``, ``LigerJSD`` (and the functions beside them).

GRPO (TRL's ``GRPOTrainer`` loss), per completion token with log-probability ``l``, the rollout policy's ``l_old``
(``old_per_token_logps``; None: ``l`` detached, one update per rollout), the reference model's ``l_ref`` and the
sequence's advantage ``A``::

    ρ      = exp(l - l_old)                      (importance_sampling_level="sequence": exp of the sequence's
                                                  masked mean of l - l_old, GSPO)
    loss_t = -min(ρ A, clip(ρ, 1 - ε_low, 1 + ε_high) A)          loss_type grpo / bnpo / dr_grpo / dapo
    loss_t = -sg(min(ρ, ε_high)) · A · l                          loss_type cispo (sg: no gradient)
    loss_t = -(4 / τ) σ(τ (ρ - 1)) · A                            loss_type sapo (soft gate instead of a clip;
                                                  τ = sapo_temperature_pos if A > 0 else sapo_temperature_neg)
    loss_t += β (exp(l_ref - l) - (l_ref - l) - 1)                the k3 estimate of KL(π || π_ref), β > 0

reduced over the completion mask ``M`` (``attention_mask``): grpo and sapo ``mean_i(Σ_t M loss / Σ_t M)``; bnpo and dapo
``Σ M loss / Σ M`` (dapo's normaliser is the global token count; one process here); dr_grpo ``Σ M loss / (B ·
max_completion_length)``. Metrics, as TRL logs them: the masked mean KL (β > 0) and the clip ratios (the fraction of
tokens whose ratio sits outside the clip range on the side the advantage's sign makes binding; 0 for sapo, which
clips nothing).

DPO (``loss_type="sigmoid"``), over pairs whose inputs are stacked chosen-first (``[2B, T, d]``) with per-sequence
log-probabilities ``π_c, π_r`` (sums over the non-ignored tokens; means with ``average_log_prob``) and the reference
model's ``ρ_c, ρ_r``: ``loss = -mean log σ(β ((π_c - ρ_c) - (π_r - ρ_r)))``, rewards ``β (π - ρ)``; with
``compute_nll_loss`` the chosen tokens' mean negative log-likelihood is added. SimPO (no reference model; mean
log-probabilities): ``logits = β (π̄_c - π̄_r) - γ``, ``loss = mean(-(1 - ε) log σ(logits) - ε log σ(-logits))`` (+
``alpha`` · the chosen NLL with ``compute_nll_loss``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import fused_linear_jsd, jsd, linear_log_probs

__all__ = ["grpo_loss", "dpo_loss", "simpo_loss", "LigerFusedLinearGRPOLoss", "LigerFusedLinearDPOLoss",
           "LigerFusedLinearSimPOLoss", "LigerFusedLinearJSD", "LigerJSD", "GRPO_LOSS_TYPES"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


def _check(name: str, ok: bool, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {why}")


def grpo_loss(per_token_logps: torch.Tensor, attention_mask: torch.Tensor, advantages: torch.Tensor, *,
              old_per_token_logps: torch.Tensor | None = None, ref_per_token_logps: torch.Tensor | None = None,
              beta: float = 0.04, epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "bnpo",
              max_completion_length: int | None = None, importance_sampling_level: str = "token",
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05):
    """The GRPO loss (module docstring) of ``per_token_logps[B, T]`` under the completion mask ``attention_mask[B,
    T]`` and ``advantages[B]``. Returns ``(loss, metrics)`` with metrics a dict of scalars: ``clip_ratio``,
    ``low_clip``, ``high_clip`` and, with β > 0, ``kl``."""
    op = "grpo_loss"
    _check(op, loss_type in GRPO_LOSS_TYPES, f"loss_type {loss_type!r} is not supported (supported: "
                                             f"{', '.join(GRPO_LOSS_TYPES)})")
    _check(op, importance_sampling_level in ("token", "sequence"),
           f"importance_sampling_level {importance_sampling_level!r} must be 'token' or 'sequence'")
    _check(op, per_token_logps.dim() == 2 and attention_mask.shape == per_token_logps.shape,
           f"per_token_logps {tuple(per_token_logps.shape)} and attention_mask {tuple(attention_mask.shape)} must "
           "both be [batch, completion tokens]")
    _check(op, advantages.shape == per_token_logps.shape[:1], f"advantages must be [batch] = "
                                                              f"[{per_token_logps.shape[0]}], got {tuple(advantages.shape)}")
    _check(op, beta == 0 or ref_per_token_logps is not None, "beta > 0 needs the reference model's log-probs "
                                                             "(ref_per_token_logps, or ref_input / ref_weight)")
    if loss_type == "sapo":
        _check(op, sapo_temperature_pos > 0 and sapo_temperature_neg > 0,
               f"sapo_temperature_pos ({sapo_temperature_pos}) and sapo_temperature_neg ({sapo_temperature_neg}) "
               "must be > 0")
    logps = per_token_logps.float()
    mask = attention_mask.to(logps.dtype)
    old = logps.detach() if old_per_token_logps is None else old_per_token_logps.float()
    adv = advantages.float()[:, None]
    log_ratio = logps - old
    if importance_sampling_level == "sequence":  # (GSPO: one ratio per sequence, the masked mean)
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp_min(1.0))[:, None]
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps
    elif loss_type == "sapo":  # (the gate's slope at ρ = 1 is 1 whatever τ: the 4 / τ)
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    else:
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
    metrics = {}
    if beta != 0:
        diff = ref_per_token_logps.float() - logps
        kl = torch.exp(diff) - diff - 1.0
        per_token = per_token + beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp_min(1.0)).detach()
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)).mean()
    elif loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else per_token.shape[1]
        loss = (per_token * mask).sum() / (per_token.shape[0] * length)
    else:  # bnpo, dapo, cispo: over every completion token of the batch
        loss = (per_token * mask).sum() / mask.sum().clamp_min(1.0)
    ratio_t = ratio.expand_as(logps).detach()
    clips = loss_type != "sapo"
    low = ((ratio_t < 1.0 - epsilon_low) & (adv < 0) & clips).to(mask.dtype)
    high = ((ratio_t > 1.0 + epsilon_high) & (adv > 0) & clips).to(mask.dtype)
    tokens = mask.sum().clamp_min(1.0)
    metrics.update(low_clip=(low * mask).sum() / tokens, high_clip=(high * mask).sum() / tokens,
                   clip_ratio=(((low + high) > 0).to(mask.dtype) * mask).sum() / tokens)
    return loss, metrics


class LigerFusedLinearGRPOLoss(nn.Module):
    """GRPO from hidden states (Liger's class and call): ``forward(_input[B, T, d], lin_weight[V, d],
    selected_token_ids[B, T], attention_mask[B, T], advantages[B], bias=None, ref_per_token_logps=None,
    old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None) -> (loss, metrics)``, metrics
    ``[kl (β > 0), clip_ratio]`` as Liger returns them. ``compiled`` and ``chunk_size`` are accepted for the
    signature (the head is always the chunked kernel)."""

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "bnpo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 temperature: float = 1.0, sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05):
        super().__init__()
        _check("LigerFusedLinearGRPOLoss", loss_type in GRPO_LOSS_TYPES,
               f"loss_type {loss_type!r} is not supported (supported: {', '.join(GRPO_LOSS_TYPES)})")
        self.beta, self.use_ref_model, self.epsilon_low, self.epsilon_high = beta, use_ref_model, epsilon_low, epsilon_high
        self.loss_type, self.max_completion_length = loss_type, max_completion_length
        self.importance_sampling_level, self.temperature = importance_sampling_level, temperature
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None):
        logps = linear_log_probs(_input, lin_weight, selected_token_ids, bias=bias, temperature=self.temperature)
        if self.beta != 0 and self.use_ref_model and ref_per_token_logps is None:
            if ref_input is None or ref_weight is None:
                raise ValueError("LigerFusedLinearGRPOLoss: beta > 0 with use_ref_model needs ref_per_token_logps or "
                                 "ref_input and ref_weight")
            with torch.no_grad():
                ref_per_token_logps = linear_log_probs(ref_input, ref_weight, selected_token_ids, bias=ref_bias,
                                                       temperature=self.temperature)
        beta = self.beta if self.use_ref_model else 0.0
        loss, metrics = grpo_loss(logps, attention_mask, advantages, old_per_token_logps=old_per_token_logps,
                                  ref_per_token_logps=ref_per_token_logps, beta=beta, epsilon_low=self.epsilon_low,
                                  epsilon_high=self.epsilon_high, loss_type=self.loss_type,
                                  max_completion_length=self.max_completion_length,
                                  importance_sampling_level=self.importance_sampling_level,
                                  sapo_temperature_pos=self.sapo_temperature_pos,
                                  sapo_temperature_neg=self.sapo_temperature_neg)
        return loss, ([metrics["kl"]] if "kl" in metrics else []) + [metrics["clip_ratio"]]


def _sequence_logps(lin_weight, _input, target, bias, ignore_index: int, average: bool, temperature: float = 1.0):
    """Per-sequence log-probabilities of ``target[N, T]`` (sums, or means with ``average``, over the non-ignored
    tokens), and the per-token ones."""
    token = linear_log_probs(_input, lin_weight, target, bias=bias, ignore_index=ignore_index, temperature=temperature)
    mask = (target != ignore_index).to(token.dtype)
    total = (token * mask).sum(-1)
    return (total / mask.sum(-1).clamp_min(1.0) if average else total), token, mask


def _halves(name: str, x: torch.Tensor):
    _check(name, x.shape[0] % 2 == 0, f"inputs stack chosen then rejected along dim 0: an even count, got {x.shape[0]}")
    return x[: x.shape[0] // 2], x[x.shape[0] // 2:]


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float = 0.1):
    """The sigmoid DPO loss of per-sequence log-probabilities: ``(loss, chosen_rewards, rejected_rewards)``."""
    chosen = beta * (chosen_logps - ref_chosen_logps)
    rejected = beta * (rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(chosen - rejected).mean(), chosen.detach(), rejected.detach()


def simpo_loss(chosen_logps, rejected_logps, beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0):
    """The SimPO loss of per-sequence mean log-probabilities: ``(loss, chosen_rewards, rejected_rewards)``."""
    logits = beta * (chosen_logps - rejected_logps) - gamma
    loss = (-(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)).mean()
    return loss, (beta * chosen_logps).detach(), (beta * rejected_logps).detach()


class LigerFusedLinearDPOLoss(nn.Module):
    """DPO from hidden states (Liger's class and call): ``forward(lin_weight, _input[2B, T, d], target[2B, T],
    bias=None, ref_input=None, ref_weight=None, ref_bias=None) -> (loss, (chosen_logps, rejected_logps, nll_loss,
    chosen_rewards, rejected_rewards))``, chosen sequences first. ``loss_type`` "sigmoid" only."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compute_nll_loss: bool = False,
                 compiled: bool = True, use_ref_model: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1, loss_type: str = "sigmoid"):
        super().__init__()
        _check("LigerFusedLinearDPOLoss", loss_type == "sigmoid",
               f"loss_type {loss_type!r} is not supported (supported: sigmoid)")
        _check("LigerFusedLinearDPOLoss", use_ref_model, "use_ref_model=False is not supported: DPO needs the "
                                                         "reference model's log-probabilities")
        self.ignore_index, self.beta, self.compute_nll_loss = ignore_index, beta, compute_nll_loss
        self.average_log_prob = average_log_prob

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None):
        if ref_input is None or ref_weight is None:
            raise ValueError("LigerFusedLinearDPOLoss: needs ref_input and ref_weight (the reference model's hidden "
                             "states and LM head)")
        logps, token, mask = _sequence_logps(lin_weight, _input, target, bias, self.ignore_index, self.average_log_prob)
        with torch.no_grad():
            ref, _, _ = _sequence_logps(ref_weight, ref_input, target, ref_bias, self.ignore_index,
                                        self.average_log_prob)
        (c, r), (rc, rr) = _halves("LigerFusedLinearDPOLoss", logps), _halves("LigerFusedLinearDPOLoss", ref)
        loss, chosen_rewards, rejected_rewards = dpo_loss(c, r, rc, rr, self.beta)
        token_c, mask_c = _halves("", token)[0], _halves("", mask)[0]
        nll = -(token_c * mask_c).sum() / mask_c.sum().clamp_min(1.0)
        if self.compute_nll_loss:
            loss = loss + nll
        return loss, (c.detach(), r.detach(), nll.detach(), chosen_rewards, rejected_rewards)


class LigerFusedLinearSimPOLoss(nn.Module):
    """SimPO from hidden states (Liger's class and call): ``forward(lin_weight, _input[2B, T, d], target[2B, T],
    bias=None) -> (loss, (chosen_logps, rejected_logps, nll_loss, chosen_rewards, rejected_rewards))``."""

    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = False, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.gamma = ignore_index, beta, alpha, gamma
        self.label_smoothing, self.compute_nll_loss = label_smoothing, compute_nll_loss

    def forward(self, lin_weight, _input, target, bias=None):
        logps, token, mask = _sequence_logps(lin_weight, _input, target, bias, self.ignore_index, True)
        c, r = _halves("LigerFusedLinearSimPOLoss", logps)
        loss, chosen_rewards, rejected_rewards = simpo_loss(c, r, self.beta, self.gamma, self.label_smoothing)
        token_c, mask_c = _halves("", token)[0], _halves("", mask)[0]
        nll = -(token_c * mask_c).sum() / mask_c.sum().clamp_min(1.0)
        if self.compute_nll_loss:
            loss = loss + self.alpha * nll
        return loss, (c.detach(), r.detach(), nll.detach(), chosen_rewards, rejected_rewards)


class LigerFusedLinearJSD(nn.Module):
    """Liger's class: ``LigerFusedLinearJSD(jsd_beta=0.5, ignore_index=-100, temperature=1.0)(student_input,
    student_weight, teacher_input, teacher_weight, shift_labels=None)`` (:func:`tritonlm.kernels.fused_linear_jsd`)."""

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0):
        super().__init__()
        self.jsd_beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None):
        return fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                self.jsd_beta, self.ignore_index, self.temperature)


class LigerJSD(nn.Module):
    """Liger's class: ``LigerJSD(beta=0.5, ignore_index=-100)(log_q, log_p, shift_labels=None)``, the student's
    and the teacher's log-probabilities (:func:`tritonlm.kernels.jsd`)."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        self.beta, self.ignore_index = beta, ignore_index

    def forward(self, log_q, log_p, shift_labels=None):
        return jsd(log_q, log_p, self.beta, shift_labels=shift_labels, ignore_index=self.ignore_index)
