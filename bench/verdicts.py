"""Verdicts per §Performance target, plots and the Markdown rendering of the GPU suite's report."""

from __future__ import annotations

from pathlib import Path


def _rows(report, name):
    sec = report["sections"].get(name, {})
    return sec.get("rows", []) if isinstance(sec, dict) else []


def verdicts(report) -> list[dict]:
    out = []
    tests = _rows(report, "kernel_tests")
    if tests:
        t = tests[0]
        if t.get("tests") is None:  # pytest left no result file (stopped by the time limit, or crashed)
            out.append({"target": "kernel tests rerun on CUDA pass", "verdict": "not measured",
                        "detail": f"no result: pytest {t['pytest exit code']}, see {t['log']}"})
        else:
            out.append({"target": "kernel tests rerun on CUDA pass", "verdict": "met" if t["failed"] == t["errored"] == 0
                        and t["passed"] > 0 else "not met", "detail": f"{t['passed']} passed, {t['failed']} failed, "
                        f"{t['errored']} errors, {t['not run']} skipped"})

    def add(target, met, detail):
        out.append({"target": target, "verdict": "met" if met else ("not met" if met is not None else "not measured"),
                    "detail": detail})

    ops = [r for r in _rows(report, "ops") if "error" not in r]
    for op in ("rmsnorm", "add_rmsnorm", "qk_norm", "swiglu", "rope"):
        for mode in ("fwd", "bwd"):
            ours = [r for r in ops if r["op"] == op and r["mode"] == mode and r["impl"] == "tritonlm"]
            if not ours:
                add(f"{op} {mode} >= 85% of copy bandwidth", None, "no measurement")
                continue
            worst = min(ours, key=lambda r: r["pct_copy_bw"])
            add(f"{op} {mode} >= 85% of copy bandwidth", worst["pct_copy_bw"] >= 85,
                f"lowest {worst['pct_copy_bw']:.0f}% at {worst['shape']} ({worst['GBps']:.0f} GB/s)")
            for rival in ("torch.compile(reference)", "liger-kernel", "two rms_norm calls"):
                pairs = [(o, r) for o in ours for r in ops if r["op"] == op and r["mode"] == mode
                         and r["impl"] == rival and r["shape"] == o["shape"]]
                if pairs:
                    ratio = min(r["ms"] / o["ms"] for o, r in pairs)
                    add(f"{op} {mode} faster than {rival}", ratio >= 1.0, f"worst speed-up {ratio:.2f}x")
    att = [r for r in _rows(report, "attention") if "error" not in r]
    ours = [r for r in att if r["impl"] == "tritonlm"]
    if ours:
        worst = min(ours, key=lambda r: r["fwd_TFLOPs"])
        add("attention fwd >= 450 TFLOP/s", worst["fwd_TFLOPs"] >= 450,
            f"lowest {worst['fwd_TFLOPs']:.0f} TFLOP/s at {worst['shape']}")
        for key, label in (("fwd_ms", "fwd"), ("fwd_bwd_ms", "fwd+bwd")):
            pairs = [(o, r) for o in ours for r in att if r["impl"] == "sdpa-flash" and r["shape"] == o["shape"]]
            if pairs:
                ratio = min(r[key] / o[key] for o, r in pairs)
                add(f"attention {label} >= 1.0x SDPA flash", ratio >= 1.0, f"worst {ratio:.2f}x")
    variants = {r["case"]: r for r in _rows(report, "attention_variants") if "error" not in r}
    if "tritonlm-gqa" in variants and "tritonlm-mha" in variants:
        s = variants["tritonlm-mha"]["ms"] / variants["tritonlm-gqa"]["ms"]
        add("GQA fwd+bwd at the speed of MHA with the same query heads", s >= 0.95, f"{s:.2f}x MHA")
    if "tritonlm-varlen" in variants and "tritonlm-padded" in variants:
        s = variants["tritonlm-padded"]["ms"] / variants["tritonlm-varlen"]["ms"]
        add("varlen no slower than the padded batch", s >= 1.0, f"{s:.2f}x padded")
    if "tritonlm-softcap" in variants and "tritonlm-no-softcap" in variants:
        t = variants["tritonlm-softcap"]["ms"] / variants["tritonlm-no-softcap"]["ms"]
        add("attention with a logit softcap (Gemma 2) <= 1.15x the time without", t <= 1.15, f"{t:.2f}x")
    if "tritonlm-mla" in variants and "tritonlm-d128-16h" in variants:
        s = variants["tritonlm-mla"]["TFLOPs"] / variants["tritonlm-d128-16h"]["TFLOPs"]
        add("MLA attention (d_qk 192, d_v 128) fwd+bwd at the TFLOP/s of d 128", s >= 0.95, f"{s:.2f}x d 128's")
    if "tritonlm-sinks" in variants and "tritonlm-no-sinks" in variants:
        t = variants["tritonlm-sinks"]["ms"] / variants["tritonlm-no-sinks"]["ms"]
        add("attention with sinks (gpt-oss) <= 1.05x the time without", t <= 1.05, f"{t:.2f}x")
    sunk = [(r["ms"] / variants[c.replace("tritonlm-sinks-split-kv", "tritonlm-split-kv")]["ms"], c)
            for c, r in variants.items() if c.startswith("tritonlm-sinks-split-kv")
            and c.replace("tritonlm-sinks-split-kv", "tritonlm-split-kv") in variants]
    if sunk:
        t, case = max(sunk)
        add("split-KV decode with sinks (gpt-oss) <= 1.05x the time without", t <= 1.05, f"worst {t:.2f}x ({case})")
    decode = [r for c, r in variants.items() if c.startswith("tritonlm-split-kv")]
    if decode:
        worst = min(decode, key=lambda r: r["pct_copy_bw"])
        add("split-KV decode >= 70% of the bandwidth to read the cache", worst["pct_copy_bw"] >= 70,
            f"lowest {worst['pct_copy_bw']:.0f}% ({worst['case']})")
    dec = [r for r in _rows(report, "decode") if "error" not in r and r.get("group") == "decode_kernel"]
    if dec:
        worst = min(dec, key=lambda r: r["pct_copy_bw"])
        add("flash_attn_with_kvcache decode >= 70% of HBM bandwidth on K/V (batch 1-64, 4K-128K)",
            worst["pct_copy_bw"] >= 70, f"lowest {worst['pct_copy_bw']:.0f}% ({worst['impl']} {worst['case']})")
        pairs = [(p, q) for p in dec for q in dec if p["impl"] == "tritonlm-paged" and q["impl"] == "tritonlm-dense"
                 and p["case"] == q["case"]]
        if pairs:
            p, q = max(pairs, key=lambda pq: pq[0]["ms"] / pq[1]["ms"])
            add("paged KV decode <= 1.1x dense time", p["ms"] / q["ms"] <= 1.1,
                f"worst {p['ms'] / q['ms']:.2f}x ({p['case']})")
    loss = [r for r in _rows(report, "lm_head_loss") if "error" not in r]
    for shape in sorted({r["shape"] for r in loss}):
        by = {r["impl"]: r for r in loss if r["shape"] == shape}
        if "tritonlm" in by and "eager" in by:
            t = by["tritonlm"]["fwd_bwd_ms"] / by["eager"]["fwd_bwd_ms"]
            add(f"linear cross-entropy {shape}: time <= 1.1x eager", t <= 1.1, f"{t:.2f}x eager")
            m = by["tritonlm"]["peak_MiB"] / by["eager"]["peak_MiB"]
            add(f"linear cross-entropy {shape}: peak memory <= 1/10 eager", m <= 0.1, f"{m:.3f}")
        if "tritonlm" in by and "liger-kernel" in by:
            s = by["liger-kernel"]["fwd_bwd_ms"] / by["tritonlm"]["fwd_bwd_ms"]
            add(f"linear cross-entropy {shape}: faster than Liger", s >= 1.0, f"{s:.2f}x")
    moe = [r for r in _rows(report, "moe") if "error" not in r]
    for shape in sorted({r["shape"] for r in moe}):
        by = {r["impl"]: r for r in moe if r["shape"] == shape}
        for rival, floor in (("eager-loop", 2.0), ("torch._grouped_mm", 1.1), ("liger-kernel", 1.0)):
            if "tritonlm" in by and rival in by:
                s = by[rival]["fwd_bwd_ms"] / by["tritonlm"]["fwd_bwd_ms"]
                add(f"MoE experts fwd+bwd {shape}: >= {floor}x {rival}", s >= floor, f"{s:.2f}x")
    delta = [r for r in _rows(report, "gated_delta") if "error" not in r]
    for case in sorted({r["case"] for r in delta if r["group"] == "chunk"}):
        by = {r["impl"]: r for r in delta if r["group"] == "chunk" and r["case"] == case}
        for rival, floor in (("transformers-torch", 10.0), ("flash-linear-attention", 1.0)):
            if "tritonlm" in by and rival in by:
                s = by[rival]["fwd_bwd_ms"] / by["tritonlm"]["fwd_bwd_ms"]
                add(f"gated delta fwd+bwd {case}: >= {floor}x {rival}", s >= floor, f"{s:.2f}x")
    for r in delta:
        if r["group"] == "decode":
            add(f"gated delta decode {r['case']}: state at >= 70% of copy bandwidth", r["pct_copy_bw"] >= 70,
                f"{r['pct_copy_bw']:.0f}%")
        if r["group"] == "conv1d":
            add(f"causal conv1d {r['case']}: >= 85% of copy bandwidth", r["pct_copy_bw"] >= 85,
                f"{r['pct_copy_bw']:.0f}%")
    post = [r for r in _rows(report, "post_training") if "error" not in r]
    for group in sorted({r["group"] for r in post}):
        by = {r["impl"]: r for r in post if r["group"] == group}
        ours, eager, liger = by.get("tritonlm"), by.get("torch (materialised logits)"), by.get("liger-kernel")
        if ours and eager and group == "logp+entropy fwd":
            s = eager["ms"] / ours["ms"]
            add("post-training log-prob + entropy fwd: >= 10x the materialised-logits path", s >= 10.0,
                f"{s:.1f}x ({ours['ms']:.2f} ms vs {eager['ms']:.2f} ms)")
        if ours and eager:
            m = ours["peak_MiB"] / eager["peak_MiB"]
            add(f"post-training {group}: peak memory <= 1/10 the materialised-logits path", m <= 0.1, f"{m:.3f}")
        if ours and liger:
            s, m = liger["ms"] / ours["ms"], ours["peak_MiB"] / liger["peak_MiB"]
            add(f"post-training {group}: no slower than Liger at no more memory", s >= 1.0 and m <= 1.0,
                f"{s:.2f}x Liger's speed, {m:.2f}x its peak memory")
    steps = [r for r in _rows(report, "train_step") if r.get("mean_s")]
    for preset in sorted({r["preset"] for r in steps}):
        by = {r["impl"]: r for r in steps if r["preset"] == preset}
        if "fused" in by and "reference" in by:
            s = by["reference"]["mean_s"] / by["fused"]["mean_s"]
            add(f"train step {preset}: fused >= 1.5x reference eager", s >= 1.5, f"{s:.2f}x")
        if "fused" in by and "compiled-reference" in by:
            s = by["compiled-reference"]["mean_s"] / by["fused"]["mean_s"]
            add(f"train step {preset}: fused >= 1.1x torch.compile(reference)", s >= 1.1, f"{s:.2f}x")
    hf = {r["impl"]: r for r in _rows(report, "hf_train_step") if "error" not in r}
    if "tritonlm" in hf and "unpatched" in hf:
        s = hf["unpatched"]["step_ms"] / hf["tritonlm"]["step_ms"]
        add("HF Llama step: apply_kernels >= 1.2x unpatched eager", s >= 1.2, f"{s:.2f}x")
        rivals = [hf[k] for k in ("unpatched", "liger-kernel") if k in hf]
        lowest = min(r["peak_MiB"] for r in rivals)
        add("HF Llama step: peak memory below unpatched and Liger", hf["tritonlm"]["peak_MiB"] < lowest,
            f"{hf['tritonlm']['peak_MiB']:.1f} MiB vs {lowest:.1f} MiB")
    if "tritonlm" in hf and "liger-kernel" in hf:
        s = hf["liger-kernel"]["step_ms"] / hf["tritonlm"]["step_ms"]
        add("HF Llama step: apply_kernels ahead of Liger's patch", s >= 1.0, f"{s:.2f}x")
    for r in _rows(report, "activation_memory"):
        if r["seq"] == 4096:
            add(f"activation memory {r['preset']} seq 4096: fused <= 1/8 reference", r["ratio"] <= 0.125,
                f"{r['ratio']:.3f}")
    return out


