"""Profile training steps: an nsys timeline when ``nsys`` is installed, else a torch.profiler trace.

    python profiles/profile_step.py --preset small --seq 1024 --batch 4 --backend triton --out profiles/out

With nsys: re-runs itself under ``nsys profile --trace=cuda,nvtx`` (every module and kernel launch carries an
NVTX range, so the timeline reads by layer and op) and writes ``step.nsys-rep``. Without it: a Chrome/Perfetto
trace (``trace.json``), a per-op time table (``ops.txt``), and a comparison of the measured step time with the
accounting FLOPs (achieved TFLOP/s and MFU on a GPU). Runs on CPU too (reference backend, small shapes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="default: small on GPU, tiny on CPU")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"])
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    ap.add_argument("--out", default="profiles/out")
    ap.add_argument("--no-nsys", action="store_true", help="use torch.profiler even if nsys exists")
    ap.add_argument("--under-nsys", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if shutil.which("nsys") and not args.no_nsys and not args.under_nsys:
        # capture only between cudaProfilerStart/Stop: the profiled steps, not imports, compiles and warm-up
        cmd = ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--capture-range=cudaProfilerApi",
               "--capture-range-end=stop", "--force-overwrite=true", "-o", str(out / "step"),
               sys.executable, __file__, "--under-nsys", *sys.argv[1:]]
        print("running:", " ".join(cmd))
        return subprocess.call(cmd)

    import torch

    from tritonlm import ModelConfig, accounting, profiling
    from tritonlm.benchmarking import make_train_step, sync

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    preset = args.preset or ("small" if on_gpu else "tiny")
    seq = args.seq or (1024 if on_gpu else 64)
    batch = args.batch or (4 if on_gpu else 2)
    backend = args.backend if args.backend != "auto" else ("triton" if on_gpu else "reference")
    if backend == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        print("the triton backend on CPU needs TRITON_INTERPRET=1 set before the run", file=sys.stderr)
        return 2
    cfg = ModelConfig.preset(preset)
    step = make_train_step(cfg, "fused" if backend == "triton" else "reference", batch, seq, device)
    profiling.annotate(step.model)  # NVTX / record_function label per module path, and per kernel launch
    for _ in range(2):
        step()
    sync(device)

    if args.under_nsys:
        torch.cuda.cudart().cudaProfilerStart()
        for i in range(args.steps):
            torch.cuda.nvtx.range_push(f"step {i}")
            step()
            torch.cuda.nvtx.range_pop()
        sync(device)
        torch.cuda.cudart().cudaProfilerStop()
        print(f"nsys report: {out / 'step.nsys-rep'}")
        return 0

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
        sync(device)
    elapsed = (time.perf_counter() - t0) / args.steps
    prof.export_chrome_trace(str(out / "trace.json"))
    sort = "cuda_time_total" if on_gpu else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40)
    (out / "ops.txt").write_text(table)
    flops = accounting.training_flops(cfg, seq, batch)
    lines = [f"preset {preset}, seq {seq}, batch {batch}, backend {backend}, device "
             f"{torch.cuda.get_device_name() if on_gpu else 'cpu'}",
             f"step time (under the profiler) {elapsed * 1e3:.1f} ms; accounting: {flops / 1e12:.3f} TFLOPs per step "
             f"-> {flops / elapsed / 1e12:.2f} TFLOP/s achieved"]
    peak = accounting.peak_flops(torch.cuda.get_device_name()) if on_gpu else None
    if peak:
        lines.append(f"MFU {100 * flops / elapsed / peak:.1f}% of {peak / 1e12:.0f} TFLOP/s")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print(table)
    print("\n".join(lines))
    print(f"wrote {out / 'trace.json'} (open in https://ui.perfetto.dev), {out / 'ops.txt'}, {out / 'summary.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
