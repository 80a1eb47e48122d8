"""``tritonlm.hf.apply_kernels`` on transformers' own Llama / Mistral models: every patched op against the unpatched
model (logits, loss, gradients, fp32 and bf16), the RoPE and RMSNorm kernels in HF's layouts, and every way
transformers says which keys a query sees (padding, packed documents, flash kwargs, windows, custom masks) against
unpatched sdpa.

Needs the optional extra (``pip install 'tritonlm[hf]'``); skipped with that reason when it is absent.
"""

import copy

import pytest
import torch

from helpers import (
    DEVICE,
    LLAMA_SIZES,
    ON_CUDA,
    tiny_llama,
    transformers_or_skip,
)


# ----------------------------------------------------------------------------------------------------
# apply_kernels
# ----------------------------------------------------------------------------------------------------
def _loss_and_grads(model, ids, labels, mask=None):
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_kernels_matches_unpatched(dtype, monkeypatch):
    from tritonlm import hf
    from tritonlm.hf import patch

    base = tiny_llama(dtype=dtype, seed=8)
    patched = hf.apply_kernels(copy.deepcopy(base))
    calls = {"attention": 0, "rope": 0}
    real_attention, real_rope = patch.tritonlm_attention, patch._rope_kernel

    def counting(*args, **kwargs):
        calls["attention"] += 1
        return real_attention(*args, **kwargs)

    def counting_rope(*args, **kwargs):
        calls["rope"] += 1
        return real_rope(*args, **kwargs)

    monkeypatch.setattr(patch, "_rope_kernel", counting_rope)  # the RoPE kernel, not HF's formula, runs

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "tritonlm", counting)
    assert patched.model.layers[0].mlp._tritonlm_patch == "swiglu"
    assert patched.model.norm._tritonlm_patch == "rms_norm"
    assert patched.config._attn_implementation == "tritonlm"
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 300, (2, 13), generator=gen).to(DEVICE)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, -3:] = -100

    # eval: logits, with and without left padding (compared where HF's output is meaningful: real tokens)
    with torch.no_grad():
        got, expected = patched(ids).logits, base(ids).logits
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        got_pad, expected_pad = patched(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits
    assert calls["attention"] == 4 and calls["rope"] == 4  # two layers, two forwards
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    valid = mask.bool()
    torch.testing.assert_close(got_pad[valid].float(), expected_pad[valid].float(), **tol)

    # training: loss with ignored labels, gradients of every weight
    patched.train()
    base.train()
    loss, grads = _loss_and_grads(patched, ids, labels)
    assert patched(ids, labels=labels).logits is None  # training never forms the logits
    loss_ref, grads_ref = _loss_and_grads(base, ids, labels)
    if dtype == torch.float32:
        torch.testing.assert_close(loss, loss_ref, atol=2e-5, rtol=1e-5)
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], atol=2e-5, rtol=1e-4, msg=name)
    else:
        # bf16: each side against the fp32 model, the patched one no further off than HF's own bf16 run
        exact = tiny_llama(dtype=torch.float32, seed=8).train()
        loss_32, grads_32 = _loss_and_grads(exact, ids, labels)
        assert abs(loss.float() - loss_32) <= 2 * abs(loss_ref.float() - loss_32) + 1e-2
        for name, g32 in grads_32.items():
            err = (grads[name] - g32).norm() / g32.norm()
            err_ref = (grads_ref[name] - g32).norm() / g32.norm()
            assert err <= 2 * err_ref + 0.02, (name, err, err_ref)


def test_apply_kernels_generation_and_removal():
    from tritonlm import hf

    base = tiny_llama(seed=10)
    patched = hf.apply_kernels(copy.deepcopy(base))
    prompt = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(11)).to(DEVICE)
    kw = dict(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert patched.generate(prompt, **kw).tolist() == base.generate(prompt, **kw).tolist()
    # num_items_in_batch (HF Trainer's gradient-accumulation normalisation): the summed loss over that count
    ids = prompt.repeat(1, 3)
    labels = ids.clone()
    torch.testing.assert_close(patched(ids, labels=labels, num_items_in_batch=7).loss,
                               base(ids, labels=labels, num_items_in_batch=7).loss, atol=2e-5, rtol=1e-5)
    previous = base.config._attn_implementation
    hf.remove_kernels(patched)
    assert patched.config._attn_implementation == previous
    assert not any(hasattr(m, "_tritonlm_patch") for m in patched.modules())
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, base(ids).logits)


