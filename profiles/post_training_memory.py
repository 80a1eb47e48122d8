"""Peak memory of the post-training head, forward + backward: per-token log-probabilities + entropy from the
materialised logits (what trainers run: ``log_softmax(hidden @ W.T)``, gather, ``-Σ p log p``) vs fused
``linear_log_probs(..., return_entropy=True)`` -- measured on real CPU tensors (the kernels under Triton's
interpreter) at TRL #7244's 8,192 tokens x vocabulary 151,936 with a small hidden size.

    python profiles/post_training_memory.py [--tokens 8192] [--d-model 64] [--vocab 151936] [--small-tokens 2048]
                                            [--out profiles/post_training_memory.md]

The materialised path at the full shape needs about 23 GiB (five fp32 [tokens, vocab] tensors), more than this
machine holds: it is counted on meta tensors there (``tritonlm.memory.log_probs_peak_bytes``, every storage the
same ops allocate) and both paths are measured for real at ``--small-tokens``. §Performance target: fused <= 1/10
of one fp32 logits tensor, flat in the vocabulary.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernels run on CPU tensors through the interpreter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--small-tokens", type=int, default=2048)
    ap.add_argument("--out", default="profiles/post_training_memory.md")
    args = ap.parse_args()

    import torch

    from tritonlm.kernels import linear_log_probs
    from tritonlm.kernels.log_probs import log_prob_chunk_rows
    from tritonlm.memory import log_probs_peak_bytes, peak_live_bytes

    mib = 2**20
    d, v = args.d_model, args.vocab

    def measure(n: int, eager_too: bool):
        torch.manual_seed(0)
        hidden = torch.randn(n, d, requires_grad=True)
        weight = (torch.randn(v, d) / d**0.5).requires_grad_()
        targets = torch.randint(0, v, (n,))

        def eager():
            z = torch.log_softmax(hidden @ weight.t(), -1)
            log_p, entropy = z.gather(-1, targets[:, None])[:, 0], -(z.exp() * z).sum(-1)
            (log_p.sum() + entropy.sum()).backward()
            return log_p.detach(), entropy.detach()

        def fused():
            log_p, entropy = linear_log_probs(hidden, weight, targets, return_entropy=True)
            (log_p.sum() + entropy.sum()).backward()
            return log_p.detach(), entropy.detach()

        out = {}
        for name, fn in (("eager", eager), ("fused", fused)):
            if name == "eager" and not eager_too:
                continue
            hidden.grad = weight.grad = None
            t0 = time.perf_counter()
            (log_p, entropy), peak = peak_live_bytes(fn)
            out[name] = dict(peak=peak, seconds=time.perf_counter() - t0, log_p=log_p, entropy=entropy,
                             dhidden=hidden.grad.clone(), dweight=weight.grad.clone())
            print(f"{n} tokens, {name}: peak {peak / mib:,.1f} MiB", file=sys.stderr)
        return out

    small = measure(args.small_tokens, True)
    full = measure(args.tokens, False)
    meta = log_probs_peak_bytes(args.tokens, d, v)
    e, f = small["eager"], small["fused"]
    agree = dict(log_p=(e["log_p"] - f["log_p"]).abs().max().item(), entropy=(e["entropy"] - f["entropy"]).abs().max()
                 .item(), dhidden=(e["dhidden"] - f["dhidden"]).abs().max().item(),
                 dweight=(e["dweight"] - f["dweight"]).abs().max().item())
    logits = args.tokens * v * 4
    flat = {vocab: log_probs_peak_bytes(args.tokens, d, vocab)["fused"] for vocab in (32000, 151936, 262144)}
    fused_full = full["fused"]["peak"]
    rows = log_prob_chunk_rows(args.tokens, v, 4)
    lines = [
        "# Post-training head: peak memory of log-probs + entropy, forward + backward (CPU, measured)", "",
        f"{args.tokens:,} tokens x d_model {d} x vocab {v:,} (TRL #7244's tokens and Qwen's vocabulary), fp32, hidden "
        f"and weight requiring gradients; one fp32 `[tokens, vocab]` tensor is {logits / mib:,.1f} MiB. Peak of live "
        "tensor storage counted with `tritonlm.memory.peak_live_bytes`; regenerate with "
        "`python profiles/post_training_memory.py`.", "",
        "| implementation | tokens | peak live tensors | vs one fp32 logits tensor of 8,192 tokens |",
        "|---|---:|---:|---:|",
        f"| materialised logits (`log_softmax`, gather, `-Σ p log p`), measured | {args.small_tokens:,} | "
        f"{e['peak'] / mib:,.1f} MiB | {e['peak'] / logits:.3f} |",
        f"| fused `linear_log_probs(return_entropy=True)`, measured | {args.small_tokens:,} | {f['peak'] / mib:,.1f} MiB "
        f"| {f['peak'] / logits:.3f} |",
        f"| materialised logits, counted on meta tensors (needs more memory than this machine has) | {args.tokens:,} | "
        f"{meta['eager'] / mib:,.1f} MiB | {meta['eager'] / logits:.3f} |",
        f"| fused, measured | {args.tokens:,} | {fused_full / mib:,.1f} MiB | {fused_full / logits:.3f} |", "",
        f"Target fused <= 1/10 of one fp32 logits tensor at {args.tokens:,} tokens: "
        f"{'met' if fused_full <= logits / 10 else 'MISSED'} ({fused_full / logits:.3f}); against the materialised "
        f"path at the same shape: {fused_full / meta['eager']:.3f} (meta count {meta['fused'] / mib:,.1f} MiB for the "
        "fused path, beside the measured figure, which also counts the interpreter's copies of kernel arguments).", "",
        "Flat in the vocabulary (fused, meta count at the same tokens and width): "
        + ", ".join(f"{vocab:,}: {b / mib:,.1f} MiB" for vocab, b in flat.items())
        + f". What grows is one chunk of logits ({rows} tokens at {v:,}: `log_prob_chunk_rows`) and the weight's own "
        "gradient, not tokens x vocab.", "",
        f"Fused vs materialised at {args.small_tokens:,} tokens: max |log-prob diff| {agree['log_p']:.2e}, max "
        f"|entropy diff| {agree['entropy']:.2e}, max |dhidden diff| {agree['dhidden']:.2e}, max |dweight diff| "
        f"{agree['dweight']:.2e}. Wall time on this CPU (not a speed figure: the kernels run in Triton's interpreter):"
        f" materialised {e['seconds']:.1f} s, fused {f['seconds']:.1f} s at {args.small_tokens:,} tokens; fused "
        f"{full['fused']['seconds']:.1f} s at {args.tokens:,}.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
