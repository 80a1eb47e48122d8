"""One registration per op: everything the tooling needs to know about a kernel, declared beside its launcher.

Each op's file ends with ``register(Op(...))``. The tools read this registry and nothing private of the kernel
files:

- ``tritonlm.kernels.tuned`` validates tuned launch tables against the ops' :class:`Tunable` fields;
- ``bench/sweep.py`` (the GPU suite's sweep) times each tunable's shipped configuration beside its candidates on
  the op's :class:`SweepCase` inputs;
- ``tritonlm.kernel_report`` (the SASS report) captures each :class:`SassCase` launch on meta tensors and compiles
  it for sm_90 / sm_80;
- ``bench/ops_suite.py`` times each op's :class:`BenchCase` beside its reference and the third-party baselines, or
  names the GPU-suite section that measures it (``bench_section``);
- ``reference`` names the op's readable PyTorch twin (resolved lazily: ``kernels/`` imports nothing above it); the
  op suite's "reference" rows run that twin;
- the tests read ``opcheck_cases`` (``torch.library.opcheck`` on every custom op the op defines) and
  ``double_backward_cases`` (every autograd Function refuses ``create_graph=True``), so a new op cannot be left
  out of them.

Every op registers in ``kernels/registrations/<op>.py`` (single-file ops and op packages alike); the kernel keeps its
:class:`Tunable` beside its launcher. Adding an op: CONTRIBUTING.md, "Adding a kernel".
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Tunable:
    """A kernel whose launch configuration a tuned table may replace (``kernels/tuned/<gpu>.json``).

    ``shipped(key, device, dtype)`` is the configuration the launcher picks without a table, for the sweep's
    report; ``candidates`` are the alternatives the sweep times (the smoke run takes the first two)."""
    name: str
    fields: tuple[str, ...]
    candidates: tuple[dict, ...]
    shipped: Callable[[str, torch.device, torch.dtype], dict]


@dataclass(frozen=True)
class SweepCase:
    """Inputs the sweep times one tunable on: ``make_step()`` builds them and returns the timed callable (whose
    result every candidate must reproduce). ``key`` must be the key the launcher looks up for these inputs (the
    sweep checks it: a winner is written under it, and a key no launch reads would be a table entry that never
    applies); kernel variants have keys of their own (attention: ``"bf16-d128-gqa"``, ``"bf16-d128-atomic"``)."""
    tunable: str
    key: str
    make_step: Callable[[], Callable[[], object]]
    candidates: tuple[dict, ...]


@dataclass(frozen=True)
class SassLaunch:
    """One report row: the ``index``-th kernel launch a :class:`SassCase` captures, its label and FLOPs.

    ``unit`` names the work one iteration of the kernel's main loop does (``"key"``, ``"logit"``, ...) and
    ``per_iteration(constexprs)`` how many units that is at the launch's configuration; with ``per_warp`` the report
    counts warp-instructions (the loop's instructions times the launch's warps) per unit, else instructions per
    unit as one warp issues them (attention's convention: per key, for the tile's query rows)."""
    kernel: str
    index: int = 0
    flops: int = 0
    unit: str = ""
    per_iteration: Callable[[dict], int] | None = None
    per_warp: bool = False


@dataclass(frozen=True)
class SassCase:
    """A representative call of the op's launcher on meta tensors (``run()``); the SASS report captures the
    kernel launches it makes and compiles ``launches`` of them. ``bytes_moved`` is the compulsory traffic when
    counting each tensor argument once is not it; ``context`` wraps the call (a tuned override, a precision)."""
    case: str
    run: Callable[[], object]
    launches: tuple[SassLaunch, ...]
    bytes_moved: int | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    shipped: bool = True  # False: a sweep alternative's configuration, shown as evidence (never launched by default)


@dataclass(frozen=True)
class BenchCase:
    """One op-suite row group: ``impls`` (at least "reference" and "tritonlm") called on ``inputs``, forward and
    backward timed apart; ``traffic`` the compulsory bytes per mode ("fwd", "bwd"). ``liger`` names the matching
    Liger-Kernel baseline in ``bench/benchutil.liger_impls`` (``liger_args`` when it is built from tensors)."""
    impls: dict[str, Callable]
    inputs: tuple
    traffic: dict[str, int]
    liger: str | None = None
    liger_args: tuple = ()


@dataclass(frozen=True)
class Op:
    """What the tooling knows about one op.

    ``sass_cases(quick)`` and ``sweep_cases(device, smoke)`` build their cases on demand; ``bench_case(rows,
    hidden, device, dtype)`` an op-suite row group for an activation of ``[rows, hidden]``. An op measured by a
    section of its own in the GPU suite names it in ``bench_section``."""
    name: str
    entry_points: tuple[str, ...]
    reference: str
    tunables: tuple[Tunable, ...] = ()
    sass_cases: Callable[[bool], list[SassCase]] | None = None
    sweep_cases: Callable[[torch.device, bool], list[SweepCase]] | None = None
    bench_case: Callable[[int, int, torch.device, torch.dtype], BenchCase] | None = None
    bench_section: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: ``{custom op name: [argument tuples]}``: small CPU calls of each ``torch.ops.tritonlm`` op this op defines
    opcheck_cases: Callable[[], dict[str, list[tuple]]] | None = None
    #: ``[(name, output, inputs)]``: one call per autograd Function entry point, on small inputs that require grad
    double_backward_cases: Callable[[], list[tuple[str, torch.Tensor, list[torch.Tensor]]]] | None = None

    def reference_twin(self):
        """The readable PyTorch twin (a function or module class), imported on request."""
        module, _, name = self.reference.rpartition(".")
        return getattr(importlib.import_module(module), name)


_OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Add ``op`` (once: a second registration under the same name is a mistake, not an update)."""
    if op.name in _OPS and _OPS[op.name] is not op:
        raise ValueError(f"op {op.name!r} is registered twice")
    names = [t.name for o in _OPS.values() if o.name != op.name for t in o.tunables]
    clash = [t.name for t in op.tunables if t.name in names]
    if clash:
        raise ValueError(f"op {op.name!r}: tunable kernel names already registered by another op: {clash}")
    _OPS[op.name] = op
    return op


