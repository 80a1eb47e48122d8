"""Timing helpers shared by ``bench/``, ``tritonlm bench`` and the one-shot GPU suite.

Every comparison is measured in one process, side by side, with the same inputs: GPU times with CUDA
events after warm-up, CPU times with ``perf_counter``. Machine ceilings (copy bandwidth, matmul peak) are
measured in the same run so that results are reported as fractions of what this machine can do.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import accounting
from .config import ModelConfig


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int = 3, rounds: int = 10) -> list[float]:
    """Seconds per call of ``fn`` over ``rounds`` calls (after ``warmup``)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


#: bytes written between timed runs so that no run finds its inputs in L2 (H100 50 MB, H200 60 MB; B200 126 MB)
L2_FLUSH_BYTES = 256 << 20
_FLUSH_BUFFERS: dict = {}


def _flush_l2(device: torch.device) -> None:
    """Overwrite more memory than the GPU's L2 holds (a no-op on CPU)."""
    if device.type != "cuda":
        return
    buffer = _FLUSH_BUFFERS.get(device)
    if buffer is None:
        buffer = _FLUSH_BUFFERS[device] = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    buffer.zero_()


def time_device(fn: Callable[[], object], device: torch.device, warmup: int = 3, target_s: float = 0.1,
                min_rounds: int = 10, max_rounds: int = 500) -> list[float]:
    """Seconds of device time per call of ``fn``, for the sweep's comparisons of launch configurations.

    Unlike :func:`time_fn`: L2 is flushed before every run (each run reads its inputs from HBM, as in a model where
    the layer before evicted them); rounds are as many as fill ``target_s`` (between ``min_rounds`` and
    ``max_rounds``), not a fixed few; on CUDA every round is enqueued behind a spin kernel with no host sync
    between rounds, so the host runs ahead and the events time the GPU's work, not Python's launch overhead."""
    for _ in range(warmup):
        fn()
    rounds = min_rounds
    if max_rounds > min_rounds:  # as many rounds as fill target_s, from one timed run
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        estimate = max(time.perf_counter() - t0, 1e-6)
        rounds = int(min(max_rounds, max(min_rounds, target_s // estimate)))
    if device.type != "cuda":
        times = []
        for _ in range(rounds):
            _flush_l2(device)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
    torch.cuda._sleep(50_000_000)  # ~25 ms of spinning: the host enqueues the rounds while the GPU is busy
    for start, end in events:
        _flush_l2(device)
        start.record()
        fn()
        end.record()
    sync(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def summary(times: list[float]) -> dict:
    return {"mean_s": statistics.fmean(times), "std_s": statistics.pstdev(times) if len(times) > 1 else 0.0,
            "min_s": min(times), "rounds": len(times)}


def measure_copy_bandwidth(device: torch.device, n_bytes: int | None = None) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    n_bytes = n_bytes or (1 << 30 if device.type == "cuda" else 1 << 26)
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = min(time_fn(lambda: dst.copy_(src), device, warmup=2, rounds=10))
    return 2 * n_bytes / t


def measure_matmul_peak(device: torch.device, dtype: torch.dtype | None = None, n: int | None = None) -> float:
    """Dense matmul FLOP/s (bf16 on GPU, fp32 on CPU by default)."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = min(time_fn(lambda: a @ b, device, warmup=2, rounds=10))
    return 2 * n ** 3 / t


@contextlib.contextmanager
def peak_memory(device: torch.device, out: dict):
    """Peak bytes allocated on a CUDA device inside the block, beyond what was allocated before."""
    if device.type != "cuda":
        yield
        out["peak_bytes"] = None
        return
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    yield
    sync(device)
    out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base


# ----------------------------------------------------------------------------------------------------
# training step
# ----------------------------------------------------------------------------------------------------
IMPLEMENTATIONS = ("reference", "fused", "compiled-reference", "compiled-fused")


def make_train_step(cfg: ModelConfig, impl: str, batch: int, seq: int, device: torch.device):
    """A closure running one full training step (forward, loss, backward, AdamW) of ``impl``."""
    from .modules import TransformerLM
    from .optim import AdamW

    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS}")
    backend = "triton" if "fused" in impl else "reference"
    torch.manual_seed(0)
    model = TransformerLM.from_config(cfg.replace(context_length=max(seq, cfg.context_length)), device=device,
                                      backend=backend)
    model.token_embeddings.check_ids = False  # the ids below are in range; no per-step host sync
    run = torch.compile(model) if impl.startswith("compiled") else model
    opt = AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:  # TransformerLM.loss via forward: the fused backend never forms the logits
            loss = run(x, targets=y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.model = model  # for profilers that label modules
    return step


@dataclass
class StepResult:
    preset: str
    impl: str
    batch: int
    seq: int
    mean_s: float | None
    std_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    peak_bytes: int | None
    error: str | None = None


def benchmark_train_steps(preset: str, seqs: list[int], batch: int, impls: list[str], device: torch.device,
                          warmup: int = 3, rounds: int = 10, cfg: ModelConfig | None = None,
                          progress: Callable[[str], None] | None = None) -> list[StepResult]:
    """Time the training step of each implementation at each sequence length, side by side."""
    cfg = cfg or ModelConfig.preset(preset)
    peak = accounting.peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    results = []
    for seq in seqs:
        for impl in impls:
            if progress:
                progress(f"{preset} seq {seq} {impl}")
            mem: dict = {}
            try:
                step = make_train_step(cfg, impl, batch, seq, device)
                with peak_memory(device, mem):
                    times = time_fn(step, device, warmup=warmup, rounds=rounds)
                s = summary(times)
                flops = accounting.training_flops(cfg, seq, batch)
                results.append(StepResult(preset, impl, batch, seq, s["mean_s"], s["std_s"], batch * seq / s["mean_s"],
                                          flops / s["mean_s"] / peak if peak else None, mem.get("peak_bytes")))
            except torch.cuda.OutOfMemoryError:
                results.append(StepResult(preset, impl, batch, seq, None, None, None, None, None, "out of memory"))
            except Exception as e:  # e.g. a compile failure: report it in its row, keep measuring the rest
                results.append(StepResult(preset, impl, batch, seq, None, None, None, None, None,
                                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
            finally:
                step = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return results
