#!/usr/bin/env bash
# The GPU proof runs, batched for a device lease: `bash tests/gpu_batch.sh PHASE` with $OUT set
# (the device tool sets it). Each scenario runs in a fresh process; logs land in $OUT/logs-PHASE.tgz.
#   core     every GPU test (tests/ -m gpu: core, many workers per GPU, whole-step, channel) + doctor --selftest
#   lanes    two GPUs, two independent lanes at once: GPU 0 the many-worker tests at $STEPS (1000),
#            GPU 1 the self-test and the other one-GPU tests at 200 steps
#   verify   what 2026-11-29 left unverified (see the case below); about 9 minutes on nvidia-h200-x2
#   pair     the tests that need both GPUs (two_gpus, whole_step), then the trainer on one GPU and on all
#   trainer  the DFlash embedded default on cuda:0 (all 8 workers on one GPU), then on all GPUs
#   tune     the DFlash throughput bench at several GIL switch intervals (two lanes), then the
#            trainer and the bench on both GPUs
#   whole    the DFlash bench with whole-step graphs (one GPU, then both) next to Trees, and the
#            default trainer on one GPU
#   switch   the whole-step DFlash bench at GIL switch intervals $SWITCH0 / $SWITCH1 ms (GPU 0 / 1)
#   eight    (nvidia-h200-x8) the trainer and the DFlash bench with one GPU per worker;
#   eight-replay  (nvidia-h200-x8) replay_step_time with 8 workers one per GPU
#   profile  (carry .whl with a py-spy wheel) GIL profiles of the threaded pipeline, whole-step and
#            Trees; the DFlash bench for both; the trainer with whole-step graphs, eval and checkpoints
#   final    whole-step tests, the GIL profile and both DFlash benches after the captured optimizer;
#            the whole-step trainer in full, resumed from a checkpoint, and on both GPUs
#   last     the GIL profile and both DFlash benches, and the default (Trees) trainer in full
#   channel  the channel's GPU tests, then both DFlash benches on one GPU each
#   replay   benchmarks/replay_step_time.py, one model and some modes per call (REPLAY_* variables)
#   replay-rest  (carry .whl) the replay cells session 5 left out, and the per-GPU thread cells under py-spy
#   replay-fill  (carry .whl) the cells replay-rest ran out of time for
#   spread   issue 6 on two GPUs: the default trainer and the whole-step DFlash bench over both
#   resume   the whole-step trainer twice uninterrupted (run-to-run drift), the Trees trainer resumed
#   bench    benchmarks/replay_step_time.py (training) and benchmarks/dflash_throughput.py
# Carry the default assets (THREADGRAPH_CACHE) to skip their 3-minute build: build them here with
# `python -c "from examples.dflash_trainer.assets import default_assets; default_assets('.tgcache')"`
# and pass carry=[".tgcache"].
set -uo pipefail
phase=${1:?phase: core, lanes, verify, tune, whole, switch, eight, eight-replay, profile, final, last, channel, replay, replay-rest, replay-fill, spread, resume, resume-whole, pair, trainer or bench}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src:. TOKENIZERS_PARALLELISM=false
export THREADGRAPH_CACHE=${THREADGRAPH_CACHE:-$PWD/.tgcache} THREADGRAPH_GPU_LOG=/tmp/gpu-logs
mkdir -p "$THREADGRAPH_GPU_LOG"
nvidia-smi -L
save_logs() { tar czf "$OUT/.logs.tgz" -C "$THREADGRAPH_GPU_LOG" . && mv "$OUT/.logs.tgz" "$OUT/logs-$phase.tgz"; }
# The device kills the whole command at its limit, traps included: keep a fresh copy of the logs.
(while sleep 20; do save_logs; done) &
saver=$!

selftest() {
  timeout "${DOCTOR_S:-120}" python3 -m threadgraph doctor --selftest 2>&1 | tee "$THREADGRAPH_GPU_LOG/doctor-$1.txt" | grep -E "selftest|torch"
}

