"""Fused losses (Triton, interpreter): cross_entropy on logits and linear_cross_entropy (LM head + loss), against
``F.cross_entropy`` and an fp64 recomputation of every option; peak memory of the head + loss on CPU."""


import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import cross_entropy, linear_cross_entropy
from tritonlm.kernels import linear_cross_entropy_loss as lce_module
from tritonlm.memory import peak_live_bytes
from tritonlm.modules import functional

from helpers import DTYPE_TOLERANCES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPTIONS = [  # (label_smoothing, z_loss, softcap)
    (0.0, 0.0, None), (0.1, 0.0, None), (0.0, 1e-3, None), (0.0, 0.0, 4.0), (0.2, 1e-2, 7.5)]


def _fp64_loss(logits, targets, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
               reduction="mean"):
    """The loss in fp64 from PyTorch's own ops: F.cross_entropy (smoothing, ignore_index) + z_loss · lse²."""
    z = logits.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    flat_z, flat_t = z.reshape(-1, z.shape[-1]), targets.reshape(-1)
    per_row = TF.cross_entropy(flat_z, flat_t, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="none")
    keep = flat_t != ignore_index
    per_row = per_row + torch.where(keep, z_loss * torch.logsumexp(flat_z, -1) ** 2, 0.0)
    if reduction == "none":
        return per_row.view(targets.shape)
    if reduction == "sum":
        return per_row.sum()
    return per_row.sum() / keep.sum().clamp(min=1)


def _targets(shape, vocab, ignore_every=5):
    t = torch.randint(0, vocab, shape)
    flat = t.view(-1)
    flat[::ignore_every] = -100
    return t


@pytest.fixture
def small_chunks(monkeypatch):
    """A few rows per chunk (a byte budget far below one row-multiple: the floor decides), so a test shape runs
    through several chunks."""
    monkeypatch.setattr(lce_module, "CHUNK_BYTES", 2400)
    monkeypatch.setattr(lce_module, "CHUNK_MIN_ROWS", 4)


# ----------------------------------------------------------------------------------------------------
# cross_entropy on logits
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("vocab", [7, 1000])
def test_cross_entropy_options_vs_fp64(vocab, options, reduction):
    label_smoothing, z_loss, softcap = options
    logits = (3 * torch.randn(3, 13, vocab)).requires_grad_()
    targets = _targets((3, 13), vocab)
    kw = dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction)
    loss = cross_entropy(logits, targets, **kw)
    x64 = logits.detach().double().requires_grad_()
    ref = _fp64_loss(x64, targets, **kw)
    assert loss.shape == ref.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(ref)
    (loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_cross_entropy_matches_torch_in_each_dtype(dtype, tol):
    # GPT-2's vocabulary (not a multiple of any tile), a few rows, and 3-D leading dims
    logits = torch.randn(2, 3, 50257).to(dtype).requires_grad_()
    targets = _targets((2, 3), 50257, ignore_every=4)
    loss = cross_entropy(logits, targets, label_smoothing=0.1)
    x32 = logits.detach().float().requires_grad_()
    ref = TF.cross_entropy(x32.view(-1, 50257), targets.view(-1), label_smoothing=0.1)
    ref.backward()
    loss.backward()
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad.float(), x32.grad, **tol)


def test_cross_entropy_all_ignored_is_zero_not_nan():
    logits = torch.randn(4, 9, requires_grad=True)
    targets = torch.full((4,), -100)
    for reduction in ("mean", "sum"):
        loss = cross_entropy(logits, targets, reduction=reduction, z_loss=1e-2)
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, logits)
        assert torch.equal(grad, torch.zeros_like(grad))
    assert torch.equal(cross_entropy(logits, targets, reduction="none"), torch.zeros(4))


def test_cross_entropy_large_logits_do_not_overflow():
    logits = torch.tensor([[1e4, -1e4, 0.0, 9999.0], [-1e4, -1e4, -1e4, -1e4]], requires_grad=True)
    targets = torch.tensor([3, 2])
    loss = cross_entropy(logits, targets, reduction="none")
    x64 = logits.detach().double().requires_grad_()
    ref = _fp64_loss(x64, targets, reduction="none")
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss.double(), ref, atol=1e-4, rtol=1e-6)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=1e-6, rtol=1e-6)


