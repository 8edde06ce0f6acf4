"""``python -m threadgraph doctor --selftest`` on a GPU, kept as a results file.

    python -m benchmarks doctor-selftest                          # runs the doctor here (needs a GPU)
    python -m benchmarks doctor-selftest --report LOG --date D    # a doctor's printed report, kept

Without ``--report`` it runs the doctor in a child process (``--json``), prints its checks and writes
``doctor-selftest_<gpu>_torch<version>_<date>.{json,md}``. With ``--report`` it reads what a doctor
printed before, as JSON (``--json``) or as its text report (the log of ``tools/gpu_evidence.sh
check``), dated by ``--date`` since a text report carries no date. Exit 1 when a check failed (the
file is written all the same), 2 when there is nothing to record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import results_schema  # noqa: E402

THEME = "doctor-selftest"
# The lines of the doctor's text report that say the versions and each check (threadgraph's
# ``selftest_line``; tests/bench/test_doctor_selftest.py reads what it prints).
VERSIONS = re.compile(r"^python (?P<python>\S+), torch (?P<torch>\S+) \(CUDA build: (?P<cuda>[^)]+)\)$")
CHECK = re.compile(r"^selftest (?P<verdict>PASS|FAIL): (?P<check>[^:]+): (?P<detail>.*)$")
TIMING = re.compile(r"^p50 (?P<p50>[\d.]+) ms, p90 (?P<p90>[\d.]+) ms, (?P<captures>\d+) captures$")


class NoReport(ValueError):
    """Nothing a doctor's selftest printed: no versions or no checks."""


def from_text(text: str) -> dict:
    """The doctor's text report as its --json would say it (versions, GPUs, checks)."""
    info, checks = {}, []
    for line in text.splitlines():
        if (found := VERSIONS.match(line)) is not None:
            info.update(python=found["python"], torch=found["torch"], cuda_build=found["cuda"])
        elif line.startswith("GPUs: ") and not line.startswith("GPUs: none"):
            info["gpus"] = [g.strip() for g in line[len("GPUs: "):].split(",")]
        elif (found := CHECK.match(line)) is not None:
            check = {"check": found["check"], "passed": found["verdict"] == "PASS"}
            timing = TIMING.match(found["detail"])
            check.update({"p50_ms": float(timing["p50"]), "p90_ms": float(timing["p90"]),
                          "captures": int(timing["captures"])} if timing else {"error": found["detail"]})
            checks.append(check)
    if "torch" not in info or not checks:
        raise NoReport("no 'python X, torch Y (CUDA build: Z)' line and 'selftest PASS|FAIL: ...' lines: "
                       "give the output of python -m threadgraph doctor --selftest")
    return info | {"selftest": checks}


def parse(text: str) -> dict:
    """A doctor's output, JSON or text."""
    try:
        info = json.loads(text)
    except json.JSONDecodeError:
        return from_text(text)
    if not isinstance(info.get("selftest"), list) or not info["selftest"] or not info.get("gpus"):
        raise NoReport(f"a doctor JSON report without a GPU's selftest ({info.get('selftest') or 'no selftest'}): "
                       "run python -m threadgraph doctor --selftest --json on a GPU machine")
    return info


def record(info: dict, date: str) -> dict:
    """The results file's content: the header of its name, the versions and each check."""
    gpu = info["gpus"][0] if info.get("gpus") else None
    checks = list(info["selftest"])
    return {"gpu": results_schema.machine_of(gpu), "torch": info["torch"].split("+")[0], "date": date,
            "torch_build": info["torch"], "cuda_build": info.get("cuda_build"), "python": info.get("python"),
            "gpus": info.get("gpus", []), "checks": checks}


def render(data: dict) -> str:
    rows = [["PASS" if c["passed"] else "FAIL", c["check"], common.fmt(c.get("p50_ms"), 3),
             common.fmt(c.get("p90_ms"), 3), c.get("captures", "-"), c.get("error", "")] for c in data["checks"]]
    return "\n".join([
        f"# threadgraph doctor --selftest: {', '.join(data['gpus']) or data['gpu']}, torch {data['torch_build']}, {data['date']}",
        "", f"Python {data['python']}, CUDA build {data['cuda_build']}. Each check trains or infers with "
        "reduce-overhead in a worker thread, in a process of its own. Regenerate on a GPU machine: "
        "`python -m benchmarks doctor-selftest`.", "",
        common.markdown_table(["verdict", "check", "step p50 ms", "step p90 ms", "captures", "error"], rows), ""])


def write(data: dict, out_dir: Path) -> Path:
    env = {"gpu": data["gpus"][0] if data["gpus"] else None, "torch": data["torch"], "date": data["date"]}
    path = out_dir / f"{results_schema.stem(env, THEME)}.json"
    results_schema.write(path, data)
    path.with_suffix(".md").write_text(render(data))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", type=Path, help="a doctor's earlier output (JSON or text) instead of running it")
    p.add_argument("--date", help="the report's date, YYYY-MM-DD (with --report; default today)")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    args = p.parse_args(argv)
    date = args.date or datetime.date.today().isoformat()
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        p.error(f"--date {date!r}: give it as YYYY-MM-DD")
    if args.report is not None:
        if not args.report.is_file():
            p.error(f"--report {args.report}: no such file (the doctor's output, JSON or text)")
        text = args.report.read_text()
    else:
        print("running python -m threadgraph doctor --selftest --json (a minute or two on a GPU)", flush=True)
        doctor = subprocess.run([sys.executable, "-m", "threadgraph", "doctor", "--selftest", "--json"],
                                capture_output=True, text=True)
        text = doctor.stdout
    try:
        data = record(parse(text), date)
    except NoReport as exc:
        said = "" if args.report is not None else f" (the doctor exited {doctor.returncode}: {doctor.stderr.strip()[-500:]})"
        print(f"error: {exc}{said}", file=sys.stderr)
        return 2
    print(render(data))
    print(f"wrote {write(data, common.results_dir(args.out_dir))} and its .md")
    return 0 if all(c["passed"] for c in data["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
