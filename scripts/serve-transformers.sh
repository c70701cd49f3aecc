#!/usr/bin/env bash
# Serve kvtui's default model (SmolLM2-135M-Instruct, the float32 copy kvtui converts into its cache) with
# `transformers serve --continuous-batching` (transformers' own OpenAI-compatible server), on the CPU, and
# wait until /health answers. By default it is the transformers of the python3 on PATH (kvtui's venv:
# nothing else to install); --transformers VERSION serves a release scripts/install-transformers-serve.sh
# installed into a venv of its own (the tests pin 5.24.0, the release docs/findings.md's finding is on).
#
# Continuous batching there is transformers' paged-attention manager (generation/continuous_batching):
# a KV cache of --num-blocks blocks of --block-size tokens. Settings that hold on a small shared CPU
# machine: one OpenMP thread, no network (HF_HUB_OFFLINE), the model preloaded (transformers serve's
# FORCE_MODEL argument, so the first request does not load it). The served model's name is the model
# folder's path, as /v1/models lists it.
#
# Usage: scripts/serve-transformers.sh [--port P] [--model DIR] [--python PY | --transformers VERSION] [--num-blocks N]
#                                      [--block-size N] [--threads N] [--wait SECONDS] [--log FILE]
#                                      [--detach --pid-file F] [-- EXTRA TRANSFORMERS SERVE ARGS...]
#   --port        TCP port on 127.0.0.1 (default 8020)
#   --model       a Hugging Face model folder (default: kvtui's converted default model; `kvtui model`
#                 converts it once)
#   --python      the Python whose transformers serves (default: python3 on PATH, e.g. kvtui's venv);
#                 it needs fastapi, uvicorn and openai (pip install -e '.[test]' has them)
#   --transformers  serve this transformers release, from the venv scripts/install-transformers-serve.sh
#                 VERSION made under kvtui's cache (instead of --python)
#   --num-blocks  KV cache blocks (--cb-num-blocks, default 64)
#   --block-size  tokens per KV block (--cb-block-size, default 16)
#   --threads     OpenMP threads for the model (OMP_NUM_THREADS, default 1)
#   --wait        seconds to wait for /health before giving up (default 120)
#   --log         the server's output (default: <kvtui cache>/transformers-serve/server-PORT.log)
#   --detach      return once the server is healthy and leave it running (its process group id is
#                 written to --pid-file; stop it with: kill -TERM -- -PGID, then -KILL if it stays: a
#                 server whose batching worker died may not stop on TERM). Without --detach the script
#                 stays in the foreground until the server exits; Ctrl-C stops it.
# Exit codes: 0 healthy (--detach) or the server exited cleanly; 1 it did not start (the log's tail is
# printed); 2 bad arguments, or transformers serve cannot run with that Python.
set -euo pipefail

CACHE="${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}"
# kvtui/models/default.py: DEFAULT_MODEL_ID plus the first 12 hex digits of DEFAULT_GGUF_SHA256
# (tests/remote/test_transformers_serve.py checks the two agree)
DEFAULT_MODEL_DIR="$CACHE/SmolLM2-135M-Instruct-b179c9523d0e"
PORT=8020
MODEL=""
PYTHON=python3
RELEASE=""
NUM_BLOCKS=64
BLOCK_SIZE=16
THREADS=1
WAIT=120
LOG=""
DETACH=0
PID_FILE=""
EXTRA=()

die() { echo "serve-transformers: error: $1" >&2; exit "${2:-2}"; }
say() { echo "serve-transformers: $*"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="${2:?--port needs a number}"; shift 2 ;;
    --model) MODEL="${2:?--model needs a folder}"; shift 2 ;;
    --python) PYTHON="${2:?--python needs an interpreter}"; shift 2 ;;
    --transformers) RELEASE="${2:?--transformers needs a release, e.g. 5.24.0}"; shift 2 ;;
    --num-blocks) NUM_BLOCKS="${2:?--num-blocks needs a number}"; shift 2 ;;
    --block-size) BLOCK_SIZE="${2:?--block-size needs a number}"; shift 2 ;;
    --threads) THREADS="${2:?--threads needs a number}"; shift 2 ;;
    --wait) WAIT="${2:?--wait needs seconds}"; shift 2 ;;
    --log) LOG="${2:?--log needs a file}"; shift 2 ;;
    --detach) DETACH=1; shift ;;
    --pid-file) PID_FILE="${2:?--pid-file needs a file}"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