def ops() -> list[Op]:
    """Every registered op, in registration order (importing ``tritonlm.kernels`` registers them all)."""
    importlib.import_module(__package__)
    return list(_OPS.values())


def op(name: str) -> Op:
    ops()
    if name not in _OPS:
        raise KeyError(f"no op {name!r} is registered (registered: {', '.join(_OPS)})")
    return _OPS[name]


def entry_points() -> list[str]:
    """Every registered op's public names, in registration order: ``tritonlm.kernels.__all__``."""
    return [name for o in _OPS.values() for name in o.entry_points]


def tunables() -> dict[str, Tunable]:
    """Every tunable kernel by its tuned-table name."""
    return {t.name: t for o in ops() for t in o.tunables}


def dtype_label(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how report cases name a dtype."""
    return str(dtype).replace("torch.", "")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


#: Rows of the elementwise ops' SASS cases: 4096 tokens of these hidden sizes, in these dtypes (quick: the first).
SASS_ROWS = 4096
SASS_HIDDENS = (768, 4096, 8192, 16384)
SASS_DTYPES = (torch.bfloat16, torch.float32)


def sass_shapes(quick: bool) -> list[tuple[torch.dtype, int]]:
    """``(dtype, hidden)`` of the elementwise ops' SASS cases: bf16 x 4096 when ``quick``."""
    hiddens = (4096,) if quick else SASS_HIDDENS
    dtypes = SASS_DTYPES[:1] if quick else SASS_DTYPES
    return [(dtype, hidden) for dtype in dtypes for hidden in hiddens]
