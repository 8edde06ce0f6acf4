"""Whether fresh builds of the embedded default are bit-identical, and the trainer's tau on them.

Build the embedded default fresh N times, compare the builds bit for bit, and train the default
drafter on some of them: acceptance length tau with its baselines per build.

    python -m benchmarks tau-reproducibility --caches tau/a tau/b tau/c --train 2

Each ``--caches`` directory gets its own default-asset build (``default_assets(DIR)``, whose time
depends on the machine: examples/dflash_trainer/README.md gives measured ranges; a complete one is
reused). The first ``--train`` of them get a default trainer run
(``python -m examples.dflash_trainer --devices cpu --json`` with ``THREADGRAPH_CACHE=DIR``), whose
tau and baselines are kept in ``DIR/tau-run.json``, so a later call only runs what is missing. The
results file (``dflash-tau-reproducibility_<gpu-or-cpu>_torch<ver>_<date>.json``) lists each file's
SHA-256 per build, the target reports' differences (build timings aside) and the runs' tau.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

from . import common
from . import results_schema
from . import trainer_process

from examples.dflash_trainer.assets.assets import default_assets

_RUN = "tau-run.json"
_VARYING = ("timings",)  # report keys that differ by build duration, not by content
_REPORT = "target_report.json"  # holds the timings: compared as a report without them, not by hash


def file_hashes(root: Path) -> dict[str, str]:
    """SHA-256 of every file of a default-asset build, by path relative to the build."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def train_once(cache: Path, timeout: int) -> dict:
    """One default trainer run on the CPU against ``cache``'s assets: tau and baselines."""
    with tempfile.TemporaryDirectory() as out:
        run = trainer_process.run_trainer(["--devices", "cpu", "--json", "--out-dir", out], timeout=timeout,
                                          env={"THREADGRAPH_CACHE": str(cache), "CUDA_VISIBLE_DEVICES": ""})
    if run.result is None:
        raise SystemExit(f"trainer on {cache}: {run.error}")
    results = run.result
    return {"tau": results["eval"]["tau"], "tau_random_init": results["baseline"]["tau_random_init"],
            "tau_repeat_last_token": results["baseline"]["tau_repeat_last_token"], "steps": results["last"]["step"],
            "loss_last": results["last"]["loss"], "seconds": run.took_s}


def compare(caches: list[Path], train: int, timeout: int) -> dict:
    builds = []
    for i, cache in enumerate(caches):
        assets = default_assets(cache)
        report = {k: v for k, v in assets.load_report().items() if k not in _VARYING}
        run_file = assets.root / _RUN
        if i < train and not run_file.is_file():
            print(f"[training on {assets.root}]", file=sys.stderr, flush=True)
            run_file.write_text(json.dumps(train_once(cache, timeout), indent=1) + "\n")
        builds.append({"cache": str(assets.root), "hashes": file_hashes(assets.target_dir.parent), "report": report,
                       "build_s": assets.load_report()["timings"]["total_s"],
                       "run": json.loads(run_file.read_text()) if run_file.is_file() else None})
    first = builds[0]
    for b in builds:
        b["hashes"].pop(_RUN, None)  # the run's record, not an asset
        b["hashes"].pop(_REPORT, None)
    differing = sorted({name for b in builds for name in set(b["hashes"]) | set(first["hashes"])
                        if b["hashes"].get(name) != first["hashes"].get(name)})
    taus = [b["run"]["tau"] for b in builds if b["run"]]
    return {"builds": builds, "bit_identical": not differing, "differing_files": differing,
            "reports_identical": all(b["report"] == first["report"] for b in builds),
            "tau": {"runs": len(taus), "min": min(taus, default=None), "max": max(taus, default=None)}}


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caches", nargs="+", type=Path, required=True, help="one cache directory per build (>= 2)")
    p.add_argument("--train", type=int, default=2, help="train on the first N builds (default 2)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per trainer run")
    common.add_out_dir(p)
    args = p.parse_args(argv)
    if len(args.caches) < 2 or len(set(args.caches)) != len(args.caches):
        p.error("--caches needs at least two different directories: one build is not a comparison")
    env = common.environment()
    result = compare(args.caches, args.train, args.timeout)
    stem = results_schema.stem(env, "dflash-tau-reproducibility")
    common.save(common.results_dir(args.out_dir) / f"{stem}.json", {"benchmark": "tau_reproducibility", "env": env, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
