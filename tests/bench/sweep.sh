#!/usr/bin/env bash
# SparseLoCo quality sweep on the bench preset: one knob changed per run, results as JSON.
# Run by hand (3-4 minutes per run on 2 CPU cores, 10 runs):  bash tests/bench/sweep.sh [OUT_DIR]
# Compare against `sparseloco bench quality`, which runs the three algorithms at the defaults.
set -euo pipefail
out=${1:-bench-out/sweep}
mkdir -p "$out"
run() {
    local name=$1
    shift
    echo "== $name: $*"
    sparseloco simulate --preset bench "$@" --json "$out/$name.json" | tail -1
}
s="--algo sparseloco"
h15="--inner-steps 15 --rounds 60"  # the same tokens as H=30, 30 rounds
run k128 $s --topk 128
run k256 $s --topk 256
run noclip $s --no-clip
run beta0.9 $s --beta 0.9
run alpha2 $s --alpha 2
run h15 $s $h15
run k128_h15 $s --topk 128 $h15
run k256_h15 $s --topk 256 $h15
run alpha2_h15 $s --alpha 2 $h15
run diloco_h15 --algo diloco $h15
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:10s} final eval loss {r['final_eval_loss']:.4f}  "
          f"bytes/round/worker {r['bytes_per_round_per_worker']:,.0f}")
PY