gpu_tests() {  # gpu_tests TAG STEPS SECONDS [-k EXPR]
  local tag=$1 steps=$2 seconds=$3; shift 3
  THREADGRAPH_GPU_STEPS=$steps timeout "$seconds" python3 -m pytest -m gpu tests/ -v -p no:cacheprovider "$@" 2>&1 \
    | tee "$THREADGRAPH_GPU_LOG/pytest-$tag.txt" | grep -E "PASSED|FAILED|SKIPPED|Error" | sed "s/^/[$tag] /"
}

trainer() {  # trainer TAG [trainer flags]
  local tag=$1; shift
  # on timeout: SIGUSR1 first (the trainer prints every thread's stack), then TERM 20 s later
  THREADGRAPH_GATE_TIMEOUT=${GATE_S:-150} timeout -s USR1 -k 20 "${TRAIN_S:-240}" python3 -X faulthandler -m examples.dflash_trainer "$@" --out-dir "${TRAIN_DIR:-/tmp/dflash-$tag}" --json \
    > "$OUT/dflash-$tag.json" 2> "$THREADGRAPH_GPU_LOG/dflash-$tag.err"
  echo "[dflash $tag] rc=$?"; tail -c 1500 "$OUT/dflash-$tag.json"; grep -v Warn "$THREADGRAPH_GPU_LOG/dflash-$tag.err" | tail -5
}

resume_pair() {  # resume_pair TAG [trainer flags]: 100 steps uninterrupted, then again from its step-50 checkpoint
  local tag=$1; shift
  local flags=(--max-steps 100 --checkpoint-every 50 --eval-every 0 "$@")
  trainer "$tag-a" "${flags[@]}"
  rm -rf "/tmp/dflash-$tag-a/checkpoints/step_00000100"; echo step_00000050 > "/tmp/dflash-$tag-a/checkpoints/latest"
  TRAIN_DIR="/tmp/dflash-$tag-a" trainer "$tag-b" "${flags[@]}" --resume
}

install_py_spy() {  # from the wheel carried in .whl/ (the device reaches no package index)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/py_spy*.whl && export PATH=/tmp/site/bin:$PATH
}

replay() {  # replay OUT_DIR [replay_step_time flags]: 100 timed steps a cell; per-cell progress and the tables
  local dir=$1; shift; mkdir -p "$dir"
  timeout "${BENCH_S:-540}" python3 benchmarks/replay_step_time.py --steps "${REPLAY_STEPS:-100}" --out-dir "$dir" "$@" 2>&1 \
    | grep -E "^\||^\[|^#|rror|ratio|interrupted|not measured"
}

dflash_bench() {  # dflash_bench TAG [bench flags]: results in the logs, under TAG/ (the device returns few files)
  local tag=$1; shift
  timeout "${DFLASH_BENCH_S:-200}" python3 benchmarks/dflash_throughput.py --steps "${DFLASH_STEPS:-60}" --out-dir "$THREADGRAPH_GPU_LOG/$tag" "$@" 2>&1 \
    | grep -E "^\| (threaded|sequential)|threaded / sequential|rror" | sed "s/^/[$tag] /"
}

