"""The remaining CLI commands (accounting, tokenize, bench) and the profiler annotations."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tritonlm import ModelConfig, TransformerLM, profiling

REPO = Path(__file__).resolve().parents[2]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tritonlm.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=env)


def test_accounting_cli_breakdown_and_activations():
    r = _cli("accounting", "--preset", "gpt2-xl", "--seq-len", "1024", "--activations",
             "--activation-seq-lens", "512", "4096")
    assert r.returncode == 0, r.stderr
    assert "1,640,452,800" in r.stdout and "57.5%" in r.stdout and "28.6%" in r.stdout and "9.2%" in r.stdout
    assert "fused/ref" in r.stdout and "4096" in r.stdout
    bad = _cli("accounting", "--preset", "gpt2-xl", "--seq-len", "0")
    assert bad.returncode == 2 and "positive" in bad.stderr


def test_tokenize_cli_train_encode_stats(tmp_path):
    src = tmp_path / "text.txt"
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(300)]
    src.write_text(" ".join(rng.choice(words) for _ in range(5000)) + "<|endoftext|>more text here\n" * 50)
    r = _cli("tokenize", str(src), "--vocab-size", "300", "--out", str(tmp_path / "tok"))
    assert r.returncode == 0, r.stderr
    assert "300 tokens" in r.stdout and (tmp_path / "tok" / "vocab.json").exists()
    r = _cli("tokenize", str(src), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "t.npy"),
             "--workers", "2")
    assert r.returncode == 0, r.stderr
    import numpy as np

    from tritonlm.tokenizer import load_tokenizer

    arr = np.load(tmp_path / "t.npy")
    assert arr.dtype == np.uint16
    assert arr.tolist() == load_tokenizer(tmp_path / "tok").encode(src.read_text())
    r = _cli("tokenize", str(src), "--stats", "--tokenizer", str(tmp_path / "tok"))
    assert r.returncode == 0 and "bytes/token" in r.stdout
    r = _cli("tokenize", str(src))
    assert r.returncode == 2 and "--vocab-size" in r.stderr


def test_bench_cli_json_smoke():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = _cli("bench", "--preset", "tiny", "--seq-lens", "16", "--batch", "1", "--impls", "reference", "fused",
             "--rounds", "1", "--warmup", "1", "--json", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout)
    assert data["gpu_figures"] is torch.cuda.is_available()
    assert {row["impl"] for row in data["rows"]} == {"reference", "fused"}
    assert all(row["tokens_per_s"] > 0 for row in data["rows"])
    bad = _cli("bench", "--impls", "turbo")
    assert bad.returncode == 2 and "unknown implementation" in bad.stderr


def test_every_command_has_help():
    for cmd in ("train", "generate", "tokenize", "accounting", "bench", "kernels"):
        r = _cli(cmd, "--help")
        assert r.returncode == 0 and "usage" in r.stdout


def test_profiler_labels_modules_and_kernel_launches():
    model = TransformerLM(**ModelConfig.preset("tiny", vocab_size=64, context_length=16, num_layers=1).model_kwargs(),
                          backend="triton")
    handles = profiling.annotate(model)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(torch.randint(0, 64, (1, 16))).sum().backward()
    finally:
        for h in handles:
            h.remove()
        profiling.enable(False)
    names = {e.key for e in prof.key_averages()}
    assert {"layers.0.attn", "layers.0.ffn", "layers.0.ln1", "lm_head"} <= names
    assert {"tritonlm::rms_norm_fwd", "tritonlm::flash_attention_fwd", "tritonlm::flash_attention_bwd",
            "tritonlm::swiglu_fwd", "tritonlm::rope_fwd"} <= names


def test_kernel_ranges_are_off_by_default():
    assert not profiling.enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        from tritonlm.kernels import swiglu_gate

        swiglu_gate(torch.randn(8), torch.randn(8))
    assert "tritonlm::swiglu_fwd" not in {e.key for e in prof.key_averages()}
