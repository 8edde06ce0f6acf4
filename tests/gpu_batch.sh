#!/usr/bin/env bash
# The GPU proof runs, batched for a device lease: `bash tests/gpu_batch.sh PHASE` with $OUT set
# (the device tool sets it). Each scenario runs in a fresh process; logs land in $OUT/logs-PHASE.tgz.
#   core     threadgraph GPU tests (issues: core, many workers per GPU, whole-step) + doctor --selftest
#   trainer  the DFlash embedded default on cuda:0 (all 8 workers on one GPU), then on all GPUs
#   bench    benchmarks/replay_step_time.py (training) and benchmarks/dflash_throughput.py
# Carry the default assets (THREADGRAPH_CACHE) to skip their 3-minute build: build them here with
# `python -c "from examples.dflash_trainer.assets import default_assets; default_assets('.tgcache')"`
# and pass carry=[".tgcache"].
set -uo pipefail
phase=${1:?phase: core, trainer or bench}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src:. TOKENIZERS_PARALLELISM=false
export THREADGRAPH_CACHE=${THREADGRAPH_CACHE:-$PWD/.tgcache} THREADGRAPH_GPU_LOG=/tmp/gpu-logs THREADGRAPH_GPU_STEPS=${STEPS:-1000}
mkdir -p "$THREADGRAPH_GPU_LOG"
nvidia-smi -L
case "$phase" in
  core)
    timeout "${DOCTOR_S:-120}" python3 -m threadgraph doctor --selftest 2>&1 | grep -E "selftest|torch"
    timeout "${PYTEST_S:-420}" python3 -m pytest -m gpu tests/test_gpu.py -v -p no:cacheprovider ${K:+-k "$K"} 2>&1 \
      | tee "$THREADGRAPH_GPU_LOG/pytest.txt" | grep -E "PASSED|FAILED|SKIPPED|Error" ;;
  trainer)
    for devices in cuda:0 all; do
      flag=(); [ "$devices" = all ] || flag=(--devices "$devices")
      timeout "${TRAIN_S:-240}" python3 -X faulthandler -m examples.dflash_trainer "${flag[@]}" --out-dir "/tmp/dflash-$devices" --json \
        > "$OUT/dflash-${devices/:/}.json" 2> "$THREADGRAPH_GPU_LOG/dflash-${devices/:/}.err"
      echo "dflash $devices rc=$?"; tail -c 2000 "$OUT/dflash-${devices/:/}.json"; grep -v Warn "$THREADGRAPH_GPU_LOG/dflash-${devices/:/}.err" | tail -5
    done ;;
  bench)
    timeout "${BENCH_S:-400}" python3 benchmarks/replay_step_time.py --tasks train --out-dir "$OUT" 2>&1 | tail -40
    timeout "${DFLASH_BENCH_S:-150}" python3 benchmarks/dflash_throughput.py --out-dir "$OUT" 2>&1 | tail -15 ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
tar czf "$OUT/logs-$phase.tgz" -C "$THREADGRAPH_GPU_LOG" .