def test_apply_kernels_refuses_other_models():
    transformers = transformers_or_skip()
    from tritonlm import hf

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        hf.apply_kernels(gpt2)
    with pytest.raises(ValueError, match="hidden_act"):
        hf.apply_kernels(tiny_llama(hidden_act="gelu"))


@pytest.mark.skipif(ON_CUDA, reason="checks the interpreter's half-split kernel against the formula on CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_kernel_layout(dtype):
    """``layout="half"`` against HF's formula (``q·cos + rotate_half(q)·sin``) in fp64, forward and backward, on a
    non-contiguous [batch, heads, seq, d] view with odd sizes and 16-bit tables."""
    from tritonlm.kernels import apply_rope, rope_tables

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    gen = torch.Generator().manual_seed(12)
    base = torch.randn(3, 7, 5, 12, generator=gen)  # [batch, seq, heads, d]
    q = base.to(dtype).transpose(1, 2).requires_grad_()
    positions = torch.tensor([0, 3, 9, 4, 11, 2, 30])
    cos, sin = (t.to(dtype) for t in rope_tables(10000.0, 12, 32))  # tables in q's dtype, as HF makes them
    out = apply_rope(q, None, positions, cos=cos, sin=sin, layout="half")
    c = torch.cat([cos[positions]] * 2, dim=-1).double()
    s = torch.cat([sin[positions]] * 2, dim=-1).double()
    q64 = q.detach().double().requires_grad_()
    expected = q64 * c + rotate_half(q64) * s
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    grad = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(grad)
    expected.backward(grad.double())
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="layout"):
        apply_rope(q, None, positions, cos=cos, sin=sin, layout="halves")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_hf_casting(dtype):
    """``cast_xhat=True``: HF Llama's ``weight * (x * rstd).to(x.dtype)`` computed here in fp64 from the same
    rounding points; gradients against autograd through that formula."""
    from tritonlm.kernels import rms_norm

    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(2, 5, 37, generator=gen) * 3).to(dtype)[:, ::2].requires_grad_()  # non-contiguous rows
    w = (1 + torch.randn(37, generator=gen) / 4).to(dtype).requires_grad_()
    y = rms_norm(x, w, 1e-6, cast_xhat=True)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    xhat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = w64 * xhat.to(dtype).double()  # the rounding HF does before the weight multiply
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(y.double(), expected, atol=tol, rtol=tol)
    grad = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(grad)
    # HF's graph: the cast is the identity for gradients, dweight sums dy times the rounded xhat
    (w64 * (xhat + (xhat.to(dtype).double() - xhat).detach())).backward(grad.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=tol * 4, rtol=tol * 4)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=tol * 4, rtol=tol * 4)


# ----------------------------------------------------------------------------------------------------
# apply_kernels: every way transformers says which keys a query sees, against unpatched sdpa
# ----------------------------------------------------------------------------------------------------
def _mistral(window, seed):
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    cfg = transformers.MistralConfig(**LLAMA_SIZES, sliding_window=window)
    return transformers.MistralForCausalLM(cfg).to(DEVICE).eval()


def _flattened(lengths, flash_kwargs=False, seed=20):
    transformers = transformers_or_skip()
    gen = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(0, 300, (n,), generator=gen).tolist()} for n in lengths]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(docs)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


SDPA_TOL = dict(atol=3e-5, rtol=1e-4)


def _compare_with_sdpa(base, batch, valid=None, tol=SDPA_TOL):
    """Logits (eval, no cache), then loss and every gradient with gradient checkpointing on, patched vs
    unpatched sdpa; ``valid`` picks the logit positions HF's output means something at (real tokens)."""
    from tritonlm import hf

    base.config._attn_implementation = "sdpa"
    patched = hf.apply_kernels(copy.deepcopy(base))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        got = patched(**inputs, use_cache=False).logits
        expected = base(**inputs, use_cache=False).logits
    if valid is not None:
        got, expected = got[valid], expected[valid]
    torch.testing.assert_close(got, expected, **tol)
    grads = []
    for model in (patched, base):
        model.train()
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad(set_to_none=True)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, g), (loss_ref, g_ref) = grads
    torch.testing.assert_close(loss, loss_ref, **tol)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], **tol, msg=name)
    return patched


