"""Static analysis of the Triton kernels: compile each for sm_90 / sm_80 without a GPU and read its SASS.

For every kernel at the configuration its launcher picks for a representative shape, the launch is
*captured* (the real launcher runs on meta tensors with GPU heuristics, and the kernel call is recorded
instead of executed), specialised the way Triton's JIT would specialise those arguments (16-byte
divisibility of pointers and of integers that are multiples of 16, integers equal to 1 as constants),
compiled with ``triton.compile`` for the target, and the cubin is read with the ``cuobjdump`` that ships
inside the Triton wheel: registers, shared memory, local memory (spills), and SASS instruction counts
(tensor-core ops, global load/store widths, async copies, local loads/stores).

Each row also carries the compulsory traffic and FLOPs of the launch and the roofline time on H100/H200.
This is static analysis, not measured speed.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

#: Peak figures the roofline uses: (HBM bytes/s, dense bf16 FLOP/s).
ROOFLINE = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}
ARCHS = {"sm_90": 90, "sm_80": 80}


@dataclass
class Launch:
    kernel: str
    case: str
    fn: object
    args: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    bytes_moved: int = 0
    flops: int = 0
    dot_precision: str | None = None  # fp32 attention: the DOT_PRECISION ("ieee" / "tf32") its tl.dots take
    fp_fusion: bool | None = None  # the launch's enable_fp_fusion (None: Triton's default)
    unit: str = ""  # the work of one main-loop iteration (SassLaunch.unit) and how many of them
    units_per_iteration: float = 0
    per_warp: bool = False
    shipped: bool = True
    peer: str | None = None  # a peer library's kernel ("liger-kernel 0.8.5"), compiled the same way
    compare_to: str | None = None  # the tritonlm row label it stands beside


@dataclass
class Row:
    kernel: str
    case: str
    arch: str
    config: str
    registers: int
    shared_bytes: int
    spill_bytes: int
    sass: dict = field(default_factory=dict)
    bytes_moved: int = 0
    flops: int = 0
    roofline_us: dict = field(default_factory=dict)
    dynamic_smem_bytes: int = 0
    ctas_per_sm: int = 0
    error: str | None = None
    # loops of the SASS (backward branches): the main loop (the first innermost one: the steady-state tiles, before
    # any masked edge loop), every innermost loop in program order, and all loops together (outermost ones, so
    # nested code counts once)
    loop_instructions: int = 0
    loops: list = field(default_factory=list)
    all_loop_instructions: int = 0
    unit: str = ""
    instructions_per_unit: float | None = None
    all_loops_per_unit: float | None = None
    shipped: bool = True
    sass_file: str | None = None
    peer: str | None = None
    compare_to: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------------
# capturing launches
# ----------------------------------------------------------------------------------------------------
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def capture(thunk, capability: int = 90) -> list[tuple]:
    """Run ``thunk`` (which calls launchers on meta tensors) as if on a GPU of ``capability`` and return
    the captured kernel calls."""
    from .kernels._common import INTERPRETING, assume_gpu_target, capture_launches

    if INTERPRETING:
        raise RuntimeError("the SASS report compiles kernels for real GPUs; run it without TRITON_INTERPRET=1 "
                           "(the interpreter replaces the compiled kernels)")
    with assume_gpu_target(capability), capture_launches() as calls:
        thunk()
    return calls


def _to_launch(kernel_label: str, case: str, call, flops: int = 0) -> Launch:
    fn, args, kwargs = call
    kwargs = dict(kwargs)
    warps = kwargs.pop("num_warps", 4)
    stages = kwargs.pop("num_stages", 3)
    fp_fusion = kwargs.pop("enable_fp_fusion", None)
    # (16-bit dots ignore the precision: shown for fp32 launches only)
    fp32 = bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32
    precision = kwargs.get("DOT_PRECISION") if fp32 else None
    # each tensor once: a launcher may pass one tensor for two pointers (an unused optional input); a host-made
    # TMA descriptor moves its tensor (its .base)
    tensors = [getattr(a, "base", a) for a in args]
    moved = sum(_nbytes(a) for a in {id(a): a for a in tensors if isinstance(a, torch.Tensor)}.values())
    return Launch(kernel_label, case, fn, tuple(args), kwargs, warps, stages, moved, flops, precision, fp_fusion)


def representative_launches(quick: bool = False, arch: str = "sm_90") -> list[Launch]:
    """Every registered op's SASS cases (``kernels/_registry.py``), each at its launcher's configuration for
    ``arch``: the launch is captured on meta tensors and becomes one :class:`Launch` per registered row.

    Elementwise ops: 4096 rows × hidden 768 / 4096 / 8192 / 16384 (``quick``: 4096 only), bf16 and fp32
    (``quick``: bf16). Attention: batch 1 × 16 heads × seq 4096, d 64 / 128, causal, forward and each backward
    kernel (``quick``: bf16 only); then, bf16 d 128, GQA, TMA, packed documents, a sliding window, and split-KV
    decoding with its combine kernel.
    """
    from .kernels import _registry

    cap = ARCHS[arch]  # launch heuristics may differ per architecture
    out: list[Launch] = []
    for op in _registry.ops():
        for case in op.sass_cases(quick) if op.sass_cases else ():
            with case.context():
                calls = capture(case.run, cap)
            for row in case.launches:
                launch = _to_launch(row.kernel, case.case, calls[row.index], flops=row.flops)
                if case.bytes_moved is not None:
                    launch.bytes_moved = case.bytes_moved
                launch.shipped = case.shipped
                if row.per_iteration is not None:
                    launch.unit, launch.per_warp = row.unit, row.per_warp
                    launch.units_per_iteration = row.per_iteration(launch.constexprs)
                out.append(launch)
    return out


# ----------------------------------------------------------------------------------------------------
# compiling and reading SASS
# ----------------------------------------------------------------------------------------------------
def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} not found in the Triton wheel ({path})")
    return path


def _specialise(launch: Launch):
    """(signature, constexprs, attrs) as Triton's JIT would build them for these arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = launch.fn.params
    signature, constexprs, attrs = {}, {}, {}
    args = list(launch.args)
    for i, p in enumerate(params):
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = launch.constexprs[name] if name in launch.constexprs else args[i]
            continue
        value = args[i] if i < len(args) else launch.constexprs[name]
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if ty == "constexpr":
            signature[name] = "constexpr"
            constexprs[name] = value
            continue
        signature[name] = ty
        if spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _sass_counts(sass: str) -> dict:
    # (opcode and its modifiers: wgmma shapes are lower-case, "HGMMA.64x32x8.F32.TF32")
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,5}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]+)", sass, re.M)
    counts: Counter = Counter()
    for op in ops:
        base = op.split(".")[0]
        if base in ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "UBLKCP", "LDL", "STL", "LDS", "STS", "FFMA", "REDG",
                    "ATOMG", "RED", "ATOM", "MEMBAR", "FMUL", "FADD"):
            counts[base] += 1
            if base in ("HGMMA", "HMMA") and "TF32" in op.split("."):
                counts["TF32"] += 1  # tensor-core MMAs on TF32 operands (10-bit mantissas): never on IEEE rows
            if base == "LDGSTS" and "128" in op.split("."):
                counts["LDGSTS.128"] += 1  # 128-bit async copies (a pipelined loop's vectorised loads)
        elif base in ("LDG", "STG"):
            parts = op.split(".")
            width = "32"
            for tag in parts[1:]:
                if tag in ("128", "64"):
                    width = tag
                elif tag in ("U16", "S16"):
                    width = "16"
                elif tag in ("U8", "S8"):
                    width = "8"
            counts[f"{base}.{width}"] += 1
    return dict(sorted(counts.items()))


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]+)([^;]*);", re.M)


