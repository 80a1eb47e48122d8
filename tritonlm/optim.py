"""Training utilities: AdamW, the cosine learning-rate schedule with warmup, global-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), bias-corrected moments.

    Per parameter, at step ``t``::

        θ ← θ - lr·λ·θ                                  (decoupled decay)
        m ← β1·m + (1-β1)·g ;  v ← β2·v + (1-β2)·g²
        θ ← θ - lr/(1-β1ᵗ) · m / (sqrt(v)/sqrt(1-β2ᵗ) + ε)

    the same arithmetic as ``torch.optim.AdamW``. State (``step``, ``exp_avg``, ``exp_avg_sq``) saves and
    loads through ``state_dict``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError("eps and weight_decay must be non-negative")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * wd)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1 ** t
                bias2 = 1 - beta2 ** t
                denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / bias1)
        return loss


def cosine_lr_schedule(it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int,
                       cosine_cycle_iters: int) -> float:
    """Linear warmup to ``max`` over ``warmup_iters``, cosine decay to ``min`` at ``cosine_cycle_iters``,
    then flat at ``min``."""
    if it < warmup_iters:
        return max_learning_rate * it / warmup_iters
    if it <= cosine_cycle_iters:
        progress = (it - warmup_iters) / max(1, cosine_cycle_iters - warmup_iters)
        return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (max_learning_rate - min_learning_rate)
    return min_learning_rate


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_l2_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients in place so their global L2 norm is at most ``max_l2_norm``.

    Returns the norm before clipping. The scale is ``max / (norm + eps)`` when the norm exceeds the max.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    scale = torch.clamp(max_l2_norm / (total + eps), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total
