"""Shared launcher helpers: where a kernel may run, shape flattening, GPU facts."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import triton

#: Whether Triton's interpreter was switched on before Triton was imported (it decides at decoration time).
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: Set while the SASS report captures launches on meta tensors: launchers then pick their GPU
#: configurations for this compute capability (90: H100/H200, 80: A100) although no GPU is present.
_ASSUME_GPU = contextvars.ContextVar("tritonlm_assume_gpu", default=None)
ASSUMED_SM_COUNT = 132  # H100/H200 SXM


@contextlib.contextmanager
def assume_gpu_target(capability: int = 90):
    token = _ASSUME_GPU.set(capability)
    try:
        yield
    finally:
        _ASSUME_GPU.reset(token)


def on_gpu(device: torch.device) -> bool:
    """Whether launch heuristics should choose GPU configurations for tensors on ``device``."""
    return device.type == "cuda" or _ASSUME_GPU.get() is not None


def gpu_capability(device: torch.device) -> int:
    """Compute capability as an int (90 for sm_90), of the device or of the assumed target."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return _ASSUME_GPU.get() or 90


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; nothing else."""
    first = tensors[0].device
    for t in tensors:
        if t.device != first:
            raise ValueError(f"{op}: all tensors must be on one device, got {first} and {t.device}")
    if first.type in ("cuda", "meta"):  # meta: shape-only runs (activation accounting)
        return
    if first.type == "cpu" and INTERPRETING:
        return
    if first.type == "cpu":
        raise RuntimeError(
            f"{op}: the Triton kernels need CUDA tensors. To run them on CPU (slowly, for testing) set "
            "TRITON_INTERPRET=1 before Triton is imported; or use backend='reference'.")
    raise RuntimeError(f"{op}: unsupported device {first} (Triton kernels run on CUDA)")


def use_custom_op(x: torch.Tensor) -> bool:
    """Route through the ``torch.library`` custom ops (rather than launching directly) while
    torch.compile traces, and for meta tensors, whose shapes the ops' fake implementations give."""
    return torch.compiler.is_compiling() or x.device.type == "meta"


