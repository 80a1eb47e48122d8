"""Launch variants and tuned tables: the GPU tile tables and the atomic-dQ backward run in the interpreter against
fp64, the tuned-table loader falls back and refuses bad files, SwiGLU's in-place backward saves memory."""

import importlib
import json

import pytest
import torch
import torch.nn.functional as F

from tritonlm.kernels import flash_attention, rms_norm, swiglu_gate, tuned
from tritonlm.kernels.attention import launch as FA

from helpers import cpu_only, tolerance

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _sdpa64(q, k, v, is_causal):
    """fp64 reference via PyTorch's own SDPA (GQA by repeating k/v heads; bottom-right causal mask)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    kk, vv = (t.repeat_interleave(group, dim=-3) for t in (k64, v64))
    mask = None
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
    return (q64, k64, v64), F.scaled_dot_product_attention(q64, kk, vv, attn_mask=mask)


def _compare(q, k, v, is_causal, dtype, **kw):
    out = flash_attention(q, k, v, is_causal, **kw)
    grad = torch.randn_like(out)
    out.backward(grad)
    (q64, k64, v64), ref = _sdpa64(q, k, v, is_causal)
    ref.backward(grad.double())
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=2 * tol, rtol=2 * tol)


def _qkv(batch, heads, kv_heads, n_q, n_k, d, dtype):
    return (torch.randn(batch, heads, n_q, d).to(dtype).requires_grad_(),
            torch.randn(batch, kv_heads, n_k, d).to(dtype).requires_grad_(),
            torch.randn(batch, kv_heads, n_k, d).to(dtype).requires_grad_())


# ----------------------------------------------------------------------------------------------------
# the atomic-dQ backward (opt-in, non-deterministic)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,n_q,n_k,is_causal", [(2, 2, 37, 37, True), (4, 2, 19, 50, True),
                                                              (3, 1, 33, 21, False)])
def test_atomic_dq_backward_vs_fp64(dtype, heads, kv_heads, n_q, n_k, is_causal):
    _compare(*_qkv(2, heads, kv_heads, n_q, n_k, 16, dtype), is_causal, dtype, deterministic=False)


def test_atomic_dq_backward_varlen_and_window():
    from tritonlm.kernels import FlashAttention

    lens = [5, 17, 0, 33]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lens)
    q, k, v = (torch.randn(total, 4, 16, requires_grad=True) for _ in range(3))
    grads = []
    for deterministic in (True, False):
        out = FlashAttention.apply(q, k, v, True, None, (7, 0), cu, cu, max(lens), max(lens), deterministic)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.cos(torch.arange(out.numel()).view(out.shape) * 1.0)))
    for det, atomic in zip(*grads):  # the deterministic path is itself checked against fp64 elsewhere
        torch.testing.assert_close(atomic, det, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# the GPU launch tables, run in the interpreter at small shapes (CPU runs otherwise use 32x32 tiles)
# ----------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.float16), (32, torch.float32), (80, torch.bfloat16)])
def test_gpu_attention_tables_in_interpreter(arch, d, dtype):
    from tritonlm.kernels._common import assume_gpu_target

    with assume_gpu_target(arch):
        fwd, bwd = FA._fwd_config(d, dtype, torch.device("cpu")), FA._bwd_config(d, dtype, torch.device("cpu"))
        assert fwd != FA.INTERPRETER_CONFIG and bwd != FA.INTERPRETER_CONFIG  # the GPU tables really apply
        # several query and key tiles of the GPU sizes, a ragged last one, GQA
        _compare(*_qkv(1, 2, 1, 150, 150, d, dtype), True, dtype)


@cpu_only
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_cross_entropy_launch_in_interpreter(arch, dtype):
    """The loss's GPU launch (16K-wide tiles, pass 1 through its load pipeline) at a vocabulary of five whole tiles
    and a ragged one, loss and gradient against F.cross_entropy in fp64; the pipeline's buffers keep two CTAs off
    an SM there, and a one-tile vocabulary gets no deeper pipeline than its loop."""
    from tritonlm.kernels import cross_entropy
    from tritonlm.kernels import cross_entropy_loss as CE
    from tritonlm.kernels._common import assume_gpu_target

    vocab = 5 * 16384 + 1234
    with assume_gpu_target(arch):
        cfg = CE._launch_config(vocab, dtype, torch.device("cpu"))
        assert (cfg["BLOCK_V"], cfg["num_warps"]) == (16384, 32)
        buffers = (cfg["LOAD_STAGES"] - 1) * 16384 * dtype.itemsize
        assert buffers > {90: 114, 80: 82}[arch] * 1024, cfg
        assert CE._launch_config(16384 + 1234, dtype, torch.device("cpu"))["LOAD_STAGES"] == 2
        logits = (4 * torch.randn(3, vocab)).to(dtype).requires_grad_()
        targets = torch.tensor([5, vocab - 1, 70000])
        loss = cross_entropy(logits, targets)
        loss.backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, **tolerance(dtype))
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, **tolerance(dtype))


@cpu_only
@pytest.mark.parametrize("n_q,n_k,is_causal", [(70, 90, True), (130, 45, True), (33, 140, False)])
def test_sm90_default_tma_forward_on_flash_attn_layout(n_q, n_k, is_causal, monkeypatch):
    """sm_90's default d 128 bf16 forward, as flash_attn_func reaches it: [batch, seq, heads, d] tensors (descriptors
    over transposed views), GQA, more keys than queries and fewer (rows that see no key), against SDPA in fp64; the
    TMA kernel is the one launched."""
    from tritonlm.kernels import flash_attn_func
    from tritonlm.kernels._common import assume_gpu_target

    launched, kernel = [], FA._fwd_kernel_tma
    monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **kw: launched.append(1) or _run(*a, **kw))
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in _qkv(2, 4, 2, n_q, n_k, 128, torch.bfloat16))
    with assume_gpu_target(90):
        out = flash_attn_func(q, k, v, causal=is_causal)
    assert launched
    (q64, k64, v64), ref = _sdpa64(*(t.transpose(1, 2) for t in (q, k, v)), is_causal)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@cpu_only
def test_tma_forward_is_the_sm90_default_at_d128_only():
    """sm_90, fp16 / bf16, d 128 (97-128 wide): the forward loads through TMA by default (SASS: fewer instructions
    per key, and spill-free with the GPU machine's Triton 3.6 where the cp.async kernel spills); d 64, fp32, sm_80
    and the backward keep the cp.async kernels; a tuned ``"TMA": 0`` turns the default off. The interpreter (no GPU
    target assumed) runs the cp.async kernel unless a table asks."""
    from tritonlm.kernels._common import assume_gpu_target

    cpu = torch.device("cpu")
    assert not FA._tma_selected(128, torch.bfloat16, cpu)
    with assume_gpu_target(90):
        for d, dtype in ((128, torch.bfloat16), (128, torch.float16), (100, torch.bfloat16)):
            assert FA._tma_selected(d, dtype, cpu), (d, dtype)
            assert FA._tma_selected(d, dtype, cpu, variant=("gqa",))
            assert not FA._tma_selected(d, dtype, cpu, "attention_bwd")
        for d, dtype in ((64, torch.bfloat16), (128, torch.float32), (256, torch.bfloat16)):
            assert not FA._tma_selected(d, dtype, cpu), (d, dtype)
        with tuned.override("attention_fwd", TMA=0):
            assert not FA._tma_selected(128, torch.bfloat16, cpu)
    with assume_gpu_target(80):
        assert not FA._tma_selected(128, torch.bfloat16, cpu)


@cpu_only
@pytest.mark.parametrize("n_cols", [768, 4096, 9000])
def test_gpu_elementwise_tables_in_interpreter(n_cols):
    """RMSNorm's launch rule at GPU widths (the row kept in registers, or chunked past 8192) and its dweight
    reduction over many partial rows, against F.rms_norm in fp64."""
    x = torch.randn(37, n_cols, dtype=torch.float64).float().requires_grad_()
    w = (1 + torch.randn(n_cols) / 4).requires_grad_()
    y = rms_norm(x, w, 1e-5)
    grad = torch.randn_like(y)
    y.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.rms_norm(x64, (n_cols,), w64, 1e-5)
    ref.backward(grad.double())
    torch.testing.assert_close(y.double(), ref, **tolerance(torch.float32))
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------
# tuned tables: lookup, fallback, refusal of bad files, overrides
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tuned, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuned, "_device_name", lambda device: "NVIDIA Test GPU 9000")
    tuned.load.cache_clear()
    yield tmp_path
    tuned.load.cache_clear()


SHIPPED = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
CUDA = torch.device("cuda")  # a device object only: choose() reads its type, the name comes from the stub


def _write(directory, table):
    (directory / "nvidia-test-gpu-9000.json").write_text(json.dumps(table), encoding="utf-8")


def test_tuned_table_used_for_its_gpu_and_shape(tuned_dir):
    assert tuned.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert tuned.choose("attention_fwd", "bf16-d128", CUDA, SHIPPED) == SHIPPED  # no file: shipped
    _write(tuned_dir, {"version": 1, "kernels": {"attention_fwd": {"bf16-d128": {"BLOCK_N": 128, "num_stages": 4}}}})
    tuned.load.cache_clear()
    assert tuned.choose("attention_fwd", "bf16-d128", CUDA, SHIPPED) == dict(SHIPPED, BLOCK_N=128, num_stages=4)
    assert tuned.choose("attention_fwd", "bf16-d64", CUDA, SHIPPED) == SHIPPED  # shape not swept: shipped
    assert tuned.choose("attention_fwd", "bf16-d128", torch.device("cpu"), SHIPPED) == SHIPPED  # not a GPU


@pytest.mark.parametrize("content,message", [
    ("{not json", "not readable JSON"),
    ({"version": 2, "kernels": {}}, "version"),
    ({"version": 1, "kernels": {"matmul": {}}}, "unknown kernel 'matmul'"),
    ({"version": 1, "kernels": {"attention_fwd": {"bf16-d128": {"BLOCK_K": 64}}}}, "unknown field 'BLOCK_K'"),
    ({"version": 1, "kernels": {"attention_fwd": {"bf16-d128": {"BLOCK_N": 96}}}}, "power of two"),
    ({"version": 1, "kernels": {"rms_norm": {"bf16-n4096": {"num_warps": 64}}}}, r"\[1, 32\]"),
    ({"version": 1, "kernels": {"swiglu": {"bf16": {"BLOCK": "1024"}}}}, "must be an int"),
    ({"version": 1, "kernels": {"attention_fwd": {"bf16-d128": {"TMA": 2}}}}, r"TMA = 2"),
    ({"version": 1, "kernels": {"rope": {"bf16-d128": {"TMA": 1}}}}, "unknown field 'TMA'"),
])
def test_malformed_tuned_table_is_an_error(tuned_dir, content, message):
    path = tuned_dir / "nvidia-test-gpu-9000.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    with pytest.raises(tuned.TunedTableError, match=message) as info:
        tuned.choose("attention_fwd", "bf16-d128", CUDA, SHIPPED)
    assert str(path) in str(info.value)


@cpu_only
def test_override_reaches_the_launchers_and_stays_correct():
    """What the sweep does: force a configuration; the kernels still agree with fp64 under it."""
    device = torch.device("cpu")
    with tuned.override("attention_fwd", BLOCK_M=64, BLOCK_N=16), tuned.override("attention_bwd", BLOCK_M=16,
                                                                                   BLOCK_N=64):
        assert FA._fwd_config(16, torch.float32, device)[:2] == (64, 16)
        assert FA._bwd_config(16, torch.float32, device)[:2] == (16, 64)
        _compare(*_qkv(1, 2, 2, 70, 70, 16, torch.float32), True, torch.float32)
    assert FA._fwd_config(16, torch.float32, device) == FA.INTERPRETER_CONFIG
    with pytest.raises(tuned.TunedTableError, match="BLOCK_S"):
        with tuned.override("attention_fwd", BLOCK_S=4):
            pass
    with tuned.override("swiglu", BLOCK=256, num_warps=2):
        a, b = torch.randn(3, 333), torch.randn(3, 333)
        torch.testing.assert_close(swiglu_gate(a, b), F.silu(a) * b, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# SwiGLU's in-place backward
# ----------------------------------------------------------------------------------------------------
def test_swiglu_inplace_backward_saves_memory_and_matches():
    from tritonlm.memory import peak_live_bytes
    from tritonlm.modules import fused

    def run(inplace: bool):
        torch.manual_seed(0)
        x = torch.randn(64, 32, requires_grad=True)
        w1, w3 = torch.randn(256, 32, requires_grad=True), torch.randn(256, 32, requires_grad=True)

        def step():
            h = swiglu_gate(x @ w1.t(), x @ w3.t(), inplace_backward=inplace)
            h.sum().backward()

        peak = peak_live_bytes(step)[1]
        return peak, x.grad.clone(), w1.grad.clone()

    peak_copy, gx, gw = run(False)
    peak_inplace, gx_in, gw_in = run(True)
    torch.testing.assert_close(gx_in, gx)
    torch.testing.assert_close(gw_in, gw)
    # da and db (two [64, 256] fp32 tensors) are no longer allocated beside a and b
    assert peak_inplace <= peak_copy - 64 * 256 * 4
    # the fused FFN uses it; a second backward through the same graph is refused, not silently wrong
    ffn = fused.SwiGLU(32, 64)
    out = ffn(torch.randn(5, 32)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward()


# ----------------------------------------------------------------------------------------------------
# RoPE: several heads per program share one cos/sin load; q and GQA k in one launch
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads_per_program", [None, 1, 2, 8, 64])
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_heads_per_program_and_gqa_in_one_launch(heads_per_program, layout):
    """Against an fp64 rotation built here from the same tables, forward and backward; q has 6 heads, k 2
    (a ragged last head group for HEADS = 4 or 8), odd sequence length, per-batch positions."""
    import contextlib

    from tritonlm.kernels import apply_rope, rope_tables

    cos, sin = rope_tables(10000.0, 16, 64)
    q = torch.randn(2, 6, 37, 16, requires_grad=True)
    k = torch.randn(2, 2, 37, 16, requires_grad=True)
    pos = torch.randint(0, 64, (2, 1, 37))

    def rotate64(x):
        c, s = cos[pos].double(), sin[pos].double()  # [2, 1, 37, 8]
        x = x.double()
        if layout == "half":
            a, b = x[..., :8], x[..., 8:]
            return torch.cat((a * c - b * s, b * c + a * s), dim=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)

    force = tuned.override("rope", HEADS=heads_per_program) if heads_per_program else contextlib.nullcontext()
    with force:
        q_out, k_out = apply_rope(q, k, pos, cos=cos, sin=sin, layout=layout)
        (2 * q_out.sum() + (k_out * k_out).sum()).backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    (2 * rotate64(q64).sum() + (rotate64(k64) ** 2).sum()).backward()
    torch.testing.assert_close(q_out.double(), rotate64(q64).detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out.double(), rotate64(k64).detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.grad.double(), k64.grad, atol=1e-5, rtol=1e-5)


def test_rope_per_head_positions_take_one_head_per_program():
    from tritonlm.kernels import apply_rope, rope_tables

    cos, sin = rope_tables(10000.0, 16, 64)
    q = torch.randn(1, 3, 9, 16)
    pos = torch.randint(0, 64, (1, 3, 9))  # a different position per head
    with tuned.override("rope", HEADS=8):
        out = apply_rope(q, None, pos, cos=cos, sin=sin)
    for h in range(3):
        torch.testing.assert_close(out[:, h], apply_rope(q[:, h], None, pos[:, h], cos=cos, sin=sin))
    with pytest.raises(ValueError, match="fewer heads"):
        apply_rope(q, torch.randn(1, 1, 9, 16), pos, cos=cos, sin=sin)


# ----------------------------------------------------------------------------------------------------
# the Hopper TMA kernels (descriptor loads): the forward is sm_90's 16-bit d 128 default, the backward a tuned choice
# ----------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,n_q,n_k,d,is_causal", [(2, 2, 70, 70, 16, True), (4, 2, 37, 53, 32, True),
                                                                (2, 1, 5, 40, 24, True), (3, 3, 33, 20, 16, False)])
def test_tma_attention_vs_fp64(dtype, heads, kv_heads, n_q, n_k, d, is_causal):
    """The TMA forward and backward: descriptor loads zero-fill rows and columns past the tensor (odd lengths,
    d 24 in a 32-wide box, GQA, more keys than queries and fewer)."""
    q, k, v = _qkv(2, heads, kv_heads, n_q, n_k, d, dtype)
    with tuned.override("attention_fwd", TMA=1), tuned.override("attention_bwd", TMA=1):
        assert FA._tma_selected(d, dtype, q.device) and FA._tma_selected(d, dtype, q.device, "attention_bwd")
        _compare(q, k, v, is_causal, dtype)
    assert not FA._tma_selected(d, dtype, q.device)  # the interpreter: only through a table entry


@cpu_only
def test_tma_forward_checks_its_grid_before_launching(monkeypatch):
    """More batch x heads than one launch holds: the TMA forward is not started (the default kernel runs, in
    several launches) instead of failing after a first launch. Its descriptors are made on the host and passed
    in: no kernel needs Triton's global scratch allocator (never set)."""
    import triton

    from tritonlm.kernels import _common as common
    monkeypatch.setattr(FA, "MAX_GRID_AXIS1", 2)  # so 2 x 3 heads need several launches
    monkeypatch.setattr(common, "MAX_GRID_AXIS1", 2)
    launches, allocators = [], []
    for name in ("_fwd_kernel_tma", "_fwd_kernel"):
        kernel = getattr(FA, name)
        monkeypatch.setattr(kernel, "run", lambda *a, _n=name, _r=kernel.run, **k: launches.append(_n) or _r(*a, **k))
    real_set = triton.set_allocator
    monkeypatch.setattr(triton, "set_allocator", lambda fn: allocators.append(fn) or real_set(fn))
    q, k, v = _qkv(2, 3, 3, 20, 20, 16, torch.float32)
    with tuned.override("attention_fwd", TMA=1):
        _compare(q, k, v, True, torch.float32)
        assert "_fwd_kernel_tma" not in launches and launches.count("_fwd_kernel") >= 3
        launches.clear()
        monkeypatch.setattr(FA, "MAX_GRID_AXIS1", 65535)
        monkeypatch.setattr(common, "MAX_GRID_AXIS1", 65535)
        for _ in range(2):
            FA.flash_attention_forward(q, k, v, True, 0.25)
    assert launches == ["_fwd_kernel_tma"] * 2 and allocators == []


# ----------------------------------------------------------------------------------------------------
# the GPU suite's sweep, smoke-run on CPU: every path, and a table the launchers accept
# ----------------------------------------------------------------------------------------------------
def _sweep_module(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    return importlib.import_module("sweep")


@cpu_only
def test_sweep_smoke_writes_a_valid_table(tmp_path, monkeypatch):
    from pathlib import Path

    sweep = _sweep_module(monkeypatch)
    result = sweep.run_sweep(torch.device("cpu"), tmp_path, smoke=True)
    # every candidate ran with the shipped results, and every case's key is one its launcher looked up
    assert [r for r in result["rows"] if "error" in r] == []
    rows = result["rows"]
    assert {r["kernel"] for r in rows} == set(tuned.FIELDS)  # every tunable kernel was timed
    # the attention variants under keys of their own, each kernel of the backward apart
    keys = {(r["kernel"], r["key"]) for r in rows}
    for variant in ("", "-gqa", "-varlen", "-window", "-softcap"):
        for kernel in ("attention_fwd", "attention_bwd", "attention_bwd_dq"):
            assert (kernel, "fp32-d16" + variant) in keys
    assert ("attention_bwd", "fp32-d16-atomic") in keys and ("attention_fwd", "fp32-d16-gqa-decode") in keys
    assert any('"TMA":1' in r["config"] for r in rows)  # the TMA forward competes
    table = json.loads(Path(result["table"]).read_text())
    tuned.validate(table, result["table"])  # what the launchers would read


@cpu_only
def test_sweep_refuses_a_key_the_launcher_does_not_read(tmp_path, monkeypatch):
    """A GQA step timed under the plain kernel's key: its winner would land where GQA launches never look, so
    the case is an error row and writes nothing (even with a candidate that would win)."""
    sweep = _sweep_module(monkeypatch)

    def make_step():
        q, k = torch.randn(1, 4, 40, 16), torch.randn(1, 1, 40, 16)
        return lambda: flash_attention(q, k, k, True)

    monkeypatch.setattr(sweep, "_cases", lambda device, smoke: [
        ("attention_fwd", "fp32-d16", make_step, [dict(BLOCK_M=16, BLOCK_N=16)])])
    result = sweep.run_sweep(torch.device("cpu"), tmp_path, smoke=True)
    errors = [r for r in result["rows"] if "error" in r]
    assert len(errors) == 1 and "wrong key" in errors[0]["error"] and "fp32-d16-gqa" in errors[0]["error"]
    assert result["entries"] == 0 and not [r for r in result["rows"] if "ms" in r]


@cpu_only
@pytest.mark.parametrize("call, kernel_keys", [
    (lambda q, k: flash_attention(q, q, q, True), {("attention_fwd", "fp32-d16"), ("attention_bwd", "fp32-d16"),
                                                   ("attention_bwd_dq", "fp32-d16")}),
    (lambda q, k: flash_attention(q, k, k, True), {("attention_fwd", "fp32-d16-gqa"), ("attention_bwd", "fp32-d16-gqa"),
                                                   ("attention_bwd_dq", "fp32-d16-gqa")}),
    (lambda q, k: flash_attention(q, q, q, True, softcap=30.0), {("attention_bwd", "fp32-d16-softcap")}),
    (lambda q, k: flash_attention(q, q, q, True, deterministic=False), {("attention_bwd", "fp32-d16-atomic")}),
])
def test_attention_launches_look_up_their_variant_key(call, kernel_keys):
    """Each kernel variant reads its own tuned entry: the keys every launch looks up, recorded."""
    q = torch.randn(1, 4, 40, 16, requires_grad=True)
    k = torch.randn(1, 2, 40, 16, requires_grad=True)
    with tuned.record_lookups() as seen:
        call(q, k).sum().backward()
    assert kernel_keys <= seen, seen
    attention = {key for kernel, key in seen if kernel.startswith("attention")}
    assert all(key.startswith("fp32-d16") for key in attention)
    assert FA.parse_key("bf16-d128-gqa-window") == (128, ("gqa", "window"), 128)
    assert FA.config_key(100, torch.bfloat16, ("window", "gqa")) == "bf16-d128-gqa-window"  # variants in order


def test_time_device_flushes_l2_before_every_timed_run(monkeypatch):
    """The sweep's timer: a flush precedes every timed call (none between a flush and its call), and the rounds
    fill the time target instead of a fixed few."""
    from tritonlm import benchmarking

    events = []
    monkeypatch.setattr(benchmarking, "_flush_l2", lambda device: events.append("flush"))
    times = benchmarking.time_device(lambda: events.append("run"), torch.device("cpu"), warmup=2, target_s=1e-9,
                                     min_rounds=7, max_rounds=9)
    assert len(times) == 7
    timed = events[3:]  # (warm-up runs and the estimate run are not timed and not flushed)
    assert events[:3] == ["run"] * 3 and timed == ["flush", "run"] * 7


@cpu_only
def test_sweep_refuses_a_candidate_with_other_results(tmp_path, monkeypatch):
    """A faster candidate whose outputs differ from the shipped launch's is an error row and never enters the
    table."""
    import contextlib

    sweep = _sweep_module(monkeypatch)
    active = []

    @contextlib.contextmanager
    def override(kernel, **cfg):
        active.append(cfg)
        yield
        active.pop()

    def make_step():
        x = torch.randn(8, 8)
        def step():  # looks up its key as a launcher would; the candidate computes something else
            tuned.choose("swiglu", "fp32", torch.device("cpu"), {})
            return x * (2.0 if active else 1.0)
        return step

    monkeypatch.setattr(sweep.tuned, "override", override)
    monkeypatch.setattr(sweep, "_cases", lambda device, smoke: [("swiglu", "fp32", make_step, [dict(BLOCK=512)])])
    result = sweep.run_sweep(torch.device("cpu"), tmp_path, smoke=True)
    errors = [r for r in result["rows"] if "error" in r]
    assert len(errors) == 1 and "wrong result" in errors[0]["error"] and result["entries"] == 0


@cpu_only
@pytest.mark.parametrize("fold", [0, 1])
def test_forward_scale_in_the_exponent_or_first_agree_with_fp64(fold):
    """FOLD_SCALE (shipped 1: the scale applied in the exponent's FMA after a max over raw products) and the
    sweep's alternative 0 (scores scaled first): both exact, with masked tiles, GQA, a window and decoding splits."""
    with tuned.override("attention_fwd", FOLD_SCALE=fold):
        _compare(*_qkv(1, 4, 2, 70, 90, 16, torch.float32), True, torch.float32)
        q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 2100, 16)  # split-KV decoding (>= 2048 keys)
        (q64, k64, _), ref = _sdpa64(q, k, k, True)
        torch.testing.assert_close(flash_attention(q, k, k, True).double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf")])
def test_attention_refuses_a_scale_that_is_not_positive(scale):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
        flash_attention(q, q, q, True, softmax_scale=scale)


@cpu_only
@pytest.mark.parametrize("stages", [1, 3])
def test_rms_norm_backward_row_pipeline_depths_agree_with_fp64(stages):
    """The backward's ROW_STAGES (shipped 2 for 16-bit rows; the sweep tries 1 and 3) over several row blocks per
    program: the same dx and dweight as F.rms_norm in fp64. (The interpreter runs the loop unpipelined, so on CPU
    this checks the launch path each depth takes; the pipelined SASS itself is checked in test_kernel_sass.py.)"""
    x = torch.randn(300, 768).to(torch.bfloat16).requires_grad_()
    w = (1 + torch.randn(768) / 4).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(300, 768).to(torch.bfloat16)
    with tuned.override("rms_norm", ROW_STAGES=stages):
        rms_norm(x, w, 1e-5).backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.rms_norm(x64, (768,), w64, 1e-5).backward(grad.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, **tolerance(torch.bfloat16))
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=0.5, rtol=2e-2)


@cpu_only
def test_sweep_times_every_case_before_any_alternative(tmp_path, monkeypatch):
    """Candidates run in rounds across cases: with time for only three runs, each of three cases has its shipped
    launch timed (and the alternatives are reported as skipped), rather than one case timed in depth."""
    sweep = _sweep_module(monkeypatch)
    runs = []

    def make_case(key):
        def make_step():
            x = torch.randn(4)

            def step():
                tuned.choose("swiglu", key, torch.device("cpu"), {})
                runs.append(key)
                return x
            return step
        return ("swiglu", key, make_step, [dict(BLOCK=256), dict(BLOCK=512)])

    monkeypatch.setattr(sweep, "_cases", lambda device, smoke: [make_case(k) for k in ("fp32", "fp16", "bf16")])
    started = []

    def time_left():  # enough for the three shipped launches only
        return 100.0 if len(started) < 3 else 0.0

    real = sweep._run_candidate
    monkeypatch.setattr(sweep, "_run_candidate", lambda case, *a: started.append(case["key"]) or real(case, *a))
    result = sweep.run_sweep(torch.device("cpu"), tmp_path, smoke=True, time_left=time_left)
    timed = [r for r in result["rows"] if "ms" in r]
    assert started == ["fp32", "fp16", "bf16"] and {r["key"] for r in timed} == {"fp32", "fp16", "bf16"}
    assert all(r["config"] == "shipped" for r in timed)
    skipped = [r for r in result["rows"] if "skipped" in r.get("error", "")]
    assert len(skipped) == 3 and all("1 of 3 configurations timed" in r["error"] for r in skipped)
