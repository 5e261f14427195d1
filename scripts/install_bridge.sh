#!/usr/bin/env bash
# The Megatron-Bridge test stack in its own virtual environment (default .venv-bridge): python3.12, the
# package's pinned torch / megatron-core, megatron-bridge 0.6.2 without its dependency list (its
# fast-hadamard-transform is a source-only CUDA build), then the packages `import megatron.bridge` and its
# training loop need.  Transformer Engine and nvidia-resiliency-ext are not installed (no wheel runs here):
# tests/bridge/bridge_kit.py stands in for them where Bridge imports them unconditionally.
# Measured on the 2-core dev machine: 277 s (pip cache warm); then `make test-bridge` 115 s of tests (150 s wall).
# Usage: scripts/install_bridge.sh [PYTHON] [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3.12}
VENV=${2:-.venv-bridge}
start=$(date +%s)
"$PYTHON" -m venv "$VENV"
scripts/pip_install.sh "$VENV" --upgrade pip
scripts/pip_install.sh "$VENV" -c constraints.txt -e '.[test]'
scripts/pip_install.sh "$VENV" --no-deps 'megatron-bridge==0.6.2'
scripts/pip_install.sh "$VENV" -c constraints.txt \
    'transformers>=5.8,<=5.12.1' 'omegaconf>=2.3.0' 'hydra-core>=1.3.4,<1.4' pyyaml tqdm rich einops \
    'datasets>=2.20.0' 'nvidia-modelopt>=0.44' 'megatron-energon~=7.0' requests 'tensorboard>=2.19.0' \
    'diffusers>=0.36.0'
touch "$VENV/.installed"
echo "install_bridge.sh: $VENV ready in $(( $(date +%s) - start )) s"