def test_apply_kernels_packed_position_ids(monkeypatch):
    """DataCollatorWithFlattening: one row, position_ids restarting per document, no attention_mask. Each
    document sees only itself: equal to unpatched sdpa and to running each document alone. (The mask check runs
    in blocks of two queries here, as long sequences do.)"""
    from tritonlm.hf import patch

    monkeypatch.setattr(patch, "MASK_CHECK_ELEMENTS", 40)
    base = tiny_llama(seed=21)
    batch = _flattened([5, 9, 3])
    patched = _compare_with_sdpa(base, batch)
    # and to each document alone (the packed logits are the documents' own)
    patched.eval()
    with torch.no_grad():
        packed = patched(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone = [base(input_ids=d.unsqueeze(0)).logits for d in batch["input_ids"][0].split([5, 9, 3])]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=3e-5, rtol=1e-4)


def test_apply_kernels_packed_rows_and_flash_kwargs():
    """Two rows each packing documents (position_ids [2, s]); and the flash-attention kwargs (cu_seq_lens_q/k,
    max_length_q/k) the collator passes with return_flash_attn_kwargs=True."""
    base = tiny_llama(seed=22)
    gen = torch.Generator().manual_seed(23)
    ids = torch.randint(0, 300, (2, 12), generator=gen).to(DEVICE)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1, 2]]).to(DEVICE)
    _compare_with_sdpa(base, dict(input_ids=ids, position_ids=position_ids, labels=ids))
    _compare_with_sdpa(base, _flattened([7, 2, 6], flash_kwargs=True))


def test_apply_kernels_flash_kwargs_alone_decide_documents():
    """cu_seq_lens alone (position_ids not restarting, so nothing else says "packed") keep the documents apart,
    as HF's flash-attention path reads them: each document against HF run on it alone at the same positions."""
    from tritonlm import hf

    base = tiny_llama(seed=24)
    batch = _flattened([4, 6], flash_kwargs=True)
    patched = hf.apply_kernels(copy.deepcopy(base))
    kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    ids = batch["input_ids"]
    positions = torch.arange(10, device=DEVICE)[None]
    with torch.no_grad():
        got = patched(input_ids=ids, position_ids=positions, use_cache=False, **kwargs).logits
        alone = [base(input_ids=ids[:, a:b], position_ids=positions[:, a:b]).logits for a, b in ((0, 4), (4, 10))]
    torch.testing.assert_close(got, torch.cat(alone, dim=1), atol=3e-5, rtol=1e-4)
    padding = torch.ones_like(ids)
    padding[0, 0] = 0
    with pytest.raises(ValueError, match="cu_seq_lens"):
        patched(input_ids=ids, attention_mask=padding, use_cache=False, **kwargs)


@pytest.mark.parametrize("side", ["left", "right"])
def test_apply_kernels_padding_loss_and_grads(side):
    base = tiny_llama(seed=25)
    gen = torch.Generator().manual_seed(26)
    ids = torch.randint(0, 300, (3, 11), generator=gen).to(DEVICE)
    mask = torch.ones_like(ids)
    pads = slice(0, 4) if side == "left" else slice(7, None)
    mask[1, pads] = 0
    mask[2, :2 if side == "left" else -2] = 0 if side == "left" else 1
    labels = ids.masked_fill(mask == 0, -100)
    _compare_with_sdpa(base, dict(input_ids=ids, attention_mask=mask, labels=labels), valid=mask.bool())


def test_apply_kernels_sliding_window_packed_and_padded():
    """Mistral's window inside packed documents, and with padding; padding between valid tokens under a window
    (the varlen kernel would shift the window) runs HF's sdpa path."""
    base = _mistral(window=4, seed=27)
    _compare_with_sdpa(base, _flattened([9, 3, 7], seed=28))
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(29)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    _compare_with_sdpa(base, dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)),
                       valid=mask.bool())
    mask[1, 4:6] = 0  # a hole: not one run of valid tokens
    _compare_with_sdpa(base, dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)),
                       valid=mask.bool())


