"""The GPU suite's sweep: each kernel's shipped launch configuration beside a bounded set of alternatives, timed
side by side in one process; the winners become a tuned launch table (``kernels/tuned/<gpu>.json`` once
committed) that the launchers read on that GPU.

Every candidate runs through the real launcher under :func:`tritonlm.kernels.tuned.override`, so what is timed is
exactly what a tuned table would launch. A candidate that fails to compile or run (e.g. too much shared memory) is
reported and skipped. A winner enters the table only when it beats the shipped configuration by
``MIN_GAIN``; the attention backward's atomic-dQ variant is timed and reported beside its deterministic
twin but never written (deterministic stays the default until a report argues otherwise).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from tritonlm.benchmarking import time_fn
from tritonlm.kernels import tuned

MIN_GAIN = 1.03

#: Alternatives per kernel, besides the shipped configuration (GPU runs; the smoke run takes the first two).
ATTENTION_FWD = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3), dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4),
                 dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                 dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4), dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
                 # two CTAs per sm_90 SM at d 128 (SASS report with this config: 174 registers x 128 threads,
                 # 80 KB dynamic shared memory, spill-free)
                 dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)]
ATTENTION_BWD = [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
                 dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2), dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
                 dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3)]
RMS_NORM = [dict(BLOCK_M=1, num_warps=4), dict(BLOCK_M=1, num_warps=8), dict(BLOCK_M=2, num_warps=8),
            dict(BLOCK_M=4, num_warps=8), dict(BLOCK_M=4, num_warps=16)]
ROPE = [dict(HEADS=1), dict(HEADS=4), dict(HEADS=8), dict(HEADS=32),  # 32: every q head of a 32-head layer
        dict(BLOCK_S=16, HEADS=8, num_warps=4), dict(BLOCK_S=64, HEADS=2, num_warps=8)]
SWIGLU = [dict(BLOCK=2048, num_warps=4), dict(BLOCK=2048, num_warps=8), dict(BLOCK=4096, num_warps=8),
          dict(BLOCK=512, num_warps=4)]


def _cases(device, smoke: bool) -> list[tuple]:
    """``(kernel, key, make_step, candidates)``: ``make_step()`` builds inputs and returns the timed callable."""
    from tritonlm.kernels import apply_rope, flash_attention, rms_norm, rope_tables, swiglu_gate

    dtype = torch.float32 if smoke else torch.bfloat16
    dn = tuned.dtype_name(dtype)
    cases = []

    # attention, causal, batch x heads x seq x d
    for d in ((16,) if smoke else (64, 128)):
        b, h, n = (1, 2, 64) if smoke else (4, 16, 4096)
        key = f"{dn}-d{d}"

        def fwd_step(d=d, b=b, h=h, n=n):
            q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(3))
            return lambda: flash_attention(q, k, v, True)

        def bwd_step(d=d, b=b, h=h, n=n, deterministic=True):
            q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(b, h, n, d, device=device, dtype=dtype)

            def step():  # forward and backward (a candidate's forward must not change what the backward sees)
                out = flash_attention(q, k, v, True, deterministic=deterministic)
                return torch.autograd.grad(out, (q, k, v), grad)
            return step

        # the Hopper TMA variant competes with the shipped tiles on sm_90+ (and in the smoke run's interpreter)
        hopper = smoke or torch.cuda.get_device_capability(device)[0] >= 9
        cases.append(("attention_fwd", key, fwd_step, ([dict(TMA=1)] if hopper else []) + ATTENTION_FWD))
        cases.append(("attention_bwd", key, bwd_step, ([dict(TMA=1)] if hopper else []) + ATTENTION_BWD))
        cases.append(("attention_bwd", key + " atomic-dQ", lambda f=bwd_step: f(deterministic=False), []))

    # RMSNorm forward + backward over 16K rows (smoke: 64)
    for n_cols in ((256,) if smoke else (768, 4096)):
        rows = 64 if smoke else 16384

        def norm_step(n_cols=n_cols, rows=rows):
            x = torch.randn(rows, n_cols, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(n_cols, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(rows, n_cols, device=device, dtype=dtype)

            def step():
                y = rms_norm(x, w)
                return (y, *torch.autograd.grad(y, (x, w), grad))
            return step

        block_n = 1 << (n_cols - 1).bit_length()
        cases.append(("rms_norm", f"{dn}-n{block_n}", norm_step,
                      [c for c in RMS_NORM if c["BLOCK_M"] * block_n <= 16384]))

    # RoPE on q and k, [batch, heads, seq, 128] (smoke: d 16)
    d = 16 if smoke else 128

    def rope_step(d=d):
        b, h, n = (1, 2, 32) if smoke else (4, 32, 4096)
        q, k = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(2))
        cos, sin = rope_tables(10000.0, d, n, device)
        pos = torch.arange(n, device=device)
        return lambda: apply_rope(q, k, pos, cos=cos, sin=sin, check_positions=False)

    cases.append(("rope", f"{dn}-d{d}", rope_step, ROPE))

    # SwiGLU gate, a Llama-7B FFN's worth: 8K tokens x 11008
    def swiglu_step():
        shape = (64, 96) if smoke else (8192, 11008)
        a, b_ = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
        return lambda: swiglu_gate(a, b_)

    cases.append(("swiglu", dn, swiglu_step, SWIGLU))
    return cases


def _shipped(kernel: str, key: str, device, dtype) -> dict:
    """The configuration the launcher picks without a table, for the report."""
    import importlib

    d_or_n = int(key.split("-")[1].split()[0][1:]) if "-" in key else 0
    if kernel in ("attention_fwd", "attention_bwd"):
        fa = importlib.import_module("tritonlm.kernels.flash_attention")
        pick = fa._fwd_config if kernel == "attention_fwd" else fa._bwd_config
        return dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), pick(d_or_n, dtype, device)))
    if kernel == "rms_norm":
        cfg = importlib.import_module("tritonlm.kernels.rmsnorm")._launch_config(d_or_n)
        return {k: cfg[k] for k in ("BLOCK_M", "num_warps")}
    if kernel == "rope":
        cfg = importlib.import_module("tritonlm.kernels.rope")._launch_config(d_or_n, dtype)
        return {k: cfg[k] for k in ("BLOCK_S", "num_warps")}
    return dict(BLOCK=importlib.import_module("tritonlm.kernels.swiglu").BLOCK, num_warps=4)


def _mismatch(got, expected, dtype) -> str | None:
    """Why a candidate's outputs differ from the shipped launch's on the same inputs, or None when they agree."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for i, (a, b) in enumerate(zip(got, expected)):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
        if not err <= tol:  # (NaN fails too)
            return f"wrong result: output {i} differs from the shipped launch by {err:.2e} (relative to its max)"
    return None


