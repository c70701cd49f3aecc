#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from source and install it into kvtui's cache folder.
#
# The sources are the llama.cpp tree vendored in the PyPI source distribution of llama-cpp-python
# (fetched with `python3 -m pip download`, or from PyPI's simple index with python3's urllib when pip
# is missing); no virtual environment is needed. Only the `llama-server` target is built, statically
# against llama.cpp's own libraries, with CPU instruction sets chosen from /proc/cpuinfo (a native
# build can emit instructions a virtual machine's guest may not run, e.g. AMX).
#
# Installs: ${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}/llama-server/llama-server
# plus a stamp file naming the source version, the vendored llama.cpp commit and the CMake flags; a rerun
# with the same stamp does nothing. From the same sources it also installs llama.cpp's Hugging Face ->
# GGUF converter into llama-server/convert/ (convert_hf_to_gguf.py, convert_lora_to_gguf.py for peft LoRA
# adapters, conversion/, gguf-py/ and a stamp naming the version and commit; kvtui/models/hybrid.py and
# kvtui/models/lora.py run them with gguf-py on PYTHONPATH), also skipped when its stamp matches and both
# converters are there.
#
# The sdist vendors llama.cpp as a git submodule but ships no work-tree git metadata, so llama.cpp's own
# CMake cannot find the commit and `llama-server --version` would say "unknown". The commit is passed as
# -DLLAMA_BUILD_COMMIT instead (known per sdist version below, checked against the submodule HEAD that
# the sdist records in .git/modules/vendor/llama.cpp/HEAD).
#
# Usage: scripts/build-llama-server.sh [--force]
# Environment: KVTUI_CACHE_DIR / XDG_CACHE_HOME (install folder), LLAMA_CPP_PYTHON_VERSION (sdist
# version, default below), LLAMA_BUILD_COMMIT (the vendored commit, for a version not listed below),
# BUILD_JOBS (parallel jobs, default: number of cores).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# llama.cpp commit vendored by each known llama-cpp-python sdist (short hash, as `git rev-parse --short`).
case "$VERSION" in
  0.3.36) KNOWN_COMMIT=0c1e57098 ;;
  *) KNOWN_COMMIT="" ;;
esac
COMMIT="${LLAMA_BUILD_COMMIT:-$KNOWN_COMMIT}"
CACHE="${KVTUI_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtui}"
DEST="$CACHE/llama-server"
STAMP="$DEST/stamp.txt"
JOBS="${BUILD_JOBS:-$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)}"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

die() { echo "build-llama-server: error: $*" >&2; exit 1; }
say() { echo "build-llama-server: $*"; }

# --- tools ---------------------------------------------------------------------------------------
command -v cmake >/dev/null 2>&1 || die "cmake not found: install cmake (3.18+) and a C++17 compiler, e.g. apt-get install cmake g++"
CXX_BIN="${CXX:-}"
if [ -z "$CXX_BIN" ]; then
  for c in c++ g++ clang++; do command -v "$c" >/dev/null 2>&1 && { CXX_BIN=$c; break; }; done
fi
[ -n "$CXX_BIN" ] && command -v "$CXX_BIN" >/dev/null 2>&1 \
  || die "no C++ compiler found (tried \$CXX, c++, g++, clang++): install one, e.g. apt-get install g++"
command -v python3 >/dev/null 2>&1 || die "python3 not found: it is needed to download the llama.cpp sources from PyPI"

# --- CMake flags: static, server only, no network at build time, ISA from /proc/cpuinfo -----------
FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF
  -DGGML_OPENMP=OFF
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
)
[ -n "$COMMIT" ] && FLAGS+=("-DLLAMA_BUILD_COMMIT=$COMMIT")
if [ "$(uname -m)" = x86_64 ]; then
  cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  isa() {  # isa CMAKE_OPTION cpuinfo_flag: ON when /proc/cpuinfo lists the flag, else OFF
    case "$cpu_flags" in *" $2 "*) FLAGS+=("-D$1=ON") ;; *) FLAGS+=("-D$1=OFF") ;; esac
  }
  isa GGML_SSE42 sse4_2
  isa GGML_AVX avx
  isa GGML_AVX2 avx2
  isa GGML_BMI2 bmi2
  isa GGML_FMA fma
  isa GGML_F16C f16c
  isa GGML_AVX512 avx512f
fi
KEY="llama-cpp-python==$VERSION target=llama-server flags: ${FLAGS[*]}"

CONVERT="$DEST/convert"
CONVERT_KEY="llama-cpp-python==$VERSION llama.cpp commit ${COMMIT:-unknown} convert_hf_to_gguf.py"
convert_ok=0
[ "$FORCE" = 0 ] && [ -f "$CONVERT/convert_hf_to_gguf.py" ] && [ -f "$CONVERT/convert_lora_to_gguf.py" ] \
  && [ -f "$CONVERT/stamp.txt" ] \
  && [ "$(head -n1 "$CONVERT/stamp.txt")" = "$CONVERT_KEY" ] && convert_ok=1
server_ok=0
[ "$FORCE" = 0 ] && [ -x "$DEST/llama-server" ] && [ -f "$STAMP" ] && [ "$(head -n1 "$STAMP")" = "$KEY" ] && server_ok=1
if [ "$server_ok" = 1 ] && [ "$convert_ok" = 1 ]; then
  say "up to date: $DEST/llama-server ($KEY) and its converter in $CONVERT"
  exit 0
fi

start=$SECONDS
if [ "$server_ok" = 1 ]; then
  say "installing llama.cpp's converter from llama-cpp-python==$VERSION (llama-server is up to date)"
