"""Optimizer, schedule, clipping, batching, checkpointing and the training job end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tritonlm import TransformerLM
from tritonlm.checkpoint import load_checkpoint, save_checkpoint
from tritonlm.data import get_batch
from tritonlm.optim import AdamW, clip_grad_norm_, cosine_lr_schedule
from tritonlm.train import TrainConfig, TrainError, train

REPO = Path(__file__).resolve().parents[2]


def test_adamw_matches_torch_over_steps():
    torch.manual_seed(0)
    w0 = torch.randn(5, 7)
    ours, theirs = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    opt1 = AdamW([ours], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt2 = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(20):
        g = torch.randn(5, 7)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt1.step()
        opt2.step()
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    state = opt1.state_dict()
    assert state["state"][0]["step"] == 20
    opt3 = AdamW([w0.clone().requires_grad_()], lr=1e-2)
    opt3.load_state_dict(state)
    torch.testing.assert_close(opt3.state[opt3.param_groups[0]["params"][0]]["exp_avg"], opt1.state[ours]["exp_avg"])


def test_cosine_schedule_boundaries():
    kw = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert cosine_lr_schedule(0, **kw) == 0.0
    assert cosine_lr_schedule(5, **kw) == pytest.approx(0.5)
    assert cosine_lr_schedule(10, **kw) == pytest.approx(1.0)
    assert cosine_lr_schedule(60, **kw) == pytest.approx(0.55)
    assert cosine_lr_schedule(110, **kw) == pytest.approx(0.1)
    assert cosine_lr_schedule(500, **kw) == pytest.approx(0.1)


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        g = torch.randn_like(p) * 3
        p.grad, q.grad = g.clone(), g.clone()
    norm = clip_grad_norm_(a, 1.0)
    torch_norm = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(norm, torch_norm)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    small = [torch.nn.Parameter(torch.ones(2))]
    small[0].grad = torch.full((2,), 0.1)
    clip_grad_norm_(small, 1.0)
    assert torch.equal(small[0].grad, torch.full((2,), 0.1))


def test_get_batch_windows_and_targets():
    data = np.arange(100, dtype=np.uint16)
    x, y = get_batch(data, 8, 10, "cpu")
    assert x.shape == y.shape == (8, 10) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(8, 9, dtype=torch.int64))
    assert int(x[:, 0].max()) <= 89
    starts = set()
    for _ in range(200):
        starts.update(get_batch(data, 8, 10, "cpu")[0][:, 0].tolist())
    assert starts == set(range(90))  # every valid window, including the last
    with pytest.raises(ValueError, match="tokens"):
        get_batch(np.arange(10), 2, 10, "cpu")


def _model():
    return TransformerLM(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)


def test_checkpoint_round_trip_bitwise(tmp_path):
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 8))).sum().backward()
    opt.step()
    save_checkpoint(model, opt, 7, tmp_path / "ck.pt", note="hi")
    model2 = _model()
    opt2 = AdamW(model2.parameters(), lr=1e-2)
    assert load_checkpoint(tmp_path / "ck.pt", model2, opt2) == 7
    for (k, v), v2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(v, v2), k
    assert opt2.state_dict()["state"][0]["step"] == 1
    import io

    buf = io.BytesIO()
    save_checkpoint(model, opt, 3, buf)
    buf.seek(0)
    assert load_checkpoint(buf, _model()) == 3


def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = _model()
    path = tmp_path / "ck.pt"
    save_checkpoint(model, None, 1, path)
    before = path.read_bytes()

    def crash(obj, f, *a, **k):
        f.write(b"partial garbage")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(model, None, 2, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind
    assert load_checkpoint(path, _model()) == 1


@pytest.fixture
def corpus(tmp_path):
    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park", "and", "then", "slept"]
    rng = np.random.default_rng(0)
    # a text with structure: sentences drawn from a few templates
    lines = []
    for _ in range(1500):
        i = rng.integers(0, 5)
        lines.append(f"the {words[1 + i]} {words[2 + i]} on the {words[4 + i]} and then {words[7 + i]}.")
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines))
    return path


def _cfg(corpus, out, **kw):
    base = dict(data=str(corpus), out=str(out), preset="tiny", max_steps=30, batch_size=8,
                model_overrides=dict(vocab_size=300, context_length=16, d_model=32, num_layers=1, num_heads=2,
                                     d_ff=64),
                eval_every=10, eval_batches=2, log_every=5, progress=False, sample_tokens=10, lr=1e-2, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def test_short_training_run_loss_drops_and_writes_outputs(corpus, tmp_path):
    summary = train(_cfg(corpus, tmp_path / "run"), say=lambda *a: None)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] - 1.0
    assert summary["final_val_loss"] < summary["unigram_entropy"]
    for name in ("checkpoint.pt", "summary.json", "tokenizer/vocab.json", "tokenizer/merges.txt"):
        assert (tmp_path / "run" / name).exists(), name
    assert isinstance(summary["sample"], str)


def test_mid_run_checkpoints_do_not_perturb_training(corpus, tmp_path):
    quiet = lambda *a: None  # noqa: E731
    train(_cfg(corpus, tmp_path / "plain", max_steps=8, sample_tokens=0), say=quiet)
    train(_cfg(corpus, tmp_path / "ckpt", max_steps=8, sample_tokens=0, checkpoint_every=3), say=quiet)
    a = torch.load(tmp_path / "plain" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "ckpt" / "checkpoint.pt", weights_only=False)
    assert a["iteration"] == b["iteration"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_resume_from_mid_run_checkpoint_is_bitwise_identical(corpus, tmp_path, monkeypatch):
    quiet = lambda *a: None  # noqa: E731
    train(_cfg(corpus, tmp_path / "full", max_steps=8, sample_tokens=0), say=quiet)
    # interrupted run: stop after the step-4 checkpoint by failing at step 5's batch
    import tritonlm.train as T

    real = T.batch_at
    calls = {"n": 0}

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] > 4:  # 4 training batches, then the crash
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(T, "batch_at", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(_cfg(corpus, tmp_path / "crashed", max_steps=8, sample_tokens=0, checkpoint_every=4,
                   eval_every=0), say=quiet)
    monkeypatch.setattr(T, "batch_at", real)
    assert torch.load(tmp_path / "crashed" / "checkpoint.pt", weights_only=False)["iteration"] == 4
    train(_cfg(corpus, tmp_path / "crashed", max_steps=8, sample_tokens=0, resume=True), say=quiet)
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "crashed" / "checkpoint.pt", weights_only=False)["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_generation_is_deterministic_under_a_seed(corpus, tmp_path):
    from tritonlm.generate import generate_text, load_for_generation

    train(_cfg(corpus, tmp_path / "g", sample_tokens=0), say=lambda *a: None)
    model, tok = load_for_generation(tmp_path / "g", device="cpu", backend="reference")
    one = generate_text(model, tok, "the cat", 14, temperature=1.0, top_k=10, seed=5)
    two = generate_text(model, tok, "the cat", 14, temperature=1.0, top_k=10, seed=5)
    assert one == two and len(one) > 0


def test_z_loss_and_label_smoothing_reach_the_training_loss(corpus, tmp_path, monkeypatch):
    """The first logged loss is taken before any update, on the same batch: with z_loss it exceeds the plain
    run's by z_loss · mean(lse²), and at initialisation lse ≈ log(vocab) (near-uniform logits)."""
    def first_loss(name, **kw):
        train(_cfg(corpus, tmp_path / name, max_steps=1, log_every=1, eval_every=1, eval_batches=1, sample_tokens=0, **kw),
              say=lambda *a: None)
        return json.loads((tmp_path / name / "log.jsonl").read_text().splitlines()[0])["loss"]

    plain = first_loss("plain")
    z = first_loss("z", z_loss=1e-2)
    expected_extra = 1e-2 * np.log(300) ** 2
    assert abs((z - plain) - expected_extra) < 0.05 * expected_extra
    # smoothing barely moves a near-uniform first loss, so check the option reaches the model's loss instead
    from tritonlm.modules.model import TransformerLM as LM

    seen = []
    original = LM._loss_from_hidden
    monkeypatch.setattr(LM, "_loss_from_hidden",
                        lambda self, h, t, **kw: seen.append(kw) or original(self, h, t, **kw))
    first_loss("smooth", label_smoothing=0.5)
    assert dict(label_smoothing=0.5, z_loss=0.0) in seen  # training steps
    assert {"aux_loss": False} in seen  # validation: the plain cross-entropy (no smoothing, z-loss or router term)
    with pytest.raises(TrainError, match="--z-loss"):
        train(_cfg(corpus, tmp_path / "bad", z_loss=-1.0), say=lambda *a: None)
    with pytest.raises(TrainError, match="--label-smoothing"):
        train(_cfg(corpus, tmp_path / "bad", label_smoothing=2.0), say=lambda *a: None)