for pair in "--port:$PORT" "--num-blocks:$NUM_BLOCKS" "--block-size:$BLOCK_SIZE" "--threads:$THREADS" "--wait:$WAIT"; do
  case "${pair#*:}" in ''|*[!0-9]*|0) die "${pair%%:*} ${pair#*:}: give a positive whole number" ;; esac
done
[ "$DETACH" = 0 ] || [ -n "$PID_FILE" ] || die "--detach needs --pid-file FILE (to stop the server later)"

if [ -n "$RELEASE" ]; then
  case "$RELEASE" in
    *[!0-9a-z.]*) die "--transformers $RELEASE: give a whole release such as 5.24.0" ;;
    [0-9]*.[0-9]*.[0-9]*) ;;
    *) die "--transformers $RELEASE: give a whole release such as 5.24.0" ;;
  esac
  PYTHON="$CACHE/transformers-serve/$RELEASE/venv/bin/python"
  [ -x "$PYTHON" ] && [ -f "$CACHE/transformers-serve/$RELEASE/stamp.txt" ] \
    || die "--transformers $RELEASE: not installed in $CACHE/transformers-serve/$RELEASE: run scripts/install-transformers-serve.sh $RELEASE"
fi
if [ -z "$MODEL" ]; then
  MODEL="$DEFAULT_MODEL_DIR"
  [ -f "$MODEL/config.json" ] || die "kvtui's default model is not converted yet ($MODEL): run \`kvtui model\` once"
fi
[ -f "$MODEL/config.json" ] || die "--model $MODEL: no config.json there, so not a Hugging Face model folder"
MODEL="${MODEL%/}"
command -v "$PYTHON" >/dev/null 2>&1 || die "--python $PYTHON: not found"
if ! "$PYTHON" -c "import transformers.cli.serving.server, fastapi, uvicorn, openai" 2>/dev/null; then
  die "$PYTHON cannot run transformers serve (it needs transformers with fastapi, uvicorn and openai): pip install 'transformers[serving]', or pip install -e '.[test]' in kvtui's venv"
fi
if [ -z "$LOG" ]; then
  mkdir -p "$CACHE/transformers-serve"
  LOG="$CACHE/transformers-serve/server-$PORT.log"
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  die "port $PORT on 127.0.0.1 is in use: choose another --port"
fi

export OMP_NUM_THREADS="$THREADS" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
VERSION=$("$PYTHON" -c "import transformers; print(transformers.__version__)")
say "starting transformers serve $VERSION --continuous-batching on http://127.0.0.1:$PORT ($MODEL, $NUM_BLOCKS blocks of $BLOCK_SIZE tokens, $THREADS threads); log: $LOG"
start=$SECONDS
# its own session (process group), so one signal reaches the server and whatever it starts
setsid "$PYTHON" -c "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())" \
  serve "$MODEL" --continuous-batching --device cpu --host 127.0.0.1 --port "$PORT" \
  --cb-num-blocks "$NUM_BLOCKS" --cb-block-size "$BLOCK_SIZE" "${EXTRA[@]}" >"$LOG" 2>&1 </dev/null &
pgid=$!
[ -z "$PID_FILE" ] || echo "$pgid" >"$PID_FILE"

stop_server() {
  kill -TERM -- "-$pgid" 2>/dev/null || return 0
  for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 -- "-$pgid" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- "-$pgid" 2>/dev/null || true
}
healthy() {
  "$PYTHON" - "$PORT" <<'PY' 2>/dev/null
import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=5).status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}
trap 'stop_server; exit 130' INT TERM

while ! healthy; do
  if ! kill -0 "$pgid" 2>/dev/null; then
    tail -n 25 "$LOG" >&2
    die "transformers serve exited before it was ready (log above, whole log: $LOG)" 1
  fi
  if [ $((SECONDS - start)) -ge "$WAIT" ]; then
    tail -n 25 "$LOG" >&2
    stop_server
    die "transformers serve was not healthy within $WAIT s (log above, whole log: $LOG); stopped it" 1
  fi
  sleep 1
done
say "ready in $((SECONDS - start)) s: http://127.0.0.1:$PORT/v1 (pid $pgid; model name $MODEL)"
if [ "$DETACH" = 1 ]; then
  trap - INT TERM
  say "detached; stop it with: kill -TERM -- -$pgid (then kill -KILL -- -$pgid if it stays)"
  exit 0
fi
trap 'stop_server; wait "$pgid" 2>/dev/null; exit 130' INT TERM
wait "$pgid"
