"""Launch tables measured on real GPUs, read by the launchers in place of their shipped defaults.

The GPU suite's sweep (``bench/gpu_suite.py``, section ``sweep``) times each kernel's shipped configuration
beside a bounded set of alternatives and writes the winners as ``<gpu>.json``; committed here, e.g.
``kernels/tuned/nvidia-h200.json``, they apply on that GPU (its ``torch.cuda.get_device_name`` slug). No
autotuning happens at import or at launch: a launcher asks :func:`choose` for its configuration, which is

1. an override set by :func:`override` (the sweep itself, and tests), else
2. this GPU's tuned entry for the kernel and shape key, else
3. the launcher's shipped configuration (unknown GPUs, CPU / interpreter runs, shapes the sweep did not cover).

A tuned file that cannot be read, or holds unknown kernels, fields or values, is a :class:`TunedTableError` naming
the file: never silently ignored.

File format (version 1)::

    {"version": 1, "gpu": "NVIDIA H200", "source": "profiles/h200/2026-12-01/report.json",
     "kernels": {"attention_fwd": {"bf16-d128": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}},
                 "rms_norm": {"bf16-n4096": {"BLOCK_M": 1, "num_warps": 8}}}}
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import re
from pathlib import Path

import torch

from .. import _registry

VERSION = 1
TUNED_DIR = Path(__file__).parent



def fields() -> dict[str, tuple[str, ...]]:
    """Tunable fields per kernel, as the ops register them (every field of an entry must be one of these)."""
    return {name: t.fields for name, t in _registry.tunables().items()}


def __getattr__(name):
    if name == "FIELDS":  # the registry's view, read when asked (the ops register after this module loads)
        return fields()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_POW2_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_R", "BLOCK_S", "BLOCK", "BLOCK_V", "HEADS", "num_warps")
_LIMITS = {"BLOCK_M": (1, 256), "BLOCK_N": (16, 256), "BLOCK_S": (1, 256), "BLOCK_K": (16, 256), "BLOCK_R": (16, 256), "BLOCK": (128, 16384), "HEADS": (1, 64),
           "num_warps": (1, 32), "num_stages": (1, 8), "TMA": (0, 1), "FOLD_SCALE": (0, 1),
           "ROW_STAGES": (1, 4), "PROGRAMS_PER_SM": (1, 8), "BLOCK_V": (256, 32768), "LOAD_STAGES": (1, 8)}


class TunedTableError(ValueError):
    """A tuned launch table that cannot be used as written."""


def gpu_slug(device_name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: the file name of a GPU's table."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def validate(table: dict, source: str = "<table>") -> dict:
    """Check a parsed table; returns ``{kernel: {key: config}}`` or raises :class:`TunedTableError`."""
    def bad(why: str):
        return TunedTableError(f"tuned launch table {source}: {why}")

    if not isinstance(table, dict) or table.get("version") != VERSION:
        raise bad(f"expected a JSON object with \"version\": {VERSION}")
    kernels = table.get("kernels")
    if not isinstance(kernels, dict):
        raise bad("\"kernels\" must be an object of kernel -> {shape key -> config}")
    known = fields()
    for kernel, entries in kernels.items():
        if kernel not in known:
            raise bad(f"unknown kernel {kernel!r} (known: {', '.join(known)})")
        if not isinstance(entries, dict):
            raise bad(f"{kernel}: must map shape keys to configs")
        for key, cfg in entries.items():
            if not isinstance(cfg, dict) or not cfg:
                raise bad(f"{kernel}[{key!r}]: a config must be a non-empty object")
            for name, value in cfg.items():
                if name not in known[kernel]:
                    raise bad(f"{kernel}[{key!r}]: unknown field {name!r} (fields: {', '.join(known[kernel])})")
                lo, hi = _LIMITS[name]
                if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                    raise bad(f"{kernel}[{key!r}].{name} = {value!r}: must be an int in [{lo}, {hi}]")
                if name in _POW2_FIELDS and value & (value - 1):
                    raise bad(f"{kernel}[{key!r}].{name} = {value}: must be a power of two")
    return kernels


@functools.cache
def load(slug: str) -> dict:
    """The tuned entries for a GPU slug (``{}`` when no file exists for it)."""
    path = TUNED_DIR / f"{slug}.json"
    if not path.exists():
        return {}
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TunedTableError(f"tuned launch table {path}: not readable JSON ({e})") from None
    return validate(table, str(path))


@functools.cache
def _device_name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_name(device: torch.device) -> str:
    # cached per device: choose() runs on every launch, the name never changes
    return _device_name_of(device.index if device.index is not None else torch.cuda.current_device())


_OVERRIDES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tritonlm_tuned_overrides", default=None)


@contextlib.contextmanager
def override(kernel: str, **config):
    """Inside the block, ``kernel`` launches with ``config`` (merged over what it would choose): how the sweep
    times alternatives and how tests run GPU tables in the interpreter."""
    validate({"version": VERSION, "kernels": {kernel: {"override": config}}}, "override")
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), kernel: config})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


_LOOKUPS: contextvars.ContextVar[set | None] = contextvars.ContextVar("tritonlm_tuned_lookups", default=None)


@contextlib.contextmanager
def record_lookups():
    """Inside the block, the ``(kernel, key)`` of every :func:`choose` call is added to the yielded set: how the
    sweep checks that the key it writes a winner under is the one the launcher looks up for that case."""
    seen: set = set()
    token = _LOOKUPS.set(seen)
    try:
        yield seen
    finally:
        _LOOKUPS.reset(token)


def choose(kernel: str, key: str, device: torch.device, shipped: dict) -> dict:
    """The configuration to launch ``kernel`` with for shape ``key`` on ``device`` (see the module docstring)."""
    seen = _LOOKUPS.get()
    if seen is not None:
        seen.add((kernel, key))
    forced = (_OVERRIDES.get() or {}).get(kernel)
    if forced is not None:
        return {**shipped, **forced}
    if device.type != "cuda":
        return shipped
    entry = load(gpu_slug(_device_name(device))).get(kernel, {}).get(key)
    return {**shipped, **entry} if entry else shipped


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
