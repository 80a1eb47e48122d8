"""The one-shot GPU suite: one command, under 8 minutes on one H100/H200, writes report.md + report.json
(+ plots) into the directory given.

    bash bench/gpu_suite.sh OUTDIR            # or: python bench/gpu_suite.py OUTDIR
    python bench/gpu_suite.py OUTDIR --smoke  # the same code paths on CPU, tiny shapes (not GPU figures)

Sections: environment; measured copy bandwidth and bf16 matmul peak; the kernel tests rerun on CUDA; op
benchmarks (RMSNorm, RoPE, SwiGLU gate; forward and backward) against the reference, torch.compile of it,
PyTorch built-ins and Liger-Kernel when installed; the causal attention subset against SDPA's flash backend;
Gated DeltaNet (chunked, decode, conv1d) against transformers' torch fallback and
flash-linear-attention when installed; the training step for two presets (reference, fused, compiled); MFU; the activation-memory table; and a
verdict row per §Performance target. Every ratio is measured in this one process, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="output directory for report.md, report.json and plots")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny shapes, interpreter, no compile")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting new sections after this")
    ap.add_argument("--skip-tests", action="store_true", help="skip the CUDA rerun of the kernel tests")
    ap.add_argument("--sweep-reserve-s", type=float, default=120.0,
                    help="seconds of the budget kept for the launch-configuration sweep (the sections before it "
                         "stop early to leave them)")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    import torch

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        print("gpu_suite: no CUDA device; use --smoke for the CPU code-path check", file=sys.stderr)
        return 2
    device = torch.device("cuda" if on_gpu else "cpu")
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": args.smoke, "sections": {}}

    # until the sweep starts, its reserve is not the other sections' to spend: every variant's shipped launch and a
    # few alternatives get timed even when the benchmarks before it would fill the budget
    reserve = [args.sweep_reserve_s if on_gpu else 0.0]

    def left() -> float:
        return args.budget_s - reserve[0] - (time.perf_counter() - t_start)

    def section(name, fn, min_left=20.0):
        if left() < min_left:
            report["sections"][name] = {"skipped": f"time budget ({args.budget_s:.0f} s) used up"}
            print(f"[suite] {name}: skipped (time budget)", flush=True)
            return
        t0 = time.perf_counter()
        print(f"[suite] {name} ...", flush=True)
        try:
            report["sections"][name] = fn()
        except Exception as e:  # a broken section is reported, the rest still runs
            import traceback

            report["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        report["sections"].setdefault(name, {})
        if isinstance(report["sections"][name], dict):
            report["sections"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[suite] {name}: {time.perf_counter() - t0:.1f}s", flush=True)

    # ---------------------------------------------------------------------------------------- environment
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "platform": platform.platform(), "device": torch.cuda.get_device_name() if on_gpu else "cpu (smoke)"}
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        env.update({"sms": props.multi_processor_count, "memory_GiB": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda})
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            env["driver"] = "unknown"
    from benchutil import liger_version

    env["liger_kernel"] = liger_version()
    report["environment"] = env

    from tritonlm.benchmarking import measure_copy_bandwidth, measure_matmul_peak

    copy_bw = measure_copy_bandwidth(device)
    mm_peak = measure_matmul_peak(device)
    report["ceilings"] = {"copy_GBps": copy_bw / 1e9, "matmul_TFLOPs": mm_peak / 1e12,
                          "matmul_dtype": "bf16" if on_gpu else "fp32"}

    # ---------------------------------------------------------------------------------------- kernel tests
    def kernel_tests():
        # the package comes from PYTHONPATH (gpu_suite.sh puts a copy there): run pytest from the output folder,
        # never the repository root, whose tritonlm/ source folder (no kernels/, modules/) would shadow it
        env_vars = {**os.environ, "TRITONLM_TEST_DEVICE": "cuda" if on_gpu else "cpu", "PYTHONSAFEPATH": "1",
                    "PYTHONUNBUFFERED": "1"}
        if on_gpu:
            env_vars.pop("TRITON_INTERPRET", None)
        files = [str(REPO / "tests" / folder / f"test_{name}.py")
                 for folder, name in (("kernels", "rmsnorm"), ("kernels", "rope"), ("kernels", "swiglu"),
                                      ("kernels", "flash_attention"), ("kernels", "flash_attn_interface"),
                                      ("kernels", "loss"), ("modules", "fused_model"))]
        junit = out / "kernel_tests.xml"
        parallel = []
        import importlib.util

        if on_gpu and importlib.util.find_spec("xdist") is not None:
            # most of the time is Triton compiling each specialisation once: spread it over processes
            parallel = ["-n", str(min(8, os.cpu_count() or 1))]
        timeout = max(60, min(240, left() - 30))
        log = out / "kernel_tests.log"
        with open(log, "w") as f:  # streamed to the file, so a run cut off by the timeout still leaves its log
            try:
                code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel,
                                       f"--junitxml={junit}", *files], cwd=out, env=env_vars, stdout=f,
                                      stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = f"stopped after {timeout:.0f} s"
        if not junit.exists():
            return {"rows": [{"tests": None, "pytest exit code": code, "log": log.name}]}
        import xml.etree.ElementTree as ET

        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        return {"rows": [{"tests": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
                          "failed": n["failures"], "errored": n["errors"], "not run": n["skipped"],
                          "pytest exit code": code, "log": log.name}]}

    if not args.skip_tests:
        section("kernel_tests", kernel_tests, min_left=120 if on_gpu else 20)

    # ---------------------------------------------------------------------------------------- ops
    from ops_suite import (
        attention_rows,
        attention_variant_rows,
        decode_rows,
        gated_delta_rows,
        hf_rows,
        loss_rows,
        moe_rows,
        op_rows,
        post_training_rows,
        train_rows,
    )

    section("ops", lambda: {"rows": op_rows(device, copy_bw, smoke=not on_gpu, time_left=left)}, min_left=60)
    section("attention", lambda: {"rows": attention_rows(device, mm_peak, smoke=not on_gpu, time_left=left)},
            min_left=60)
    section("attention_variants",
            lambda: {"rows": attention_variant_rows(device, copy_bw, smoke=not on_gpu, time_left=left)}, min_left=60)
    section("decode", lambda: {"rows": decode_rows(device, copy_bw, smoke=not on_gpu, time_left=left)}, min_left=60)
    section("lm_head_loss", lambda: {"rows": loss_rows(device, smoke=not on_gpu, time_left=left)}, min_left=60)
    section("post_training", lambda: {"rows": post_training_rows(device, smoke=not on_gpu, time_left=left)},
            min_left=60)
    section("moe", lambda: {"rows": moe_rows(device, smoke=not on_gpu, time_left=left)}, min_left=60)
    section("gated_delta", lambda: {"rows": gated_delta_rows(device, copy_bw, smoke=not on_gpu, time_left=left)},
            min_left=60)
    section("train_step", lambda: {"rows": train_rows(device, smoke=not on_gpu, time_left=left)}, min_left=60)
    section("hf_train_step", lambda: {"rows": hf_rows(device, smoke=not on_gpu, time_left=left)}, min_left=45)

    from sweep import run_sweep

    # shipped launch configurations vs alternatives; the winners are written to OUT/tuned/<gpu>.json
    reserve[0] = 0.0
    section("sweep", lambda: run_sweep(device, out, smoke=not on_gpu, time_left=left), min_left=45)

    def activations():
        from tritonlm import ModelConfig
        from tritonlm.memory import block_activation_bytes

        return {"rows": [{"preset": p, "seq": s, **block_activation_bytes(ModelConfig.preset(p), s)}
                         for p in ("small", "medium") for s in (512, 4096, 16384)]}

    section("activation_memory", activations, min_left=0)

    # ---------------------------------------------------------------------------------------- verdicts
    from verdicts import plots, render_markdown, verdicts

    report["verdicts"] = verdicts(report)
    report["plots"] = plots(report, out)
    report["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render_markdown(report))
    print(f"[suite] done in {report['total_seconds']} s: {out / 'report.md'}, {out / 'report.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