def check_float(op: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in _TRITON_DTYPES:
            raise TypeError(f"{op}: expected float32, float16 or bfloat16 tensors, got {t.dtype}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x[..., n]`` as ``[rows, n]`` with a unit column stride, copying only when no view exists."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


def as_4d(x: torch.Tensor) -> torch.Tensor:
    """View ``x[..., seq, d]`` as ``[batch, heads, seq, d]`` with a unit last stride.

    The two leading strides are kept separate so that ``[batch, heads, seq, d]`` views of a
    ``[batch, seq, heads*d]`` projection need no copy; only leading dims beyond two are collapsed.
    """
    if x.dim() < 2:
        raise ValueError(f"expected at least [seq, d], got {tuple(x.shape)}")
    while x.dim() < 4:
        x = x.unsqueeze(0)
    if x.dim() > 4:
        try:
            x = x.view(-1, *x.shape[-3:])
        except RuntimeError:
            x = x.reshape(-1, *x.shape[-3:])
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return x


#: CUDA launches at most 65535 programs along grid axes 1 and 2 (axis 0: 2**31 - 1).
MAX_GRID_AXIS1 = 65535


def grid_axis1_launches(n_programs: int) -> list[tuple[int, int]]:
    """``(start, count)`` per launch covering ``n_programs`` on grid axis 1 within CUDA's limit; the kernel adds
    ``start`` to ``tl.program_id(1)``. One launch unless batch x heads exceeds 65535."""
    return [(start, min(MAX_GRID_AXIS1, n_programs - start)) for start in range(0, n_programs, MAX_GRID_AXIS1)]


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_persistent_programs(x: torch.Tensor, n_blocks: int, per_sm: int = 4) -> int:
    """Programs for a grid-stride loop: enough to fill the GPU, never more than the work."""
    if x.device.type == "cuda":
        return max(1, min(n_blocks, per_sm * sm_count(x.device.index or 0)))
    if _ASSUME_GPU.get() is not None:
        return max(1, min(n_blocks, per_sm * ASSUMED_SM_COUNT))
    return max(1, min(n_blocks, 4))  # interpreter: programs run one after another anyway


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def install_interpreter_bf16_dot_shim() -> bool:
    """Make the interpreter's ``tl.dot`` correct on bfloat16 operands, and its fp32 -> bf16 casts round as GPUs do.

    The interpreter keeps bf16 values as raw uint16 bit patterns and its dot multiplies those patterns
    (triton-lang/triton#11584). The shim widens bf16 operands to fp32 before the matmul, which is what
    the GPU's tensor cores compute (bf16 products accumulated in fp32). Its fp32 -> bf16 cast truncates; the shim
    rounds to nearest even, as the GPU's conversion does. Only touches the interpreter.
    """
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover
        return False
    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "_tritonlm_bf16_shim", False):
        return True
    original = builder.create_dot
    tl = interp.tl
    np = interp.np

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            def widen(h):
                if h.dtype.scalar != tl.bfloat16:
                    return h
                # a bf16 bit pattern is the top half of the fp32 with the same value
                data = (h.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
                return interp.TensorHandle(data, tl.float32)

            a, b = widen(a), widen(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._tritonlm_bf16_shim = True
    builder.create_dot = create_dot

    # fp32 -> bf16 casts (``x.to(tl.bfloat16)``): the interpreter truncates the mantissa (rounds toward zero); GPUs
    # round to nearest even, which halves the rounding error of every bf16 result a kernel stores
    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            out = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)
            return interp.TensorHandle(out, dst_type.scalar)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    return True


def install_interpreter_index_shim() -> bool:
    """Let the interpreter use a scalar computed in a kernel as a Python index (``range(lo, hi)`` bounds made with
    ``tl.maximum`` / ``tl.where``, as the attention launchers' key ranges are).

    The interpreter holds scalars as one-element 1-D arrays, and Triton 3.6's ``tensor.__index__`` is
    ``int(array)``, which NumPy 2 refuses for anything but 0-D arrays ("only 0-dimensional arrays can be
    converted to Python scalars"); later Triton squeezes the array first. The shim installs the squeezing form on
    every interpreted launch. Only touches the interpreter.
    """
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover
        return False
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:  # a Triton whose interpreter patches tensors another way: nothing to fix here
        return False
    if getattr(original, "_tritonlm_index_shim", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._tritonlm_index_shim = True
    interp._patch_lang_tensor = patch_lang_tensor
    return True


def first_order_backward(backward):
    """Decorate an ``autograd.Function.backward`` written with kernels that have no backward of their own:
    under ``create_graph=True`` (double backward, gradient penalties) it raises instead of returning gradients
    that would silently miss their second-order terms. A plain backward runs as before (grad mode off)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(f"{type(ctx).__name__.removesuffix('Backward')}: double backward (create_graph=True) "
                               "is not supported by the Triton kernels; use backend='reference' for higher-order "
                               "gradients")
        return backward(ctx, *grads)

    return wrapper


@contextlib.contextmanager
def capture_launches(keep: bool = True):
    """Inside the block every compiled ``kernel[grid](...)`` call is recorded as ``(kernel, args, kwargs)`` instead of
    run (``keep=False``: skipped, holding no reference to its arguments). The SASS report compiles what it
    records; the memory counter skips launches on meta tensors."""
    from triton.runtime.jit import JITFunction

    calls = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if keep:
            calls.append((self, args, kwargs))
        return None

    JITFunction.run = run
    try:
        yield calls
    finally:
        JITFunction.run = original


def dot_precision(dtype: torch.dtype) -> dict:
    """The ``DOT_PRECISION`` constexpr every ``tl.dot`` of a matmul kernel (attention, MoE) takes as ``input_precision`` (the compile option
    ``default_dot_input_precision`` does not reach ``tl.dot``: measured, fp32 dots compiled with it "ieee" were
    still TF32 on sm_80/sm_90). For fp32 inputs PyTorch's fp32 matmul precision decides, as for its own matmuls
    ("highest", the default: IEEE fp32; "high"/"medium": TF32 tensor cores); 16-bit dots ignore it."""
    if dtype != torch.float32:
        return {"DOT_PRECISION": "tf32"}
    return {"DOT_PRECISION": "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"}
