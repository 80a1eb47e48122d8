"""The ``tritonlm`` command: train, generate, tokenize, accounting, bench, kernels.

Every subcommand prints what it did and exits non-zero with a one-line reason on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class CLIError(Exception):
    """A bad input: printed as one line, exit status 2."""


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


# ----------------------------------------------------------------------------------------------------
# accounting
# ----------------------------------------------------------------------------------------------------
def cmd_accounting(args) -> int:
    from . import accounting
    from .config import PRESETS, ModelConfig

    try:
        if args.hf:
            from .hf.checkpoint import model_config_from_hf, read_hf_config

            cfg = model_config_from_hf(read_hf_config(args.hf))
            if args.num_kv_heads:
                raise CLIError("--num-kv-heads comes from the checkpoint with --hf")
        else:
            cfg = ModelConfig.preset(args.preset, **({"num_kv_heads": args.num_kv_heads} if args.num_kv_heads else {}))
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(str(e)) from None
    if args.seq_len <= 0 or args.batch <= 0:
        raise CLIError("--seq-len and --batch must be positive")
    if args.activations and any(n <= 0 for n in args.activation_seq_lens):
        raise CLIError(f"--activation-seq-lens {args.activation_seq_lens}: every length must be positive")
    n = accounting.param_count(cfg)
    name = f"{args.hf} (Hugging Face)" if args.hf else f"preset {args.preset}"
    print(f"{name}: vocab {cfg.vocab_size}, context {cfg.context_length}, d_model {cfg.d_model}, "
          f"layers {cfg.num_layers}, heads {cfg.num_heads} (kv heads {cfg.kv_heads}), d_ff {cfg.d_ff}"
          + (f", MLA (latent {cfg.kv_lora_rank} + rotary key {cfg.qk_rope_head_dim}, query/key heads {cfg.d_head}, "
             f"value heads {cfg.v_dim})" if cfg.attention == "mla" else "")
          + (f", Gated DeltaNet layers {list(cfg.linear_layers)} (q/k heads {cfg.linear_num_key_heads} x "
             f"{cfg.linear_key_head_dim}, value heads {cfg.linear_num_value_heads} x {cfg.linear_value_head_dim}, "
             f"conv {cfg.linear_conv_kernel})" if cfg.linear_layers else "")
          + (", tied embeddings" if cfg.tie_embeddings else "")
          + (f", {cfg.num_experts} experts ({cfg.experts_per_token} per token, d_ff {cfg.expert_d_ff})"
             if cfg.num_experts else ""))
    print(f"parameters: {n:,} ({_fmt_bytes(4 * n)} in fp32, {_fmt_bytes(2 * n)} in bf16)")
    if cfg.num_experts:
        active = accounting.param_count(cfg, active=True)
        print(f"active parameters per token: {active:,} ({100 * active / n:.1f}% of the total; FLOPs and MFU count "
              "the active work)")
    print()
    f = accounting.forward_flops(cfg, args.seq_len, args.batch)
    rows = [[k, _fmt_count(v), f"{100 * v / f['total']:.1f}%"] for k, v in f.items()]
    print(f"forward matmul FLOPs, batch {args.batch} x seq {args.seq_len} "
          f"(training step = 3x: {_fmt_count(accounting.training_flops(cfg, args.seq_len, args.batch))}FLOPs)")
    print(_table(rows, ["component", "FLOPs", "share"]))
    mem = accounting.memory_bytes(cfg, args.seq_len, args.batch, param_dtype="fp32")
    print(f"KV cache for generation, batch {args.batch} x seq {args.seq_len}: "
          f"{_fmt_bytes(accounting.kv_cache_bytes(cfg, args.seq_len, args.batch, 'bf16'))} in bf16")
    print("\ntraining memory estimate (fp32 params, AdamW):")
    print(_table([[k, _fmt_bytes(v)] for k, v in mem.items()], ["item", "bytes"]))

    print("\nscaling: forward FLOPs by preset and sequence length (attention-matmul share)")
    seqs = [512, 1024, 2048, 4096, 8192, 16384]
    rows = []
    for name in [p for p in PRESETS if not p.startswith("tiny")]:
        c = ModelConfig.preset(name)
        row = [name]
        for s in seqs:
            ff = accounting.forward_flops(c, s)
            row.append(f"{_fmt_count(ff['total'])} ({100 * ff['attention_matmuls'] / ff['total']:.0f}%)")
        rows.append(row)
    print(_table(rows, ["preset"] + [f"seq {s}" for s in seqs]))

    if args.activations:
        from .memory import activation_table

        print("\nactivation memory saved for backward per layer (measured with saved_tensors_hooks, fp32, batch 1)")
        print(activation_table(cfg, seq_lens=args.activation_seq_lens))
        from .memory import lm_head_loss_peak_bytes

        tokens = args.batch * args.seq_len
        head = lm_head_loss_peak_bytes(tokens, cfg.d_model, cfg.vocab_size)
        print(f"\nLM head + loss, forward + backward, {tokens:,} tokens x vocab {cfg.vocab_size:,} (fp32, peak live "
              f"tensor bytes): eager linear + F.cross_entropy {_fmt_bytes(head['eager'])}, fused "
              f"linear_cross_entropy {_fmt_bytes(head['fused'])} ({head['ratio']:.3f}x)")
    return 0


# ----------------------------------------------------------------------------------------------------
# train / generate
# ----------------------------------------------------------------------------------------------------
def cmd_train(args) -> int:
    from .train import TrainConfig, TrainError, train

    try:
        cfg = TrainConfig.from_args(args)
    except TrainError as e:
        raise CLIError(str(e)) from None
    try:
        train(cfg)
    except (TrainError, FileNotFoundError) as e:
        raise CLIError(str(e)) from None
    return 0


def cmd_generate(args) -> int:
    import time
    from pathlib import Path

    from ._base import TrainError
    from .generate import (
        CONSTRAINTS,
        DEFAULTS,
        continuation_text,
        encoded_length,
        end_ids,
        generate_batch_ids,
        generate_ids,
        generation_settings,
        load_for_generation,
        vocab_mismatch,
    )

    def check(settings: dict) -> None:
        if settings["max_new_tokens"] < 0:
            raise CLIError(f"--max-new-tokens {settings['max_new_tokens']}: must be >= 0")
        if not settings["temperature"] >= 0:
            raise CLIError(f"--temperature {settings['temperature']}: must be >= 0 (0 = greedy)")
        if settings["top_k"] is not None and settings["top_k"] <= 0:
            raise CLIError(f"--top-k {settings['top_k']}: must be positive")
        if settings["top_p"] is not None and not 0 < settings["top_p"] <= 1:
            raise CLIError(f"--top-p {settings['top_p']}: must be in (0, 1]")

    given = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p)
    check({**DEFAULTS, **{k: v for k, v in given.items() if v is not None}})  # (bad flags before any loading)
    prompts = None
    if args.prompt_file is not None:
        try:
            lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise CLIError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from None
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise CLIError(f"--prompt-file {args.prompt_file}: no prompts (one per line; blank lines are skipped)")
    try:
        model, tokenizer = load_for_generation(args.checkpoint, args.device, args.backend)
        mismatch = vocab_mismatch(model, tokenizer)
        if mismatch:
            print(mismatch, file=sys.stderr)
        settings, source = generation_settings(model, **given)
        check(settings)
        longest = max(encoded_length(tokenizer, p) for p in (prompts or [args.prompt]))
        room = model.context_length - longest
        if settings["max_new_tokens"] > room:
            if args.max_new_tokens is not None:  # (asked for explicitly: the model cannot)
                raise CLIError(f"--max-new-tokens {args.max_new_tokens}: the prompt's {longest} tokens + "
                               f"{args.max_new_tokens} exceed the model's context_length {model.context_length}")
            print(f"generation: max_new_tokens {settings['max_new_tokens']} capped to {max(room, 0)}: the prompt's "
                  f"{longest} tokens fill the rest of the model's context_length {model.context_length}",
                  file=sys.stderr)
            settings["max_new_tokens"] = max(room, 0)
        sampling = ("greedy" if settings["temperature"] == 0 else f"temperature {settings['temperature']:g}"
                    + (f", top-k {settings['top_k']}" if settings["top_k"] else "")
                    + (f", top-p {settings['top_p']:g}" if settings["top_p"] is not None else ""))
        constraints = {k: settings[k] for k in CONSTRAINTS if settings[k] != CONSTRAINTS[k]}
        sampling += "".join(f", {k.replace('_', ' ')} {v:g}" for k, v in constraints.items())
        print(f"generation: up to {settings['max_new_tokens']} new tokens, {sampling}, stopping at "
              f"{end_ids(model, tokenizer)} ({source})", file=sys.stderr)
        t0 = time.perf_counter()
        options = [settings[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")]
        if prompts is not None:
            batch = generate_batch_ids(model, tokenizer, prompts, *options, args.seed, page_size=args.page_size,
                                       **constraints)
        else:
            new_ids = generate_ids(model, tokenizer, args.prompt, *options, args.seed, **constraints)
    except (TrainError, ValueError) as e:
        raise CLIError(str(e)) from None
    dt = time.perf_counter() - t0
    if prompts is not None:
        for i, (prompt, ids) in enumerate(zip(prompts, batch), 1):
            print(f"=== {i}/{len(prompts)} ===")
            print(prompt + continuation_text(tokenizer, prompt, ids))
        n = sum(len(ids) for ids in batch)
        stats = getattr(model, "last_generation_cache", None) or {}
        print(f"\n[{len(prompts)} prompts, {n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tokens/s, backend "
              f"{model.backend}, paged KV cache: {stats.get('pool_blocks', 0)} blocks of {args.page_size} positions, "
              f"{stats.get('pool_bytes', 0) / 2**20:.1f} MiB]", file=sys.stderr)
        return 0
    print(args.prompt + continuation_text(tokenizer, args.prompt, new_ids))
    n = len(new_ids)  # tokens generated, not a re-encoding of the decoded text
    print(f"\n[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tokens/s, backend {model.backend}, "
          f"KV cache on]", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------------
# tokenize
# ----------------------------------------------------------------------------------------------------
def cmd_tokenize(args) -> int:
    import time
    from pathlib import Path

    from ._base import TrainError
    from .tokenizer import (
        SPECIAL_TOKENS,
        SPECIAL_TOKENS_FILE,
        Tokenizer,
        encode_file,
        first_invalid_utf8,
        load_tokenizer,
        train_bpe,
    )

    src = Path(args.input)
    if not src.is_file():
        raise CLIError(f"input file not found: {src}")
    if args.errors == "strict":
        bad = first_invalid_utf8(src)
        if bad is not None:
            raise CLIError(f"{src}: not valid UTF-8 at byte {bad:,}; pass --errors replace to read such bytes as "
                           "U+FFFD")
    specials = args.special_tokens if args.special_tokens is not None else SPECIAL_TOKENS
    try:
        if args.stats:
            if not args.tokenizer:
                raise CLIError("--stats needs one or two --tokenizer directories")
            text = src.read_text(encoding="utf-8", errors="replace")
            n_bytes = len(text.encode("utf-8"))
            rows = []
            for loc in args.tokenizer:
                tok = load_tokenizer(loc)
                t0 = time.perf_counter()
                n = len(tok.encode(text))
                dt = time.perf_counter() - t0
                rows.append([str(loc), f"{tok.vocab_size}", f"{n:,}", f"{n_bytes / max(1, n):.3f}",
                             f"{n_bytes / 1e6 / dt:.2f}"])
            print(f"{src}: {n_bytes:,} bytes")
            print(_table(rows, ["tokenizer", "vocab", "tokens", "bytes/token", "MB/s"]))
            return 0
        if args.output:
            if not args.tokenizer or len(args.tokenizer) != 1:
                raise CLIError("encoding needs exactly one --tokenizer directory")
            tok = load_tokenizer(args.tokenizer[0])
            info = encode_file(tok, src, args.output, num_workers=args.workers, progress=True)
            print(f"encoded {src} ({info['bytes'] / 1e6:.2f} MB) -> {info['path']}: {info['tokens']:,} tokens "
                  f"({info['dtype']}), compression {info['bytes'] / max(1, info['tokens']):.3f} bytes/token, "
                  f"{info['bytes'] / 1e6 / info['seconds']:.2f} MB/s with {args.workers or 'all'} workers")
            return 0
        if not args.vocab_size or not args.out:
            raise CLIError("training needs --vocab-size and --out (or use --output to encode, --stats to compare)")
        t0 = time.perf_counter()
        vocab, merges = train_bpe(src, args.vocab_size, specials, num_workers=args.workers, progress=True)
        dt = time.perf_counter() - t0
        tok = Tokenizer(vocab, merges, specials)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tok.save(out / "vocab.json", out / "merges.txt")
        (out / SPECIAL_TOKENS_FILE).write_text(json.dumps(specials), encoding="utf-8")  # reloaded with the tokenizer
        sample = src.read_text(encoding="utf-8", errors="replace")[:1_000_000]
        print(f"trained byte-level BPE on {src} ({src.stat().st_size / 1e6:.2f} MB): {len(vocab)} tokens, "
              f"{len(merges)} merges in {dt:.2f}s -> {out}/vocab.json, {out}/merges.txt; compression "
              f"{tok.compression_ratio(sample):.3f} bytes/token")
        if len(vocab) < args.vocab_size:
            print(f"note: stopped at {len(vocab)} of the {args.vocab_size} tokens asked for: the text has no "
                  "pair left to merge")
        return 0
    except (TrainError, ValueError) as e:
        raise CLIError(str(e)) from None


# ----------------------------------------------------------------------------------------------------
# bench (end-to-end training step)
# ----------------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    import dataclasses
    import json
    import os

    import torch

    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    if not on_gpu:
        # the fused path runs through Triton's interpreter on CPU; it must be set before Triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .benchmarking import IMPLEMENTATIONS, benchmark_train_steps
    from .config import ModelConfig

    device = torch.device("cuda" if on_gpu and args.device == "auto" else ("cpu" if args.device == "auto" else args.device))
    preset = args.preset or ("small" if on_gpu else "tiny")
    seqs = args.seq_lens or ([256, 512, 1024, 2048, 4096] if on_gpu else [32, 64])
    batch = args.batch or (8 if on_gpu else 1)
    impls = args.impls or (["reference", "fused", "compiled-reference"] if on_gpu else ["reference", "fused"])
    bad = [i for i in impls if i not in IMPLEMENTATIONS]
    if bad:
        raise CLIError(f"unknown implementation {bad[0]!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    try:
        cfg = ModelConfig.preset(preset)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if not on_gpu:
        cfg = cfg.replace(num_layers=min(cfg.num_layers, 2))
    if not args.json:
        where = torch.cuda.get_device_name(device) if on_gpu else (
            "CPU -- the fused path runs under the Triton interpreter: these are NOT GPU figures")
        print(f"training step (forward, loss, backward, AdamW), preset {preset}"
              f"{' (2 layers on CPU)' if not on_gpu else ''}, batch {batch}, on {where}")
    rows = benchmark_train_steps(preset, seqs, batch, impls, device, warmup=args.warmup, rounds=args.rounds, cfg=cfg,
                                 progress=None if args.json else (lambda m: print(f"  measuring {m} ...", file=sys.stderr)))
    base = {(r.seq): r.mean_s for r in rows if r.impl == "reference" and r.mean_s}
    out = []
    for r in rows:
        d = dataclasses.asdict(r)
        d["speedup_vs_reference"] = (base[r.seq] / r.mean_s) if r.mean_s and r.seq in base else None
        out.append(d)
    if args.json:
        print(json.dumps({"device": str(device), "gpu_figures": on_gpu, "rows": out}, indent=1))
    else:
        table = []
        for d in out:
            if d["error"]:
                table.append([str(d["seq"]), d["impl"], d["error"], "-", "-", "-", "-"])
                continue
            table.append([str(d["seq"]), d["impl"], f"{1e3 * d['mean_s']:.2f} ± {1e3 * d['std_s']:.2f}",
                          f"{d['tokens_per_s']:,.0f}",
                          f"{d['speedup_vs_reference']:.2f}x" if d["speedup_vs_reference"] else "-",
                          f"{100 * d['mfu']:.1f}%" if d["mfu"] is not None else "-",
                          _fmt_bytes(d["peak_bytes"]) if d["peak_bytes"] is not None else "-"])
        print(_table(table, ["seq", "impl", "ms/step", "tokens/s", "vs reference", "MFU", "peak memory"]))
    if args.plot:
        path = _plot_bench(out, args.plot, preset, on_gpu)
        print(f"plot: {path}" if path else "plot skipped: pip install 'tritonlm[plot]'", file=sys.stderr)
    return 0


def _plot_bench(rows, path, preset, on_gpu):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    impls = sorted({r["impl"] for r in rows})
    has_mfu = any(r["mfu"] for r in rows)
    fig, axes = plt.subplots(1, 2 if has_mfu else 1, figsize=(11 if has_mfu else 6, 4), squeeze=False)
    for impl in impls:
        pts = [(r["seq"], r["speedup_vs_reference"]) for r in rows if r["impl"] == impl and r["speedup_vs_reference"]]
        if pts:
            axes[0][0].plot(*zip(*pts), "o-", label=impl)
        if has_mfu:
            pts = [(r["seq"], 100 * r["mfu"]) for r in rows if r["impl"] == impl and r["mfu"]]
            if pts:
                axes[0][1].plot(*zip(*pts), "o-", label=impl)
    axes[0][0].set(xlabel="sequence length", ylabel="speed-up vs reference eager", xscale="log",
                   title=f"training step, {preset}" + ("" if on_gpu else " (CPU, not GPU figures)"))
    axes[0][0].axhline(1.0, color="gray", ls="--")
    axes[0][0].legend()
    if has_mfu:
        axes[0][1].set(xlabel="sequence length", ylabel="MFU (%)", xscale="log", title="model FLOP utilisation")
        axes[0][1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------
# kernels (static SASS report)
# ----------------------------------------------------------------------------------------------------
def cmd_kernels(args) -> int:
    import json
    import os
    from pathlib import Path

    if not args.report:
        raise CLIError("nothing to do: pass --report")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    from .kernel_report import format_markdown, run_report

    archs = ("sm_90", "sm_80") if args.arch == "all" else (args.arch,)
    rows = run_report(archs, quick=args.quick, progress=not args.json, sass_dir=args.sass_dir)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=1))
    else:
        hdr = ["kernel", "case", "arch", "config", "regs", "smem", "dyn smem", "CTAs/SM", "spill",
               "SASS (tensor-core, LDG/STG by bits, async)", "main loop", "per unit", "roofline µs H100/H200"]
        table = []
        for r in rows:
            if r.error:
                table.append([r.kernel, r.case, r.arch, r.config, "-", "-", "-", "-", "-", "COMPILE ERROR " + r.error,
                              "-", "-", "-"])
                continue
            sass = " ".join(f"{k}:{v}" for k, v in r.sass.items() if k not in ("LDS", "STS"))
            table.append([r.kernel, r.case, r.arch, r.config, str(r.registers), str(r.shared_bytes),
                          str(r.dynamic_smem_bytes), str(r.ctas_per_sm), str(r.spill_bytes), sass,
                          str(r.loop_instructions or "-"),
                          "-" if r.instructions_per_unit is None else f"{r.instructions_per_unit}/{r.unit}",
                          f"{r.roofline_us['H100']}/{r.roofline_us['H200']}"])
        print("static analysis of compiled kernels (not measured speed)")
        print(_table(table, hdr))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(format_markdown(rows))
        print(f"wrote {args.markdown}", file=sys.stderr)
    bad = [r for r in rows if r.error]
    return 1 if bad else 0


# ----------------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    # (the family list for the help texts: plain Python, no transformers; train's options come from its config)
    from .hf.family import supported_phrase
    from .train import TrainConfig

    parser = argparse.ArgumentParser(prog="tritonlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("accounting", help="parameter / FLOP / memory accounting for a preset",
                       description="Print parameters, forward FLOPs by component, training memory and a "
                                   "scaling table across presets and sequence lengths.")
    p.add_argument("--preset", default="gpt2-xl", help="model preset (default gpt2-xl)")
    p.add_argument("--hf", metavar="HF_DIR",
                   help=f"account for a local {supported_phrase()} instead (its config.json)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", type=int, default=1, help="sequences per batch (default 1)")
    p.add_argument("--num-kv-heads", type=int, default=None,
                   help="grouped-query attention: key/value heads (default: the preset's, = num_heads)")
    p.add_argument("--activations", action="store_true",
                   help="also measure saved-for-backward bytes per layer, reference vs fused (runs a "
                        "block of the preset's width on CPU/GPU)")
    p.add_argument("--activation-seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                   help="sequence lengths for --activations (default 512 1024 2048 4096)")
    p.set_defaults(func=cmd_accounting)

    p = sub.add_parser("train", help="train a TransformerLM (the main job)",
                       description="Train a TransformerLM on text. Without --data it trains the tiny preset on an "
                                   "embedded corpus (Python's pydoc_data topics), on CPU in a few minutes, and "
                                   "prints a generated sample. Writes checkpoint.pt, log.jsonl, loss.png, "
                                   "summary.json and the tokenizer into --out.")
    TrainConfig.add_options(p)  # (one option per TrainConfig field: tritonlm/train.py)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="sample text from a trained checkpoint or a Hugging Face model",
                       description=f"Load a training output directory, or a local {supported_phrase()} "
                                   "directory (config.json, safetensors, tokenizer.json), and continue a prompt "
                                   "(KV-cached decoding). --prompt-file decodes many prompts together in batched "
                                   "steps through a paged KV cache, each stopping on its own.")
    p.add_argument("--checkpoint", required=True,
                   help="training output directory (or its checkpoint.pt), or a Hugging Face model directory")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="one prompt")
    which.add_argument("--prompt-file", help="a text file of prompts, one per line (blank lines skipped): generated "
                                             "as one batch, printed in order, with a tokens/s summary")
    p.add_argument("--page-size", type=int, default=16,
                   help="--prompt-file: positions per block of the paged KV cache (a multiple of 16)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: a Hugging Face directory's generation_config.json, else 200 (capped so the "
                        "prompt and the new tokens fit the model's context; a value beyond it is an error)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: generation_config.json's (greedy unless it sets do_sample), else 0.8")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json's when it samples")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json's when it samples")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"])
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("tokenize", help="train a BPE tokenizer, encode a file to tokens, compare compression",
                       description="Three modes on INPUT: train (--vocab-size, --out), encode (--tokenizer DIR "
                                   "--output FILE.npy), or --stats (compression of one or two --tokenizers). A "
                                   "tokenizer is a directory with *vocab.json + *merges.txt (GPT-2 format) or a "
                                   "byte-level BPE tokenizer.json (Hugging Face), or the path of that tokenizer.json.")
    p.add_argument("input", help="a UTF-8 text file")
    p.add_argument("--vocab-size", type=int, help="train: final vocabulary size")
    p.add_argument("--out", help="train: directory for vocab.json and merges.txt")
    p.add_argument("--special-tokens", nargs="*", default=None,
                   help="train: special tokens (default <|endoftext|>), saved beside the tokenizer; encoding uses "
                        "the ones the --tokenizer directory was trained with")
    p.add_argument("--tokenizer", action="append",
                   help="a directory with *vocab.json + *merges.txt or a tokenizer.json, or the tokenizer.json "
                        "itself (repeatable)")
    p.add_argument("--output", help="encode: output .npy token file (uint16, or uint32 for big vocabs)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--stats", action="store_true", help="compare compression ratios (bytes/token)")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="input that is not valid UTF-8: strict (default) stops, replace reads such bytes as U+FFFD")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("bench", help="end-to-end training-step comparison: table, plot, --json",
                       description="Time a whole training step (forward, loss, backward, AdamW) of reference, fused "
                                   "and compiled models side by side across sequence lengths; report tokens/s, "
                                   "speed-up, MFU (GPU) and peak memory. On CPU: a small labelled smoke run.")
    p.add_argument("--preset", default=None, help="model preset (default: small on GPU, tiny on CPU)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--impls", nargs="+", default=None,
                   help="reference fused compiled-reference compiled-fused (default: the first three on GPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", help="write a PNG: speed-up (and MFU) vs sequence length")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("kernels", help="compile every kernel for sm_90/sm_80 and report its SASS (no GPU needed)",
                       description="Static analysis: compile each Triton kernel at its launcher's configuration "
                                   "for representative shapes, for H100/H200 (sm_90) and A100 (sm_80), and print "
                                   "registers, shared memory, spills, SASS counts and the roofline time.")
    p.add_argument("--report", action="store_true", help="build the report")
    p.add_argument("--arch", default="all", choices=["sm_90", "sm_80", "all"])
    p.add_argument("--quick", action="store_true", help="bf16 only, hidden 4096, attention d 64/128")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--markdown", help="also write the report as Markdown to this path")
    p.add_argument("--sass-dir", help="also write each row's compiled SASS to a file of its own in this directory "
                                      "(named in the JSON rows' sass_file)")
    p.set_defaults(func=cmd_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at interpreter exit
        return code
    except CLIError as e:
        print(f"tritonlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`tritonlm accounting ... | head -1`): stop quietly, as `git log | head` does. Point
        # stdout at devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
