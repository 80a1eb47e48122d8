"""The one Transformer assembly, shared by both backends.

:class:`TransformerBlock` and :class:`TransformerLM` are written once; the components they build
(norms, and the layer parts of :mod:`tritonlm.modules.parts`: each layer's token mixer and MLP, built from the
specs :meth:`ModelConfig.layer_mixer` / :meth:`ModelConfig.layer_mlp` give) come from a backend namespace: ``tritonlm.modules.reference`` or
``tritonlm.modules.fused``. Fused components subclass the reference ones and only replace ``forward``
hot paths, so parameters and ``state_dict`` keys are identical across backends.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from . import generation
from .cache import Documents
from .config import ModelConfig
from .functional import load_balancing_loss

logger = logging.getLogger("tritonlm")

BACKENDS = ("reference", "triton", "auto")


def resolve_backend(backend: str, device=None) -> str:
    """Map ``"auto"`` to a concrete backend (triton on CUDA, reference elsewhere) and say which."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device is not None:
        on_cuda = torch.device(device).type == "cuda"
    else:
        on_cuda = torch.cuda.is_available()
    chosen = "triton" if on_cuda else "reference"
    logger.info("backend='auto' chose %r (%s)", chosen, "CUDA device" if on_cuda else "no CUDA device")
    return chosen


_COMPONENTS: dict[str, ModuleType] = {}


def register_components(backend: str, namespace: ModuleType) -> None:
    """Name the module namespace whose classes a backend's models are built from (``reference`` and ``fused``
    register themselves when imported; ``tritonlm.modules`` imports both, neither imports Triton)."""
    _COMPONENTS[backend] = namespace


def components(backend: str) -> ModuleType:
    """The module namespace that provides a backend's components."""
    if backend not in _COMPONENTS:
        raise ValueError(f"no components for backend {backend!r} (registered: {', '.join(_COMPONENTS)})")
    return _COMPONENTS[backend]


def _make_norm(kind: str, comps, d_model: int, device, dtype, eps: float = 1e-5, offset: bool = False) -> nn.Module:
    if kind == "rmsnorm":
        return comps.RMSNorm(d_model, eps, device=device, dtype=dtype, offset=offset)
    if kind == "layernorm":
        return comps.LayerNorm(d_model, eps, device=device, dtype=dtype)
    if kind == "batchnorm":
        return comps.BatchNorm(d_model, eps, device=device, dtype=dtype)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}")