case "$phase" in
  core)
    selftest all
    gpu_tests core "${STEPS:-1000}" "${PYTEST_S:-420}" ${K:+-k "$K"} ;;
  lanes)
    (export CUDA_VISIBLE_DEVICES=0; gpu_tests gpu0 "${STEPS:-1000}" "${LANE_S:-540}" -k "many") & lane0=$!
    (export CUDA_VISIBLE_DEVICES=1; selftest gpu1
     gpu_tests gpu1 200 "${LANE1_TESTS_S:-420}" -k "not many and not whole_step and not two_gpus") & lane1=$!
    wait "$lane0" "$lane1" ;;  # a bare `wait` would also wait for the log saver, forever
  verify)  # what 2026-11-29 left unverified: GPU 0 new shapes, whole-step (compiled inner), the DFlash
           # throughput bench; GPU 1 the trainer on one GPU; then the trainer on both GPUs
    (export CUDA_VISIBLE_DEVICES=0
     gpu_tests gpu0 200 200 -k "new_input_shapes or whole_step"
     timeout "${DFLASH_BENCH_S:-230}" python3 benchmarks/dflash_throughput.py --steps 60 --out-dir "$OUT" 2>&1 | tail -15) & lane0=$!
    (export CUDA_VISIBLE_DEVICES=1; TRAIN_S=${TRAIN_S:-300} trainer one-gpu --devices cuda:0) & lane1=$!
    wait "$lane0" "$lane1"
    TRAIN_S=180 trainer all-gpus ;;
  tune)  # SWITCH0 / SWITCH1: GIL switch intervals in ms, run in turn on GPU 0 / GPU 1
    (for ms in ${SWITCH0:-5 0.2}; do dflash_bench "gpu0-$ms" --devices cuda:0 --gil-switch-interval-ms "$ms"; done) & lane0=$!
    (for ms in ${SWITCH1:-1 0.05}; do CUDA_VISIBLE_DEVICES=1 dflash_bench "gpu1-$ms" --devices cuda:0 --gil-switch-interval-ms "$ms"; done) & lane1=$!
    wait "$lane0" "$lane1"
    TRAIN_S=${TRAIN_S:-220} trainer all-gpus ${TRAIN_ARGS:-}
    dflash_bench two-gpus --devices cuda:0,cuda:1 ${BENCH_ARGS:-} ;;
  whole)  # whole-step graphs in the DFlash pipeline; the default (Trees) trainer after the setup change
    (export CUDA_VISIBLE_DEVICES=0
     gpu_tests gpu0 200 150 -k "whole_step"
     dflash_bench whole-1gpu --devices cuda:0 --cuda-graphs whole-step) & lane0=$!
    (export CUDA_VISIBLE_DEVICES=1
     TRAIN_S=${TRAIN_S:-220} trainer one-gpu --devices cuda:0
     dflash_bench trees-1gpu --devices cuda:0) & lane1=$!
    wait "$lane0" "$lane1"
    dflash_bench whole-2gpus --devices cuda:0,cuda:1 --cuda-graphs whole-step ;;
  eight)  # issue 6 on nvidia-h200-x8: the trainer and the DFlash bench, one GPU per worker (~7 min)
    all8=cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7
    TRAIN_S=${TRAIN_S:-240} trainer eight-gpus
    dflash_bench trees-8gpus --devices "$all8"
    dflash_bench whole-8gpus --devices "$all8" --cuda-graphs whole-step ;;
  eight-replay)  # issue 6: per-thread replay step time, 8 workers one per GPU, against one alone
    timeout "${BENCH_S:-540}" python3 benchmarks/replay_step_time.py --tasks train --placements main,worker,per-gpu \
      --modes eager,reduce-overhead,whole-step --out-dir "$THREADGRAPH_GPU_LOG/replay-8gpus" 2>&1 | tail -30 ;;
  switch)  # the whole-step pipeline at a shorter GIL switch interval, one interval per GPU
    (export CUDA_VISIBLE_DEVICES=0; ms=${SWITCH0:-0.5}
     dflash_bench "whole-$ms-ms" --devices cuda:0 --cuda-graphs whole-step --gil-switch-interval-ms "$ms") & lane0=$!
    (export CUDA_VISIBLE_DEVICES=1; ms=${SWITCH1:-0.1}
     dflash_bench "whole-$ms-ms" --devices cuda:0 --cuda-graphs whole-step --gil-switch-interval-ms "$ms") & lane1=$!
    wait "$lane0" "$lane1" ;;
  pair)
    gpu_tests pair "${STEPS:-200}" "${PYTEST_S:-200}" -k "two_gpus or whole_step"
    trainer one-gpu --devices cuda:0
    trainer all-gpus ;;
  trainer)
    trainer one-gpu --devices cuda:0
    trainer all-gpus ;;
  profile|final|last)  # where the threaded pipeline's GIL time goes (issue 5); the whole-step trainer in full
    install_py_spy
    gil_profile() {  # gil_profile TAG [bench flags]
      local tag=$1; shift
      timeout "${PROFILE_S:-200}" python3 benchmarks/gil_profile.py --out-dir "$THREADGRAPH_GPU_LOG/$tag" "$@" 2>&1 \
        | grep -E "GIL busy|^\| (drafter|target) |GIL share|rror" | sed "s/^/[$tag] /"
    }
    whole=(--devices cuda:0 --cuda-graphs whole-step)
    if [ "$phase" = last ]; then  # after the target step moved anchors onto the device
      (export CUDA_VISIBLE_DEVICES=0
       PROFILE_S=170 gil_profile gil-whole "${whole[@]}" --steps 3000 --start-step 150
       DFLASH_BENCH_S=200 dflash_bench whole-1gpu "${whole[@]}") & lane0=$!
      (export CUDA_VISIBLE_DEVICES=1
       TRAIN_S=190 trainer trees-default --devices cuda:0
       DFLASH_BENCH_S=200 dflash_bench trees-1gpu --devices cuda:0) & lane1=$!
      wait "$lane0" "$lane1"
    elif [ "$phase" = profile ]; then
      (export CUDA_VISIBLE_DEVICES=0
       gil_profile gil-whole "${whole[@]}" --steps 2500 --start-step 150
       dflash_bench whole-1gpu "${whole[@]}") & lane0=$!
      (export CUDA_VISIBLE_DEVICES=1
       gil_profile gil-trees --devices cuda:0 --steps 1500 --start-step 150
       TRAIN_S=${TRAIN_S:-200} trainer whole-step "${whole[@]}"
       dflash_bench trees-1gpu --devices cuda:0) & lane1=$!
      wait "$lane0" "$lane1"
    else
      (export CUDA_VISIBLE_DEVICES=0
       gpu_tests whole 200 120 -k "whole_step"
       PROFILE_S=170 gil_profile gil-whole "${whole[@]}" --steps 3000 --start-step 150
       DFLASH_BENCH_S=200 dflash_bench whole-1gpu "${whole[@]}") & lane0=$!
      (export CUDA_VISIBLE_DEVICES=1 TRAIN_S=150
       trainer whole-step "${whole[@]}"
       resume_pair resume "${whole[@]}"
       DFLASH_BENCH_S=200 dflash_bench trees-1gpu --devices cuda:0) & lane1=$!
      wait "$lane0" "$lane1"
      TRAIN_S=150 trainer whole-2gpus --cuda-graphs whole-step
    fi ;;
  resume)  # GPU resume equivalence: whole-step run twice uninterrupted (GPU 0), Trees resumed (GPU 1)
    (export CUDA_VISIBLE_DEVICES=0 TRAIN_S=150
     trainer det-whole-a --devices cuda:0 --cuda-graphs whole-step --max-steps 100 --checkpoint-every 50 --eval-every 0
     trainer det-whole-b --devices cuda:0 --cuda-graphs whole-step --max-steps 100 --checkpoint-every 50 --eval-every 0) & lane0=$!
    (export CUDA_VISIBLE_DEVICES=1 TRAIN_S=200; resume_pair trees --devices cuda:0) & lane1=$!
    wait "$lane0" "$lane1" ;;
  channel)  # the channel's GPU tests (both GPUs), then both DFlash benches, one GPU each
    timeout 120 python3 -m pytest -m gpu tests/test_dflash_channel.py -v -p no:cacheprovider 2>&1 \
      | tee "$THREADGRAPH_GPU_LOG/pytest-channel.txt" | grep -E "PASSED|FAILED|SKIPPED|Error" | sed "s/^/[channel] /"
    (export CUDA_VISIBLE_DEVICES=0; DFLASH_BENCH_S=200 dflash_bench whole-1gpu --devices cuda:0 --cuda-graphs whole-step) & lane0=$!
    (export CUDA_VISIBLE_DEVICES=1; DFLASH_BENCH_S=200 dflash_bench trees-1gpu --devices cuda:0) & lane1=$!
    wait "$lane0" "$lane1" ;;
  replay)  # issue 5's replay_step_time on this machine's GPUs: REPLAY_MODEL (small | dflash), REPLAY_MODES,
           # REPLAY_PLACEMENTS, REPLAY_TASKS; rows merge into benchmarks/results/$REPLAY_SEED (an earlier
           # call's file) when set, so a set too long for one call spans several
    replay "$THREADGRAPH_GPU_LOG/replay" --model "${REPLAY_MODEL:-small}" \
      --modes "${REPLAY_MODES:-eager,compile,reduce-overhead,whole-step}" --tasks "${REPLAY_TASKS:-train,infer}" \
      ${REPLAY_PLACEMENTS:+--placements "$REPLAY_PLACEMENTS"} ${REPLAY_SEED:+--merge-from "benchmarks/results/$REPLAY_SEED"} ;;
  replay-rest)  # (carry .whl) what issue 5 still lacked after session 5 (~9 min on nvidia-h200-x2): the
                # thread cells of the per-GPU miss under py-spy (where the GIL goes when two threads drive
                # two GPUs), then the compile-default cells that session's replay calls left out
    install_py_spy
    day=nvidia-h200_torch2.11.0_2026-11-29
    for model in dflash small; do
      BENCH_S=$([ "$model" = dflash ] && echo 180 || echo 100) replay "$THREADGRAPH_GPU_LOG/replay" --model "$model" \
        --tasks train --modes reduce-overhead,whole-step --placements worker,per-gpu --gil-profile 5
    done
    BENCH_S=120 replay "$THREADGRAPH_GPU_LOG/replay" --model small --modes compile --placements shared,procs-per-gpu,procs-shared \
      --merge-from "benchmarks/results/$day.json"
    BENCH_S=150 replay "$THREADGRAPH_GPU_LOG/replay" --model dflash --tasks train --modes compile \
      --placements shared,procs-per-gpu,procs-shared --merge-from "benchmarks/results/${day}_dflash-step.json" ;;
  replay-fill)  # (carry .whl) the cells replay-rest ran out of time for, merged into its 2026-11-30 files:
                # whole-step per-GPU under py-spy (both models), the small model's last compile cells
    install_py_spy
    day=nvidia-h200_torch2.11.0_2026-11-30
    BENCH_S=150 replay "$THREADGRAPH_GPU_LOG/replay" --model dflash --tasks train --modes whole-step --placements per-gpu \
      --gil-profile 5 --merge-from "benchmarks/results/${day}_dflash-step_gil.json"
    BENCH_S=90 replay "$THREADGRAPH_GPU_LOG/replay" --model small --tasks train --modes whole-step --placements per-gpu \
      --gil-profile 5 --merge-from "benchmarks/results/${day}_gil.json"
    BENCH_S=80 replay "$THREADGRAPH_GPU_LOG/replay" --model small --tasks train --modes compile --placements procs-shared \
      --merge-from "benchmarks/results/$day.json"
    BENCH_S=110 replay "$THREADGRAPH_GPU_LOG/replay" --model small --tasks infer --modes compile \
      --placements procs-per-gpu,procs-shared --merge-from "$THREADGRAPH_GPU_LOG/replay/$day.json" ;;
  spread)  # issue 6's reduced form on nvidia-h200-x2 (carry .tgcache): the default trainer, 5 + 3 workers
           # spread over both GPUs, then the DFlash bench on both with whole-step graphs (~8 min)
    TRAIN_S=${TRAIN_S:-210} trainer spread-2gpus
    DFLASH_BENCH_S=${DFLASH_BENCH_S:-200} dflash_bench whole-2gpus --devices cuda:0,cuda:1 --cuda-graphs whole-step ;;
  resume-whole)  # one GPU: the whole-step trainer resumed from its step-50 checkpoint
    TRAIN_S=150 resume_pair whole --devices cuda:0 --cuda-graphs whole-step ;;
  bench)
    timeout "${BENCH_S:-400}" python3 benchmarks/replay_step_time.py --tasks train --out-dir "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -40
    timeout "${DFLASH_BENCH_S:-150}" python3 benchmarks/dflash_throughput.py --out-dir "$OUT" 2>&1 | tail -15 ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
kill "$saver" 2>/dev/null
save_logs