def sass_loops(sass: str) -> list[tuple[int, int]]:
    """The loops of one kernel's SASS as ``(first, last)`` instruction addresses: a branch back to an earlier
    address closes a loop from its target to itself (a branch to itself, the trap after EXIT, is none)."""
    loops = []
    for m in _SASS_LINE.finditer(sass):
        address, op, operands = int(m.group(1), 16), m.group(2), m.group(3)
        if op.split(".")[0] != "BRA":
            continue
        target = re.search(r"0x([0-9a-f]+)", operands)
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    return loops


def loop_figures(sass: str) -> tuple[int, list[int], int]:
    """``(main, innermost, all)``: instructions of the main loop (the first innermost loop in program order),
    of every innermost loop (none nested inside it), and of all loops counted once (the outermost ones). SASS
    instructions are 16 bytes apart."""
    loops = sass_loops(sass)
    size = lambda lo, hi: (hi - lo) // 16 + 1  # noqa: E731
    inner = sorted((lo, hi) for lo, hi in loops
                   if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in loops))
    outer = [(lo, hi) for lo, hi in loops if not any((a, b) != (lo, hi) and a <= lo and hi <= b for a, b in loops)]
    sizes = [size(lo, hi) for lo, hi in inner]
    return (sizes[0] if sizes else 0), sizes, sum(size(lo, hi) for lo, hi in set(outer))


