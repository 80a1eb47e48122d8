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
from ._base import Dist, TrainError, all_mean, resolve_device, runnable_backend, setup_distributed  # noqa: F401
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
from .data import (  # noqa: F401  (prepare_data, default_corpus_text: their homes moved, the names stay)
    batch_at,
    default_corpus_text,
    document_ids,
    fingerprint,
    prepare_data,
    sample_starts,
    unigram_entropy,
)
from .generate import generate_ids, generate_text, load_for_generation, vocab_mismatch  # noqa: F401
from .modules import TransformerLM
from .optim import AdamW, clip_grad_norm_, cosine_lr_schedule
from .tokenizer import SPECIAL_TOKENS, SPECIAL_TOKENS_FILE, find_tokenizer_files, load_tokenizer  # noqa: F401


@dataclass
class TrainConfig:
    """Everything ``tritonlm train`` takes (see ``tritonlm train --help``)."""

    data: str | None = None
    tokenizer: str | None = None
    init_from: str | None = None  # a local Hugging Face directory of a family in tritonlm.hf.SUPPORTED_MODELS: its sizes, weights, tokenizer
    preset: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    max_steps: int = 300
    batch_size: int = 32
    grad_accum: int = 1
    context_length: int | None = None
    lr: float = 3e-3
    min_lr: float | None = None
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    document_mask: bool = False
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 0
    out: str = "runs/tiny"
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    compile: bool = False
    fsdp: bool = False
    seed: int = 0
    resume: bool = False
    overwrite: bool = False
    errors: str = "strict"
    val_fraction: float = 0.05
    sample_prompt: str = "The"
    sample_tokens: int = 120
    progress: bool = True

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


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


def check_config(cfg: TrainConfig) -> None:
    """Every option that can be checked before any work, each failure one line naming the flag and value."""
    def need(ok: bool, flag: str, value, rule: str):
        if not ok:
            raise TrainError(f"{flag} {value!r}: must be {rule}")

    finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
    need(cfg.max_steps > 0, "--max-steps", cfg.max_steps, "positive")
    need(cfg.batch_size > 0, "--batch-size", cfg.batch_size, "positive")
    need(cfg.grad_accum > 0, "--grad-accum", cfg.grad_accum, "positive")
    need(finite(cfg.lr) and cfg.lr > 0, "--lr", cfg.lr, "a positive number")
    need(cfg.min_lr is None or (finite(cfg.min_lr) and 0 <= cfg.min_lr <= cfg.lr), "--min-lr", cfg.min_lr,
         "between 0 and --lr")
    need(cfg.warmup_steps is None or cfg.warmup_steps >= 0, "--warmup-steps", cfg.warmup_steps, ">= 0")
    need(finite(cfg.weight_decay) and cfg.weight_decay >= 0, "--weight-decay", cfg.weight_decay, ">= 0")
    need(finite(cfg.grad_clip) and cfg.grad_clip > 0, "--grad-clip", cfg.grad_clip, "a positive L2 norm")
    need(all(finite(b) and 0 <= b < 1 for b in cfg.betas), "betas", cfg.betas, "in [0, 1)")
    need(finite(cfg.z_loss) and cfg.z_loss >= 0, "--z-loss", cfg.z_loss, ">= 0")
    need(finite(cfg.label_smoothing) and 0 <= cfg.label_smoothing <= 1, "--label-smoothing", cfg.label_smoothing,
         "in [0, 1]")
    need(cfg.log_every > 0, "--log-every", cfg.log_every, "positive")
    need(cfg.eval_every >= 0, "--eval-every", cfg.eval_every, ">= 0 (0: only at the end)")
    need(cfg.eval_batches > 0, "--eval-batches", cfg.eval_batches, "positive")
    need(cfg.checkpoint_every >= 0, "--checkpoint-every", cfg.checkpoint_every, ">= 0 (0: only at the end)")
    need(cfg.sample_tokens >= 0, "--sample-tokens", cfg.sample_tokens, ">= 0")
    need(cfg.context_length is None or cfg.context_length > 0, "--context-length", cfg.context_length, "positive")
    need(0 < cfg.val_fraction < 1, "val_fraction", cfg.val_fraction, "in (0, 1)")
    need(cfg.errors in ("strict", "replace"), "--errors", cfg.errors, "strict or replace")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out}: exists and is not a directory")
    if cfg.resume and cfg.overwrite:
        raise TrainError("--resume and --overwrite contradict each other: continue the run, or start it over")
    previous = [name for name in (CHECKPOINT_NAME, "log.jsonl") if (out / name).exists()]
    if previous and not (cfg.resume or cfg.overwrite):
        raise TrainError(f"--out {out} holds a previous run ({', '.join(previous)}); pass --resume to continue it "
                         "or --overwrite to start over")


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
    check_config(cfg)
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
           f"{mcfg.experts_per_token} per token, aux loss x {mcfg.router_aux_loss_coef:g})" if mcfg.num_experts else "")
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
            sample = generate_text(run.model, run.tokenizer, cfg.sample_prompt, cfg.sample_tokens, temperature=0.8,
                                   top_k=40, seed=cfg.seed)
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
