"""The mixture-of-experts MLP: a router (softmax or sigmoid scoring, top-k, grouped choice, a choice bias) over
``num_experts`` gated experts stored stacked (``gate_up_proj [E, 2I, d_model]`` gate rows first, ``down_proj
[E, d_model, I]``), plus an optional shared expert every token runs. Builds ``MoEFFN``.

Its Hugging Face transforms read and write the experts in the layouts checkpoints use: one tensor per expert and
projection (the Hub's files; the family names the block and the three projections), transformers 5's stacked
tensors, and gpt-oss's transposed stacks with interleaved gate / up columns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Part


@dataclass(frozen=True)
class MoESpec(Part):
    """One MoE layer: each token goes to ``top_k`` of ``num_experts`` experts of width ``d_ff`` (the fields are
    ``MoEFFN``'s arguments; see its docstring for the routing options)."""

    kind = "moe"
    component = "MoEFFN"
    flop_categories = ("ffn",)

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    shared_d_ff: int | None = None
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    scoring: str = "softmax"
    choice_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_gate: bool = True

    # --- Hugging Face layout ----------------------------------------------------------------------------------
    def hf_names(self) -> dict[str, str]:
        """The shared expert (and its gate); the router and experts go through :meth:`state_from_hf`."""
        if not self.shared_d_ff:
            return {}
        names = {f"shared_expert.{ours}.weight": f"mlp.shared_expert.{theirs}.weight"
                 for ours, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))}
        if self.shared_gate:
            names["shared_expert_gate.weight"] = "mlp.shared_expert_gate.weight"
        return names

    def state_from_hf(self, hf_state: dict, hf_layer: str, ours: str, weights, used: set) -> dict:
        """The router and experts, from per-expert tensors (the family's block and names, or the other common ones)
        or stacked ones (``mlp.experts.gate_up_proj`` / ``down_proj``), into the stacked layout."""
        def take(key):
            if key not in hf_state:
                raise ValueError(f"checkpoint lacks {key}")
            used.add(key)
            return hf_state[key]

        self._check_layout(weights)
        if weights.expert_format == "transposed_interleaved":  # (gpt-oss)
            block = f"{hf_layer}.{weights.expert_block}"
            return {f"{ours}.router.weight": take(f"{block}.router.weight"),
                    f"{ours}.router.bias": take(f"{block}.router.bias"),
                    f"{ours}.experts.gate_up_proj": _deinterleave(take(f"{block}.experts.gate_up_proj").transpose(1, 2)),
                    f"{ours}.experts.gate_up_bias": _deinterleave(take(f"{block}.experts.gate_up_proj_bias")),
                    f"{ours}.experts.down_proj": take(f"{block}.experts.down_proj").transpose(1, 2),
                    f"{ours}.experts.down_bias": take(f"{block}.experts.down_proj_bias")}
        blocks = dict.fromkeys((weights.expert_block, "mlp"))
        block = next((f"{hf_layer}.{name}" for name in blocks if f"{hf_layer}.{name}.gate.weight" in hf_state), None)
        if block is None:
            raise ValueError(f"checkpoint lacks {hf_layer}.{weights.expert_block}.gate.weight")
        out = {f"{ours}.router.weight": take(f"{block}.gate.weight")}
        if self.choice_bias:  # (DeepSeek-V3's e_score_correction_bias)
            out[f"{ours}.choice_bias"] = take(f"{block}.gate.e_score_correction_bias")
        if f"{block}.experts.gate_up_proj" in hf_state:
            out[f"{ours}.experts.gate_up_proj"] = take(f"{block}.experts.gate_up_proj")
            out[f"{ours}.experts.down_proj"] = take(f"{block}.experts.down_proj")
            return out
        candidates = dict.fromkeys((weights.expert_names, ("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")))
        names = next((n for n in candidates if f"{block}.experts.0.{n[0]}.weight" in hf_state), weights.expert_names)
        experts = [[take(f"{block}.experts.{j}.{n}.weight") for n in names] for j in range(self.num_experts)]
        out[f"{ours}.experts.gate_up_proj"] = torch.stack([torch.cat([gate, up]) for gate, up, _ in experts])
        out[f"{ours}.experts.down_proj"] = torch.stack([down for _, _, down in experts])
        return out

    def state_to_hf(self, state: dict, hf_layer: str, ours: str, weights) -> dict:
        """The inverse of :meth:`state_from_hf`: gpt-oss's layout for its family, else per-expert names (the Hub and
        transformers 4.x; 5.x converts them on load)."""
        self._check_layout(weights)
        block = f"{hf_layer}.{weights.expert_block}"
        if weights.expert_format == "transposed_interleaved":
            return {f"{block}.router.weight": state[f"{ours}.router.weight"],
                    f"{block}.router.bias": state[f"{ours}.router.bias"],
                    f"{block}.experts.gate_up_proj": _interleave(state[f"{ours}.experts.gate_up_proj"]).transpose(1, 2),
                    f"{block}.experts.gate_up_proj_bias": _interleave(state[f"{ours}.experts.gate_up_bias"]),
                    f"{block}.experts.down_proj": state[f"{ours}.experts.down_proj"].transpose(1, 2),
                    f"{block}.experts.down_proj_bias": state[f"{ours}.experts.down_bias"]}
        gate_name, up_name, down_name = weights.expert_names
        out = {f"{block}.gate.weight": state[f"{ours}.router.weight"]}
        if self.choice_bias:
            out[f"{block}.gate.e_score_correction_bias"] = state[f"{ours}.choice_bias"]
        gate_up, down = state[f"{ours}.experts.gate_up_proj"], state[f"{ours}.experts.down_proj"]
        for j in range(self.num_experts):
            out[f"{block}.experts.{j}.{gate_name}.weight"] = gate_up[j, :self.d_ff]
            out[f"{block}.experts.{j}.{up_name}.weight"] = gate_up[j, self.d_ff:]
            out[f"{block}.experts.{j}.{down_name}.weight"] = down[j]
        return out

    def _check_layout(self, weights) -> None:
        """The biases live in gpt-oss's layout only (its router and experts have them, the per-expert files of the
        other families none): a one-line error rather than tensors silently left out."""
        biased = self.router_bias or self.expert_bias
        if weights.expert_format == "transposed_interleaved" and not (self.router_bias and self.expert_bias):
            raise ValueError("the transposed_interleaved expert layout (gpt-oss) holds router and expert biases: "
                             "it needs router_bias and expert_bias")
        if weights.expert_format != "transposed_interleaved" and biased:
            raise ValueError(f"the {weights.expert_format!r} expert layout has no router or expert biases (only "
                             "gpt-oss's transposed_interleaved one does)")

    # --- accounting ---------------------------------------------------------------------------------------------
    def param_count(self, active: bool = False) -> int:
        d = self.d_model
        experts = self.top_k if active else self.num_experts
        # the shared expert, + its sigmoid gate (Qwen2-MoE; DeepSeek-V3's shared experts have none)
        shared = 3 * d * self.shared_d_ff + d * self.shared_gate if self.shared_d_ff else 0
        biases = (2 * self.d_ff + d) * self.expert_bias  # (gpt-oss: gate_up and down biases per expert)
        # router (+ its bias), experts, shared expert
        return self.num_experts * (d + self.router_bias) + experts * (3 * d * self.d_ff + biases) + shared

    def forward_flops(self, batch: int, seq: int) -> dict[str, int]:
        return {"ffn": 2 * batch * seq * self.param_count(active=True)}  # the router and the experts a token reaches

    def saved_elements(self, batch: int, seq: int) -> int:
        # the router logits, each routed pair's two projections, activation and product, the shared expert's
        b, s = batch, seq
        return b * s * self.num_experts + 4 * b * s * self.top_k * self.d_ff + 4 * b * s * (self.shared_d_ff or 0)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) alternating gate, up -> gate rows, then up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_deinterleave`."""
    half = t.shape[1] // 2
    return torch.stack([t[:, :half], t[:, half:]], dim=2).flatten(1, 2)