def _add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``: one kernel for a fused RMSNorm (``add_forward``), else spelled out."""
    add_forward = getattr(norm, "add_forward", None)
    if add_forward is not None:
        return add_forward(x, residual)
    h = x + residual
    return norm(h), h


class TransformerBlock(nn.Module):
    """One decoder block. Pre-norm (default): ``h = x + attn(ln1(x))``, ``out = h + ffn(ln2(h))``.
    Post-norm: ``h = ln1(x + attn(x))``, ``out = ln2(h + ffn(h))``. Output norms (OLMo 2): ``h = x + ln1(attn(x))``,
    ``out = h + ln2(ffn(h))``. ``norm="none"`` drops both norms.

    Built from a :class:`ModelConfig` (``TransformerBlock(config)``, what :class:`TransformerLM` does), or from
    the CS336 arguments ``(d_model, num_heads, d_ff, max_seq_len, theta)`` plus keyword options, which build that
    config. ``theta=None`` builds attention without RoPE (for sinusoidal or no position encoding).
    """

    def __init__(self, d_model: int | ModelConfig, num_heads: int | None = None, d_ff: int | None = None,
                 max_seq_len: int | None = None, theta: float | None = None, device=None, dtype=None, *,
                 backend: str = "reference", layer_idx: int = 0, **options):
        super().__init__()
        if isinstance(d_model, ModelConfig):
            if num_heads is not None or d_ff is not None or max_seq_len is not None or theta is not None or options:
                raise TypeError("TransformerBlock(config): give the config alone (its fields are the options)")
            config = d_model
        else:
            if None in (num_heads, d_ff, max_seq_len):
                raise TypeError("TransformerBlock needs (d_model, num_heads, d_ff, max_seq_len, theta) or a ModelConfig")
            position = "rope" if theta is not None else "none"
            config = ModelConfig(1, max_seq_len, d_model, 1, num_heads, d_ff, 10000.0 if theta is None else
                                 float(theta), position=position, **options)
        self.config = config
        self.backend = resolve_backend(backend, device)
        comps = components(self.backend)
        self.norm_position = config.norm_position
        self.ln1 = _make_norm(config.norm, comps, config.d_model, device, dtype, config.norm_eps, config.norm_offset)
        # the layer's parts (tritonlm.modules.parts): its token mixer and its MLP, whatever their kinds
        self.attn = config.layer_mixer(layer_idx).build(comps, device, dtype)
        self.ln2 = _make_norm(config.norm, comps, config.d_model, device, dtype, config.norm_eps, config.norm_offset)
        self.ffn = config.layer_mlp(layer_idx).build(comps, device, dtype)
        self.residual_scale = config.residual_scale  # (Granite) each branch's output scaled before its add
        # sandwich norms (Gemma 2 / 3): each branch's output normed before its residual add
        self.attn_post_norm = self.ffn_post_norm = None
        if config.post_norms:
            self.attn_post_norm = _make_norm("rmsnorm", comps, config.d_model, device, dtype, config.norm_eps,
                                             config.norm_offset)
            self.ffn_post_norm = _make_norm("rmsnorm", comps, config.d_model, device, dtype, config.norm_eps,
                                            config.norm_offset)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                kv_cache=None, *, pending: torch.Tensor | None = None, return_pending: bool = False,
                documents=None):
        """``x[..., seq, d_model] -> [..., seq, d_model]``. Pre-norm only: ``pending`` is added to ``x`` first and
        ``return_pending=True`` returns ``(h, ffn_out)`` unsummed (see :meth:`forward_pending`); going through
        ``__call__`` keeps module hooks (FSDP's unsharding) in effect."""
        if self.norm_position == "pre":
            h, ffn_out = self.forward_pending(x, pending, token_positions, kv_cache, documents)
            return (h, ffn_out) if return_pending else h + ffn_out
        if self.norm_position == "output":  # (OLMo 2) each branch's output normed, then added
            h = x + self.ln1(self.attn(x, token_positions, kv_cache, documents))
            return h + self.ln2(self.ffn(h))
        h = self.ln1(x + self.attn(x, token_positions, kv_cache, documents))
        return self.ln2(h + self.ffn(h))

    def forward_pending(self, residual: torch.Tensor, pending: torch.Tensor | None,
                        token_positions: torch.Tensor | None = None, kv_cache=None, documents=None):
        """Pre-norm block on the input ``residual + pending`` (``pending=None``: ``residual`` alone), returning
        ``(h, ffn_out)`` with the block's output ``h + ffn_out`` left unsummed.

        Leaving the last addition to the next norm lets every residual add meet its RMSNorm in one fused
        ``add_rms_norm`` pass (this block's ln1 and ln2, the next block's ln1, the final norm); the reference
        components spell the same sums out.
        """
        if pending is None:
            h_in, a = residual, self.ln1(residual)
        else:
            a, h_in = _add_norm(self.ln1, pending, residual)
        attn_out = self.attn(a, token_positions, kv_cache, documents)
        if self.attn_post_norm is not None:
            attn_out = self.attn_post_norm(attn_out)
        if self.residual_scale is not None:
            attn_out = attn_out * self.residual_scale
        y, h = _add_norm(self.ln2, attn_out, h_in)
        ffn_out = self.ffn(y)
        if self.ffn_post_norm is not None:
            ffn_out = self.ffn_post_norm(ffn_out)
        if self.residual_scale is not None:
            ffn_out = ffn_out * self.residual_scale
        return h, ffn_out


class TransformerLM(nn.Module):
    """Decoder-only LM: embeddings -> ``num_layers`` blocks -> final norm -> LM head.

    ``token_ids[batch, seq] -> logits[batch, seq, vocab_size]`` with ``seq <= context_length``.
    ``backend``: ``"reference"`` (einsum modules), ``"triton"`` (fused kernels) or ``"auto"``.
    Ablations: ``norm`` in rmsnorm/layernorm/batchnorm/none, ``ffn`` in swiglu/relu/silu, ``position``
    in rope/sinusoidal/none, ``norm_position`` pre/post. Llama-family options: ``num_kv_heads`` (grouped-query
    attention), ``norm_eps``, ``tie_embeddings`` (``lm_head.weight`` *is* ``token_embeddings.weight``; both
    ``state_dict`` keys stay, so untied checkpoints load too, the head's copy winning) and ``rope_scaling``
    (Hugging Face's dict, e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``).

    ``TransformerLM(config)`` builds the model from one :class:`ModelConfig` (every block reads it); the CS336
    keyword constructor ``TransformerLM(vocab_size, context_length, d_model, num_layers, num_heads, d_ff,
    rope_theta, ...)`` builds that config from its arguments. A new model option is one ``ModelConfig`` field.
    """

    def __init__(self, vocab_size: int | ModelConfig, context_length: int | None = None, d_model: int | None = None,
                 num_layers: int | None = None, num_heads: int | None = None, d_ff: int | None = None,
                 rope_theta: float = 10000.0, device=None, dtype=None, *, backend: str = "reference", **options):
        super().__init__()
        if isinstance(vocab_size, ModelConfig):
            sizes = (context_length, d_model, num_layers, num_heads, d_ff)
            if any(s is not None for s in sizes) or options or rope_theta != 10000.0:
                raise TypeError("TransformerLM(config): give the config alone (its fields are the options)")
            config = vocab_size
        else:
            # validates every size and option in one place
            config = ModelConfig(vocab_size, context_length, d_model, num_layers, num_heads, d_ff,
                                 float(rope_theta), **options)
        self.config = config
        self.backend = resolve_backend(backend, device)
        comps = components(self.backend)
        self.vocab_size, self.context_length = config.vocab_size, config.context_length
        self.token_embeddings = comps.Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        if config.position == "sinusoidal":
            self.position_encoding = comps.SinusoidalPositionalEncoding(config.d_model, config.context_length,
                                                                        device=device)
        else:
            self.position_encoding = None
        self.layers = nn.ModuleList(TransformerBlock(config, device=device, dtype=dtype, backend=self.backend,
                                                     layer_idx=i) for i in range(config.num_layers))
        # one RoPE module (its cos/sin tables) shared by every layer with the same base and scaling: long-context
        # checkpoints would otherwise hold num_layers copies of [context_length, d_head / 2] tables (Gemma 3's
        # local layers keep their own)
        shared = {}
        for i, layer in enumerate(self.layers):
            if getattr(layer.attn, "rope", None) is not None:  # (a mixer without positions has none)
                layer.attn.rope = shared.setdefault(repr(config.layer_rope(i)), layer.attn.rope)
        self.ln_final = (_make_norm(config.norm, comps, config.d_model, device, dtype, config.norm_eps,
                                    config.norm_offset) if config.norm_position != "post" else nn.Identity())
        self.lm_head = comps.Linear(config.d_model, config.vocab_size, device=device, dtype=dtype)
        if config.tie_embeddings:
            # the shared matrix keeps the head's init (std sqrt(2 / (d_model + vocab))): the embedding's std 1
            # would make the first logits huge
            self.token_embeddings.weight = self.lm_head.weight

    @classmethod
    def from_config(cls, cfg: ModelConfig, device=None, dtype=None, backend: str = "reference") -> TransformerLM:
        """``cls(cfg, ...)``: the model of one :class:`ModelConfig`."""
        return cls(cfg, device=device, dtype=dtype, backend=backend)

    def forward(self, token_ids: torch.Tensor, token_positions: torch.Tensor | None = None,
                kv_caches=None, *, document_ids: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                **loss_options) -> torch.Tensor:
        """``token_ids[batch, seq]`` -> ``logits[batch, seq, vocab_size]``; with ``targets[batch, seq]``, the
        loss instead (see :meth:`loss`, which is the documented way to ask for it).

        ``kv_caches`` (one :class:`~tritonlm.modules.reference.KVCache` per layer) makes the call
        incremental: ``token_ids`` are then the positions after those already cached. The layers of a
        :class:`~tritonlm.modules.cache.PagedKVCache` (``[cache.layer(i) ...]``, after ``cache.prepare``) do the
        same for a batch of sequences of different lengths, each continuing from its own.
        """
        if self.training and self.config.dropout:
            raise ValueError(f"ModelConfig.dropout={self.config.dropout}: the checkpoint was trained with dropout, "
                             "which tritonlm's kernels do not have; eval and generation are exact, training would "
                             "not be the recipe (to fine-tune without dropout: model.config = "
                             "model.config.replace(dropout=0.0))")
        hidden = self.hidden_states(token_ids, token_positions, kv_caches, document_ids=document_ids)
        if targets is not None:
            return self._loss_from_hidden(hidden, targets, **loss_options)
        if loss_options:
            raise TypeError(f"loss options {sorted(loss_options)} given without targets")
        logits = self.lm_head(hidden)
        if self.config.logits_divisor is not None:  # (Granite's logits_scaling)
            logits = logits / self.config.logits_divisor
        cap = self.config.final_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def loss(self, token_ids: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
             label_smoothing: float = 0.0, z_loss: float = 0.0, document_ids: torch.Tensor | None = None,
             aux_loss: bool | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy of ``token_ids[batch, seq]`` against ``targets[batch, seq]``.

        ``ignore_index`` targets are skipped (the mean is over the others); ``label_smoothing`` as in
        ``F.cross_entropy``; ``z_loss`` adds ``z_loss · logsumexp²`` per target. The fused backend computes it
        with ``linear_cross_entropy`` and never forms the ``[batch, seq, vocab]`` logits; the reference backend
        forms them and applies :func:`tritonlm.modules.functional.cross_entropy`. Goes through ``forward``, so
        DDP/FSDP/``torch.compile`` wrappers see the whole computation.

        A mixture-of-experts model adds ``router_aux_loss_coef`` times the load-balancing loss of this forward
        (:meth:`router_aux_loss`) when ``aux_loss`` is True, or when it is None, the model is training and its config
        says so (``ModelConfig.router_aux_loss``: a Hugging Face checkpoint's ``output_router_logits``, which published
        configs ship false; a model built here adds it). ``aux_loss=False`` never adds it.
        """
        return self(token_ids, document_ids=document_ids, targets=targets, ignore_index=ignore_index,
                    label_smoothing=label_smoothing, z_loss=z_loss, aux_loss=aux_loss)

    def _moe_layers(self) -> list[nn.Module]:
        return [layer.ffn for layer in self.layers if getattr(layer.ffn, "router_logits", None) is not None]

    def router_aux_loss(self) -> torch.Tensor:
        """The load-balancing loss (:func:`functional.load_balancing_loss`) of the last forward's MoE layers."""

        moe = self._moe_layers()
        if not moe:
            raise ValueError("router_aux_loss: no mixture-of-experts layer has run a forward yet")
        return load_balancing_loss([ffn.router_logits for ffn in moe], self.config.num_experts,
                                   self.config.experts_per_token)

    def expert_load(self) -> torch.Tensor:
        """Fraction of the last forward's routed (token, slot) pairs that each expert received, over all MoE
        layers: ``[num_experts]``, summing to 1 (uniform: ``1 / num_experts`` each)."""
        moe = self._moe_layers()
        if not moe:
            raise ValueError("expert_load: no mixture-of-experts layer has run a forward yet")
        counts = sum(ffn.expert_tokens for ffn in moe).double()
        return counts / counts.sum().clamp_min(1)

    def _loss_from_hidden(self, hidden: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                          label_smoothing: float = 0.0, z_loss: float = 0.0, aux_loss: bool | None = None
                          ) -> torch.Tensor:
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(f"targets {tuple(targets.shape)} must match token_ids {tuple(hidden.shape[:-1])}")
        if self.config.logits_divisor is not None:  # logits / s = (hidden / s) W^T: the fused loss sees the same
            hidden = hidden / self.config.logits_divisor
        # the backend's own loss: the fused one never forms the [tokens, vocab] logits; targets come from the ids'
        # data, so a trainer that validated it once (check_ids off) skips the per-step range check (a host sync)
        loss = components(self.backend).lm_head_loss(
            self.lm_head, hidden, targets, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            check_targets=self.token_embeddings.check_ids, softcap=self.config.final_softcap)
        with_aux = (self.training and self.config.router_aux_loss) if aux_loss is None else aux_loss
        if with_aux and self.config.num_experts and self.config.router_aux_loss_coef:
            loss = loss + self.config.router_aux_loss_coef * self.router_aux_loss()
        return loss

    def hidden_states(self, token_ids: torch.Tensor, token_positions: torch.Tensor | None = None,
                      kv_caches=None, *, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``token_ids[batch, seq]`` -> the final normed hidden states ``[batch, seq, d_model]`` (the LM head's
        input)."""
        if token_ids.dim() < 1:
            raise ValueError("token_ids must have a sequence dim: [batch, seq] or [seq]")
        seq = token_ids.shape[-1]
        past = kv_caches[0].length if kv_caches else 0
        if past + seq > self.context_length:
            raise ValueError(f"sequence length {past + seq} exceeds context_length {self.context_length}")
        documents = None
        if document_ids is not None:
            if kv_caches:
                raise ValueError("document_ids cannot be combined with kv_caches (decoding is one document)")
            if token_ids.dim() != 2 or document_ids.shape != token_ids.shape:
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must match token_ids "
                                 f"{tuple(token_ids.shape)} as [batch, seq]")
            if token_positions is not None:
                raise ValueError("give document_ids or token_positions, not both (positions restart per document)")
            documents = Documents(document_ids.to(token_ids.device))
            token_positions = documents.positions
        x = self.token_embeddings(token_ids)
        if self.config.embedding_scale is not None:
            # (Gemma multiplies by the scale rounded to the activations' dtype)
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype, device=x.device)
        if self.position_encoding is not None:
            if token_positions is None:
                paged = kv_caches and hasattr(kv_caches[0], "positions")  # (each sequence from its own length)
                token_positions = (kv_caches[0].positions(seq) if paged
                                   else torch.arange(past, past + seq, device=token_ids.device))
            x = self.position_encoding(x, token_positions)
        if self.config.norm_position != "pre":
            for i, layer in enumerate(self.layers):
                x = layer(x, token_positions, kv_caches[i] if kv_caches else None, documents=documents)
            return self.ln_final(x)
        # pre-norm: each block's last residual add is left pending for the next norm to fuse (forward_pending)
        pending = None
        for i, layer in enumerate(self.layers):
            x, pending = layer(x, token_positions, kv_caches[i] if kv_caches else None, pending=pending,
                               return_pending=True, documents=documents)
        return self.ln_final(x) if pending is None else _add_norm(self.ln_final, pending, x)[0]

    def new_kv_caches(self, reserve: int | None = None):
        """One empty cache per layer, the one its mixer keeps: a :class:`KVCache` per attention layer, holding up to
        ``context_length`` positions (storage allocated for ``reserve`` positions first, growing with use), a
        fixed-size :class:`RecurrentCache` per Gated DeltaNet layer."""
        return [self.config.layer_mixer(i).new_cache(self.context_length, reserve) for i in range(len(self.layers))]

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | list[int] | None = None,
                 generator: torch.Generator | None = None,
                 use_cache: bool = True, allowed: torch.Tensor | None = None, page_size: int = 16, *,
                 repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                 min_new_tokens: int = 0):
        """Sample up to ``max_new_tokens`` after ``prompt_ids``: :func:`tritonlm.modules.generation.generate` (its
        docstring has the options), which sets ``last_generation_cache`` after a ragged batch."""
        return generation.generate(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, eos_id, generator,
                                   use_cache, allowed, page_size, repetition_penalty=repetition_penalty,
                                   no_repeat_ngram_size=no_repeat_ngram_size, min_new_tokens=min_new_tokens)
