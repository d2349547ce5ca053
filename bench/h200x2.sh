#!/usr/bin/env bash
# DDP scaling on the 2 x H200 machine: one GPU and two GPUs, alternating, RUNS times each, then
# bench/ddp.py's summary (median epoch images/s per GPU count, scaling, every sample once).
#   bash bench/h200x2.sh        writes OUT/ddp-*.json, OUT/summary.json, OUT/ddp.log
# Wheels for what the machine lacks in .whl/ (docs/benchmarks.md, "Reproducing").
set -uo pipefail
OUT=${OUT:-bench-results}
COUNT=${COUNT:-40000}
EPOCHS=${EPOCHS:-8}
RUNS=${RUNS:-2}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m gdsdata.cli doctor | tee "$OUT/doctor.txt"
python3 bench/ddp.py prepare --dir /tmp/ddp --count "$COUNT" | tail -1
for run in $(seq 1 "$RUNS"); do
    for gpus in 1 2; do
        timeout 240 torchrun --nproc_per_node "$gpus" bench/ddp.py train --dir /tmp/ddp --epochs "$EPOCHS" \
            --out "$OUT/ddp-${gpus}gpu-run$run.json" >> "$OUT/ddp.log" 2>&1 || echo "run $run, $gpus GPU(s): exit $?"
    done
done
python3 bench/ddp.py summary "$OUT"/ddp-*gpu-run*.json --out "$OUT/summary.json"
