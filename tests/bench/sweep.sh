#!/usr/bin/env bash
# SparseLoCo quality sweep on the bench preset: one knob changed per run, results as JSON.
# Run by hand (about 4 minutes per run on 2 CPU cores):  bash tests/bench/sweep.sh [OUT_DIR]
# Compare against `sparseloco bench quality`, which runs the three algorithms at the defaults.
set -euo pipefail
out=${1:-bench-out/sweep}
mkdir -p "$out"
run() {
    local name=$1
    shift
    echo "== $name: $*"
    sparseloco simulate --preset bench --algo sparseloco "$@" --json "$out/$name.json" | tail -1
}
run k128 --topk 128
run k256 --topk 256
run h15 --inner-steps 15 --rounds 60
run noclip --no-clip
run beta0.9 --beta 0.9
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:10s} final eval loss {r['final_eval_loss']:.4f}  "
          f"bytes/round/worker {r['bytes_per_round_per_worker']:,.0f}")
PY
