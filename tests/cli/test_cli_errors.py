"""Bad input through the real console script: every case exits 2 with one line naming the bad value or file,
no traceback, before any expensive work; a tokenizer directory through the command line keeps its special tokens;
a closed pipe ends quietly."""

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


_SCRIPT = Path(sys.executable).parent / "tritonlm"


COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else ([shutil.which("tritonlm")] if shutil.which("tritonlm")
                                                  else [sys.executable, "-m", "tritonlm.cli"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "a_file").write_text("not a directory")
    bad_tok = d / "bad_tok"
    bad_tok.mkdir()
    (bad_tok / "vocab.json").write_text("{not json")
    (bad_tok / "merges.txt").write_text("#version: 0.2\n")
    text = d / "text.txt"
    text.write_text("hello world. " * 200)
    np.save(d / "neg.npy", np.array([1, 2, -3, 4] * 200, dtype=np.int64))
    from tritonlm import TransformerLM
    from tritonlm.checkpoint import save_checkpoint

    save_checkpoint(TransformerLM(50, 8, 16, 1, 2, 32), None, 0, d / "bare.pt")
    (d / "garbage.pt").write_bytes(b"\x00garbage" * 100)
    (d / "latin1.txt").write_bytes("café au lait ".encode() * 50 + b"caf\xe9 " + b"tail " * 10)
    (d / "prev").mkdir()
    (d / "prev" / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return d


CASES = [  # (argv with {d} for the fixture folder, text the one line must contain)
    ("train --lr -1 --out {d}/o1", "--lr -1.0"),
    ("train --weight-decay -1 --out {d}/o2", "--weight-decay -1.0"),
    ("train --log-every 0 --out {d}/o3", "--log-every 0"),
    ("train --eval-batches 0 --out {d}/o4", "--eval-batches 0"),
    ("train --grad-clip -1 --out {d}/o5", "--grad-clip -1.0"),
    ("train --z-loss -1 --out {d}/o6", "--z-loss -1.0"),
    ("train --device banana --out {d}/o7", "--device 'banana'"),
    ("train --out {d}/a_file", "not a directory"),
    ("train --num-kv-heads 3 --out {d}/o8", "num_kv_heads"),
    ("train --out {d}/prev", "holds a previous run"),
    ("train --data {d}/latin1.txt --out {d}/o11", "not valid UTF-8 at byte 703"),
    ("tokenize {d}/latin1.txt --vocab-size 300 --out {d}/t", "not valid UTF-8 at byte 703"),
    ("train --out {d}/prev --resume --overwrite", "contradict"),
    ("train --data {d}/text.txt --tokenizer {d}/bad_tok --out {d}/o9", "vocab.json"),
    ("train --data {d}/neg.npy --out {d}/o10", "negative token id"),
    ("generate --checkpoint {d}/bare.pt --prompt hi", "model_config"),
    ("generate --checkpoint {d}/garbage.pt --prompt hi", "garbage.pt"),
    ("generate --checkpoint {d}/bare.pt --prompt hi --top-p 2", "--top-p 2.0"),
    ("generate --checkpoint {d}/bare.pt --prompt hi --max-new-tokens -1", "--max-new-tokens -1"),
    ("accounting --activations --activation-seq-lens 0", "--activation-seq-lens"),
    ("tokenize {d}/text.txt --tokenizer {d}/bad_tok --output {d}/t.npy", "vocab.json"),
]


def _run(argv):
    return subprocess.run(COMMAND + argv, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_bad_inputs_exit_2_with_one_line(files):
    argvs = [case.format(d=files).split() for case, _ in CASES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_run, argvs))
    for (case, expected), r in zip(CASES, results):
        err = r.stderr.strip()
        assert r.returncode == 2, (case, r.returncode, err[-2000:])
        assert "Traceback" not in err and err.count("\n") == 0, (case, err[-2000:])
        assert expected in err, (case, err)
    assert not (files / "o1").exists()  # refused before creating the run directory
    assert torch.load(files / "bare.pt", weights_only=False)["iteration"] == 0  # the fixture is what it claims


def test_tokenizer_directory_keeps_its_special_tokens(tmp_path):
    """Trained with custom special tokens, a tokenizer directory encodes with those (not <|endoftext|>), and
    --errors replace lets non-UTF-8 input through."""
    text = tmp_path / "t.txt"
    text.write_text("hello <|a|> world <|b|> again " * 80)
    r = _run(["tokenize", str(text), "--vocab-size", "300", "--out", str(tmp_path / "tok"), "--special-tokens",
              "<|a|>", "<|b|>"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run(["tokenize", str(text), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "ids.npy")])
    assert r.returncode == 0, r.stderr[-2000:]
    from tritonlm.tokenizer import Tokenizer

    tok = Tokenizer.from_files(tmp_path / "tok" / "vocab.json", tmp_path / "tok" / "merges.txt", ["<|a|>", "<|b|>"])
    ids = np.load(tmp_path / "ids.npy").tolist()
    assert ids.count(tok._special_ids["<|b|>"]) == 80 and ids.count(tok._special_ids["<|a|>"]) == 80
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 " * 200)
    r = _run(["tokenize", str(bad), "--vocab-size", "280", "--out", str(tmp_path / "tok2"), "--errors", "replace"])
    assert r.returncode == 0, r.stderr[-2000:]


def test_closed_pipe_ends_quietly():
    """`tritonlm accounting ... | head -1`: the reader closes the pipe early; the command stops without a
    BrokenPipeError traceback, as `git log | head` does."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "tritonlm"
    if not script.exists():
        script = shutil.which("tritonlm")
    assert script, "the tritonlm console script is not installed beside this Python"
    # a reader that takes one line and closes the pipe while the writer still has most of its output to print
    cmd = (f"'{script}' accounting --preset tiny --activations --activation-seq-lens 32 64 128 256 512 "
           "| head -c 1 > /dev/null")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]
    assert r.returncode in (0, 141)  # 141: the writer reports the closed pipe, as SIGPIPE would
