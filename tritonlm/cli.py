"""The ``tritonlm`` command: train, generate, tokenize, accounting, bench, kernels.

Every subcommand prints what it did and exits non-zero with a one-line reason on bad input.
"""

from __future__ import annotations

import argparse
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
        cfg = ModelConfig.preset(args.preset)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.seq_len <= 0 or args.batch <= 0:
        raise CLIError("--seq-len and --batch must be positive")
    n = accounting.param_count(cfg)
    print(f"preset {args.preset}: vocab {cfg.vocab_size}, context {cfg.context_length}, d_model {cfg.d_model}, "
          f"layers {cfg.num_layers}, heads {cfg.num_heads}, d_ff {cfg.d_ff}")
    print(f"parameters: {n:,} ({_fmt_bytes(4 * n)} in fp32, {_fmt_bytes(2 * n)} in bf16)\n")
    f = accounting.forward_flops(cfg, args.seq_len, args.batch)
    rows = [[k, _fmt_count(v), f"{100 * v / f['total']:.1f}%"] for k, v in f.items()]
    print(f"forward matmul FLOPs, batch {args.batch} x seq {args.seq_len} "
          f"(training step = 3x: {_fmt_count(accounting.training_flops(cfg, args.seq_len, args.batch))}FLOPs)")
    print(_table(rows, ["component", "FLOPs", "share"]))
    mem = accounting.memory_bytes(cfg, args.seq_len, args.batch, param_dtype="fp32")
    print("\ntraining memory estimate (fp32 params, AdamW):")
    print(_table([[k, _fmt_bytes(v)] for k, v in mem.items()], ["item", "bytes"]))

    print("\nscaling: forward FLOPs by preset and sequence length (attention-matmul share)")
    seqs = [s for s in (512, 1024, 2048, 4096, 8192, 16384)]
    rows = []
    for name in [p for p in PRESETS if p != "tiny"]:
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
    return 0


# ----------------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("accounting", help="parameter / FLOP / memory accounting for a preset",
                       description="Print parameters, forward FLOPs by component, training memory and a "
                                   "scaling table across presets and sequence lengths.")
    p.add_argument("--preset", default="gpt2-xl", help="model preset (default gpt2-xl)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", type=int, default=1, help="sequences per batch (default 1)")
    p.add_argument("--activations", action="store_true",
                   help="also measure saved-for-backward bytes per layer, reference vs fused (runs a "
                        "block of the preset's width on CPU/GPU)")
    p.add_argument("--activation-seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                   help="sequence lengths for --activations (default 512 1024 2048 4096)")
    p.set_defaults(func=cmd_accounting)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"tritonlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