def test_bad_inputs(tmp_path, corpus):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TrainError, match="empty"):
        train(_cfg(empty, tmp_path / "e"), say=lambda *a: None)
    short = tmp_path / "short.txt"
    short.write_text("tiny text only")
    with pytest.raises(TrainError, match="too few"):
        train(_cfg(short, tmp_path / "s"), say=lambda *a: None)
    with pytest.raises(TrainError, match="unknown preset"):
        train(_cfg(corpus, tmp_path / "p", preset="gigantic"), say=lambda *a: None)
    with pytest.raises(TrainError, match="resume"):
        train(_cfg(corpus, tmp_path / "r", resume=True), say=lambda *a: None)
    train(_cfg(corpus, tmp_path / "r", max_steps=2, sample_tokens=0), say=lambda *a: None)
    other = _cfg(corpus, tmp_path / "r", resume=True, max_steps=4)
    other.model_overrides = {**other.model_overrides, "d_model": 64}
    with pytest.raises(TrainError, match="d_model 32 vs 64"):
        train(other, say=lambda *a: None)


def _cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "tritonlm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_cli_bad_inputs_exit_nonzero_with_one_line(tmp_path):
    r = _cli("train", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "not found" in r.stderr
    r = _cli("train", "--preset", "nope", "--out", str(tmp_path / "o"), "--max-steps", "1")
    assert r.returncode == 2 and "unknown preset" in r.stderr
    r = _cli("accounting", "--preset", "nope")
    assert r.returncode == 2 and "unknown preset" in r.stderr
    if not torch.cuda.is_available():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        r = _cli("train", "--backend", "triton", "--out", str(tmp_path / "t"), "--max-steps", "1", env=env)
        assert r.returncode == 2 and "TRITON_INTERPRET=1" in r.stderr and r.stderr.strip().count("\n") == 0


def test_cli_main_job_on_embedded_corpus(tmp_path):
    out = tmp_path / "run"
    r = _cli("train", "--out", str(out), "--max-steps", "12", "--log-every", "4", "--eval-every", "12",
             "--sample-tokens", "8", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "embedded default corpus" in r.stdout and "sample" in r.stdout
    g = _cli("generate", "--checkpoint", str(out), "--prompt", "The", "--max-new-tokens", "5", "--seed", "0",
             "--temperature", "0")
    assert g.returncode == 0, g.stderr[-2000:]
    # the prompt is echoed: what matters is what follows it, and the count on stderr is of generated tokens
    import re

    n_new = int(re.search(r"\[(\d+) tokens", g.stderr).group(1))
    assert 1 <= n_new <= 5
    from tritonlm.generate import generate_ids, load_for_generation

    model, tok = load_for_generation(out, "cpu", "reference")
    expected = tok.decode(generate_ids(model, tok, "The", 5, temperature=0))
    assert g.stdout == "The" + expected + "\n"  # print() adds one newline after the text
    assert n_new == len(generate_ids(model, tok, "The", 5, temperature=0))
    # a prompt file: batched through the paged cache, each prompt's continuation what it gets alone
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The\nclass A:\n")
    g = _cli("generate", "--checkpoint", str(out), "--prompt-file", str(prompts), "--max-new-tokens", "5",
             "--temperature", "0")
    assert g.returncode == 0, g.stderr[-2000:]
    alone = [p + tok.decode(generate_ids(model, tok, p, 5, temperature=0)) for p in ("The", "class A:")]
    assert g.stdout == f"=== 1/2 ===\n{alone[0]}\n=== 2/2 ===\n{alone[1]}\n"
    assert "[2 prompts" in g.stderr and "tokens/s" in g.stderr


def test_ddp_and_fsdp_two_processes_gloo_match_single_process(tmp_path, corpus):
    common = ["train", "--data", str(corpus), "--max-steps", "4", "--log-every", "2", "--eval-every", "0",
              "--sample-tokens", "0", "--no-progress", "--vocab-size", "300", "--context-length", "16",
              "--d-model", "32", "--num-layers", "1", "--num-heads", "2", "--d-ff", "64", "--seed", "1",
              "--grad-clip", "0.05"]  # a cap every step's norm exceeds: FSDP must clip by the global norm
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_port", str(29500 + os.getpid() % 1000), "-m", "tritonlm.cli", *common,
                          "--batch-size", "4", "--out", str(tmp_path / "ddp")],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    single = _cli(*common, "--batch-size", "8", "--out", str(tmp_path / "one"), env=env)
    assert single.returncode == 0, single.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2
    c0, c1 = summary["rank_checksums"]
    assert c0 == c1  # replicas hold identical weights
    log_ddp = [json.loads(x)["loss"] for x in (tmp_path / "ddp" / "log.jsonl").read_text().splitlines()]
    log_one = [json.loads(x)["loss"] for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    assert len(log_ddp) == len(log_one) == 2  # steps 2 and 4: zip() alone would pass on an empty log
    norms = [json.loads(x)["grad_norm"] for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    assert min(norms) > 0.05  # the clip fired on the logged steps
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(log_ddp, log_one))
    # FSDP2 (fully_shard) over the same global batch: the gathered checkpoint equals DDP's weights
    fsdp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_port", str(29500 + (os.getpid() + 7) % 1000), "-m", "tritonlm.cli", *common,
                           "--batch-size", "4", "--fsdp", "--out", str(tmp_path / "fsdp")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    a = torch.load(tmp_path / "fsdp" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "ddp" / "checkpoint.pt", weights_only=False)["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert type(a[k]) is torch.Tensor  # full tensors, not shards
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_optimizer_state_converts_between_index_and_name_keys(tmp_path):
    from tritonlm.checkpoint import optimizer_param_names, optimizer_state_keyed
    from tritonlm.train import _param_groups

    model = _model()
    opt = AdamW(_param_groups(model, 0.1), lr=1e-2)
    model(torch.randint(0, 50, (2, 8))).sum().backward()
    opt.step()
    by_index = opt.state_dict()
    names = optimizer_param_names(model, opt)
    # the optimizer's order: the decayed matrices first, then the vectors (norm gains)
    named = list(model.named_parameters())
    assert names == [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]
    by_name = optimizer_state_keyed(by_index, names, by_name=True)
    assert set(by_name["state"]) <= set(names) and by_name["param_groups"][0]["params"][0] == names[0]
    back = optimizer_state_keyed(by_name, names, by_name=False)
    fresh = AdamW(_param_groups(_model(), 0.1), lr=1e-2)
    fresh.load_state_dict(back)
    for k, v in fresh.state_dict()["state"].items():
        torch.testing.assert_close(v["exp_avg"], by_index["state"][k]["exp_avg"])
    assert optimizer_state_keyed(by_index, names, by_name=False) is by_index  # already in that form

    # the public loader takes a name-keyed (FSDP-style) optimizer state too, matching names through the model
    save_checkpoint(model, None, 5, tmp_path / "named.pt", optimizer_state=by_name)
    model2 = _model()
    opt2 = AdamW(_param_groups(model2, 0.1), lr=1e-2)
    assert load_checkpoint(tmp_path / "named.pt", model2, opt2) == 5
    for k, v in opt2.state_dict()["state"].items():
        assert torch.equal(v["exp_avg_sq"], by_index["state"][k]["exp_avg_sq"])
    with pytest.raises(ValueError, match="parameters"):
        optimizer_state_keyed(by_name, names[:-1], by_name=False)


def test_index_keyed_optimizer_state_loads_without_name_lookup(tmp_path):
    # an optimizer may hold tensors that are not model parameters; an ordinary (index-keyed) checkpoint of it
    # loads as torch's own load_state_dict would, with no name matching involved
    model = _model()
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = AdamW(list(model.parameters()) + [extra], lr=1e-2)
    (model(torch.randint(0, 50, (2, 8))).sum() + extra.sum()).backward()
    opt.step()
    save_checkpoint(model, opt, 2, tmp_path / "ck.pt")
    model2, extra2 = _model(), torch.nn.Parameter(torch.zeros(3))
    opt2 = AdamW(list(model2.parameters()) + [extra2], lr=1e-2)
    assert load_checkpoint(tmp_path / "ck.pt", model2, opt2) == 2
    last = len(opt.param_groups[0]["params"]) - 1
    assert torch.equal(opt2.state_dict()["state"][last]["exp_avg"], opt.state_dict()["state"][last]["exp_avg"])


def test_document_ids_from_end_of_text_and_document_mask_training(corpus, tmp_path):
    from tritonlm.data import document_ids

    x = torch.tensor([[5, 0, 7, 7, 0, 0, 3]])
    # an end-of-text token (0) closes its document; the next token starts the following one
    assert document_ids(x, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    text = corpus.read_text().replace(".\n", ".<|endoftext|>\n")
    docs = tmp_path / "docs.txt"
    docs.write_text(text)
    lines = []
    summary = train(_cfg(docs, tmp_path / "run", document_mask=True, max_steps=20), say=lines.append)
    assert any("--document-mask" in line for line in lines)
    assert summary["final_val_loss"] < summary["unigram_entropy"]


def test_evaluation_runs_on_its_own_schedule(corpus, tmp_path):
    """--eval-every 5 with --log-every 7: validation at steps 5 and 10 (the end), whatever the logging does."""
    train(_cfg(corpus, tmp_path / "run", max_steps=10, log_every=7, eval_every=5, sample_tokens=0), say=lambda *a: None)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "val_loss" in e] == [5, 10]
    assert [e["step"] for e in log if "loss" in e] == [7, 10]


def test_bin_token_files_use_the_width_the_vocabulary_needs(tmp_path, corpus):
    """A raw .bin has no dtype: uint16 for vocabularies up to 65,536 ids, uint32 beyond (ids above 65,535 kept)."""
    rng = np.random.default_rng(0)
    small = tmp_path / "small.bin"
    rng.integers(0, 300, 4000).astype(np.uint16).tofile(small)
    big = tmp_path / "big.bin"
    ids = rng.integers(0, 70_000, 4000).astype(np.uint32)
    ids[:10] = 69_999
    ids.tofile(big)
    train(_cfg(small, tmp_path / "s", max_steps=2, sample_tokens=0, eval_every=0), say=lambda *a: None)
    cfg = _cfg(big, tmp_path / "b", max_steps=2, sample_tokens=0, eval_every=0)
    cfg.model_overrides = {**cfg.model_overrides, "vocab_size": 70_000}
    train(cfg, say=lambda *a: None)  # read as uint16 the ids would wrap below 65,536 and the run still "work"
    from tritonlm.data import prepare_data

    tokens, _, _ = prepare_data(cfg, tmp_path / "b", 70_000, say=lambda *a: None)
    assert tokens.dtype == np.uint32 and int(tokens[:10].min()) == 69_999 and len(tokens) == 4000
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(TrainError, match="whole number"):
        train(_cfg(odd, tmp_path / "o", max_steps=2), say=lambda *a: None)


def test_resume_truncates_the_log_and_keeps_a_finished_checkpoint(corpus, tmp_path):
    run = tmp_path / "run"
    train(_cfg(corpus, run, max_steps=4, log_every=1, eval_every=0, sample_tokens=0), say=lambda *a: None)
    log = run / "log.jsonl"
    # a crashed later run logged steps 5-6 but never saved them
    log.write_text(log.read_text() + '{"step": 5, "loss": 99.0}\n{"step": 6, "loss": 99.0}\n')
    before = (run / "checkpoint.pt").read_bytes()
    with pytest.raises(TrainError, match="step 4 already"):
        train(_cfg(corpus, run, max_steps=3, resume=True, sample_tokens=0), say=lambda *a: None)
    assert (run / "checkpoint.pt").read_bytes() == before  # untouched
    with pytest.raises(TrainError, match="previous run"):
        train(_cfg(corpus, run, max_steps=6, sample_tokens=0), say=lambda *a: None)
    train(_cfg(corpus, run, max_steps=6, log_every=1, eval_every=0, resume=True, sample_tokens=0),
          say=lambda *a: None)
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert all(json.loads(line)["loss"] < 99 for line in log.read_text().splitlines())
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text() + "\nmore text.")
    with pytest.raises(TrainError, match="tokenizer in .* was trained on other data"):
        train(_cfg(other, run, max_steps=8, resume=True, sample_tokens=0), say=lambda *a: None)
    train(_cfg(corpus, run, max_steps=7, overwrite=True, eval_every=0, sample_tokens=0), say=lambda *a: None)
    assert len(log.read_text().splitlines()) == 2  # started over: log_every 5 -> steps 5 and 7


def test_sampling_top_k_top_p_and_temperature_frequencies():
    """Empirical frequencies over 20K draws against the distribution worked out by hand for each filter."""
    from tritonlm.generate import sample_next

    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log().expand(20_000, 5)
    gen = torch.Generator().manual_seed(0)

    def freq(**kw):
        draws = sample_next(logits, generator=gen, **kw)
        return torch.bincount(draws, minlength=5).double() / len(draws)

    # top-k 2: the two largest renormalised, 2/3 and 1/3
    torch.testing.assert_close(freq(top_k=2), torch.tensor([2 / 3, 1 / 3, 0, 0, 0], dtype=torch.float64), atol=0.015,
                               rtol=0)
    # top-p 0.7: tokens are kept until the mass before them reaches 0.7 -> {0.5, 0.25}; 0.9 -> first three
    torch.testing.assert_close(freq(top_p=0.7), torch.tensor([2 / 3, 1 / 3, 0, 0, 0], dtype=torch.float64),
                               atol=0.015, rtol=0)
    torch.testing.assert_close(freq(top_p=0.9), torch.tensor([0.5, 0.25, 0.15, 0, 0], dtype=torch.float64) / 0.9,
                               atol=0.015, rtol=0)
    # temperature 2 flattens: p^(1/2) renormalised
    flat = probs.double().sqrt() / probs.double().sqrt().sum()
    torch.testing.assert_close(freq(temperature=2.0), flat, atol=0.015, rtol=0)
    assert torch.equal(sample_next(logits[:3], temperature=0), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits[:1], top_p=1.5)


def test_moe_training_logs_aux_loss_and_expert_load_and_generates(corpus, tmp_path):
    """A mixture-of-experts run: the loss still drops, each log line carries the load-balancing loss and the least /
    most loaded expert's share, and the checkpoint loads for generation with its MoE layers."""
    from tritonlm.generate import generate_ids, load_for_generation

    cfg = _cfg(corpus, tmp_path / "moe", max_steps=20, preset="tiny-moe")
    cfg.model_overrides = {**cfg.model_overrides, "num_experts": 4, "experts_per_token": 2, "moe_d_ff": 32}
    said = []
    train(cfg, say=said.append)
    assert any("active per token" in line and "4 experts" in line for line in said)
    log = [json.loads(line) for line in (tmp_path / "moe" / "log.jsonl").read_text().splitlines()]
    train_lines = [e for e in log if "loss" in e]
    assert train_lines[-1]["loss"] < train_lines[0]["loss"]
    for e in train_lines:
        assert e["aux_loss"] > 0 and 0 <= e["expert_load_min"] <= 0.25 <= e["expert_load_max"] <= 1
    model, tokenizer = load_for_generation(tmp_path / "moe", device="cpu", backend="reference")
    assert model.config.num_experts == 4 and type(model.layers[0].ffn).__name__ == "MoEFFN"
    assert len(generate_ids(model, tokenizer, "the cat", 5, temperature=0)) <= 5
