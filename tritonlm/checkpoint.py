"""Checkpoints: model, optimizer, iteration, and whatever else the trainer needs to resume exactly
(config, tokenizer reference, RNG states). Written atomically: a temp file, fsync, then rename."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

#: The file a training run checkpoints to, in its output directory.
CHECKPOINT_NAME = "checkpoint.pt"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under ``torch.compile`` / DDP wrappers (so keys have no prefixes)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def rng_state() -> dict:
    """Every generator's state as tensors and plain Python values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, iteration: int, out,
                    *, model_state: dict | None = None, optimizer_state: dict | None = None, **extra) -> None:
    """Save ``model``/``optimizer`` state and ``iteration`` (plus ``extra`` entries) to a path or a binary
    file object. A path is written atomically: a crash mid-write leaves any previous file intact.

    ``model_state``/``optimizer_state`` replace the objects' own ``state_dict()`` (e.g. full state dicts
    gathered from a sharded FSDP model)."""
    if model_state is None:
        if model is None:
            raise ValueError("save_checkpoint needs a model or a model_state")
        model_state = unwrap(model).state_dict()
    if optimizer_state is None and optimizer is not None:
        optimizer_state = optimizer.state_dict()
    payload = {"model": model_state, "iteration": int(iteration), "rng": rng_state(), **extra}
    if optimizer_state is not None:
        payload["optimizer"] = optimizer_state
    if not isinstance(out, (str, os.PathLike)):
        torch.save(payload, out)
        return
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_checkpoint(src, map_location="cpu") -> dict:
    """The whole checkpoint dictionary, unpickled with ``weights_only=True``: tensors, containers and plain
    values only, never arbitrary objects (checkpoints of earlier versions held numpy's RNG state, whose array
    reconstruction is the one thing allowed besides)."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    safe = getattr(torch.serialization, "safe_globals", None)
    if safe is None:  # torch 2.4: a process-wide allow-list
        torch.serialization.add_safe_globals(allowed)
        return torch.load(src, map_location=map_location, weights_only=True)
    with safe(allowed):
        return torch.load(src, map_location=map_location, weights_only=True)


def write_text_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old or the new file,
    never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(src, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore ``model`` (and ``optimizer`` if given) from a path or binary file; returns the iteration.

    Parameters load by name, so a checkpoint of either backend (reference or fused) loads into either.
    The optimizer state may be keyed by parameter index (``optimizer.state_dict()``) or by parameter name
    (what ``tritonlm train --fsdp`` saves); names are matched to ``optimizer``'s parameters through ``model``.
    """
    payload = read_checkpoint(src, map_location=_device_of(model))
    unwrap(model).load_state_dict(payload["model"])
    if optimizer is not None and "optimizer" in payload:
        state = payload["optimizer"]
        if _keyed_by_name(state):  # names only need resolving for a name-keyed (FSDP) state
            state = optimizer_state_keyed(state, optimizer_param_names(model, optimizer), by_name=False)
        optimizer.load_state_dict(state)
    return int(payload["iteration"])


def _keyed_by_name(state: dict) -> bool:
    """Whether an optimizer state dict names its parameters (FSDP full state dict) rather than numbering them."""
    return any(isinstance(k, str) for group in state["param_groups"] for k in group["params"])


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name in ``model`` of each parameter of ``optimizer``, in the optimizer's order (its groups, concatenated),
    which is the order of the indices ``optimizer.state_dict()`` uses."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    if missing:
        raise ValueError(f"optimizer parameters {missing[:5]} are not parameters of the model")
    return [names[id(p)] for p in order]


def optimizer_state_keyed(state: dict, names: list[str], by_name: bool) -> dict:
    """An optimizer state dict keyed by parameter index (``optimizer.state_dict()``) or by name (the full state
    dict FSDP checkpoints hold), converted to the form wanted; ``names[i]`` is parameter ``i``'s name."""
    keys = [k for group in state["param_groups"] for k in group["params"]]
    if not keys or _keyed_by_name(state) == by_name:
        return state
    if len(keys) != len(names):
        raise ValueError(f"the checkpoint's optimizer has {len(keys)} parameters, this one {len(names)}")
    to_new = dict(zip(range(len(names)), names)) if by_name else {n: i for i, n in enumerate(names)}
    unknown = [k for k in keys if k not in to_new]
    if unknown:
        raise ValueError(f"the checkpoint's optimizer state names parameters this model lacks: {unknown[:5]}")
    return {"state": {to_new[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [to_new[k] for k in g["params"]]} for g in state["param_groups"]]}


def _device_of(model: torch.nn.Module):
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else "cpu"
