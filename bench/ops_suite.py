"""Measurement sections of the one-shot GPU suite (plain timing loops: faster than pytest-benchmark's
calibration, so the whole suite fits its time budget). Every row is measured side by side in one process."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as TF

from tritonlm import ModelConfig, accounting
from tritonlm.benchmarking import benchmark_train_steps, time_fn

from benchutil import fused_loss_baselines, liger_impls, moe_baselines, peak_bytes, ragged_kv_caches


def _ms(times):
    return 1e3 * statistics.median(times)


def _time(fn, device, smoke):
    return time_fn(fn, device, warmup=1 if smoke else 5, rounds=2 if smoke else 20)


def _peak_bytes(step, device) -> int:
    """Peak memory one call of ``step`` adds: the CUDA allocator's peak on a GPU, live tensor storage on CPU."""
    if device.type == "cuda":
        return peak_bytes(step)
    from tritonlm.memory import peak_live_bytes

    return peak_live_bytes(step)[1]


def _modes(forward, inputs, device, smoke):
    """Median seconds of forward and of backward alone."""
    def fwd():
        with torch.no_grad():
            forward(*inputs)

    out = forward(*inputs)
    grad = torch.randn_like(out)

    def bwd():
        out.backward(grad, retain_graph=True)

    res = {"fwd": statistics.median(_time(fwd, device, smoke)), "bwd": statistics.median(_time(bwd, device, smoke))}
    for t in inputs:
        t.grad = None
    return res