def run_sweep(device, out: Path, smoke: bool = False, time_left=lambda: 1e9) -> dict:
    """Time every case's candidates; write ``out/tuned/<gpu>.json`` with the winners; return the report rows."""
    dtype = torch.float32 if smoke else torch.bfloat16
    rows, table = [], {}
    shipped_ms: dict[tuple[str, str], float] = {}  # a variant row (atomic-dQ) compares with its key's shipped time
    for kernel, key, make_step, alternatives in _cases(device, smoke):
        if time_left() < 30:
            rows.append({"kernel": kernel, "key": key, "error": "skipped: suite time budget"})
            continue
        shipped = _shipped(kernel, key.split()[0], device, dtype)
        candidates = [None] + (alternatives[:2] if smoke else alternatives)
        timings, reference = [], None
        for cand in candidates:
            if time_left() < 20:
                break
            label = "shipped" if cand is None else json.dumps(cand, separators=(",", ":"))
            try:
                ctx = tuned.override(kernel, **cand) if cand else contextlib.nullcontext()
                with ctx:
                    torch.manual_seed(0)  # every candidate runs on the same inputs
                    step = make_step()
                    result = step()
                    if cand is None:
                        reference = result
                    wrong = None if reference is None else _mismatch(result, reference, dtype)
                    if wrong:  # a candidate may only win with the shipped launch's results
                        rows.append({"kernel": kernel, "key": key, "config": label, "error": wrong})
                        continue
                    ms = 1e3 * statistics.median(time_fn(step, device, warmup=1 if smoke else 3,
                                                         rounds=2 if smoke else 10))
            except Exception as e:  # out of resources at compile time, or a launch error
                rows.append({"kernel": kernel, "key": key, "config": label, "error": repr(e)[:160]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            timings.append((ms, cand, label))
        if not timings:
            continue
        base = next((ms for ms, cand, _ in timings if cand is None), None)
        if " " in key:  # a variant of the shipped configuration: measured against the default path
            base = shipped_ms.get((kernel, key.split()[0]), base)
        elif base is not None:
            shipped_ms[(kernel, key)] = base
        best_ms, best_cand, best_label = min(timings, key=lambda t: t[0])
        for ms, cand, label in timings:
            rows.append({"kernel": kernel, "key": key, "config": label, "ms": ms,
                         "vs_shipped": (base / ms) if base else None, "best": cand is best_cand,
                         "shipped_config": json.dumps(shipped, separators=(",", ":")) if cand is None else ""})
        writable = " " not in key  # the atomic-dQ row is a variant, not a table entry
        if writable and best_cand is not None and base and base / best_ms >= MIN_GAIN:
            table.setdefault(kernel, {})[key] = best_cand
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-smoke"
    path = out / "tuned" / f"{tuned.gpu_slug(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"version": tuned.VERSION, "gpu": name, "source": f"bench/gpu_suite.py sweep, {time.strftime('%Y-%m-%d')}",
                "min_gain": MIN_GAIN, "kernels": table}
    tuned.validate(document, str(path))  # what the launchers will accept, checked before it is written
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return {"rows": rows, "table": str(path), "entries": sum(len(v) for v in table.values())}