def plots(report, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    att = [r for r in _rows(report, "attention") if "error" not in r]
    if att:
        fig, ax = plt.subplots(figsize=(7, 4))
        for impl in sorted({r["impl"] for r in att}):
            for d in sorted({r["d"] for r in att}):
                pts = sorted((r["seq"], r["fwd_TFLOPs"]) for r in att if r["impl"] == impl and r["d"] == d)
                ax.plot(*zip(*pts), "o-", label=f"{impl} d{d}")
        ax.set(xscale="log", xlabel="sequence length", ylabel="forward TFLOP/s (causal)", title="causal attention")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "attention.png", dpi=110)
        plt.close(fig)
        made.append("attention.png")
    ops = [r for r in _rows(report, "ops") if "error" not in r]
    if ops:
        fig, ax = plt.subplots(figsize=(9, 4))
        labels, values = [], []
        for r in ops:
            if r["impl"] == "tritonlm":
                labels.append(f"{r['op']} {r['mode']}\n{r['shape']}")
                values.append(r["pct_copy_bw"])
        ax.bar(range(len(values)), values)
        ax.axhline(85, color="red", ls="--", label="target 85%")
        ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=6)
        ax.set(ylabel="% of measured copy bandwidth", title="tritonlm memory-bound kernels")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ops_bandwidth.png", dpi=110)
        plt.close(fig)
        made.append("ops_bandwidth.png")
    return made


