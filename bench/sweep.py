"""The GPU suite's sweep: each kernel's shipped launch configuration beside a bounded set of alternatives, timed
side by side in one process; the winners become a tuned launch table (``kernels/tuned/<gpu>.json`` once
committed) that the launchers read on that GPU.

The cases and candidates are the ops' registrations (``kernels/_registry.py``: each tunable's fields, alternatives
and shipped configuration, each op's sweep inputs). Every candidate runs through the real launcher under :func:`tritonlm.kernels.tuned.override`, so what is timed is
exactly what a tuned table would launch. A candidate that fails to compile or run (e.g. too much shared memory) is
reported and skipped. What keeps the comparison honest:

- keys per variant: every case's key must be one the launcher looks up while the case runs (recorded through
  :func:`tritonlm.kernels.tuned.record_lookups`), else the case is an error row and writes nothing -- a winner
  measured on the GQA kernel lands under the GQA key and applies to no other variant;
- a candidate's outputs must match the shipped launch's on the same inputs, else it is an error row;
- times come from :func:`tritonlm.benchmarking.time_device`: L2 flushed before every run, rounds filling 100 ms,
  the host enqueueing ahead of the GPU (no launch overhead in the events), the median taken;
- a winner enters the table only when it beats the shipped configuration by ``MIN_GAIN``.

The attention backward's atomic-dQ variant (``deterministic=False``) has keys of its own (``...-atomic``): a winner
there tunes that variant when a caller asks for it; it never makes the non-deterministic backward the default.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from tritonlm.benchmarking import time_device
from tritonlm.kernels import _registry, tuned

MIN_GAIN = 1.03


def _cases(device, smoke: bool) -> list[tuple]:
    """``(kernel, key, make_step, candidates)`` of every registered op's sweep cases (``kernels/_registry.py``):
    ``make_step()`` builds inputs and returns the timed callable."""
    cases = []
    for op in _registry.ops():
        for case in op.sweep_cases(device, smoke) if op.sweep_cases else ():
            cases.append((case.tunable, case.key, case.make_step, list(case.candidates)))
    return cases


def _shipped(kernel: str, key: str, device, dtype) -> dict:
    """The configuration the launcher picks without a table, for the report."""
    return _registry.tunables()[kernel].shipped(key, device, dtype)


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


def _run_candidate(case: dict, cand, device, dtype, smoke: bool) -> dict | None:
    """Check and time one candidate of a case (``None``: the shipped launch); returns an error row or None."""
    kernel, key = case["kernel"], case["key"]
    label = "shipped" if cand is None else json.dumps(cand, separators=(",", ":"))
    try:
        ctx = tuned.override(kernel, **cand) if cand else contextlib.nullcontext()
        with ctx, tuned.record_lookups() as looked_up:
            torch.manual_seed(0)  # every candidate runs on the same inputs
            step = case["make_step"]()
            t0 = time.perf_counter()
            result = step()
            checked_s = time.perf_counter() - t0
            if (kernel, key) not in looked_up:  # a winner under this key would never be read
                seen = sorted(k for name, k in looked_up if name == kernel)
                case["dead"] = True
                return {"kernel": kernel, "key": key, "config": label,
                        "error": f"wrong key: the launcher looked up {kernel} under {seen}, not {key!r}"}
            if cand is None:
                case["reference"] = result
            elif case["reference"] is None:
                return {"kernel": kernel, "key": key, "config": label, "error": "no shipped result to compare with"}
            wrong = None if cand is None else _mismatch(result, case["reference"], dtype)
            if wrong:  # a candidate may only win with the shipped launch's results
                return {"kernel": kernel, "key": key, "config": label, "error": wrong}
            if smoke:  # the checked run's wall time: the code paths exercised on CPU, not a measurement
                ms = 1e3 * checked_s
            else:
                ms = 1e3 * statistics.median(time_device(step, device, warmup=3, min_rounds=10, max_rounds=500))
    except Exception as e:  # out of resources at compile time, or a launch error
        if cand is None:
            case["dead"] = True  # (the shipped launch itself failed: nothing to compare with)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"kernel": kernel, "key": key, "config": label, "error": repr(e)[:160]}
    case["timings"].append((ms, cand, label))
    return None


def run_sweep(device, out: Path, smoke: bool = False, time_left=lambda: 1e9) -> dict:
    """Time every case's candidates; write ``out/tuned/<gpu>.json`` with the winners; return the report rows.

    Candidates run in rounds across the cases (every case's shipped launch, then every case's first alternative,
    ...), so a suite that runs out of time has still timed every kernel variant, not a few of them in depth."""
    dtype = torch.float32 if smoke else torch.bfloat16
    rows, table = [], {}
    cases = [dict(kernel=kernel, key=key, make_step=make_step, dead=False, reference=None, timings=[],
                  candidates=[None] + (alternatives[:2] if smoke else list(alternatives)))
             for kernel, key, make_step, alternatives in _cases(device, smoke)]
    for round_ in range(max((len(c["candidates"]) for c in cases), default=0)):
        for case in cases:
            if case["dead"] or round_ >= len(case["candidates"]):
                continue
            if time_left() < 20:
                case["skipped"] = True
                continue
            error = _run_candidate(case, case["candidates"][round_], device, dtype, smoke)
            if error:
                rows.append(error)
    for case in cases:
        kernel, key, timings = case["kernel"], case["key"], case["timings"]
        if case.get("skipped"):
            rows.append({"kernel": kernel, "key": key, "error": "skipped: suite time budget "
                         f"({len(timings)} of {len(case['candidates'])} configurations timed)"})
        if not timings or case["reference"] is None:  # (no shipped time: nothing to compare with)
            continue
        shipped = _shipped(kernel, key, device, dtype)
        base = next(ms for ms, cand, _ in timings if cand is None)
        best_ms, best_cand, best_label = min(timings, key=lambda t: t[0])
        for ms, cand, label in timings:
            rows.append({"kernel": kernel, "key": key, "config": label, "ms": ms, "vs_shipped": base / ms,
                         "best": cand is best_cand,
                         "shipped_config": json.dumps(shipped, separators=(",", ":")) if cand is None else ""})
        if best_cand is not None and base / best_ms >= MIN_GAIN:
            table.setdefault(kernel, {})[key] = best_cand
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-smoke"
    path = out / "tuned" / f"{tuned.gpu_slug(name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"version": tuned.VERSION, "gpu": name, "source": f"bench/gpu_suite.py sweep, {time.strftime('%Y-%m-%d')}",
                "min_gain": MIN_GAIN, "kernels": table}
    tuned.validate(document, str(path))  # what the launchers will accept, checked before it is written
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return {"rows": rows, "table": str(path), "entries": sum(len(v) for v in table.values())}
