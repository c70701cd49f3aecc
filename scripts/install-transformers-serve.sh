#!/usr/bin/env bash
# Install a named transformers release, with what `transformers serve` needs, into a virtual environment
# of its own under kvtui's cache folder, apart from kvtui's own environment: a peer server's behaviour is
# pinned to the release it was found on, while kvtui itself runs on the newest transformers its tests pass
# with. The transformers serve tests (tests/remote/test_transformers_serve.py, tests/remote/test_conformance_servers.py)
# run the release kvtui.remote.transformers_serve.PINNED_VERSION names (5.24.0: the release whose
# continuous batching keys its work by the client's x-request-id; docs/findings.md).
#
# What goes in: torch==2.13.0 (the CPU build, as kvtui's own install takes it; pip's cache makes it cheap)
# and transformers[serving]==VERSION (fastapi, uvicorn, openai, pydantic, starlette, rich, accelerate and
# transformers' own dependencies). No model is downloaded: the server reads kvtui's converted copy.
#
# Installs: ${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}/transformers-serve/VERSION/venv
# plus stamp.txt beside it naming the versions and Python; a rerun with the same stamp does nothing.
# Measured here (AMD EPYC, 2 cores shared with other jobs; packages from a local index and pip's cache):
# 5.24.0 in 128 s the first time (beside a test run), 69 s with --force; 1.2 GB (torch is most of it).
#
# Usage: scripts/install-transformers-serve.sh [VERSION] [--force]
# Environment: TRANSFORMERS_SERVE_VERSION (the release when no VERSION argument is given; default below),
# KVTUI_CACHE_DIR / XDG_CACHE_HOME (install folder), PYTHON (the interpreter that creates the venv;
# default python3, 3.10-3.13). Exit codes: 0 installed or up to date; 1 the install failed; 2 bad arguments.
set -euo pipefail

VERSION="${TRANSFORMERS_SERVE_VERSION:-5.24.0}"
TORCH_VERSION=2.13.0
CACHE="${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}"
PY="${PYTHON:-python3}"
FORCE=0

die() { echo "install-transformers-serve: error: $1" >&2; exit "${2:-1}"; }
say() { echo "install-transformers-serve: $*"; }

for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown argument $arg (see --help)" 2 ;;
    *) VERSION="$arg" ;;
  esac
done
case "$VERSION" in
  [0-9]*.[0-9]*.[0-9]*) ;;
  *) die "transformers release '$VERSION': give a whole release such as 5.24.0" 2 ;;
esac
case "$VERSION" in *[!0-9a-z.]*) die "transformers release '$VERSION': give a whole release such as 5.24.0" 2 ;; esac

DEST="$CACHE/transformers-serve/$VERSION"
VENV="$DEST/venv"
STAMP="$DEST/stamp.txt"

command -v "$PY" >/dev/null 2>&1 || die "$PY not found: install Python 3.10-3.13 or set PYTHON=/path/to/python3" 2
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "$PY does not run" 2
case "$pyver" in
  3.10|3.11|3.12|3.13) ;;
  *) die "$PY is Python $pyver; transformers serve with torch $TORCH_VERSION needs Python 3.10-3.13 (set PYTHON=...)" 2 ;;
esac
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
  || die "$PY lacks the venv/ensurepip modules: install them, e.g. apt-get install python3-venv" 2

KEY="transformers[serving]==$VERSION torch==$TORCH_VERSION python=$pyver arch=$(uname -m)"
if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$KEY" ] && [ -x "$VENV/bin/python" ]; then
  say "up to date: $VENV ($KEY)"
  exit 0
fi

start=$SECONDS
mkdir -p "$DEST" || die "could not create $DEST"
rm -f "$STAMP"
if [ ! -x "$VENV/bin/python" ] || [ "$FORCE" = 1 ]; then
  say "[1/4] creating the virtual environment $VENV (Python $pyver)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" || die "could not create a venv at $VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --progress-bar off -q)

say "[2/4] pip install torch==$TORCH_VERSION (the CPU build)"
"${PIP[@]}" "torch==$TORCH_VERSION" \
  || die "pip install torch==$TORCH_VERSION failed (output above; is the package index reachable?); rerun with --force to start afresh"

say "[3/4] pip install transformers[serving]==$VERSION"
"${PIP[@]}" "torch==$TORCH_VERSION" "transformers[serving]==$VERSION" \
  || die "pip install transformers[serving]==$VERSION failed (output above; is $VERSION a transformers release?); rerun with --force to start afresh"

say "[4/4] checking that transformers serve imports"
versions=$(env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VPY" -c \
  'import importlib.metadata as m, torch, transformers.cli.serving.server, fastapi, uvicorn, openai; print("transformers", m.version("transformers"), "torch", torch.__version__, "fastapi", m.version("fastapi"), "openai", m.version("openai"))' 2>&1 | tail -n1) \
  || die "transformers serve does not import in $VENV: $versions"
case "$versions" in
  "transformers $VERSION "*) ;;
  *) die "$VENV holds another release than transformers $VERSION: $versions" ;;
esac
{
  echo "$KEY"
  echo "installed: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - start)) s"
  echo "versions: $versions"
} >"$STAMP"
say "installed $VENV in $((SECONDS - start)) s ($versions)"