def _table(rows, cols):
    if not rows:
        return "_none_\n"
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))

    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |\n" for r in rows)


def render_markdown(report) -> str:
    env, ceil = report["environment"], report["ceilings"]
    md = [f"# tritonlm GPU suite report{' (CPU SMOKE RUN: NOT GPU FIGURES)' if report['smoke'] else ''}", "",
          f"Started {report['started']}; total {report.get('total_seconds')} s.", "",
          "## Environment", "", _table([env], list(env)), "## Machine ceilings (measured this run)", "",
          f"copy bandwidth {ceil['copy_GBps']:.0f} GB/s; {ceil['matmul_dtype']} matmul {ceil['matmul_TFLOPs']:.0f} "
          "TFLOP/s", "", "## Verdicts (§Performance targets)", "",
          _table(report.get("verdicts", []), ["target", "verdict", "detail"])]
    for name, cols in (("kernel_tests", ["tests", "passed", "failed", "errored", "not run", "pytest exit code", "log"]), ("ops", ["op", "shape", "dtype", "impl", "mode", "ms", "GBps", "pct_copy_bw", "error"]),
                       ("attention", ["shape", "dtype", "impl", "fwd_ms", "fwd_bwd_ms", "fwd_TFLOPs", "fwd_bwd_TFLOPs", "fwd_pct_matmul_peak", "error"]),
                       ("attention_variants", ["group", "case", "ms", "GBps", "pct_copy_bw", "error"]),
                       ("decode", ["group", "impl", "case", "ms", "GBps", "pct_copy_bw", "tokens_per_s", "cache_MiB",
                                   "dense_context_MiB", "error"]),
                       ("lm_head_loss", ["shape", "dtype", "impl", "fwd_bwd_ms", "peak_MiB", "error"]),
                       ("moe", ["shape", "dtype", "impl", "fwd_ms", "fwd_bwd_ms", "fwd_TFLOPs", "fwd_bwd_TFLOPs", "error"]),
                       ("gated_delta", ["group", "impl", "case", "fwd_ms", "fwd_bwd_ms", "ms", "GBps", "pct_copy_bw",
                                        "error"]),
                       ("train_step", ["preset", "impl", "batch", "seq", "mean_s", "std_s", "tokens_per_s", "mfu", "train_TFLOPs", "peak_bytes", "error"]),
                       ("hf_train_step", ["shape", "dtype", "impl", "step_ms", "tokens_per_s", "peak_MiB", "error"]),
                       ("sweep", ["kernel", "key", "config", "ms", "vs_shipped", "best", "shipped_config", "error"]),
                       ("activation_memory", ["preset", "seq", "reference", "fused", "ratio"])):
        sec = report["sections"].get(name)
        md += [f"## {name}", ""]
        if sec is None:
            md += ["_not run_", ""]
        elif "skipped" in sec or "error" in sec:
            md += [f"**{sec.get('skipped') or sec.get('error')}**", ""]
            if "traceback" in sec:
                md += ["```", sec["traceback"], "```", ""]
        else:
            md += [_table(sec.get("rows", []), cols), ""]
            if "table" in sec:
                md += [f"Tuned launch table written: `{sec['table']}` ({sec['entries']} entries beating the shipped "
                       "configuration by >= 3%); commit it as `kernels/tuned/<gpu>.json` for the launchers to use.", ""]
    for p in report.get("plots", []):
        md += [f"![{p}]({p})", ""]
    return "\n".join(md)
