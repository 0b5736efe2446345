#!/usr/bin/env bash
# The GPU machine's side of the wheelhouse (cluster/wheelhouse.py): check and rejoin the parts carried there,
# install them into a venv that sees the image's CUDA torch, then run jobs.train on one GPU with the HF engine
# and print its step figures (bench/gpu_train.py). Run from the repository root:
#   cluster/gpu_box.sh [bench.gpu_train args]          default: --shape 1.7b (configs/gpu-1-hf.yaml)
# Environment (defaults in brackets):
#   PYTHON       the interpreter that has torch, transformers and peft [python3]
#   PARTS        the folder holding p01, p02, ... [.cache/gpu-wheelhouse/cp312/parts]
#   VENV         the venv to make or reuse [.cache/gpu-venv]
#   MCPRL_CACHE  where the carried tiny-random build goes (the tokenizer of --shape) [.cache/gpu-mcprl]
#   EXTRA_SITE   only for the CPU test: a folder standing in for the image's site-packages
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PARTS=${PARTS:-.cache/gpu-wheelhouse/cp312/parts}
VENV=${VENV:-.cache/gpu-venv}
export MCPRL_CACHE=${MCPRL_CACHE:-$PWD/.cache/gpu-mcprl}
# No hub and no W&B on these machines: nothing may wait on the network.
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
t0=$(date +%s)
"$PYTHON" -m cluster.wheelhouse install --parts "$PARTS" --venv "$VENV" --cache "$MCPRL_CACHE" \
    ${EXTRA_SITE:+--extra-site "$EXTRA_SITE"}
echo "wheelhouse installed in $(( $(date +%s) - t0 )) s"
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")'
if [ $# -eq 0 ]; then set -- --shape 1.7b; fi
exec "$VENV/bin/python" -m bench.gpu_train "$@"
