#!/usr/bin/env bash
# The one-shot GPU suite: bash bench/gpu_suite.sh OUTDIR  (see bench/gpu_suite.py; < 8 minutes on an H100/H200)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash bench/gpu_suite.sh OUTDIR [--smoke]}"
shift
# a machine with torch + triton already installed (the lent GPU has torch 2.11 + Triton 3.6) only needs the
# package itself on the path; no dependency is downloaded
export PYTHONPATH="$PWD/.suite_pkg${PYTHONPATH:+:$PYTHONPATH}"
rm -rf .suite_pkg && mkdir -p .suite_pkg/tritonlm
cp -r tritonlm/. .suite_pkg/tritonlm/
cp -r kernels .suite_pkg/tritonlm/kernels
cp -r modules .suite_pkg/tritonlm/modules
# optional baselines carried as wheels in .whl/ (the GPU machine has no network), e.g. Liger-Kernel: see
# profiles/README.md. --no-deps: torch and triton are the machine's own.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .suite_pkg/site .whl/*.whl
  export PYTHONPATH="$PWD/.suite_pkg/site:$PYTHONPATH"
fi
python3 -c "import einops, regex, numpy, tqdm" 2>/dev/null || python3 -m pip install -q einops regex numpy tqdm
PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py "$out" "$@"