def op_rows(device, copy_bw, smoke=False, time_left=lambda: 1e9):
    """Every registered op with a bench case (``kernels/_registry.py``) on ``[rows, hidden]`` activations: its
    reference, ours, Liger-Kernel's when importable and torch.compile of the reference (one shape); forward and
    backward timed apart, with the bandwidth of the compulsory traffic."""
    from tritonlm.kernels import _registry

    dtype = torch.float32 if smoke else torch.bfloat16
    shapes = [(64, 256)] if smoke else [(4096, 768), (16384, 4096), (65536, 8192)]
    compile_shape = None if smoke else (16384, 4096)
    liger = liger_impls() if device.type == "cuda" else {}
    benched = [op for op in _registry.ops() if op.bench_case is not None]

    rows = []
    for rows_, hidden in shapes:
        if time_left() < 90:
            break
        for op in benched:
            case = op.bench_case(rows_, hidden, device, dtype)
            impls = dict(case.impls)
            if case.liger in liger:
                impls["liger-kernel"] = liger[case.liger](*case.liger_args) if case.liger_args else liger[case.liger]
            if (rows_, hidden) == compile_shape:
                impls["torch.compile(reference)"] = torch.compile(case.impls["reference"], dynamic=False)
            for impl, fn in impls.items():
                try:
                    t = _modes(fn, case.inputs, device, smoke)
                except Exception as e:  # e.g. a baseline that does not support this shape
                    rows.append({"op": op.name, "shape": f"{rows_}x{hidden}", "impl": impl, "error": repr(e)[:200]})
                    continue
                for mode in ("fwd", "bwd"):
                    gbps = case.traffic[mode] / t[mode] / 1e9
                    rows.append({"op": op.name, "shape": f"{rows_}x{hidden}", "dtype": str(dtype)[6:], "impl": impl,
                                 "mode": mode, "ms": 1e3 * t[mode], "GBps": gbps,
                                 "pct_copy_bw": 100 * gbps * 1e9 / copy_bw})
            del case, impls
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def attention_rows(device, mm_peak, smoke=False, time_left=lambda: 1e9):
    from tritonlm.kernels import flash_attention

    dtype = torch.float32 if smoke else torch.bfloat16
    cases = [(1, 2, 64, 16)] if smoke else [(8, 16, 1024, 64), (8, 16, 1024, 128), (4, 16, 4096, 64),
                                            (4, 16, 4096, 128), (1, 16, 16384, 64), (1, 16, 16384, 128)]
    impls = {"tritonlm": lambda q, k, v: flash_attention(q, k, v, is_causal=True)}
    if not smoke:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return TF.scaled_dot_product_attention(q, k, v, is_causal=True)

        impls["sdpa-flash"] = sdpa_flash
    else:
        impls["sdpa-math"] = lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = []
    for b, h, n, d in cases:
        if time_left() < 60:
            break
        qkv = [torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
        fwd_flops = 4 * b * h * n * n * d / 2  # causal half
        for impl, fn in impls.items():
            def fwd(fn=fn, qkv=qkv):
                with torch.no_grad():
                    fn(*qkv)

            def both(fn=fn, qkv=qkv):
                out = fn(*qkv)
                out.backward(torch.ones_like(out))

            try:
                t_f = statistics.median(_time(fwd, device, smoke))
                t_fb = statistics.median(_time(both, device, smoke))
            except torch.cuda.OutOfMemoryError:
                rows.append({"shape": f"{b}x{h}x{n}x{d}", "impl": impl, "error": "out of memory"})
                continue
            for t in qkv:
                t.grad = None
            rows.append({"shape": f"{b}x{h}x{n}x{d}", "seq": n, "d": d, "dtype": str(dtype)[6:], "impl": impl,
                         "fwd_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_fb, "fwd_TFLOPs": fwd_flops / t_f / 1e12,
                         "fwd_bwd_TFLOPs": 3.5 * fwd_flops / t_fb / 1e12,
                         "fwd_pct_matmul_peak": 100 * fwd_flops / t_f / mm_peak})
        del qkv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def train_rows(device, smoke=False, time_left=lambda: 1e9):
    if smoke:
        cfg = ModelConfig.preset("tiny").replace(num_layers=1, vocab_size=256)
        res = benchmark_train_steps("tiny", [32], 1, ["reference", "fused"], device, warmup=1, rounds=2, cfg=cfg)
    else:
        res = benchmark_train_steps("small", [512], 8, ["reference", "fused", "compiled-reference"], device,
                                    warmup=3, rounds=10)
        if time_left() > 120:
            res += benchmark_train_steps("medium", [512], 8, ["reference", "fused"], device, warmup=3, rounds=8)
    rows = []
    for r in res:
        d = dict(r.__dict__)
        if r.mean_s:
            cfg = ModelConfig.preset(r.preset)
            d["train_TFLOPs"] = accounting.training_flops(cfg, r.seq, r.batch) / r.mean_s / 1e12
        rows.append(d)
    return rows


def loss_rows(device, smoke=False, time_left=lambda: 1e9):
    """LM head + loss, forward + backward: eager ``hidden @ W.T`` + ``F.cross_entropy``, its torch.compile,
    Liger's fused linear cross-entropy and Cut Cross-Entropy when importable, and ours; time and peak memory."""
    from tritonlm.kernels import linear_cross_entropy

    dtype = torch.float32 if smoke else torch.bfloat16
    shapes = [(64, 32, 1000)] if smoke else [(8192, 768, 50257), (8192, 4096, 128256)]

    def eager(h, w, t):
        return TF.cross_entropy((h @ w.t()).float(), t)

    impls = {"eager": eager, "tritonlm": lambda h, w, t: linear_cross_entropy(h, w, t)}
    if not smoke:
        impls["torch.compile(eager)"] = torch.compile(eager, dynamic=False)
        impls.update(fused_loss_baselines())
    rows = []
    for n, d, v in shapes:
        if time_left() < 60:
            break
        hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(v, d, device=device, dtype=dtype) / d**0.5).requires_grad_()
        targets = torch.randint(0, v, (n,), device=device)
        for impl, fn in impls.items():
            def step(fn=fn, hidden=hidden, weight=weight, targets=targets):
                fn(hidden, weight, targets).backward()
                hidden.grad = weight.grad = None

            try:
                ms = _ms(_time(step, device, smoke))
                peak = _peak_bytes(step, device)
            except Exception as e:  # out of memory, or a baseline that rejects the shape
                rows.append({"shape": f"{n}x{d}x{v}", "impl": impl, "error": repr(e)[:200]})
                continue
            rows.append({"shape": f"{n}x{d}x{v}", "dtype": str(dtype)[6:], "impl": impl, "fwd_bwd_ms": ms,
                         "peak_MiB": peak / 2**20})
        del hidden, weight
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def post_training_rows(device, smoke=False, time_left=lambda: 1e9):
    """The post-training head at TRL #7244's shape (8,192 tokens, hidden 4096, vocabulary 151,936; smoke: tiny):
    per-token log-prob + entropy forward from the materialised logits (the torch path trainers run) vs
    ``linear_log_probs``; fused CE + entropy + accuracy forward + backward; the GRPO loss and the fused linear JSD
    forward + backward against the materialised-logits torch path and Liger's when installed. Time and peak memory."""
    import torch.nn.functional as TF

    from tritonlm.kernels import fused_linear_jsd, linear_cross_entropy, linear_log_probs
    from tritonlm.losses import LigerFusedLinearGRPOLoss

    from benchutil import post_training_baselines

    dtype = torch.float32 if smoke else torch.bfloat16
    n, d, v = (64, 32, 1000) if smoke else (8192, 4096, 151936)
    rows = []
    hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device=device, dtype=dtype) / d**0.5).requires_grad_()
    ids = torch.randint(0, v, (n,), device=device)
    batch = 8
    mask = torch.ones(batch, n // batch, device=device)
    adv = torch.randn(batch, device=device)
    liger = post_training_baselines()
    grpo = LigerFusedLinearGRPOLoss(beta=0.0, loss_type="bnpo")

    def eager_logps():
        z = torch.log_softmax((hidden @ weight.t()).float(), -1)
        return z.gather(-1, ids[:, None])[:, 0], -(z.exp() * z).sum(-1)

    def eager_grpo(h, w, i, m, a):
        lp = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, i[..., None])[..., 0]
        ratio = torch.exp(lp - lp.detach())
        return (-(ratio * a[:, None]) * m).sum() / m.sum()

    shaped = (hidden.view(batch, n // batch, d), ids.view(batch, n // batch))
    cases = {
        ("logp+entropy fwd", "torch (materialised logits)"): lambda: eager_logps(),
        ("logp+entropy fwd", "tritonlm"): lambda: linear_log_probs(hidden, weight, ids, return_entropy=True),
        ("ce+entropy+accuracy fwd+bwd", "torch (materialised logits)"):
            lambda: TF.cross_entropy((hidden @ weight.t()).float(), ids).backward(),
        ("ce+entropy+accuracy fwd+bwd", "tritonlm"):
            lambda: linear_cross_entropy(hidden, weight, ids, return_token_accuracy=True,
                                         return_entropy=True).loss.backward(),
        ("grpo fwd+bwd", "torch (materialised logits)"): lambda: eager_grpo(*shaped[:1], weight, shaped[1], mask,
                                                                             adv).backward(),
        ("grpo fwd+bwd", "tritonlm"): lambda: grpo(shaped[0], weight, shaped[1], mask, adv)[0].backward(),
        ("fused linear jsd fwd+bwd", "tritonlm"):
            lambda: fused_linear_jsd(hidden, weight, hidden.detach(), weight.detach()).backward(),
    }
    if "grpo" in liger:
        cases[("grpo fwd+bwd", "liger-kernel")] = lambda: liger["grpo"](shaped[0], weight, shaped[1], mask,
                                                                         adv).backward()
    if "jsd" in liger:
        cases[("fused linear jsd fwd+bwd", "liger-kernel")] = lambda: liger["jsd"](
            hidden, weight, hidden.detach(), weight.detach()).backward()
    for (group, impl), fn in cases.items():
        if time_left() < 30:
            break

        def step(fn=fn):
            fn()
            hidden.grad = weight.grad = None

        try:
            ms = _ms(_time(step, device, smoke))
            peak = _peak_bytes(step, device)
        except Exception as e:  # out of memory (the materialised path at this shape), or a baseline's refusal
            rows.append({"group": group, "impl": impl, "error": repr(e)[:200]})
            continue
        rows.append({"group": group, "impl": impl, "shape": f"{n}x{d}x{v}", "dtype": str(dtype)[6:], "ms": ms,
                     "peak_MiB": peak / 2**20})
    return rows


def attention_variant_rows(device, copy_bw, smoke=False, time_left=lambda: 1e9):
    """GQA vs MHA (same query heads) vs SDPA, packed documents vs the padded batch, and one-query decoding
    against long caches (split-KV) with the bandwidth of reading the cache once."""
    from tritonlm.kernels import FlashAttention, flash_attention, flash_attn_varlen_func

    dtype = torch.float32 if smoke else torch.bfloat16
    d, seq, (h_q, h_kv) = (16, 64, (4, 2)) if smoke else (128, 4096, (32, 8))
    rows = []

    def timed(name, case, fn, **info):
        try:
            ms = _ms(_time(fn, device, smoke))
        except Exception as e:  # e.g. out of memory: the row says so, the rest still runs
            rows.append({"group": name, "case": case, "error": repr(e)[:200]})
            return
        rows.append({"group": name, "case": case, "ms": ms, **{k: v(ms) if callable(v) else v for k, v in info.items()}})

    # ---- GQA vs MHA with the same query heads, forward + backward
    for impl, kv in (("tritonlm-gqa", h_kv), ("tritonlm-mha", h_q), ("sdpa-gqa", h_kv)):
        q = torch.randn(2, h_q, seq, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, kv, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        fn = (lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) \
            if impl == "sdpa-gqa" else (lambda q, k, v: FlashAttention.apply(q, k, v, True))

        def step(fn=fn, q=q, k=k, v=v):
            out = fn(q, k, v)
            out.backward(torch.ones_like(out))
        timed("gqa", impl, step)
    # ---- packed documents vs the padded batch of the same documents
    lengths = [40, 1, 23] if smoke else [3000, 120, 1800, 900, 77, 1500, 700, 96]
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    packed = [torch.randn(total, h_q, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    padded = [torch.randn(len(lengths), h_q, longest, d, device=device, dtype=dtype, requires_grad=True)
              for _ in range(3)]

    def varlen():
        out = flash_attn_varlen_func(*packed, cu, cu, longest, longest, causal=True)
        out.backward(torch.ones_like(out))

    def padded_step():
        out = FlashAttention.apply(*padded, True)
        out.backward(torch.ones_like(out))
    timed("varlen", "tritonlm-varlen", varlen)
    timed("varlen", "tritonlm-padded", padded_step)
    # ---- Gemma 2's attention logit softcap (tanh of every score, 1 - tanh² in the backward) vs none, fwd + bwd
    for impl, cap in (("tritonlm-no-softcap", 0.0), ("tritonlm-softcap", 50.0)):
        q, k, v = (torch.randn(2, h_q, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

        def capped(q=q, k=k, v=v, cap=cap):
            out = flash_attention(q, k, v, True, softcap=cap)
            out.backward(torch.ones_like(out))
        timed("softcap", impl, capped)
    # ---- MLA (DeepSeek-V3): queries / keys 192 wide, values 128, 16 heads, against d 128 at the same heads, fwd + bwd;
    # TFLOP/s from each shape's own matmul FLOPs (causal: half of 2·(d_qk + d_v) per pair forward, 2.5x for the
    # backward), target: MLA at the TFLOP/s of d 128
    for impl, (d_qk, d_v) in (("tritonlm-mla", (24, 16) if smoke else (192, 128)),
                              ("tritonlm-d128-16h", (16, 16) if smoke else (128, 128))):
        heads = 4 if smoke else 16
        q, k = (torch.randn(2, heads, seq, d_qk, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        v = torch.randn(2, heads, seq, d_v, device=device, dtype=dtype, requires_grad=True)

        def latent(q=q, k=k, v=v):
            out = flash_attention(q, k, v, True)
            out.backward(torch.ones_like(out))
        flops = 3.5 * 2 * (d_qk + d_v) * 2 * heads * seq * seq / 2  # (fwd+bwd, QKᵀ and PV, batch 2, causal)
        timed("mla", impl, latent, TFLOPs=lambda ms, f=flops: f / ms / 1e9)
    # ---- gpt-oss's attention sinks (one logit per head, folded in the epilogue; their gradient a per-head sum)
    sink_logits = torch.randn(h_q, device=device, requires_grad=True)
    for impl, sinks in (("tritonlm-no-sinks", None), ("tritonlm-sinks", sink_logits)):
        q = torch.randn(2, h_q, seq, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, h_kv, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))

        def sunk(q=q, k=k, v=v, sinks=sinks):
            out = flash_attention(q, k, v, True, sinks=sinks)
            out.backward(torch.ones_like(out))
        timed("sinks", impl, sunk)
    # ---- decoding: one query, long caches
    for batch, cache in ([(1, 2100)] if smoke else [(1, 8192), (8, 8192), (1, 32768), (4, 32768)]):
        if time_left() < 30:
            break
        q = torch.randn(batch, h_q, 1, d, device=device, dtype=dtype)
        k, v = (torch.randn(batch, h_kv, cache, d, device=device, dtype=dtype) for _ in range(2))
        nbytes = 2 * k.numel() * k.element_size()
        # (with sinks: gpt-oss decoding, the sink folded in once per row by the combine kernel)
        for impl in ("tritonlm-split-kv", "tritonlm-sinks-split-kv", "sdpa"):
            def dec(impl=impl, q=q, k=k, v=v):
                with torch.no_grad():
                    if impl == "sdpa":
                        TF.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    else:
                        flash_attention(q, k, v, True, sinks=sink_logits.detach() if "sinks" in impl else None)
            timed("decode", f"{impl} b{batch} cache {cache}", dec,
                  GBps=lambda ms, n=nbytes: n / ms / 1e6, pct_copy_bw=lambda ms, n=nbytes: 100 * n / ms / 1e6 * 1e9
                  / copy_bw)
    return rows


def hf_rows(device, smoke=False, time_left=lambda: 1e9):
    """An HF Llama training step (forward with labels, backward, AdamW): the unpatched model (transformers'
    default attention), ``tritonlm.hf.apply_kernels`` on a copy, and Liger's instance patch when importable. GPU:
    a Llama-3.2-1B-like shape with random weights, bf16; smoke: a tiny config. Time and peak memory."""
    import copy

    try:
        import transformers
    except ImportError:
        return [{"impl": "all", "error": "transformers is not installed (pip install 'tritonlm[hf]')"}]
    from tritonlm.hf import apply_kernels

    if smoke:
        sizes = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, vocab_size=300, max_position_embeddings=64)
        batch, seq, dtype = 2, 16, torch.float32
    else:
        sizes = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                     num_hidden_layers=16, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
        batch, seq, dtype = 4, 2048, torch.bfloat16
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, tie_word_embeddings=True))
    base = base.to(device=device, dtype=dtype).train()
    impls = {"unpatched": lambda m: m, "tritonlm": apply_kernels}
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        def liger(m):
            _apply_liger_kernel_to_instance(model=m)
            return m

        impls["liger-kernel"] = liger
    except ImportError:
        pass
    ids = torch.randint(0, sizes["vocab_size"], (batch, seq), device=device)
    rows = []
    for impl, patch in impls.items():
        if time_left() < 45:
            break
        try:
            model = patch(copy.deepcopy(base))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step(model=model, opt=opt):
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()  # AdamW state allocated before the timed and the memory-measured steps
            ms = _ms(time_fn(step, device, warmup=1 if smoke else 3, rounds=2 if smoke else 8))
            peak = _peak_bytes(step, device)
        except Exception as e:  # out of memory, a baseline that rejects the model
            rows.append({"impl": impl, "error": repr(e)[:200]})
            continue
        finally:
            model = opt = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append({"shape": f"{sizes['num_hidden_layers']}L d{sizes['hidden_size']} b{batch}x{seq}",
                     "dtype": str(dtype)[6:], "impl": impl, "step_ms": ms,
                     "tokens_per_s": batch * seq / (ms / 1e3), "peak_MiB": peak / 2**20})
    return rows


def moe_rows(device, smoke=False, time_left=lambda: 1e9):
    """Expert FFNs of one MoE layer, forward and forward + backward: the eager per-expert loop, torch's
    ``_grouped_mm`` where present, and ``kernels.moe_experts``; Mixtral-8x7B's layer (T 8192, H 4096, I 14336,
    E 8, top-2) and a Qwen3-MoE-like one (T 8192, H 2048, I 768, E 128, top-8), bf16; smoke: tiny, fp32."""
    from tritonlm.kernels import moe_experts

    dtype = torch.float32 if smoke else torch.bfloat16
    # (tokens, H, I, experts, top-k, gpt-oss's options): Mixtral-8x7B, Qwen3-MoE-like, gpt-oss-20b's layer
    # (the sigmoid-routed DeepSeek-V3 / GLM-4.5-Air layer: its router's weights, groups and correction bias)
    shapes = [(48, 32, 40, 5, 2, False), (40, 24, 20, 6, 2, True), (40, 24, 12, 8, 3, "sigmoid")] if smoke else [
        (8192, 4096, 14336, 8, 2, False), (8192, 2048, 768, 128, 8, False), (8192, 2880, 2880, 32, 4, True),
        (8192, 4096, 1408, 128, 8, "sigmoid")]
    impls = {**moe_baselines(device), "tritonlm": moe_experts}
    rows = []
    for tokens, d_model, d_ff, experts, top_k, gpt_oss in shapes:
        if time_left() < 60:
            break
        sigmoid, gpt_oss = gpt_oss == "sigmoid", gpt_oss is True
        shape = f"T{tokens} H{d_model} I{d_ff} E{experts} K{top_k}" + (" gpt-oss" if gpt_oss else "") + \
            (" sigmoid-routed" if sigmoid else "")
        hidden = torch.randn(tokens, d_model, device=device, dtype=dtype, requires_grad=True)
        logits = torch.randn(tokens, experts, device=device)
        weights, index = torch.softmax(logits, -1).topk(top_k, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype).requires_grad_()
        if sigmoid:  # DeepSeek-V3's routing: 8 groups, 4 kept, a correction bias, weights x 2.5 (fp32)
            from tritonlm.modules.functional import moe_router
            _, weights, index = moe_router(hidden.detach(), torch.randn(experts, d_model, device=device) * 0.02,
                                           top_k, scoring="sigmoid", n_group=8 if experts % 8 == 0 else 1,
                                           topk_group=4 if experts % 8 == 0 else 1, routed_scaling_factor=2.5,
                                           choice_bias=torch.randn(experts, device=device) * 0.01)
            weights = weights.requires_grad_()
        gate_up = (torch.randn(experts, 2 * d_ff, d_model, device=device, dtype=dtype) / d_model**0.5).requires_grad_()
        down = (torch.randn(experts, d_model, d_ff, device=device, dtype=dtype) / d_ff**0.5).requires_grad_()
        opts = {}
        if gpt_oss:  # biases, the clamped SwiGLU, the [E, H, 2I] parameter read through its transposed view
            gate_up = (torch.randn(experts, d_model, 2 * d_ff, device=device, dtype=dtype)
                       / d_model**0.5).requires_grad_()
            opts = dict(activation="swiglu_clamped", gate_up_layout="interleaved",
                        gate_up_bias=torch.zeros(experts, 2 * d_ff, device=device, dtype=dtype, requires_grad=True),
                        down_bias=torch.zeros(experts, d_model, device=device, dtype=dtype, requires_grad=True))
        args = (hidden, index, weights, gate_up.transpose(1, 2) if gpt_oss else gate_up, down)
        # active FLOPs: per routed pair, 2·H·2I (gate and up) + 2·I·H (down); backward twice that
        fwd_flops = 2 * tokens * top_k * 3 * d_model * d_ff
        grad = torch.ones(tokens, d_model, device=device, dtype=dtype)
        for impl, fn in impls.items():
            if gpt_oss and impl == "liger-kernel":  # (its fused MoE has no biases or clamp)
                continue

            def fwd(fn=fn, args=args, opts=opts):
                with torch.no_grad():
                    fn(*args, **opts)

            def both(fn=fn, args=args, grad=grad, opts=opts):
                fn(*args, **opts).backward(grad)

            try:
                t_f = statistics.median(_time(fwd, device, smoke))
                t_fb = statistics.median(_time(both, device, smoke))
            except Exception as e:  # out of memory, or a baseline that rejects the shape
                rows.append({"shape": shape, "impl": impl, "error": repr(e)[:200]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            for t in (hidden, weights, gate_up, down):
                t.grad = None
            rows.append({"shape": shape, "dtype": str(dtype)[6:], "impl": impl, "fwd_ms": 1e3 * t_f,
                         "fwd_bwd_ms": 1e3 * t_fb, "fwd_TFLOPs": fwd_flops / t_f / 1e12,
                         "fwd_bwd_TFLOPs": 3 * fwd_flops / t_fb / 1e12})
        del hidden, gate_up, down, args, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def decode_rows(device, copy_bw, smoke=False, time_left=lambda: 1e9):
    """Inference: ``flash_attn_with_kvcache`` decoding one token per sequence against dense and paged caches
    (batch 1-64, context 4K-128K, GQA 32 on 8, d 128; bandwidth of reading K/V once), then ragged-batch generation
    with a model (tokens/s and paged cache memory vs batch size)."""
    from tritonlm import ModelConfig, TransformerLM
    from tritonlm.kernels import flash_attn_with_kvcache

    dtype = torch.float32 if smoke else torch.bfloat16
    d, (h_q, h_kv), page = (16, (4, 2), 16) if smoke else (128, (32, 8), 256)
    cases = [(1, 2100), (3, 700)] if smoke else [(1, 4096), (1, 32768), (1, 131072), (8, 32768), (16, 131072),
                                                  (64, 4096), (64, 32768)]
    rows = []
    for batch, ctx in cases:
        if time_left() < 40:
            break
        q = torch.randn(batch, 1, h_q, d, device=device, dtype=dtype)
        try:  # ragged lengths in [ctx/2, ctx) (what a server's batch looks like), dense and as a paged pool
            lengths, dense, paged = ragged_kv_caches(batch, ctx, h_kv, d, page, dtype, device)
        except torch.OutOfMemoryError as e:
            rows.append({"group": "decode_kernel", "case": f"b{batch} ctx {ctx}", "error": repr(e)[:200]})
            continue
        nbytes = 2 * int(lengths.sum()) * h_kv * d * q.element_size()  # K and V of every cached position
        for impl, (kc, vc, bt) in (("tritonlm-dense", dense), ("tritonlm-paged", paged)):
            def step(q=q, kc=kc, vc=vc, bt=bt, lengths=lengths):
                flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=bt, causal=True)
            try:
                ms = _ms(_time(step, device, smoke))
            except Exception as e:  # e.g. out of memory: the row says so, the rest still runs
                rows.append({"group": "decode_kernel", "impl": impl, "case": f"b{batch} ctx {ctx}",
                             "error": repr(e)[:200]})
                continue
            gbps = nbytes / ms / 1e6
            rows.append({"group": "decode_kernel", "impl": impl, "case": f"b{batch} ctx {ctx}", "batch": batch,
                         "ctx": ctx, "ms": ms, "GBps": gbps, "pct_copy_bw": 100 * gbps * 1e9 / copy_bw})
        del dense, paged
    # ---- a model generating for a ragged batch: tokens/s and the paged cache's memory vs batch size
    cfg = (ModelConfig.preset("tiny", vocab_size=97, num_layers=2) if smoke
           else ModelConfig.preset("small", num_kv_heads=4, context_length=2048))
    model = TransformerLM.from_config(cfg, device=device, dtype=dtype, backend="triton").eval()
    new = 4 if smoke else 128
    for batch in ((1, 3) if smoke else (1, 8, 32)):
        if time_left() < 30:
            break
        gen = torch.Generator().manual_seed(batch)
        lengths = torch.randint(8 if smoke else 64, 24 if smoke else 1024, (batch,), generator=gen).tolist()
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).to(device) for n in lengths]
        import time as _t

        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = _t.perf_counter()
        outs = model.generate(prompts, new, temperature=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = _t.perf_counter() - t0
        made = sum(len(o) - n for o, n in zip(outs, lengths))
        stats = model.last_generation_cache
        dense_bytes = stats["pool_bytes"] / max(stats["pool_blocks"], 1) / stats["page_size"] * batch \
            * cfg.context_length  # a dense cache sized to the context for every sequence
        rows.append({"group": "generate", "impl": "tritonlm-paged", "case": f"{cfg.d_model}d x{cfg.num_layers} "
                     f"batch {batch}", "batch": batch, "tokens": made, "s": seconds, "tokens_per_s": made / seconds,
                     "cache_MiB": stats["pool_bytes"] / 2**20, "dense_context_MiB": dense_bytes / 2**20})
    return rows


def gated_delta_rows(device, copy_bw, smoke=False, time_left=lambda: 1e9):
    """Gated DeltaNet at Qwen3.5's layer shape (H 16, HV 32, K = V = 128, bf16; T 4K-32K, batch 1): the chunked
    forward and forward + backward of ``kernels.chunk_gated_delta_rule`` beside transformers' torch fallback and
    flash-linear-attention (when installed); then decoding one token per sequence (``fused_recurrent``, the state
    read and written once: bandwidth on the state bytes) and ``causal_conv1d_fn`` against copy bandwidth."""
    from tritonlm.kernels import causal_conv1d_fn, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from benchutil import gated_delta_baselines

    dtype = torch.float32 if smoke else torch.bfloat16
    heads, v_heads, d = (2, 4, 16) if smoke else (16, 32, 128)
    impls = {**gated_delta_baselines(), "tritonlm": chunk_gated_delta_rule}
    rows = []
    for seq in ((80,) if smoke else (4096, 16384, 32768)):
        if time_left() < 60:
            break
        q = torch.randn(1, seq, heads, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, seq, heads, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, seq, v_heads, d, device=device, dtype=dtype, requires_grad=True)
        g = TF.logsigmoid(torch.randn(1, seq, v_heads, device=device) + 3).requires_grad_()
        beta = torch.rand(1, seq, v_heads, device=device, dtype=dtype).requires_grad_()
        for impl, fn in impls.items():
            if impl == "transformers-torch" and seq > (80 if smoke else 16384):
                continue  # (minutes per call at 32K)

            def fwd(fn=fn, args=(q, k, v, g, beta)):
                with torch.no_grad():
                    fn(*args, use_qk_l2norm_in_kernel=True)

            def both(fn=fn, args=(q, k, v, g, beta)):
                fn(*args, use_qk_l2norm_in_kernel=True)[0].sum().backward()

            try:
                t_f, t_fb = _ms(_time(fwd, device, smoke)), _ms(_time(both, device, smoke))
            except Exception as e:  # out of memory, or a baseline that rejects the call
                rows.append({"group": "chunk", "impl": impl, "case": f"T{seq}", "error": repr(e)[:200]})
                continue
            for t in (q, k, v, g, beta):
                t.grad = None
            rows.append({"group": "chunk", "impl": impl, "case": f"T{seq} H{heads} HV{v_heads} K{d} V{d}",
                         "seq": seq, "fwd_ms": t_f, "fwd_bwd_ms": t_fb})
        del q, k, v, g, beta
    # ---- decoding: one token per sequence, the fp32 state read and written once
    for batch in ((2,) if smoke else (1, 16, 64)):
        if time_left() < 30:
            break
        q = torch.randn(batch, 1, heads, d, device=device, dtype=dtype)
        v = torch.randn(batch, 1, v_heads, d, device=device, dtype=dtype)
        g, beta = -torch.rand(batch, 1, v_heads, device=device), torch.rand(batch, 1, v_heads, device=device)
        state = torch.randn(batch, v_heads, d, d, device=device)

        def step(args=(q, q, v, g, beta), state=state):
            fused_recurrent_gated_delta_rule(*args, initial_state=state, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)

        ms = _ms(_time(step, device, smoke))
        gbps = 2 * state.numel() * 4 / ms / 1e6
        rows.append({"group": "decode", "impl": "tritonlm", "case": f"batch {batch}", "batch": batch, "ms": ms,
                     "GBps": gbps, "pct_copy_bw": 100 * gbps * 1e9 / copy_bw})
    # ---- the short convolution: Qwen3.5's q/k/v channels (8192), 4 taps, SiLU, forward
    tokens, chans = (64, 48) if smoke else (16384, 8192)
    x = torch.randn(1, tokens, chans, device=device, dtype=dtype).transpose(1, 2)
    w = torch.randn(chans, 4, device=device, dtype=dtype)
    ms = _ms(_time(lambda: causal_conv1d_fn(x, w, None, "silu"), device, smoke))
    gbps = 2 * x.numel() * x.element_size() / ms / 1e6
    rows.append({"group": "conv1d", "impl": "tritonlm", "case": f"T{tokens} D{chans} W4", "ms": ms, "GBps": gbps,
                 "pct_copy_bw": 100 * gbps * 1e9 / copy_bw})
    return rows
