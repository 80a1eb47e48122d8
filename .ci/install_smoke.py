"""Install smoke: run with the Python of a fresh virtual environment that holds a built tritonlm wheel (never an
editable install), from a directory outside the checkout. Usage::

    VENV/bin/python .ci/install_smoke.py CHECKOUT

``CHECKOUT`` is read only to list what the wheel must carry (every package folder, every tuned launch table); it is
never put on ``sys.path``. Checks, in order: the import resolves to the install; every package folder of the
checkout imports under its ``tritonlm.`` name; no ``kernels`` / ``modules`` top-level name was installed; the tuned
tables are there and validate; without the ``hf`` extra, ``tritonlm.hf`` imports and its weight I/O fails with one
line naming the extra; one kernel runs under the Triton interpreter against PyTorch; ``tritonlm --help``; a two-step
``tritonlm train`` on the embedded corpus. Exits non-zero, saying which check failed.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernel call runs on the CPU

import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

CHECKOUT = Path(sys.argv[1]).resolve()
# the installed package name of each source folder (the design card's layout)
ROOTS = {"tritonlm": "tritonlm", "kernels": "tritonlm.kernels", "modules": "tritonlm.modules"}


def fail(why: str):
    print(f"install smoke: FAILED: {why}", file=sys.stderr)
    sys.exit(1)


def step(what: str):
    print(f"install smoke: {what}", flush=True)


def expected_packages() -> list[str]:
    names = []
    for folder, name in ROOTS.items():
        for init in sorted((CHECKOUT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(CHECKOUT / folder)
            if "__pycache__" not in rel.parts:
                names.append(".".join((name, *rel.parts)))
    return names


started = time.perf_counter()
if any(Path(p or os.curdir).resolve() == CHECKOUT for p in sys.path):
    fail(f"the checkout {CHECKOUT} is on sys.path")

import tritonlm  # noqa: E402

where = Path(tritonlm.__file__).resolve()
if CHECKOUT in where.parents:
    fail(f"tritonlm imported from the checkout ({where}), not from the install")
step(f"tritonlm {getattr(tritonlm, '__version__', '?')} imported from {where.parent}")

packages = expected_packages()
for name in packages:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        fail(f"import {name}: {type(e).__name__}: {e}")
for stray in ("kernels", "modules"):
    spec = importlib.util.find_spec(stray)
    if spec is not None and spec.origin and str(Path(spec.origin).resolve()).startswith(sys.prefix):
        fail(f"the wheel installed a top-level {stray!r} package ({spec.origin})")
step(f"{len(packages)} packages import: {', '.join(packages)}")

# tuned launch tables: every table of the checkout is in the install, and each one validates
from tritonlm.kernels import tuned  # noqa: E402

shipped = sorted(p.name for p in (CHECKOUT / "kernels" / "tuned").glob("*.json"))
installed = sorted(p.name for p in Path(tuned.TUNED_DIR).glob("*.json"))
if shipped != installed:
    fail(f"tuned tables in the checkout {shipped} != installed {installed}")
for name in installed:
    tuned.load.cache_clear()
    tuned.load(name[: -len(".json")])
step(f"tuned launch tables load ({len(installed)}: {', '.join(installed) or 'none committed yet'}; "
     f"tunables known: {len(tuned.fields())})")

# without the hf extra: the plain-JSON parts work, weight I/O says which extra it needs
if importlib.util.find_spec("transformers") is None and importlib.util.find_spec("safetensors") is None:
    import tritonlm.hf  # noqa: E402

    with tempfile.TemporaryDirectory() as d:
        cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
               "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 2, "max_position_embeddings": 32}
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        tritonlm.hf.model_config_from_hf(tritonlm.hf.read_hf_config(d))
        try:
            tritonlm.hf.from_pretrained(d)
        except ImportError as e:
            message = str(e)
            if "tritonlm[hf]" not in message or "\n" in message:
                fail(f"from_pretrained without the hf extra: expected one line naming tritonlm[hf], got {message!r}")
        else:
            fail("from_pretrained without the hf extra did not raise")
    step(f"without the hf extra: tritonlm.hf imports, from_pretrained says: {message}")
else:
    step("transformers/safetensors are installed here: the no-extra check is not applicable")

# one kernel under the interpreter, against PyTorch's own op
import torch  # noqa: E402

from tritonlm.kernels import rms_norm  # noqa: E402

x = torch.randn(3, 5, 40)
w = torch.randn(40)
got = rms_norm(x, w, 1e-5)
want = torch.nn.functional.rms_norm(x, (40,), w, 1e-5)
if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
    fail(f"rms_norm under the interpreter differs from F.rms_norm by {(got - want).abs().max():.3g}")
step(f"rms_norm ran under the Triton interpreter, max |diff| vs F.rms_norm {(got - want).abs().max():.1e}")

# the console script
cli = Path(sys.executable).parent / "tritonlm"
run = subprocess.run([str(cli), "--help"], capture_output=True, text=True)
if run.returncode != 0 or "train" not in run.stdout:
    fail(f"tritonlm --help exited {run.returncode}: {run.stderr.strip()[-500:]}")
step("tritonlm --help")
with tempfile.TemporaryDirectory() as d:
    run = subprocess.run([str(cli), "train", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "8",
                          "--no-progress", "--out", os.path.join(d, "run")],
                         capture_output=True, text=True, cwd=d)
    if run.returncode != 0:
        fail(f"tritonlm train exited {run.returncode}: {(run.stderr or run.stdout).strip()[-800:]}")
    if not (Path(d) / "run" / "checkpoint.pt").is_file():
        fail("tritonlm train wrote no checkpoint.pt")
    done = [line for line in run.stdout.splitlines() if line.startswith("done:")]
    step(f"tritonlm train, 2 steps on the embedded corpus: {done[0] if done else run.stdout.splitlines()[-1]}")
step(f"passed in {time.perf_counter() - started:.1f}s")
