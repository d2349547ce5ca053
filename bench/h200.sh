#!/usr/bin/env bash
# The H200 run behind docs/benchmarks.md: GPU tests, then bench/gpu.py with DALI when present.
#   bash bench/h200.sh            the ImageNet-like set (~100 KB JPEGs), every section
#   SET=light bash bench/h200.sh  the field notes' lighter set (~53 KB JPEGs), JPEG pipelines and peers
#   SET=both bash bench/h200.sh   the first, then the second in the same call (DALI installed once)
# Writes OUT/gpu.json, OUT/gpu.png (the chart) and logs (OUT/light/ for the lighter set). Runs from the
# repository root, with wheels for what the machine lacks in .whl/ and DALI's wheel, if any, as split
# pieces under /tmp/dali-pieces/ (docs/benchmarks.md, "Reproducing").
set -uo pipefail
OUT=${OUT:-bench-results}
SET=${SET:-imagenet}
if [ "$SET" = both ]; then
    SET=imagenet bash "$0"
    SET=light exec bash "$0"
fi
if [ "$SET" = light ]; then
    OUT=$OUT/light
    BENCH_ARGS="--noise 8 --quality 90 --scale 0.93 --skip cold,paths,raw ${BENCH_ARGS:-}"
    SKIP_TESTS=1
fi
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -d /tmp/dali-site/nvidia/dali ]; then
    echo "DALI already installed"
elif ls /tmp/dali-pieces/dali.part* >/dev/null 2>&1; then
    cat /tmp/dali-pieces/dali.part* > /tmp/dali.whl
    if [ "$(sha256sum /tmp/dali.whl | cut -d' ' -f1)" = "$(cat /tmp/dali-pieces/sha256)" ]; then
        cp /tmp/dali.whl /tmp/nvidia_dali_cuda130-2.4.0-py3-none-manylinux_2_28_x86_64.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dali-site \
            /tmp/nvidia_dali_cuda130-2.4.0-py3-none-manylinux_2_28_x86_64.whl .dali/nvidia_nvimgcodec*.whl
        echo "DALI installed (sha256 ok)"
    else
        echo "DALI wheel checksum mismatch: DALI skipped"
    fi
fi
if [ -d /tmp/dali-site/nvidia/dali ]; then
    export PYTHONPATH=$PYTHONPATH:/tmp/dali-site
    export LD_LIBRARY_PATH=$(dirname "$(find /tmp/dali-site -name 'libnvimgcodec.so*' | head -1)"):${LD_LIBRARY_PATH:-}
fi
python3 -m gdsdata.cli doctor | tee "$OUT/doctor.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 200 python3 -m pytest -q -m gpu --timeout 60 tests/ 2>&1 | tee "$OUT/gpu-tests.log" | tail -3
fi
# a run that outlasts BENCH_TIMEOUT gets SIGABRT: faulthandler prints every thread's stack (where it hung)
timeout -s ABRT -k 20 ${BENCH_TIMEOUT:-500} python3 -X faulthandler bench/gpu.py --dir /tmp/bench \
    --count ${COUNT:-10000} --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
python3 bench/chart.py "$OUT/gpu.json" "$OUT/gpu.png" || echo "chart skipped (matplotlib missing)"