def test_cross_entropy_one_token_and_non_contiguous_logits():
    one = torch.randn(1, 5, requires_grad=True)
    torch.testing.assert_close(cross_entropy(one, torch.tensor([2])).double(),
                               _fp64_loss(one.detach(), torch.tensor([2])))
    # a transposed view (column stride 40: copied) and a column slice (row stride 30: used in place)
    for base, view in ((torch.randn(11, 40), lambda b: b.t()[1::2]), (torch.randn(20, 30), lambda b: b[:, 3:14])):
        base.requires_grad_()
        logits = view(base)
        assert logits.shape == (20, 11) and not logits.is_contiguous()
        targets = torch.randint(0, 11, (20,))
        loss = cross_entropy(logits, targets)
        loss.backward()
        b64 = base.detach().double().requires_grad_()
        ref = _fp64_loss(view(b64), targets)
        ref.backward()
        torch.testing.assert_close(loss.double(), ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(base.grad.double(), b64.grad, atol=1e-7, rtol=1e-6)


def test_cross_entropy_overwrite_logits_reuses_their_storage():
    leaf = torch.randn(6, 33, requires_grad=True)
    logits = leaf * 2.0  # a non-leaf whose values nothing reads afterwards
    targets = torch.randint(0, 33, (6,))
    expected = _fp64_loss(leaf.detach().double() * 2.0, targets)
    loss = cross_entropy(logits, targets, overwrite_logits=True)
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-6)
    # the logits' storage now holds dL/dlogits (rows sum to 0: softmax minus one-hot, over 6 rows)
    torch.testing.assert_close(logits.detach().sum(-1), torch.zeros(6), atol=1e-6, rtol=0)
    loss.backward()
    x64 = (leaf.detach().double() * 2.0).requires_grad_()
    _fp64_loss(x64, targets).backward()
    torch.testing.assert_close(leaf.grad.double(), 2.0 * x64.grad, atol=1e-7, rtol=1e-6)


def test_cross_entropy_return_z_loss_term():
    logits = torch.randn(5, 17)
    targets = _targets((5,), 17, ignore_every=3)
    loss, z_term = cross_entropy(logits, targets, z_loss=1e-2, return_z_loss=True)
    keep = targets != -100
    expected = (1e-2 * torch.logsumexp(logits.double(), -1)[keep] ** 2).mean()
    torch.testing.assert_close(z_term.double(), expected, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(loss.double() - z_term.double(), _fp64_loss(logits, targets), atol=1e-6, rtol=1e-6)


def test_functional_spec_matches_fp64_for_every_option():
    logits = 2 * torch.randn(4, 6, 31)
    targets = _targets((4, 6), 31)
    for label_smoothing, z_loss, softcap in OPTIONS:
        for reduction in ("mean", "sum", "none"):
            kw = dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction)
            torch.testing.assert_close(functional.cross_entropy(logits, targets, **kw).double(),
                                       _fp64_loss(logits, targets, **kw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0, 5, 1])), "target 5 is outside"),
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0, -1, 1])), "target -1 is outside"),
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0, 1])), "disagree"),
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0.0, 1.0, 2.0])), "integer class ids"),
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), reduction="avg"), "reduction"),
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), z_loss=-1.0), "z_loss"),
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), label_smoothing=1.5), "label_smoothing"),
    (lambda: cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), softcap=0.0), "softcap"),
    (lambda: cross_entropy(torch.randn(3, 5).double(), torch.tensor([0, 1, 2])), "float32, float16 or bfloat16"),
])
def test_cross_entropy_bad_inputs(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ----------------------------------------------------------------------------------------------------
# linear_cross_entropy: LM head + loss, chunked
# ----------------------------------------------------------------------------------------------------
def _lce_reference(hidden, weight, targets, **kw):
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    return h64, w64, _fp64_loss(h64 @ w64.t(), targets, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS)
def test_linear_cross_entropy_options_vs_fp64(small_chunks, options, reduction):
    label_smoothing, z_loss, softcap = options
    kw = dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction)
    hidden = torch.randn(2, 23, 24, requires_grad=True)
    weight = (0.4 * torch.randn(50, 24)).requires_grad_()
    targets = _targets((2, 23), 50)
    loss = linear_cross_entropy(hidden, weight, targets, **kw)
    h64, w64, ref = _lce_reference(hidden, weight, targets, **kw)
    assert loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(ref)
    (loss.double() * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_low_precision_vs_fp32_torch(small_chunks, dtype):
    hidden = torch.randn(3, 19, 32).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(1000, 32)).to(dtype).requires_grad_()
    targets = _targets((3, 19), 1000)
    loss = linear_cross_entropy(hidden, weight, targets, z_loss=1e-4)
    loss.backward()
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = TF.cross_entropy((h32 @ w32.t()).view(-1, 1000), targets.view(-1))
    keep = targets.view(-1) != -100
    ref = ref + 1e-4 * (torch.logsumexp(h32 @ w32.t(), -1).view(-1)[keep] ** 2).mean()
    ref.backward()
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=5e-3, rtol=5e-3),
           torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(hidden.grad.float(), h32.grad, **tol)
    torch.testing.assert_close(weight.grad.float(), w32.grad, **tol)