def test_apply_kernels_custom_4d_mask_runs_sdpa(monkeypatch):
    """A mask the kernel cannot express (a custom 4-D one: here every token also sees the first two) goes to
    HF's sdpa attention, never to a different attention."""
    from transformers.integrations import sdpa_attention

    base = tiny_llama(seed=30)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(31)).to(DEVICE)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()
    allowed[:, :2] = True
    mask = allowed.to(DEVICE).expand(2, 1, 9, 9)
    calls = []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    _compare_with_sdpa(base, dict(input_ids=ids, attention_mask=mask, labels=ids))
    assert calls  # the patched model did route through sdpa


def test_apply_kernels_is_atomic_and_idempotent():
    from tritonlm import hf

    base = tiny_llama(seed=41)
    base.config._attn_implementation = "eager"
    model = copy.deepcopy(base)
    with pytest.raises(ValueError, match="lm_head"):
        hf.apply_kernels(model.model)  # a bare model with loss=True: refused before anything is patched
    assert not any(hasattr(m, "_tritonlm_patch") for m in model.modules())
    assert model.config._attn_implementation == "eager"
    once = hf.apply_kernels(copy.deepcopy(base))
    twice = hf.apply_kernels(hf.apply_kernels(copy.deepcopy(base)))
    ids = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(42)).to(DEVICE)
    with torch.no_grad():
        assert torch.equal(once(ids).logits, twice(ids).logits)
    assert [getattr(m, "_tritonlm_patch", None) for m in once.modules()] == \
        [getattr(m, "_tritonlm_patch", None) for m in twice.modules()]
    hf.remove_kernels(twice)
    assert twice.config._attn_implementation == "eager"
    assert not any(hasattr(m, "_tritonlm_patch") for m in twice.modules())
    with torch.no_grad():
        assert torch.equal(twice(ids).logits, base(ids).logits)


def test_documents_found_only_in_a_mask_of_documents():
    """The packed-mask reader against transformers' own mask functions: causal within documents gives the
    documents (also with a window); one extra visible key (an overlay) gives None, so sdpa runs it."""
    transformers_or_skip()
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        or_masks,
        packed_sequence_mask_function,
        sliding_window_causal_mask_function,
    )

    from tritonlm.hf import patch

    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    call = dict(batch_size=2, q_length=9, kv_length=9, q_offset=0, kv_offset=0, attention_mask=None, local_size=None)
    packed = and_masks(causal_mask_function, packed_sequence_mask_function(docs))
    assert torch.equal(patch._documents_of({**call, "mask_function": packed}, None), docs.int())
    windowed = and_masks(sliding_window_causal_mask_function(2), packed_sequence_mask_function(docs))
    assert torch.equal(patch._documents_of({**call, "mask_function": windowed, "local_size": 2}, 2), docs.int())
    overlay = or_masks(packed, lambda b, h, q, kv: kv == 0)
    assert patch._documents_of({**call, "mask_function": overlay}, None) is None


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_apply_kernels_left_padded_generation(family):
    """Batched generation of prompts of different lengths (left padding, KV cache: queries fewer than keys),
    Mistral's window shorter than the prompt: the same tokens as unpatched sdpa."""
    from tritonlm import hf

    base = tiny_llama(seed=43) if family == "llama" else _mistral(window=4, seed=43)
    base.config._attn_implementation = "sdpa"
    patched = hf.apply_kernels(copy.deepcopy(base))
    ids = torch.randint(1, 300, (3, 9), generator=torch.Generator().manual_seed(44)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert patched.generate(ids, **kw).tolist() == base.generate(ids, **kw).tolist()


def test_apply_kernels_packed_bf16():
    """bf16 packed documents: the patched logits no further from the fp32 model than HF's own bf16 sdpa run."""
    batch = _flattened([6, 11, 4], seed=45)
    exact = tiny_llama(seed=46)
    exact.config._attn_implementation = "sdpa"
    half = copy.deepcopy(exact).to(torch.bfloat16)
    from tritonlm import hf

    patched = hf.apply_kernels(copy.deepcopy(half))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        reference = exact(**inputs, use_cache=False).logits
        err = (patched(**inputs, use_cache=False).logits.float() - reference).abs().max()
        err_hf = (half(**inputs, use_cache=False).logits.float() - reference).abs().max()
        # (a patched model that let documents see each other is off by far more: see the fp32 tests)
    assert err <= 2 * err_hf + 1e-2, (err, err_hf)
