"""Record a CUDA memory snapshot of one training step (``torch.cuda.memory._record_memory_history``).

    python profiles/memory_snapshot.py --preset small --seq 2048 --batch 4 --backend triton --out profiles/out

Writes ``memory_snapshot.pickle``; drag it into https://pytorch.org/memory_viz to see every allocation of the
step over time (activations saved for backward show up as the rising part of the curve). CUDA only: on a
machine without a GPU it says so and exits non-zero; the activation table (``activation_memory.py``) runs
anywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--backend", default="triton", choices=["reference", "triton"])
    ap.add_argument("--out", default="profiles/out")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("memory_snapshot: needs a CUDA device (none here); see profiles/activation_memory.py for the "
              "device-independent saved-activation table", file=sys.stderr)
        return 2
    from tritonlm import ModelConfig
    from tritonlm.benchmarking import make_train_step

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    step = make_train_step(ModelConfig.preset(args.preset), "fused" if args.backend == "triton" else "reference",
                           args.batch, args.seq, device)
    step()  # warm-up: optimizer state and kernels exist before recording
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    path = out / f"memory_snapshot_{args.backend}.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"peak allocated during the step: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; snapshot {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