def test_linear_cross_entropy_bf16_hidden_fp32_weight(small_chunks):
    """Mixed precision: the matmuls run in hidden's dtype, the weight gradient comes back fp32."""
    hidden = torch.randn(2, 9, 16).bfloat16().requires_grad_()
    weight = (0.5 * torch.randn(7, 16)).requires_grad_()
    targets = _targets((2, 9), 7)
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    h64, w64, ref = _lce_reference(hidden, weight.bfloat16(), targets)  # the weight as the matmul sees it
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=2e-2, rtol=2e-2)


def test_linear_cross_entropy_gpt2_vocab_and_one_token():
    hidden = torch.randn(3, 8, requires_grad=True)
    weight = (0.5 * torch.randn(50257, 8)).requires_grad_()
    targets = torch.tensor([50256, 0, -100])
    loss = linear_cross_entropy(hidden, weight, targets, label_smoothing=0.05)
    loss.backward()
    h64, w64, ref = _lce_reference(hidden, weight, targets, label_smoothing=0.05)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-7, rtol=1e-5)
    one = linear_cross_entropy(hidden[:1], weight, targets[:1])
    torch.testing.assert_close(one.double(), _lce_reference(hidden[:1], weight, targets[:1])[2], atol=1e-5, rtol=1e-5)


def test_linear_cross_entropy_only_hidden_grad_and_no_grad(small_chunks):
    hidden = torch.randn(10, 12, requires_grad=True)
    weight = torch.randn(20, 12)  # frozen head
    targets = torch.randint(0, 20, (10,))
    loss = linear_cross_entropy(hidden, weight, targets)
    (grad,) = torch.autograd.grad(loss, hidden)
    h64, _, ref = _lce_reference(hidden, weight, targets)
    ref.backward()
    torch.testing.assert_close(grad.double(), h64.grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets).double(), ref.detach(),
                                   atol=1e-5, rtol=1e-5)


def test_linear_cross_entropy_all_ignored():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((4,), -100))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_linear_cross_entropy_bad_inputs():
    h, w = torch.randn(4, 8), torch.randn(11, 8)
    with pytest.raises(ValueError, match="target 11 is outside"):
        linear_cross_entropy(h, w, torch.tensor([0, 11, 1, 2]))
    with pytest.raises(ValueError, match="expected \\[vocab, 8\\]"):
        linear_cross_entropy(h, torch.randn(11, 7), torch.tensor([0, 1, 1, 2]))
    with pytest.raises(ValueError, match="disagree"):
        linear_cross_entropy(h, w, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="weight\\[vocab, d\\]"):
        linear_cross_entropy(h, torch.randn(11), torch.tensor([0, 1, 1, 2]))