else
  say "building llama-server from llama-cpp-python==$VERSION with $JOBS jobs"
fi
say "flags: ${FLAGS[*]}"
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtui-llama-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- sources -------------------------------------------------------------------------------------
say "[1/4] downloading the llama-cpp-python $VERSION source distribution"
if python3 -m pip --version >/dev/null 2>&1; then
  python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$work" \
    || die "pip could not download llama-cpp-python==$VERSION (network or index unavailable?)"
else
  python3 - "$VERSION" "$work" <<'PY' || die "could not download llama-cpp-python==$VERSION from PyPI"
# PyPI's simple index in its JSON form (PEP 691), the same index pip reads; sha256 checked.
import hashlib, json, shutil, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
name = f"llama_cpp_python-{version}.tar.gz"
req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, timeout=60) as r:
    entry = next(f for f in json.load(r)["files"] if f["filename"] == name)
with urllib.request.urlopen(entry["url"], timeout=600) as r, open(f"{out}/{name}", "wb") as f:
    shutil.copyfileobj(r, f)
digest = hashlib.sha256(open(f"{out}/{name}", "rb").read()).hexdigest()
if digest != entry["hashes"]["sha256"]:
    sys.exit(f"sha256 mismatch for {name}: {digest} != {entry['hashes']['sha256']}")
PY
fi
sdist=$(ls "$work"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null) || die "no sdist llama_cpp_python-$VERSION.tar.gz in $work"
mkdir -p "$work/src"
tar -xzf "$sdist" -C "$work/src" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp" \
  || die "the sdist has no vendor/llama.cpp folder"
# The submodule commit the sdist records (absent from some sdists): it must be the one passed to CMake.
recorded=$(tar -xzOf "$sdist" "llama_cpp_python-$VERSION/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null | head -c 40 || true)
if [ -n "$recorded" ] && [ -n "$COMMIT" ]; then
  case "$recorded" in
    "$COMMIT"*) say "      vendored llama.cpp commit $recorded" ;;
    *) die "the sdist vendors llama.cpp $recorded, not $COMMIT: set LLAMA_BUILD_COMMIT=${recorded:0:9}" ;;
  esac
elif [ -n "$recorded" ]; then
  COMMIT=${recorded:0:9}
  FLAGS+=("-DLLAMA_BUILD_COMMIT=$COMMIT")
  say "      vendored llama.cpp commit $recorded (read from the sdist)"
else
  say "      warning: the sdist records no llama.cpp commit and none is known for $VERSION; --version will say unknown"
fi
# llama.cpp's converter (pure Python) from the same sources, in a folder of its own
if [ "$convert_ok" = 0 ]; then
  rm -rf "$CONVERT.tmp" && mkdir -p "$CONVERT.tmp"
  cp -r "$work/src/convert_hf_to_gguf.py" "$work/src/convert_lora_to_gguf.py" "$work/src/conversion" \
    "$work/src/gguf-py" "$CONVERT.tmp/" \
    || die "the sdist's llama.cpp has no convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/ or gguf-py/"
  echo "$CONVERT_KEY" >"$CONVERT.tmp/stamp.txt"
  rm -rf "$CONVERT" && mv "$CONVERT.tmp" "$CONVERT"
  say "      installed llama.cpp's converter into $CONVERT"
fi
rm -f "$sdist"
say "      sources ready ($((SECONDS - start)) s)"
if [ "$server_ok" = 1 ]; then
  say "up to date: $DEST/llama-server ($KEY)"
  exit 0
fi

# --- configure and build ---------------------------------------------------------------------------
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
say "[2/4] configuring"
cmake -S "$work/src" -B "$work/build" "${generator[@]}" -DCMAKE_CXX_COMPILER="$CXX_BIN" "${FLAGS[@]}" \
  >"$work/configure.log" 2>&1 || { tail -n 30 "$work/configure.log" >&2; die "cmake configure failed (log above)"; }
say "[3/4] compiling llama-server (this takes several minutes)"
build_start=$SECONDS
cmake --build "$work/build" --target llama-server -j "$JOBS" >"$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log" >&2; die "build failed (log above)"; }
say "      compiled in $((SECONDS - build_start)) s"

# --- check and install -----------------------------------------------------------------------------
say "[4/4] checking and installing into $DEST"
bin=$(find "$work/build" -type f -name llama-server -perm -u+x | head -n1)
[ -n "$bin" ] || die "the build produced no llama-server binary"
if command -v ldd >/dev/null 2>&1; then
  missing=$(ldd "$bin" | grep -e 'not found' -e "$work" || true)
  [ -z "$missing" ] || die "llama-server links libraries outside the system: $missing"
fi
version_line=$("$bin" --version 2>&1 | tr '\n' ' ') \
  || die "the built llama-server does not run on this CPU ($version_line): check the ISA flags"
# e.g. "version: 0.5.0-dev (build 0, commit 0c1e57098) built with GNU 12.2.0 for Linux x86_64"
if [ -n "$COMMIT" ]; then
  case "$version_line" in
    *"commit $COMMIT"*) ;;
    *) die "llama-server --version does not name commit $COMMIT: $version_line" ;;
  esac
fi
mkdir -p "$DEST"
cp "$bin" "$DEST/llama-server.tmp"
mv -f "$DEST/llama-server.tmp" "$DEST/llama-server"
{
  echo "$KEY"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - start)) s with $JOBS jobs, $("$CXX_BIN" --version | head -n1)"
  echo "version: $version_line"
} >"$STAMP"
say "installed $DEST/llama-server ($(du -h "$DEST/llama-server" | cut -f1)) in $((SECONDS - start)) s"
