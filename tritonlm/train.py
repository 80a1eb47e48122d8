"""The main job: train a TransformerLM on text, log, checkpoint, plot, and sample from it.

Data: a text file (a tokenizer is trained on it, or loaded, and the text is tokenised once into a cached
``.npy`` memmap), a pre-tokenised ``.npy``/``.bin`` token file, or, with no data given, an embedded default
corpus that ships with Python itself (the stdlib's ``pydoc_data.topics``: the language reference's topic
texts, about 0.5 MB), so one command trains on any fresh machine.

Runs on one device, or under ``torchrun`` with DistributedDataParallel (``gloo`` on CPU, ``nccl`` on GPU;
FSDP2 ``fully_shard`` with ``fsdp=True``): every rank draws its own slice of one global batch, rank 0 logs
and checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import accounting
from ._base import Dist, TrainError, all_mean, resolve_device, runnable_backend, setup_distributed
from .checkpoint import (
    CHECKPOINT_NAME,
    optimizer_param_names,
    optimizer_state_keyed,
    read_checkpoint,
    restore_rng_state,
    save_checkpoint,
    unwrap,
    write_text_atomic,
)
from .config import ModelConfig
from .data import (
    batch_at,
    document_ids,
    fingerprint,
    prepare_data,
    sample_starts,
    unigram_entropy,
)
from .generate import encoded_length, generate_text
from .modules import TransformerLM
from .optim import AdamW, clip_grad_norm_, cosine_lr_schedule
from .tokenizer import SPECIAL_TOKENS, find_tokenizer_files


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x) -> bool:
    return _finite(x) and x > 0


def option(default, help, *, flag: str | None = "", type=None, choices=None, metavar=None, check=None,
           rule: str = "", factory=None):
    """A :class:`TrainConfig` field and its ``tritonlm train`` option in one place: ``help`` (a string, or a
    callable giving it when the parser is built), the ``flag`` (default ``--field-name``; None: no option),
    ``type`` (default: the default's), ``choices``; ``check(value) -> bool`` with the ``rule`` a failure names
    (one line: "--flag value: must be rule"). Booleans are switches (the flag sets the opposite of the default)."""
    metadata = dict(help=help, flag=flag, type=type, choices=choices, metavar=metavar, check=check, rule=rule)
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


#: The model-size options that override the preset (``--d-model 256`` ...), collected in ``model_overrides``.
MODEL_FLAGS = {
    "vocab_size": int, "context_length": int, "d_model": int, "num_layers": int, "num_heads": int, "num_kv_heads": int,
    "d_ff": int, "rope_theta": float, "norm": str, "ffn": str, "position": str, "norm_position": str,
    "num_experts": int, "experts_per_token": int, "moe_d_ff": int}
MODEL_FLAG_HELP = {
    "num_kv_heads": "key/value heads for grouped-query attention (a divisor of --num-heads; default = num_heads)",
    "num_experts": "mixture of experts: SwiGLU experts per FFN layer (0 = dense; the tiny-moe preset has 8); the "
                   "training loss adds the load-balancing loss and the log shows it and the expert load",
    "experts_per_token": "mixture of experts: experts each token is routed to (default 2)",
    "moe_d_ff": "mixture of experts: each expert's hidden width (default: d_ff)",
}


def _init_from_help() -> str:
    from .hf.family import supported_phrase  # (plain Python: the family list, no transformers)

    return (f"fine-tune a local {supported_phrase()} (config.json + safetensors): its sizes, weights and "
            "tokenizer.json; only --context-length (training length, default min(1024, the model's)) may be changed")


@dataclass
class TrainConfig:
    """Everything ``tritonlm train`` takes: each field is one option of ``tritonlm train --help`` (its help, type,
    default and check in the field's metadata, see :func:`option`), and a config with a value its check refuses is
    a one-line :class:`TrainError` when it is made."""

    data: str | None = option(None, "text file (a tokenizer is trained on it unless --tokenizer is given), or a "
                                    ".npy/.bin token file; default: the embedded corpus", type=str)
    tokenizer: str | None = option(None, "tokenizer to use: a directory with vocab.json + merges.txt (GPT-2 "
                                         "format) or a Hugging Face tokenizer.json, or the path of that tokenizer.json",
                                   type=str)
    init_from: str | None = option(None, _init_from_help, type=str, metavar="HF_DIR")
    preset: str = option("tiny", "model size preset (default tiny; see `tritonlm accounting`)")
    model_overrides: dict = option(None, "", flag=None, factory=dict)  # (the MODEL_FLAGS options)
    max_steps: int = option(300, "optimizer steps (default 300)", check=_positive, rule="positive")
    batch_size: int = option(32, "sequences per step per process (default 32)", check=_positive, rule="positive")
    grad_accum: int = option(1, "micro-batches per step (default 1)", check=_positive, rule="positive")
    # the training context (--context-length is one of the model-size options)
    context_length: int | None = option(None, "", flag=None, check=lambda v: v is None or v > 0, rule="positive")
    lr: float = option(3e-3, "peak learning rate (default 3e-3)", check=_positive, rule="a positive number")
    min_lr: float | None = option(None, "final learning rate (default lr/10)", type=float)
    warmup_steps: int | None = option(None, "linear warmup steps (default 5%% of steps)", type=int,
                                      check=lambda v: v is None or v >= 0, rule=">= 0")
    weight_decay: float = option(0.1, "AdamW weight decay of the matrices (default 0.1)",
                                 check=lambda v: _finite(v) and v >= 0, rule=">= 0")
    betas: tuple[float, float] = option((0.9, 0.95), "", flag=None,
                                        check=lambda v: all(_finite(b) and 0 <= b < 1 for b in v), rule="in [0, 1)")
    grad_clip: float = option(1.0, "global gradient L2 norm cap (default 1.0)", check=_positive,
                              rule="a positive L2 norm")
    router_aux_loss: str = option("config", "mixture of experts: add the load-balancing loss to the training loss? "
                                            "config (default): as the model's config says (an --init-from "
                                            "checkpoint's output_router_logits, false in published configs, as "
                                            "transformers follows it; a model built here: on), on, off",
                                  choices=["config", "on", "off"])
    document_mask: bool = option(False, "packed documents: attention only within each document (split at "
                                        "<|endoftext|>), positions restarting per document (fused backend: varlen "
                                        "attention)")
    z_loss: float = option(0.0, "weight of the z-loss term z·logsumexp² per token (PaLM; e.g. 1e-4; default 0)",
                           check=lambda v: _finite(v) and v >= 0, rule=">= 0")
    label_smoothing: float = option(0.0, "label smoothing of the training loss, as in F.cross_entropy (default 0; "
                                         "validation loss is always the plain cross-entropy)",
                                    check=lambda v: _finite(v) and 0 <= v <= 1, rule="in [0, 1]")
    eval_every: int = option(100, "validation every N steps (0: only at the end)", check=lambda v: v >= 0,
                             rule=">= 0 (0: only at the end)")
    eval_batches: int = option(8, "validation batches per evaluation (default 8)", check=_positive, rule="positive")
    log_every: int = option(10, "log every N steps (default 10)", check=_positive, rule="positive")
    checkpoint_every: int = option(0, "also checkpoint every N steps (default: end only)", check=lambda v: v >= 0,
                                   rule=">= 0 (0: only at the end)")
    out: str = option("runs/tiny", "output directory (default runs/tiny)")
    backend: str = option("auto", "auto: triton kernels on CUDA, reference elsewhere",
                          choices=["auto", "reference", "triton"])
    device: str = option("auto", "auto, cpu, cuda, cuda:1, ...")
    dtype: str = option("auto", "auto: bf16 autocast on GPU, fp32 on CPU", choices=["auto", "bf16", "fp32"])
    compile: bool = option(False, "torch.compile the model")
    fsdp: bool = option(False, "shard with FSDP2 fully_shard (under torchrun)")
    seed: int = option(0, "random seed of the initialisation and the batches (default 0)")
    resume: bool = option(False, "continue from --out/checkpoint.pt")
    overwrite: bool = option(False, "start over in an --out that holds a previous run (otherwise refused)")
    errors: str = option("strict", "text that is not valid UTF-8: strict (default) stops with the byte offset, "
                                   "replace reads such bytes as U+FFFD", choices=["strict", "replace"])
    val_fraction: float = option(0.05, "", flag=None, check=lambda v: 0 < v < 1, rule="in (0, 1)")
    sample_prompt: str = option("The", "prompt for the sample printed at the end", flag="--prompt", metavar="TEXT")
    sample_tokens: int = option(120, "tokens to sample at the end (0: none)", check=lambda v: v >= 0, rule=">= 0")
    progress: bool = option(True, "no progress bars", flag="--no-progress")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            value = getattr(self, f.name)
            if check is not None and not check(value):
                raise TrainError(f"{_flag(f) or f.name} {value!r}: must be {f.metadata['rule']}")
        if self.min_lr is not None and not (_finite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise TrainError(f"--min-lr {self.min_lr!r}: must be between 0 and --lr")
        if self.resume and self.overwrite:
            raise TrainError("--resume and --overwrite contradict each other: continue the run, or start it over")

    def check_out_dir(self) -> None:
        """The output directory can take this run: a directory (or nothing yet), and a previous run in it is
        continued (``resume``) or started over (``overwrite``), never silently mixed."""
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise TrainError(f"--out {out}: exists and is not a directory")
        previous = [name for name in (CHECKPOINT_NAME, "log.jsonl") if (out / name).exists()]
        if previous and not (self.resume or self.overwrite):
            raise TrainError(f"--out {out} holds a previous run ({', '.join(previous)}); pass --resume to continue "
                             "it or --overwrite to start over")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def add_options(cls, parser) -> None:
        """Add every field's option, and after ``--preset`` the model-size overrides, to an argparse parser."""
        for f in dataclasses.fields(cls):
            flag = _flag(f)
            if flag is None:
                continue
            meta, default = f.metadata, f.default
            help_text = meta["help"]() if callable(meta["help"]) else meta["help"]
            if isinstance(default, bool):
                parser.add_argument(flag, dest=f.name, action="store_false" if default else "store_true",
                                    help=help_text)
            else:
                parser.add_argument(flag, dest=f.name, default=default, type=meta["type"] or type(default),
                                    choices=meta["choices"], metavar=meta["metavar"], help=help_text)
            if f.name == "preset":
                for name, kind in MODEL_FLAGS.items():
                    parser.add_argument("--" + name.replace("_", "-"), dest=f"model_{name}", type=kind, default=None,
                                        metavar=name.upper(),
                                        help=MODEL_FLAG_HELP.get(name, f"override the preset's {name}"))

    @classmethod
    def from_args(cls, args) -> TrainConfig:
        """The config of arguments parsed with :meth:`add_options`."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if _flag(f) is not None}
        overrides = {name: getattr(args, f"model_{name}") for name in MODEL_FLAGS
                     if getattr(args, f"model_{name}") is not None}
        return cls(**values, model_overrides=overrides)


def _flag(f) -> str | None:
    """A field's option: its metadata's ``flag``, by default ``--field-name`` (None: not an option)."""
    flag = f.metadata.get("flag", "")
    return ("--" + f.name.replace("_", "-")) if flag == "" else flag


# ----------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------
def _param_groups(model: torch.nn.Module, weight_decay: float):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _autocast(device: torch.device, dtype: str):
    if dtype == "auto":
        dtype = "bf16" if device.type == "cuda" else "fp32"
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16), "bf16"
    if dtype == "fp32":
        return torch.autocast(device.type, enabled=False), "fp32"
    raise TrainError(f"--dtype must be auto, bf16 or fp32, got {dtype!r}")


@dataclass
class _Run:
    """The state a training job builds stage by stage (see :func:`train`)."""

    cfg: TrainConfig
    say: object
    device: torch.device
    dist: Dist
    out: Path
    # data stage
    mcfg: ModelConfig | None = None
    tokenizer: object = None
    tok_dir: Path | None = None
    data_fp: str | None = None
    tok_fp: str | None = None
    train_tokens: object = None
    val_tokens: object = None
    end_of_text: int | None = None
    entropy: float = 0.0
    # model stage
    backend: str = "reference"
    model: TransformerLM | None = None
    train_model: object = None
    ddp: object = None
    optimizer: AdamW | None = None
    start_step: int = 0
    generator: torch.Generator | None = None
    autocast: object = None
    precision: str = ""
    # loop
    history: list = field(default_factory=list)
    log: object = None
    tokens_per_step: int = 0

    @property
    def main(self) -> bool:
        return self.dist.main

    @property
    def ckpt_path(self) -> Path:
        return self.out / CHECKPOINT_NAME

    @property
    def log_path(self) -> Path:
        return self.out / "log.jsonl"


def train(cfg: TrainConfig, say=print) -> dict:
    """Run the whole job; returns a summary dict (also written to ``out/summary.json``).

    Stages, top to bottom: check the options, set up devices and processes, prepare data and tokenizer, build
    (or resume) the model and optimizer, run the training loop with its evaluations and checkpoints, finish
    (summary, plot, sample).
    """
    cfg.check_out_dir()
    run = _setup(cfg, say)
    _data_stage(run)
    _model_stage(run)
    val_loss = _training_loop(run)
    return _finish(run, val_loss)


def _setup(cfg: TrainConfig, say) -> _Run:
    """Devices and processes; only rank 0 speaks. Fails on an unusable backend before any data work."""
    device = resolve_device(cfg.device)
    dist_info = setup_distributed(device)
    if device.type == "cuda" and dist_info.world > 1:
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    say = say if dist_info.main else (lambda *a, **k: None)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(cfg, say, device, dist_info, out)
    try:
        run.mcfg = (_hf_model_config(cfg) if cfg.init_from else ModelConfig.preset(cfg.preset, **cfg.model_overrides))
        if cfg.router_aux_loss != "config":
            run.mcfg = run.mcfg.replace(router_aux_loss=cfg.router_aux_loss == "on")
    except (ValueError, TypeError) as e:
        raise TrainError(str(e)) from None
    if cfg.init_from and not cfg.tokenizer:
        run.cfg = cfg = dataclasses.replace(cfg, tokenizer=cfg.init_from)  # the checkpoint's own tokenizer
    if cfg.context_length:
        run.mcfg = run.mcfg.replace(context_length=cfg.context_length)
    run.backend = runnable_backend(cfg.backend, device)  # with the fix in the message
    return run


#: Training context when --init-from gives no --context-length (checkpoints allow far longer ones).
INIT_FROM_CONTEXT = 1024


def _aux_loss_phrase(cfg: TrainConfig, mcfg: ModelConfig) -> str:
    """Whether the training loss adds the load-balancing term, and why, for the model line of the log."""
    on = mcfg.router_aux_loss and mcfg.router_aux_loss_coef > 0
    if cfg.router_aux_loss != "config":
        why = f"--router-aux-loss {cfg.router_aux_loss}"
    elif cfg.init_from:
        why = f"the checkpoint's output_router_logits is {'true' if mcfg.router_aux_loss else 'false'}"
    else:
        why = "a model built here"
    if on:
        return f"load-balancing loss x {mcfg.router_aux_loss_coef:g} in the training loss ({why})"
    return f"no load-balancing loss ({why}; coefficient {mcfg.router_aux_loss_coef:g})"


def _hf_model_config(cfg: TrainConfig) -> ModelConfig:
    """--init-from: the checkpoint's sizes; only the (training) context length may be set."""
    from .hf.checkpoint import model_config_from_hf, read_hf_config

    others = sorted(k for k in cfg.model_overrides if k != "context_length")
    if others:
        raise TrainError(f"--init-from takes the model's sizes from the checkpoint; drop "
                         f"{', '.join('--' + k.replace('_', '-') for k in others)}")
    try:
        hf_cfg = read_hf_config(cfg.init_from)
    except FileNotFoundError as e:
        raise TrainError(f"--init-from: {e}") from None
    context = cfg.model_overrides.get("context_length") or cfg.context_length
    try:
        if context is None:
            context = min(INIT_FROM_CONTEXT, model_config_from_hf(hf_cfg).context_length)
        mcfg = model_config_from_hf(hf_cfg, context)
    except ValueError as e:
        raise TrainError(f"--init-from {cfg.init_from}: {e}") from None
    if mcfg.dropout:
        raise TrainError(f"--init-from {cfg.init_from}: the checkpoint trains with dropout {mcfg.dropout} (its "
                         "config's dropout keys), which tritonlm's kernels do not have yet: fine-tuning without it "
                         "would not be its recipe")
    return mcfg


def _data_stage(run: _Run) -> None:
    """Tokenizer and token file (rank 0 prepares, the others wait and reuse the cache), their fingerprints,
    id checks, the train / validation split and the data's unigram entropy."""
    cfg, dist_info = run.cfg, run.dist
    if dist_info.world > 1 and not run.main:
        torch.distributed.barrier()
    tokens, run.tokenizer, run.tok_dir = prepare_data(cfg, run.out, run.mcfg.vocab_size, run.say)
    if dist_info.world > 1 and run.main:
        torch.distributed.barrier()
    # what a checkpoint was trained on, so that --resume can refuse other data or another tokenizer
    run.data_fp = fingerprint(Path(cfg.data) if cfg.data else run.out / "data" / "default_corpus.txt")
    run.tok_fp = (hashlib.sha1(b"".join(p.read_bytes() for p in find_tokenizer_files(run.tok_dir))).hexdigest()[:12]
                  if run.tok_dir else None)
    mcfg = run.mcfg
    if cfg.init_from and run.tokenizer is not None and run.tokenizer.vocab_size > mcfg.vocab_size:
        raise TrainError(f"the tokenizer has {run.tokenizer.vocab_size} ids but the --init-from model only "
                         f"{mcfg.vocab_size} embeddings")
    if not cfg.init_from and run.tokenizer is not None and run.tokenizer.vocab_size != mcfg.vocab_size:
        mcfg = run.mcfg = mcfg.replace(vocab_size=run.tokenizer.vocab_size)
    max_id = int(tokens.max()) if len(tokens) else -1
    if len(tokens) and np.issubdtype(tokens.dtype, np.signedinteger) and int(tokens.min()) < 0:
        raise TrainError(f"data holds a negative token id ({int(tokens.min())}); token ids must be >= 0")
    if max_id >= mcfg.vocab_size:
        raise TrainError(f"data holds token id {max_id} but the model's vocab is {mcfg.vocab_size}")
    n_val = max(mcfg.context_length + 1, int(len(tokens) * cfg.val_fraction))
    if len(tokens) - n_val <= mcfg.context_length:
        raise TrainError(f"the data has {len(tokens):,} tokens: too few for context {mcfg.context_length} "
                         f"plus a validation split")
    run.train_tokens, run.val_tokens = tokens[:-n_val], tokens[-n_val:]
    if cfg.document_mask:
        run.end_of_text = (run.tokenizer._special_ids.get(SPECIAL_TOKENS[0]) if run.tokenizer is not None
                           else None)
        if run.end_of_text is None:
            raise TrainError(f"--document-mask needs a tokenizer with {SPECIAL_TOKENS[0]} to find document ends "
                             "(pass --tokenizer with a token file)")
    run.entropy = unigram_entropy(run.train_tokens, mcfg.vocab_size)


def _model_stage(run: _Run) -> None:
    """The model (resumed from the checkpoint with --resume, after checking it is the same run), its
    distribution (FSDP2 / DDP), the optimizer and compilation."""
    cfg, mcfg, device, dist_info = run.cfg, run.mcfg, run.device, run.dist
    torch.manual_seed(cfg.seed)
    hf_state = None
    if cfg.init_from and not cfg.resume:
        from .hf.checkpoint import load_hf_weights

        try:  # (a file with its own head beside tie_word_embeddings loads untied, as transformers loads it)
            mcfg, hf_state, _ = load_hf_weights(cfg.init_from, mcfg)
        except (ValueError, FileNotFoundError, ImportError) as e:
            raise TrainError(f"--init-from {cfg.init_from}: {e}") from None
        run.mcfg = mcfg
    model = run.model = TransformerLM.from_config(mcfg, device=device, backend=run.backend)
    model.token_embeddings.check_ids = False  # every id was checked against the vocab above, once
    if hf_state is not None:
        model.load_state_dict(hf_state)
        run.say(f"model: initialised from {cfg.init_from} (context {mcfg.context_length} for training)")
    what = f"{cfg.init_from} (HF)" if cfg.init_from else f"preset {cfg.preset}"
    moe = (f" ({accounting.param_count(mcfg, active=True) / 1e6:.2f}M active per token: {mcfg.num_experts} experts, "
           f"{mcfg.experts_per_token} per token, {_aux_loss_phrase(cfg, mcfg)})" if mcfg.num_experts else "")
    run.say(f"model: {what}, {accounting.param_count(mcfg) / 1e6:.2f}M parameters{moe}, "
            f"backend {model.backend} on {device}" + (f" ({dist_info.world} ranks)" if dist_info.world > 1 else ""))
    run.generator = torch.Generator().manual_seed(cfg.seed)
    payload = _resume(run) if cfg.resume else None
    if cfg.fsdp:
        if dist_info.world == 1:
            raise TrainError("--fsdp needs torchrun with more than one process")
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6 keeps FSDP2 under _composable
            from torch.distributed._composable.fsdp import fully_shard

        # fully_shard swaps each parameter for a sharded DTensor: the optimizer is built afterwards
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        train_model = model
    elif dist_info.world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        train_model = model
    optimizer = run.optimizer = AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay)
    if payload is not None:
        # FSDP checkpoints key the optimizer state by parameter name, others by index: either resumes either way
        names = optimizer_param_names(model, optimizer)
        optim_state = optimizer_state_keyed(payload["optimizer"], names, by_name=cfg.fsdp)
        if cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(optim_state)
    # the DDP wrapper itself (also under torch.compile): gradient all-reduce skipped on all but the last micro-batch
    run.ddp = train_model if isinstance(train_model, torch.nn.parallel.DistributedDataParallel) else None
    run.train_model = torch.compile(train_model) if cfg.compile else train_model
    run.autocast, run.precision = _autocast(device, cfg.dtype)


def _resume(run: _Run) -> dict:
    """Load the checkpoint into the model after checking it is this run's (model, data, tokenizer, steps);
    returns the payload for the optimizer state."""
    cfg, mcfg, ckpt_path = run.cfg, run.mcfg, run.ckpt_path
    if not ckpt_path.exists():
        raise TrainError(f"--resume: no checkpoint in {run.out}")
    payload = read_checkpoint(ckpt_path, map_location=run.device)
    saved = payload.get("model_config", {})
    diff = {k: (v, getattr(mcfg, k)) for k, v in saved.items() if getattr(mcfg, k, v) != v}
    if diff:
        raise TrainError(f"--resume: {ckpt_path} was trained with a different model ("
                         + ", ".join(f"{k} {a} vs {b} now" for k, (a, b) in diff.items())
                         + "); pass the same --preset/--data/size flags as the first run")
    for key, now, what in (("data_fingerprint", run.data_fp, "--data"), ("tokenizer_fingerprint", run.tok_fp,
                                                                           "tokenizer")):
        if payload.get(key) is not None and payload[key] != now:
            raise TrainError(f"--resume: {ckpt_path} was trained on another {what} ({payload[key]} vs {now} now); "
                             "pass the first run's --data/--tokenizer")
    run.model.load_state_dict(payload["model"])  # full weights, before any sharding
    run.start_step = int(payload["iteration"])
    if run.start_step >= cfg.max_steps:
        raise TrainError(f"--resume: {ckpt_path} is at step {run.start_step} already, not before --max-steps "
                         f"{cfg.max_steps}; raise --max-steps to train further (the checkpoint is kept as is)")
    restore_rng_state(payload["rng"])
    run.generator.set_state(payload["generator"])
    run.say(f"resume: from step {run.start_step} of {ckpt_path}")
    return payload


def _micro_batch(run: _Run, source, gen: torch.Generator):
    """``(x, y, extra)``: this rank's windows, targets and the forward's document_ids under --document-mask."""
    cfg, ctx = run.cfg, run.mcfg.context_length
    starts = sample_starts(len(source), cfg.batch_size * run.dist.world, ctx, gen)
    mine = starts[run.dist.rank * cfg.batch_size:(run.dist.rank + 1) * cfg.batch_size]
    x, y = batch_at(source, mine, ctx, run.device)
    return x, y, ({"document_ids": document_ids(x, run.end_of_text)} if run.end_of_text is not None else {})


@torch.no_grad()
def _evaluate(run: _Run) -> float:
    """Mean validation loss over --eval-batches fixed windows: the plain cross-entropy (no smoothing, no z-loss),
    so validation perplexity stays comparable across runs."""
    run.model.eval()
    gen = torch.Generator().manual_seed(run.cfg.seed + 1)  # the same validation windows every time
    total = torch.zeros((), device=run.device)
    for _ in range(run.cfg.eval_batches):
        x, y, extra = _micro_batch(run, run.val_tokens, gen)
        with run.autocast:
            total += run.train_model(x, targets=y, aux_loss=False, **extra).float()
    run.model.train()
    return float(all_mean(total / run.cfg.eval_batches, run.dist))


def _record(run: _Run, entry: dict) -> None:
    run.history.append(entry)
    if run.log:
        run.log.write(json.dumps(entry) + "\n")
        run.log.flush()


def _checkpoint(run: _Run, step: int) -> None:
    cfg = run.cfg
    extra = dict(model_config=run.mcfg.to_dict(), train_config=cfg.to_dict(), generator=run.generator.get_state(),
                 tokenizer=str(run.tok_dir.resolve()) if run.tok_dir else None, data_fingerprint=run.data_fp,
                 tokenizer_fingerprint=run.tok_fp)
    if cfg.fsdp:
        # every rank takes part in gathering full (unsharded) weights and optimizer state; rank 0 writes
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(run.model, options=opts)
        optim_state = get_optimizer_state_dict(run.model, run.optimizer, options=opts)
        if run.main:
            save_checkpoint(None, None, step, run.ckpt_path, model_state=model_state, optimizer_state=optim_state,
                            **extra)
        return
    if run.main:
        save_checkpoint(unwrap(run.model), run.optimizer, step, run.ckpt_path, **extra)


def _open_log(run: _Run) -> None:
    if not run.main:
        return
    if run.cfg.resume and run.log_path.exists():
        # entries past the checkpoint were logged by a run that did not save them: drop them, the rerun logs anew
        kept = [line for line in run.log_path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= run.start_step]
        write_text_atomic(run.log_path, "".join(line + "\n" for line in kept))
    run.log = open(run.log_path, "a" if run.cfg.resume else "w")


def _training_loop(run: _Run) -> float:
    """The optimizer steps: cosine schedule, gradient accumulation (DDP syncs on the last micro-batch only),
    clipping, logging every --log-every steps, validation every --eval-every steps, checkpoints. Returns the
    final validation loss."""
    from tqdm.auto import tqdm

    cfg, device, model, optimizer = run.cfg, run.device, run.model, run.optimizer
    min_lr = cfg.min_lr if cfg.min_lr is not None else cfg.lr / 10
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.max_steps // 20)
    ctx = run.mcfg.context_length
    global_batch = cfg.batch_size * run.dist.world
    tokens_per_step = global_batch * ctx * cfg.grad_accum
    peak = accounting.peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    step_flops = accounting.training_flops(run.mcfg, ctx, global_batch * cfg.grad_accum)
    loss_options = dict(label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss)
    run.say(f"train: {cfg.max_steps} steps x {tokens_per_step:,} tokens (batch {cfg.batch_size} x {run.dist.world} "
            f"ranks x accum {cfg.grad_accum}, context {ctx}), {run.precision}, lr {cfg.lr:g} -> {min_lr:g}, "
            f"unigram entropy of the data {run.entropy:.3f} nats")
    if run.end_of_text is not None:
        run.say(f"train: --document-mask: attention stays within documents ended by {SPECIAL_TOKENS[0]} (id "
                f"{run.end_of_text}), positions restart per document"
                + (" (varlen kernels)" if run.backend == "triton" else ""))
    run.tokens_per_step = tokens_per_step
    _open_log(run)

    model.train()
    bar = tqdm(range(run.start_step, cfg.max_steps), initial=run.start_step, total=cfg.max_steps, desc="train",
               unit="step", disable=not (run.main and cfg.progress), dynamic_ncols=True)
    t_last, steps_since, loss_acc = time.perf_counter(), 0, torch.zeros((), device=device)
    val_loss = None
    for step in bar:
        lr = cosine_lr_schedule(step, cfg.lr, min_lr, warmup, cfg.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(cfg.grad_accum):
            x, y, extra = _micro_batch(run, run.train_tokens, run.generator)
            sync = micro == cfg.grad_accum - 1 or run.ddp is None
            with run.ddp.no_sync() if not sync else contextlib.nullcontext():
                with run.autocast:  # the loss comes out of forward (DDP/FSDP/compile see it); fused: no logits held
                    loss = run.train_model(x, targets=y, **extra, **loss_options) / cfg.grad_accum
                loss.backward()
            loss_acc += loss.detach()
        grad_norm = clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps_since += 1
        done = step + 1
        # evaluation runs on its own schedule (every --eval-every steps and at the end), whatever --log-every is
        eval_now = bool(cfg.eval_every) and (done % cfg.eval_every == 0 or done == cfg.max_steps)
        log_now = done % cfg.log_every == 0 or done == cfg.max_steps
        if eval_now:
            val_loss = _evaluate(run)
        if eval_now and not log_now:
            _record(run, {"step": done, "val_loss": val_loss, "val_ppl": math.exp(val_loss)})
        if log_now:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = (time.perf_counter() - t_last) / steps_since
            train_loss = float(all_mean(loss_acc / steps_since, run.dist))
            entry = {"step": done, "loss": train_loss, "lr": lr, "grad_norm": float(grad_norm),
                     "tokens_per_s": tokens_per_step / dt, "step_s": dt}
            if peak:
                entry["mfu"] = step_flops / dt / peak
            if run.mcfg.num_experts:  # the last micro-batch's routing: balance loss, least/most loaded expert
                core = unwrap(model)
                load = core.expert_load()
                entry.update(aux_loss=float(core.router_aux_loss().detach()), expert_load_min=float(load.min()),
                             expert_load_max=float(load.max()))
            if eval_now:
                entry["val_loss"] = val_loss
                entry["val_ppl"] = math.exp(val_loss)
            _record(run, entry)
            postfix = {"loss": f"{train_loss:.3f}", "tok/s": f"{entry['tokens_per_s']:,.0f}"}
            if val_loss is not None:
                postfix["val"] = f"{val_loss:.3f}"
            if "aux_loss" in entry:
                postfix["aux"] = f"{entry['aux_loss']:.3f}"
                postfix["load"] = f"{entry['expert_load_min']:.2f}-{entry['expert_load_max']:.2f}"
            if peak:
                postfix["mfu"] = f"{100 * entry['mfu']:.1f}%"
            bar.set_postfix(postfix)
            t_last, steps_since, loss_acc = time.perf_counter(), 0, torch.zeros((), device=device)
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
            _checkpoint(run, done)
    bar.close()
    _checkpoint(run, cfg.max_steps)
    if not cfg.eval_every:  # --eval-every 0: only at the end
        val_loss = _evaluate(run)
    return val_loss


def _finish(run: _Run, val_loss: float) -> dict:
    """Summary (with per-rank weight checksums under DDP), loss plot, a sample, summary.json."""
    cfg, history, entropy = run.cfg, run.history, run.entropy
    train_entries = [h for h in history if "loss" in h]
    summary = {"steps": cfg.max_steps, "final_train_loss": train_entries[-1]["loss"] if train_entries else None,
               "final_val_loss": val_loss, "unigram_entropy": entropy, "out": str(run.out),
               "checkpoint": str(run.ckpt_path), "backend": run.model.backend, "device": str(run.device),
               "world_size": run.dist.world, "tokens_per_step": run.tokens_per_step}
    if run.dist.world > 1 and not cfg.fsdp:
        import torch.distributed as dist

        # ranks agree? (DDP keeps replicas identical; report a checksum per rank)
        checksum = torch.stack([p.detach().double().sum() for p in run.model.parameters()]).sum().to(run.device)
        gathered = [torch.zeros_like(checksum) for _ in range(run.dist.world)]
        dist.all_gather(gathered, checksum)
        summary["rank_checksums"] = [float(c) for c in gathered]
    if run.main:
        if train_entries:
            run.say(f"done: {cfg.max_steps} steps, train loss {summary['final_train_loss']:.3f}, "
                    f"val loss {val_loss:.3f} (perplexity {math.exp(val_loss):.1f}) vs unigram entropy "
                    f"{entropy:.3f} nats" + (" -- below it: the model uses context" if val_loss < entropy else ""))
        plot = plot_loss(history, run.out / "loss.png", entropy)
        run.say(f"saved: checkpoint {run.ckpt_path}, log {run.log_path}" + (f", plot {plot}" if plot else
                " (pip install 'tritonlm[plot]' for a loss-curve PNG)"))
        if run.tokenizer is not None and cfg.sample_tokens > 0:
            # (no further than the context the model was trained on: prompt + sample must fit it)
            room = run.mcfg.context_length - encoded_length(run.tokenizer, cfg.sample_prompt)
            if room < cfg.sample_tokens:
                run.say(f"sample: --sample-tokens {cfg.sample_tokens} capped to {max(room, 0)} by the context length "
                        f"{run.mcfg.context_length}")
            sample = generate_text(run.model, run.tokenizer, cfg.sample_prompt, max(min(cfg.sample_tokens, room), 0),
                                   temperature=0.8, top_k=40, seed=cfg.seed)
            summary["sample"] = sample
            run.say(f"sample (prompt {cfg.sample_prompt!r}, temperature 0.8, top-k 40):\n{'-' * 60}\n"
                    f"{cfg.sample_prompt}{sample}\n{'-' * 60}")
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if run.log:
        run.log.close()
    if run.dist.world > 1:
        torch.distributed.barrier()
    return summary


def plot_loss(history: list[dict], path: Path, entropy: float | None = None) -> Path | None:
    """Loss curve PNG (train, validation, the unigram-entropy line); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not history:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [h for h in history if "loss" in h]
    ax.plot([h["step"] for h in train], [h["loss"] for h in train], label="train loss")
    val = [h for h in history if "val_loss" in h]
    if val:
        ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="validation loss")
    if entropy is not None:
        ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy ({entropy:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tritonlm training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use the `tritonlm train` command")
