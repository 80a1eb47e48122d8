"""The dense MLP: a gated FFN (SwiGLU, GeGLU: ``w2(act(w1 x) * w3 x)``) or an ungated one (ReLU, SiLU:
``w2(act(w1 x))``), optionally with biases (ERNIE 4.5)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Part

#: the FFN kinds and the component each builds
COMPONENTS = {"swiglu": "SwiGLU", "geglu": "GeGLU", "relu": "ReLUFFN", "silu": "SiLUFFN"}
GATED = ("swiglu", "geglu")


@dataclass(frozen=True)
class DenseMLPSpec(Part):
    """One dense FFN of hidden width ``d_ff``; ``activation`` one of :data:`COMPONENTS`; ``bias`` on its three
    projections (gated kinds only)."""

    kind = "dense"
    flop_categories = ("ffn",)

    d_model: int
    d_ff: int
    activation: str = "swiglu"
    bias: bool = False

    def __post_init__(self):
        if self.activation not in COMPONENTS:
            raise ValueError(f"DenseMLPSpec.activation must be one of {tuple(COMPONENTS)}, got {self.activation!r}")
        if self.bias and self.activation not in GATED:
            raise ValueError(f"DenseMLPSpec.bias needs a gated FFN (swiglu or geglu), got {self.activation!r}")

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    def build(self, comps, device=None, dtype=None):
        cls = getattr(comps, COMPONENTS[self.activation])
        if self.gated:
            return cls(self.d_model, self.d_ff, device=device, dtype=dtype, bias=self.bias)
        return cls(self.d_model, self.d_ff, device=device, dtype=dtype)

    def hf_names(self) -> dict[str, str]:
        if not self.gated:
            raise ValueError(f"ffn={self.activation!r} has no Hugging Face layout (the families' MLPs are gated: "
                             "swiglu or geglu)")
        names = {}
        for ours, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            names[f"{ours}.weight"] = f"mlp.{theirs}.weight"
            if self.bias:
                names[f"{ours}.bias"] = f"mlp.{theirs}.bias"
        return names

    def param_count(self, active: bool = False) -> int:
        # (+ the biases: d_ff on the gate and up rows, d_model on down)
        return (3 if self.gated else 2) * self.d_model * self.d_ff + (2 * self.d_ff + self.d_model) * self.bias

    def forward_flops(self, batch: int, seq: int) -> dict[str, int]:
        return {"ffn": 2 * batch * seq * self.param_count()}

    def saved_elements(self, batch: int, seq: int) -> int:
        # the up-projections, their activation and product (gated); the up-projection and its activation (ungated)
        return (4 if self.gated else 2) * batch * seq * self.d_ff
