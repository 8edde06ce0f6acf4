#!/usr/bin/env bash
# The project's GPU evidence for the torch that `python3` imports (after tools/device_torch.py
# install, the release it put first on PYTHONPATH), in parts that each fit a 10-minute call:
#
#   tools/gpu_evidence.sh check      # torch, CUDA, a compiled step; python -m threadgraph doctor --selftest,
#                                    # then the doctor-selftest results file
#   tools/gpu_evidence.sh suite      # the GPU tests (-m "gpu and not slow") but the fence's, then the gpu-scenarios results file
#   tools/gpu_evidence.sh slow       # the slow GPU tests (-m "gpu and slow")
#   tools/gpu_evidence.sh tests FILE # the GPU tests named in FILE (node ids, one a line: those a cut-short run
#                                    # did not reach), then a gpu-scenarios phase (default label rest)
#   tools/gpu_evidence.sh conformance  # the conformance suite, 4 placements
#   tools/gpu_evidence.sh fence      # the fence's GPU tests (its matrix, the repro), then the fence-matrix results file
#   tools/gpu_evidence.sh throughput [SHAPE [GRAPHS [ARG...]]]  # one DFlash throughput cell (default 0.6b,
#                                    # trees), with a profiled window of each thread's share of the GPU;
#                                    # ARGs go to the benchmark (e.g. --inductor-cache shared)
#   tools/gpu_evidence.sh gil [SHAPE [GRAPHS]]  # py-spy's GIL profile of the threaded pipeline (default 0.6b,
#                                    # trees); py-spy from PATH or a wheel carried in .device-torch/pyspy/
#   tools/gpu_evidence.sh startup [ARG...]  # the main job's startup (Trees, whole-step), empty Inductor
#                                    # caches; ARGs go to trainer-startup (e.g. --append --label "warmers"
#                                    # -- --compile-warmers)
#   tools/gpu_evidence.sh drafter    # the drafter's Trees step in 4 placements at once; on a failure, the
#                                    # switches that each take one suspect away; the fused attention ops compiled
#
# The correctness parts (suite, slow, conformance, fence) may run at once (`A & B & wait`): they
# pass under load; the timed parts (throughput, startup) run alone.
# Results files go to benchmarks/results (named by theme, machine, torch and date); logs to
# $EVIDENCE_LOGS (default ./gpu-evidence-logs). With $OUT set, each part leaves one archive there
# holding its logs and the results files it wrote. The embedded default assets are built once
# into $THREADGRAPH_CACHE (default /root/tgcache) and reused by later parts on the same machine.
# The suite and slow parts add a phase to today's gpu-scenarios results file, named $EVIDENCE_LABEL
# (default: the part's name; a name the file has already is refused: give another).
# $EVIDENCE_STEP_TIMEOUT (seconds) interrupts a step that runs longer (SIGINT, so pytest still
# prints what passed), leaving time for the archive before the device call's own limit.
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
parts="check, suite, slow, tests, conformance, fence, throughput, gil, startup or drafter"
part=${1:-}
die() { echo "error: $*" >&2; exit 2; }
[ -n "$part" ] || die "name a part: $parts"
case " check suite slow tests conformance fence throughput gil startup drafter " in
  *" $part "*) ;;
  *) die "unknown part '$part'; name one of $parts" ;;
