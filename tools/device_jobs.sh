#!/usr/bin/env bash
# Long GPU work across device calls that may each run 10 minutes at most: a job runs in a process
# session of its own (it outlives the call that started it, as long as the machine stays held) from a
# snapshot of the repository, so later calls that refresh the working tree leave it alone.
#
#   tools/device_jobs.sh start NAME [--torch RELEASE] -- COMMAND...
#       snapshot the repository into $DEVICE_JOBS/NAME/repo and run COMMAND there; with --torch, the
#       release that tools/device_torch.py installed comes first on PYTHONPATH, with an Inductor (and so
#       Triton) cache of its own (two releases never share compiled code). The job's $OUT is
#       $DEVICE_JOBS/NAME/out (tools/gpu_evidence.sh leaves its archive there).
#   tools/device_jobs.sh wait SECONDS [NAME...]
#       wait until the named jobs (all, without names) have ended, at most SECONDS, saying every
#       30 s which ones it waits for; exit 0 when all ended with 0, 1 when one failed, 3 when one
#       still runs.
#   tools/device_jobs.sh collect [NAME...]
#       copy each named job's out files into this call's $OUT as NAME--FILE, and its log's tail there
#       as NAME--log.txt.
#   tools/device_jobs.sh list
#
# $DEVICE_JOBS defaults to /root/device-jobs. Nothing here survives the machine being given back.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
jobs_dir=${DEVICE_JOBS:-/root/device-jobs}
usage="usage: tools/device_jobs.sh start NAME [--torch RELEASE] -- COMMAND... | wait SECONDS [NAME...] | collect [NAME...] | list"
die() { echo "error: $*" >&2; exit 2; }

state() {  # state NAME: running, exit N, or lost (no exit code and no live process)
  local d=$jobs_dir/$1
  if [ -f "$d/rc" ]; then echo "exit $(cat "$d/rc")"
  elif [ -f "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; then echo running
  else echo lost; fi
}

watched=()
pick() {  # pick [NAME...]: set watched to the named jobs, or to every job started on this machine
  local n
  for n in "$@"; do [ -d "$jobs_dir/$n" ] || die "no job named '$n' on this machine (tools/device_jobs.sh list)"; done
  if [ $# -gt 0 ]; then watched=("$@"); else read -r -a watched <<<"$(ls "$jobs_dir" 2>/dev/null | tr '\n' ' ')"; fi
  [ ${#watched[@]} -gt 0 ] || die "no job started on this machine"
}

cmd=${1:-}; shift || true
case "$cmd" in
  start)
    name=${1:-}; shift || true
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || die "name the job in letters, digits, '.', '_' or '-'; $usage"
    release=""
    if [ "${1:-}" = "--torch" ]; then release=${2:?"--torch takes a release, e.g. 2.14.1"}; shift 2; fi
    [ "${1:-}" = "--" ] || die "$usage"
    shift
    [ $# -gt 0 ] || die "no command to run; $usage"
    d=$jobs_dir/$name
    [ -e "$d" ] && [ "$(state "$name")" = running ] && die "job '$name' is still running"
    rm -rf "$d"; mkdir -p "$d/repo" "$d/out"
    # The release pieces and any virtual environment (a folder holding pyvenv.cfg: CI keeps its venvs, GBs
    # each, inside the clone) stay out; a carried py-spy wheel comes along (gpu_evidence.sh gil installs it).
    tar -C "$repo" --exclude=./.device-torch --exclude=./gpu-evidence-logs --exclude=./.git \
        --exclude-tag-all=pyvenv.cfg -cf - . | tar -C "$d/repo" -xf -
    if [ -d "$repo/.device-torch/pyspy" ]; then
      mkdir -p "$d/repo/.device-torch" && cp -r "$repo/.device-torch/pyspy" "$d/repo/.device-torch/"
    fi
    env_args=(OUT="$d/out" EVIDENCE_LOGS="$d/logs")
    if [ -n "$release" ]; then
      site=/root/device-torch/torch$release/site
      [ -d "$site" ] || die "torch $release is not installed here; run tools/device_torch.py install --torch $release first"
      # Triton's cache lives inside Inductor's unless TRITON_CACHE_DIR says otherwise: left unset, so a
      # part that empties Inductor's cache (the startup part) empties Triton's too.
      env_args+=(PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" TORCHINDUCTOR_CACHE_DIR="/root/inductor-$release")
    fi
    printf '%q ' "$@" >"$d/command"
    # The job's own shell writes its pid: setsid may fork, and the device kills what a call leaves
    # behind unless it runs in a session of its own.
    ( cd "$d/repo" && setsid env "${env_args[@]}" bash -c 'echo $$ >"$0/pid"; "$@" >"$0/log" 2>&1; echo $? >"$0/rc"' \
        "$d" "$@" & ) </dev/null >/dev/null 2>&1  # redirected around the subshell: no copy of this call's pipes stays open
    for _ in $(seq 50); do [ -s "$d/pid" ] && break; sleep 0.1; done
    [ -s "$d/pid" ] || die "job '$name' did not start (no pid after 5 s)"
    echo "started $name (pid $(cat "$d/pid")${release:+, torch $release}): $(cat "$d/command")"
    ;;
  wait)
    limit=${1:-}; shift || true
    [[ "$limit" =~ ^[0-9]+$ ]] || die "wait takes the most seconds to wait; $usage"
    pick "$@"
    t0=$SECONDS
    while :; do
      running=()
      for n in "${watched[@]}"; do [ "$(state "$n")" = running ] && running+=("$n"); done
      [ ${#running[@]} -eq 0 ] && break
      if [ $((SECONDS - t0)) -ge "$limit" ]; then break; fi
      if [ $(((SECONDS - t0) % 30)) -eq 0 ]; then
        echo "waiting $((SECONDS - t0)) s of $limit for ${running[*]}"
        for n in "${running[@]}"; do echo "  $n: $(tail -n 1 "$jobs_dir/$n/log" 2>/dev/null | cut -c1-160)"; done
      fi
      sleep 1
    done
    worst=0
    for n in "${watched[@]}"; do
      s=$(state "$n")
      echo "== $n: $s"
      tail -n 8 "$jobs_dir/$n/log" 2>/dev/null
      case "$s" in running) worst=3 ;; "exit 0") ;; *) [ "$worst" -lt 1 ] && worst=1 ;; esac
    done
    exit $worst
    ;;
  collect)
    [ -n "${OUT:-}" ] || die "collect copies into \$OUT, which is unset"
    pick "$@"
    for n in "${watched[@]}"; do
      for f in "$jobs_dir/$n/out"/*; do [ -f "$f" ] && cp "$f" "$OUT/$n--$(basename "$f")"; done
      tail -n 200 "$jobs_dir/$n/log" >"$OUT/$n--log.txt" 2>/dev/null
      echo "$n: $(state "$n"); $(ls "$jobs_dir/$n/out" | wc -l) file(s)"
    done
    ;;
  list)
    pick
    for n in "${watched[@]}"; do echo "$n: $(state "$n"): $(cat "$jobs_dir/$n/command")"; done
    ;;
  *)
    die "$usage"
    ;;
esac