def test_linear_cross_entropy_peak_memory_below_an_eighth_of_eager(monkeypatch):
    """Peak live tensor bytes of forward + backward of head + loss: fused < 1/8 of eager linear + F.cross_entropy.
    The chunk budget is scaled down with the shape (2048 tokens x vocab 3000 here, 8K x 50257 in profiles/)."""
    monkeypatch.setattr(lce_module, "CHUNK_BYTES", 1 << 18)
    monkeypatch.setattr(lce_module, "CHUNK_MIN_ROWS", 16)
    hidden = torch.randn(2048, 64, requires_grad=True)
    weight = (0.1 * torch.randn(3000, 64)).requires_grad_()
    targets = torch.randint(0, 3000, (2048,))

    def eager():
        loss = TF.cross_entropy(hidden @ weight.t(), targets)
        loss.backward()
        return loss.detach()

    def fused():
        loss = linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        return loss.detach()

    loss_eager, peak_eager = peak_live_bytes(eager)
    grads_eager = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss_fused, peak_fused = peak_live_bytes(fused)
    assert peak_eager >= 2048 * 3000 * 4  # at least the fp32 logits: the tracker sees them
    assert peak_fused < peak_eager / 8, (peak_fused, peak_eager)
    torch.testing.assert_close(loss_fused, loss_eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, grads_eager[0], atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(weight.grad, grads_eager[1], atol=1e-6, rtol=1e-4)


def test_lm_head_loss_peak_meets_the_one_tenth_target_at_gpt2_shape():
    """§Performance: head + loss peak <= 1/10 of eager at 8K tokens x vocab 50257 (d 768, fp32). Counted on meta
    tensors: the fused path runs its real chunk loop (kernel launches skipped), so every buffer is seen."""
    from tritonlm.memory import lm_head_loss_peak_bytes

    r = lm_head_loss_peak_bytes(8192, 768, 50257)
    logits_bytes = 8192 * 50257 * 4
    assert r["eager"] >= 2 * logits_bytes  # fp32 logits and their gradient at least
    assert r["fused"] <= r["eager"] / 10
    # and the fused peak does not grow with the token count (chunked): 4x the tokens, < 1.5x the peak
    assert lm_head_loss_peak_bytes(4 * 8192, 768, 50257)["fused"] < 1.5 * r["fused"]


def test_linear_cross_entropy_refuses_a_second_backward_through_one_graph():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.randint(0, 11, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_model_loss_checks_targets_unless_the_data_was_validated(monkeypatch):
    from tritonlm import ModelConfig, TransformerLM
    from tritonlm.kernels import linear_cross_entropy_loss as lce
    checks = []
    real = lce._check_targets
    monkeypatch.setattr(lce, "_check_targets", lambda *a, **k: checks.append(a[0]) or real(*a, **k))
    cfg = ModelConfig.preset("tiny", vocab_size=50, context_length=16, num_layers=1)
    model = TransformerLM(**cfg.model_kwargs(), backend="triton")
    ids = torch.randint(0, 50, (1, 9))
    with pytest.raises(ValueError, match="target 50 is outside"):
        model.loss(ids, torch.full((1, 9), 50))
    assert checks == ["linear_cross_entropy"]
    model.token_embeddings.check_ids = False  # what the trainer does after checking its token file once
    checked = TransformerLM(**cfg.model_kwargs(), backend="triton")
    checked.load_state_dict(model.state_dict())
    targets = torch.randint(0, 50, (1, 9))
    checks.clear()
    unchecked_loss = model.loss(ids, targets)
    assert checks == []  # no range check (its host sync) once the data was validated
    torch.testing.assert_close(unchecked_loss, checked.loss(ids, targets))
    assert checks == ["linear_cross_entropy"]


def _record_lce_ops(n_tokens, d, vocab):
    """The aten ops of a bf16 ``linear_cross_entropy`` forward + backward on meta tensors (the real chunk loop,
    Triton launches skipped), recorded by a TorchDispatchMode as ``(name, bytes of bf16 W it reads, output)``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tritonlm.memory import _skip_triton_launches

    hidden = torch.randn(n_tokens, d, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.bfloat16, device="meta", requires_grad=True)
    targets = torch.randint(0, vocab, (n_tokens,), device="meta")
    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            w_bytes = sum(t.numel() * t.element_size() for t in tensors
                          if t.shape in ((vocab, d), (d, vocab)) and t.dtype == torch.bfloat16)
            ops.append((str(func.overloadpacket), w_bytes, out))
            return out

    with _skip_triton_launches(), Record():
        linear_cross_entropy(hidden, weight, targets).backward()
    assert weight.grad.shape == (vocab, d) and weight.grad.dtype == torch.bfloat16
    return ops


@pytest.mark.parametrize("n_tokens, vocab, expected_rows", [(4096, 50257, 2560), (8192, 128256, 1024)])
def test_linear_cross_entropy_traffic_recorded_on_meta_tensors(n_tokens, vocab, expected_rows):
    """The traffic model of the module docstring, from the recorded aten ops of a bf16 forward + backward: chunks
    of at least 1024 tokens (the byte budget's rows at GPT-2's and Llama 3's vocabularies, worked out by hand:
    256 MiB / (50272 x 2 B) = 2670 -> 2560; 128256 x 2 B -> 1046 -> floor 1024), W read in exactly two matmuls per
    chunk (2·V·d·e bytes each chunk), the weight gradient accumulated in place (one fp32 [V, d] buffer plus the
    final cast to the weight's dtype: no [V, d] result per chunk)."""
    d = 200  # (matches no chunk's rows: W is told apart by its shape)
    ops = _record_lce_ops(n_tokens, d, vocab)
    rows = lce_module.chunk_rows(n_tokens, vocab, 2)
    assert rows == expected_rows
    chunks = -(-n_tokens // rows)
    matmuls = [(name, w_bytes, out) for name, w_bytes, out in ops if name in ("aten.mm", "aten.addmm")]
    w_reads = [out for name, w_bytes, out in matmuls if w_bytes]
    assert chunks > 1 and len(w_reads) == 2 * chunks
    assert sum(w_bytes for _, w_bytes, _ in matmuls) == chunks * 2 * (vocab * d * 2)  # 2 reads of bf16 W a chunk
    assert sorted({o.shape[0] for o in w_reads if o.shape[1] == vocab}) == sorted({rows, n_tokens - (chunks - 1) * rows})
    # tensors of W's size the loop allocates (in-place ops and views excluded): the zeroed fp32 accumulator, its
    # final cast to bf16, and autograd's .grad -- never one per chunk
    new_vd = [name for name, _, out in ops if isinstance(out, torch.Tensor) and out.shape == (vocab, d)
              and not name.endswith("_") and name not in ("aten.addmm", "aten.t", "aten.detach", "aten.view")]
    assert sorted(new_vd) == ["aten._to_copy", "aten.new_empty_strided", "aten.zeros"], new_vd
    assert sum(1 for name, _, out in matmuls if name == "aten.addmm" and out.shape == (vocab, d)) == chunks