esac
if [ "$part" = tests ]; then
  list=${2:-}
  case "$list" in ""|/*) ;; *) list=$caller/$list ;; esac  # relative to where the script was called from
  [ -s "$list" ] || die "name a file of test node ids, one a line (python -m benchmarks gpu-scenarios --unreached DIR... prints them)${2:+; $list is missing or empty}"
fi
pyspy_wheel=
if [ "$part" = gil ] && ! command -v py-spy >/dev/null && [ ! -x "$(dirname "$(command -v python3)")/py-spy" ]; then
  pyspy_wheel=$(ls .device-torch/pyspy/py_spy-*.whl 2>/dev/null | head -n 1)
  [ -n "$pyspy_wheel" ] || die "py-spy is not installed here: pip install py-spy, or carry its wheel in .device-torch/pyspy/"
fi
logs=${EVIDENCE_LOGS:-$PWD/gpu-evidence-logs}/$part
mkdir -p "$logs"
export THREADGRAPH_CACHE=${THREADGRAPH_CACHE:-/root/tgcache}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
stamp=$(mktemp)  # results files newer than this are this part's
status=0
step() {  # step NAME COMMAND...: run, log, remember a failure, go on
  local name=$1; shift
  echo "== $name: $*" | tee -a "$logs/steps.txt"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=30 "${EVIDENCE_STEP_TIMEOUT:-0}" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$logs/steps.txt"
  tail -n 15 "$logs/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

case "$part" in
  check)
    step versions python3 -c 'import torch, triton, sys; print(sys.version.split()[0], "torch", torch.__version__, "from", torch.__file__, "triton", triton.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpu", torch.cuda.get_device_name(0))'
    step compiled-step python3 -c '
import torch
m = torch.nn.Linear(64, 64).cuda()
f = torch.compile(m, mode="reduce-overhead")
x = torch.randn(8, 64, device="cuda")
for _ in range(3):
    y = f(x)
torch.cuda.synchronize()
assert torch.allclose(y, m(x), atol=1e-5), "compiled output differs from eager"
print("reduce-overhead replay matches eager")'
    step selftest python3 -m threadgraph doctor --selftest
    step selftest-results python3 -m benchmarks doctor-selftest --report "$logs/selftest.log"
    ;;
  suite)
    export THREADGRAPH_GPU_LOG="$logs/records"
    mkdir -p "$THREADGRAPH_GPU_LOG"
    # The fence's GPU tests are the fence part's (24 fresh processes): run both parts at once to cover all.
    step gpu-tests python3 -m pytest -q -rfE --durations=15 -m "gpu and not slow" -n 4 \
      --ignore=tests/library/test_gpu_fence.py --junitxml="$THREADGRAPH_GPU_LOG/junit.xml" tests
    step gpu-scenarios python3 -m benchmarks gpu-scenarios "$THREADGRAPH_GPU_LOG" --label "${EVIDENCE_LABEL:-suite}"
    ;;
  slow)
    export THREADGRAPH_GPU_LOG="$logs/records"
    mkdir -p "$THREADGRAPH_GPU_LOG"
    step gpu-slow-tests python3 -m pytest -q -rfEs --durations=15 -m "gpu and slow" -n 4 \
      --junitxml="$THREADGRAPH_GPU_LOG/junit.xml" tests
    step gpu-scenarios python3 -m benchmarks gpu-scenarios "$THREADGRAPH_GPU_LOG" --label "${EVIDENCE_LABEL:-slow}" \
      --gpu "$(python3 -c 'import torch; print(torch.cuda.get_device_name(0))')"
    ;;
  tests)
    export THREADGRAPH_GPU_LOG="$logs/records"
    mkdir -p "$THREADGRAPH_GPU_LOG"
    mapfile -t ids < <(grep -v '^[[:space:]]*$' "$list")  # whole lines: node ids hold brackets and spaces
    step gpu-listed-tests python3 -m pytest -q -rfEs --durations=15 -n 4 \
      --junitxml="$THREADGRAPH_GPU_LOG/junit.xml" "${ids[@]}"
    step gpu-scenarios python3 -m benchmarks gpu-scenarios "$THREADGRAPH_GPU_LOG" --label "${EVIDENCE_LABEL:-rest}" \
      --gpu "$(python3 -c 'import torch; print(torch.cuda.get_device_name(0))')"
    ;;
  conformance)
    step conformance python3 -m tests.conformance --jobs 4 --write benchmarks/results
    ;;
  fence)
    export THREADGRAPH_GPU_LOG="$logs/records"
    mkdir -p "$THREADGRAPH_GPU_LOG"
    step gpu-fence-tests python3 -m pytest -q -rfE --durations=15 -m gpu -n 4 \
      --junitxml="$THREADGRAPH_GPU_LOG/junit.xml" tests/library/test_gpu_fence.py
    step fence-matrix python3 -m benchmarks fence-matrix "$THREADGRAPH_GPU_LOG"
    ;;
  throughput)
    step "dflash-throughput-${2:-0.6b}-${3:-trees}" python3 -m benchmarks dflash-throughput --target-shape "${2:-0.6b}" \
      --cuda-graphs "${3:-trees}" "${@:4}"
    ;;
  gil)
    if [ -n "$pyspy_wheel" ]; then
      step py-spy-install python3 -m pip install -q --no-deps --target "$logs/py-spy" "$pyspy_wheel"
      export PATH="$logs/py-spy/bin:$PATH"
    fi
    step "gil-profile-${2:-0.6b}-${3:-trees}" python3 -m benchmarks gil-profile --target-shape "${2:-0.6b}" \
      --cuda-graphs "${3:-trees}"
    ;;
  startup)
    step trainer-startup python3 -m benchmarks trainer-startup --no-restart "${@:2}"
    ;;
  drafter)
    probe() {  # probe NAME ARGS...: one scenario process with an Inductor cache of its own, in the background
      local name=$1; shift
      ( TORCHINDUCTOR_CACHE_DIR="$logs/inductor-$name" timeout --signal=INT --kill-after=30 "${EVIDENCE_STEP_TIMEOUT:-0}" \
          python3 -X faulthandler -m tests.helpers.gpu_drafter_scenarios "$@" >"$logs/$name.log" 2>&1
        echo "== $name: exit $?" >>"$logs/steps.txt" ) &
    }
    for p in main main-install thread threads-3; do probe "$p" "$p" --steps 3; done
    wait
    cat "$logs/steps.txt"
    failed=$(grep -m1 -v ': exit 0$' "$logs/steps.txt" | sed 's/^== \([^:]*\):.*/\1/')
    if [ -n "$failed" ]; then
      status=1
      probe "$failed-sdpa-math" "$failed" --steps 3 --sdpa math
      probe "$failed-warmup-modes-off" "$failed" --steps 3 --warmup-modes off
      probe "$failed-autograd-threads-off" "$failed" --steps 3 --autograd-threads off
      TORCH_CUDNN_SDPA_DEPRIORITIZED=1 probe "$failed-cudnn-sdpa-deprioritized" "$failed" --steps 3
      wait
      cat "$logs/steps.txt"
    fi
    echo "== fused attention ops in the compiled code (count, op):"
    grep -rhoaE "aten\._(scaled_dot_product|flash_attention|efficient_attention)[a-z_]*" "$logs"/inductor-* | sort | uniq -c
    for f in "$logs"/*.log; do echo "-- $f"; tail -n 6 "$f"; done
    ;;
esac

if [ -n "${OUT:-}" ]; then
  find benchmarks/results -newer "$stamp" -type f >"$logs/results-written.txt"
  # Inductor caches (the drafter part's) stay behind: they are too big to come back.
  tar -czf "$OUT/evidence-$part.tar.gz" --exclude='inductor-*' --exclude=py-spy "$logs" $(cat "$logs/results-written.txt")
fi
rm -f "$stamp"
exit $status
