"""The bottom of ``tritonlm/``: what every module above the model may import. The one-line error type the CLI
reports, device and backend resolution, and the distributed context of ``torchrun`` runs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


class TrainError(ValueError):
    """A bad training input, reported as one line by the CLI."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise TrainError(f"--device {name!r}: not a device (auto, cpu, cuda, cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise TrainError(f"--device {name!r}: only cpu and cuda devices are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name} asked for CUDA, but no CUDA device is available")
    return dev


def runnable_backend(backend: str, device: torch.device) -> str:
    """Resolve ``auto`` and refuse a Triton backend that cannot run on ``device`` (a clear error, no fallback)."""
    from .modules.model import resolve_backend

    try:
        backend = resolve_backend(backend, device)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if backend == "triton" and device.type != "cuda":
        from .kernels import INTERPRETING

        if not INTERPRETING:
            raise TrainError("--backend triton needs a CUDA device; on CPU it runs only under Triton's interpreter "
                             "(set TRITON_INTERPRET=1 in the environment; slow) -- or use --backend reference/auto")
    return backend


# ----------------------------------------------------------------------------------------------------
# distributed
# ----------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: torch.device) -> Dist:
    """Join the process group when launched by ``torchrun`` (RANK/WORLD_SIZE set)."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def all_mean(value: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world == 1:
        return value
    import torch.distributed as dist

    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / d.world