@functools.cache
def _compile_cached(fn, sig_items, const_items, attr_items, arch: int, num_warps: int, num_stages: int,
                    fp_fusion: bool | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=dict(sig_items), constexprs=dict(const_items),
                    attrs={k: [list(x) for x in v] for k, v in attr_items})
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if fp_fusion is not None:
        options["enable_fp_fusion"] = fp_fusion
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    cubin = compiled.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)
    return usage, sass, int(compiled.metadata.shared)


#: Per-SM limits for the occupancy estimate: (registers, shared memory bytes usable by CTAs, threads, CTAs)
SM_LIMITS = {90: (65536, 228 * 1024, 2048, 32), 80: (65536, 164 * 1024, 2048, 32)}


def ctas_per_sm(arch: int, registers: int, num_warps: int, smem_bytes: int) -> int:
    """Resident CTAs per SM allowed by registers (allocated per warp in 256-register units), shared memory
    (the launch's dynamic + static bytes, plus the 1 KB the driver reserves per CTA), threads and the CTA cap."""
    regs_sm, smem_sm, threads_sm, cta_cap = SM_LIMITS[arch]
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = regs_sm // max(1, regs_per_warp * num_warps)
    by_smem = smem_sm // (smem_bytes + 1024)
    return max(0, min(by_regs, by_smem, threads_sm // (32 * num_warps), cta_cap))


def _per_unit(instructions: int, launch: Launch) -> float | None:
    if not launch.units_per_iteration or not instructions:
        return None
    return round(instructions * (launch.num_warps if launch.per_warp else 1) / launch.units_per_iteration, 3)


def analyze(launch: Launch, arch: str, sass_dir: str | None = None) -> Row:
    """Compile one captured launch for ``arch`` (``sm_90``/``sm_80``) and summarise its cubin; with ``sass_dir``
    its SASS is written to a file of its own there (named in the row's ``sass_file``)."""
    # (a peer's launcher may pass every argument by keyword: its constexpr parameters only)
    constexpr_names = {p.name for p in getattr(launch.fn, "params", ()) if p.is_constexpr}
    cfg = ", ".join(f"{k}={v}" for k, v in launch.constexprs.items()
                    if (k.isupper() or (launch.peer and k in constexpr_names)) and k != "DOT_PRECISION")
    cfg = f"{cfg}, warps={launch.num_warps}, stages={launch.num_stages}" + (
        f", dot={launch.dot_precision}" if launch.dot_precision else "")
    roof = {gpu: round(max(launch.bytes_moved / bw, launch.flops / peak) * 1e6, 2)
            for gpu, (bw, peak) in ROOFLINE.items()}
    row = Row(launch.kernel, launch.case, arch, cfg, 0, 0, 0, bytes_moved=launch.bytes_moved,
              flops=launch.flops, roofline_us=roof, unit=launch.unit, shipped=launch.shipped, peer=launch.peer,
              compare_to=launch.compare_to)
    sig, const, attrs = _specialise(launch)
    fn = launch.fn.fn if hasattr(launch.fn, "fn") and not hasattr(launch.fn, "params") else launch.fn
    try:
        usage, sass, dynamic_smem = _compile_cached(fn, tuple(sig.items()), tuple(const.items()),
                                      tuple((k, tuple(tuple(x) for x in v)) for k, v in attrs.items()),
                                      ARCHS[arch], launch.num_warps, launch.num_stages, launch.fp_fusion)
    except Exception as e:  # a kernel that does not compile is a row with its error, and a failed test
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return row
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", usage)
    if m:
        # spilled registers live in the per-thread stack frame (STACK) or local memory (LOCAL)
        row.registers, row.shared_bytes = int(m.group(1)), int(m.group(3))
        row.spill_bytes = int(m.group(2)) + int(m.group(4))
    # the dynamic shared memory a launch requests (pipelining buffers, layout conversions): Triton's own figure
    row.dynamic_smem_bytes = dynamic_smem
    row.ctas_per_sm = ctas_per_sm(ARCHS[arch], row.registers, launch.num_warps, dynamic_smem + row.shared_bytes)
    row.sass = _sass_counts(sass)
    row.loop_instructions, row.loops, row.all_loop_instructions = loop_figures(sass)
    row.instructions_per_unit = _per_unit(row.loop_instructions, launch)
    row.all_loops_per_unit = _per_unit(row.all_loop_instructions, launch)
    if sass_dir is not None:
        name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{launch.kernel}__{launch.case}__{arch}")[:180] + ".sass"
        os.makedirs(sass_dir, exist_ok=True)
        path = os.path.join(sass_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"// {launch.kernel} | {launch.case} | {arch} | {cfg}\n{sass}")
        row.sass_file = path
    return row


# ----------------------------------------------------------------------------------------------------
# peers: Liger-Kernel's kernels at the same shapes, through the same capture and compile path
# ----------------------------------------------------------------------------------------------------
def peer_launches(arch: str = "sm_90") -> list[Launch]:
    """Liger-Kernel's RMSNorm (forward, backward), SwiGLU (forward, backward), RoPE and cross-entropy kernels when it
    is installed (else none), each captured from its own launcher at the shape of the tritonlm row it stands beside
    (bf16): 4096 x 4096 norms and gates, q and k of 1 x 4096 x 32 x 128, 4096 tokens x 128256 logits."""
    try:
        from importlib.metadata import version

        from liger_kernel.ops import cross_entropy, rms_norm, rope, swiglu
        from liger_kernel.ops.utils import calculate_settings
    except ImportError:
        return []
    peer = f"liger-kernel {version('liger-kernel')}"
    meta, bf16 = torch.device("meta"), torch.bfloat16
    x = torch.empty(4096, 4096, dtype=bf16, device=meta)
    w = torch.empty(4096, dtype=bf16, device=meta)
    rstd = torch.empty(4096, dtype=torch.float32, device=meta)
    block, warps = calculate_settings(4096)
    q = torch.empty(1, 4096, 32 * 128, dtype=bf16, device=meta).unflatten(-1, (32, 128)).transpose(1, 2)
    cos = torch.empty(1, 4096, 128, dtype=bf16, device=meta)
    # (its cross-entropy reads the targets on the host: real CPU tensors, the logits never touched)
    logits = torch.empty(4096, 128256, dtype=bf16)
    targets = torch.zeros(4096, dtype=torch.int64)
    cases = [
        ("liger.rmsnorm.fwd", "rmsnorm.fwd", "4096x4096 bf16",
         lambda: rms_norm.rms_norm_forward(x, w, 1e-6, 0.0, "llama", None), ("element", None, True)),
        ("liger.rmsnorm.bwd", "rmsnorm.bwd", "4096x4096 bf16",
         lambda: rms_norm.rms_norm_backward(x, x, w, rstd, 0.0, "llama", block, warps, False, None),
         ("element", None, True)),
        ("liger.swiglu.fwd", "swiglu.fwd", "4096x4096 bf16", lambda: swiglu.swiglu_forward(x, x),
         ("element", None, True)),
        ("liger.swiglu.bwd", "swiglu.bwd", "4096x4096 bf16", lambda: swiglu.swiglu_backward(x, x, x),
         ("element", None, True)),
        ("liger.rope.fwd", "rope.fwd", "q,k 1x4096x32x128 bf16", lambda: rope.rope_forward(q, q, cos, cos),
         ("element", None, True)),
        ("liger.cross_entropy.fwd+grad", "cross_entropy.fwd+grad", "4096x128256 bf16",
         lambda: cross_entropy.cross_entropy_forward(logits, targets, None, -100, 0.0, 0.0, "mean", None, False),
         ("logit", "BLOCK_SIZE", True)),
    ]
    out = []
    for label, ours, case, thunk, (unit, per_iteration, per_warp) in cases:
        calls = capture(thunk, ARCHS[arch])
        launch = _to_launch(label, case, calls[0])
        launch.peer, launch.compare_to, launch.unit, launch.per_warp = peer, ours, unit, per_warp
        if per_iteration is not None:
            launch.units_per_iteration = int(launch.constexprs[per_iteration])
        out.append(launch)
    return out


def run_report(archs=("sm_90", "sm_80"), quick: bool = False, progress: bool = False,
               sass_dir: str | None = None, peers: bool = True) -> list[Row]:
    from tqdm.auto import tqdm

    jobs = [(launch, arch) for arch in archs for launch in representative_launches(quick, arch)]
    if peers:
        jobs += [(launch, arch) for arch in archs for launch in peer_launches(arch)]
    return [analyze(launch, arch, sass_dir) for launch, arch in tqdm(jobs, desc="compile", disable=not progress)]


def format_markdown(rows: list[Row], title: str = "Kernel SASS report") -> str:
    import triton

    lines = [f"# {title}", "",
             "Static analysis, not measured speed: each kernel compiled with `triton.compile` for the target at "
             "the configuration its launcher picks, specialised like the JIT (16-byte divisibility), and its "
             "cubin read with `cuobjdump`. Dynamic smem is what each launch requests (Triton's metadata); CTAs/SM "
             "is the occupancy those registers and shared memory allow (sm_90: 64K registers, 228 KB; sm_80: 64K, "
             "164 KB; 1 KB reserved per CTA). Regenerate with `tritonlm kernels --report --markdown "
             "profiles/sass/REPORT.md`.", "",
             f"Triton {triton.__version__}, torch {torch.__version__}. Roofline: compulsory HBM bytes / bandwidth "
             "or FLOPs / 989 TFLOP/s, whichever is larger (H100 3.35 TB/s, H200 4.8 TB/s); attention FLOPs count "
             "the causal half.", "",
             "Main loop: the instructions of the kernel's first innermost loop (its steady-state tiles; every loop "
             "the SASS holds in brackets, each counted once) and per unit of work: per key for attention (as one "
             "warp issues them, for the tile's query rows), warp-instructions per logit / element / token for the "
             "others and per thousand multiply-adds (kMAC) for the MoE grouped GEMMs. "
             "Rows marked *alt* are sweep alternatives (evidence, not launched by default).", "",
             "| kernel | case | arch | config | regs | smem (static) | dynamic smem | CTAs/SM | spill (stack+local) "
             "| tensor-core | global loads | global stores | async copies | main loop (all loops) | per unit "
             "| roofline H100 / H200 (µs) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ours_rows = [r for r in rows if not r.peer]
    peer_rows = [r for r in rows if r.peer]
    for r in ours_rows:
        if r.error:
            lines.append(f"| {r.kernel} | {r.case} | {r.arch} | {r.config} | **compile error**: {r.error} "
                         "| | | | | | | | | | | |")
            continue
        tc = ", ".join(f"{k} {v}" for k, v in r.sass.items() if k in ("HGMMA", "HMMA", "TF32")) or "-"
        ld = ", ".join(f"{k.split('.')[1]}b×{v}" for k, v in r.sass.items() if k.startswith("LDG.")) or "-"
        st = ", ".join(f"{k.split('.')[1]}b×{v}" for k, v in r.sass.items() if k.startswith("STG.")) or "-"
        asy = ", ".join(f"{k} {v}" for k, v in r.sass.items() if k in ("LDGSTS", "UTMALDG", "UBLKCP")) or "-"
        spill = f"{r.spill_bytes} B" + (f" (LDL {r.sass.get('LDL', 0)}, STL {r.sass.get('STL', 0)})"
                                       if r.spill_bytes else "")
        loops = f"{r.loop_instructions} ({r.all_loop_instructions})" if r.loops else "-"
        unit = (f"{r.instructions_per_unit} / {r.unit} ({r.all_loops_per_unit})"
                if r.instructions_per_unit is not None else "-")
        kernel = r.kernel if r.shipped else f"{r.kernel} *alt*"
        lines.append(f"| {kernel} | {r.case} | {r.arch} | {r.config} | {r.registers} | {r.shared_bytes} | "
                     f"{r.dynamic_smem_bytes} | {r.ctas_per_sm} | {spill} | {tc} | {ld} | {st} | {asy} | {loops} | "
                     f"{unit} | {r.roofline_us['H100']} / {r.roofline_us['H200']} |")
    if peer_rows:
        lines += _peer_section(ours_rows, peer_rows)
    return "\n".join(lines) + "\n"


def _peer_section(ours_rows: list[Row], peer_rows: list[Row]) -> list[str]:
    """Each peer kernel beside the tritonlm row it stands for (same case and arch), compiled in the same run."""
    lines = ["", f"## Peers: {peer_rows[0].peer}, compiled the same way in the same run", "",
             "Each peer kernel captured from its own launcher at the same shape and compiled with the same options; "
             "\"per unit\" counts the main loop (every loop in brackets) as above, \"-\" where a kernel has no loop. "
             "Ratios are tritonlm / peer.", "",
             "| tritonlm kernel | peer kernel | case | arch | regs (tritonlm / peer) | CTAs/SM | spill | per unit "
             "(tritonlm / peer) | all loops per unit |",
             "|---|---|---|---|---|---|---|---|---|"]

    def unit(r: Row, value):
        return "-" if value is None else f"{value}/{r.unit}"

    for p in peer_rows:
        ours = next((r for r in ours_rows if r.kernel == p.compare_to and r.case.startswith(p.case.split(" bf16")[0])
                     and r.arch == p.arch and r.case.endswith("bfloat16")), None)
        if ours is None or p.error or ours.error:
            lines.append(f"| {p.compare_to} | {p.kernel} | {p.case} | {p.arch} | {p.error or 'no tritonlm row'} "
                         "| | | | |")
            continue
        lines.append(f"| {ours.kernel} | {p.kernel} | {p.case} | {p.arch} | {ours.registers} / {p.registers} | "
                     f"{ours.ctas_per_sm} / {p.ctas_per_sm} | {ours.spill_bytes} / {p.spill_bytes} B | "
                     f"{unit(ours, ours.instructions_per_unit)} / {unit(p, p.instructions_per_unit)} | "
                     f"{unit(ours, ours.all_loops_per_unit)} / {unit(p, p.all_loops_per_unit)} |")
    return lines
