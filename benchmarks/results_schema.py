"""The results files of benchmarks/results/: their names, the fields each theme's JSON must hold,
and the one way to read and write them.

A results file is named ``<theme>_<gpu-or-cpu>_torch<version>_<YYYY-MM-DD>.json``: its
header (theme, machine, torch, date) is in the name, for every file old or new. Where the JSON also
records them (``env``, or top-level ``torch`` / ``date`` / ``gpu`` / ``machine`` in files without
an ``env``), they must agree with the name. Each theme's JSON must hold the fields its renderers
read (``THEMES``); a file that does not is refused with one error naming the file and the field.

``load`` reads and checks one file, ``load_folder`` every JSON of a folder (newest last), ``write``
checks and writes one. No torch import: the renderers read JSON only.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

RESULTS = Path(__file__).resolve().parent / "results"
INDEX = "README.md"  # the folder's index, the one file not named by the rule
NAME = re.compile(r"^(?P<theme>[a-z0-9.-]+)_(?P<machine>[a-z0-9-]+)_torch(?P<torch>\d[\w.]*)_"
                  r"(?P<date>\d{4}-\d{2}-\d{2})\.(?P<ext>json|md)$")
RULE = "<theme>_<gpu-or-cpu>_torch<version>_<YYYY-MM-DD>.{json,md}"

# A dflash-throughput cell's ``inductor_cache``: the cache it started on.
EMPTY, SHARED = "empty", "the threaded cell's (a restart)"
# A dflash-throughput sequential cell's ``training``: the threads' own training (their replicas, the
# mean gradient of a round, one AdamW step a round on each device). A cell without the key stepped one
# replica a device with AdamW after every batch: more optimizer work than the threads, whose drafters
# share a device's weights.
AS_THREADED = "as threaded"


# The fewest steady tokens/s windows a dflash-throughput ratio may rest on, on each side: one window
# (the next after warmup) can be fed by the batches the target threads queued during warmup, and
# read as a speed-up the devices cannot give (a 20-step run: 1.63x, its 60-step run 1.01x).
MIN_STEADY_WINDOWS = 3


def steady_windows(cell: dict) -> Optional[int]:
    """The steady tokens/s windows a dflash-throughput cell's figure rests on: a threaded cell's
    ``steady_windows``, a sequential cell's ``windows_tokens_per_s`` (None where the cell says not)."""
    if "steady_windows" in cell:
        return cell["steady_windows"]
    windows = cell.get("windows_tokens_per_s")
    return len(windows) if isinstance(windows, list) else None


def ratio_withheld(threaded: dict, sequential: dict) -> Optional[str]:
    """Why a dflash-throughput run reports no threaded / sequential ratio, or None when it may: a
    side timed over fewer than MIN_STEADY_WINDOWS steady windows."""
    short = [f"the {name} cell {count} steady window{'s' if count != 1 else ''}"
             for name, count in (("threaded", steady_windows(threaded)), ("sequential", steady_windows(sequential)))
             if count is not None and count < MIN_STEADY_WINDOWS]
    if not short:
        return None
    return f"no ratio: {' and '.join(short)}, fewer than {MIN_STEADY_WINDOWS}"


def above_gpu_bound(data: dict) -> dict:
    """The pipelines of a dflash-throughput run whose tokens/s exceed its GPU-bound limit, by their
    ratio to it: impossible (the devices cannot run their kernels faster than back to back), so a
    measurement error to flag, never a speed-up to report. Empty without a limit."""
    bound = data.get("gpu_bound_tokens_per_s")
    if not bound:
        return {}
    pipelines = {name: data.get(f"tokens_per_s_{name}") for name in ("threaded", "sequential", "processes")}
    return {name: value / bound for name, value in pipelines.items() if value is not None and value > bound}


def timed_alike(sequential: dict) -> bool:
    """Whether a dflash-throughput run timed its two cells alike: no profiler before or during either
    timed span, a median of windows on both; its sequential cell then has ``windows_tokens_per_s``."""
    return "windows_tokens_per_s" in sequential


class ResultsError(ValueError):
    """A results file that breaks the schema: its name, the field and what is wrong."""

    def __init__(self, file: str, field: str, problem: str) -> None:
        super().__init__(f"{file}: {field}: {problem}")
        self.file, self.field = file, field


class Name(NamedTuple):
    theme: str
    machine: str
    torch: str
    date: str
    ext: str


def parse_name(file_name: str) -> Optional[Name]:
    found = NAME.match(file_name)
    return Name(*found.group("theme", "machine", "torch", "date", "ext")) if found else None


def stem(env: dict, theme: str) -> str:
    """``<theme>_<gpu-or-cpu>_torch<ver>_<YYYY-MM-DD>`` of a run on ``env`` (common.environment())."""
    return f"{theme}_{machine_of(env.get('gpu'))}_torch{env['torch'].split('+')[0]}_{env['date']}"


def machine_of(gpu: Optional[str]) -> str:
    """A GPU's name as file names write it (``NVIDIA H200`` -> ``nvidia-h200``); ``cpu`` without one."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") if gpu else "cpu"


def recency(file_name: str) -> tuple:
    """Sort key of a results file, newest last: its date, then a GPU's run before a CPU's of that
    date, then the torch version (as numbers: 2.11 after 2.9), then the name."""
    name = parse_name(file_name)
    if name is None:
        return "", False, (), file_name
    return name.date, name.machine != "cpu", release(name.torch), file_name


def release(torch: str) -> tuple:
    """A torch release as written in a results file's name, as numbers to sort by (2.9.1 before 2.11.0)."""
    return tuple(int(part) for part in re.findall(r"\d+", torch)[:3])


# -- the fields of each theme ------------------------------------------------------------------------

NUMBER = (int, float)
OPTIONAL_NUMBER = (int, float, type(None))
# theme family -> {field: type(s)}; a theme belongs to the longest family it equals or starts
# with followed by '-' (``replay-dflash-gil`` is a replay file). "rows[]" checks each entry of a list.
THEMES: dict[str, dict[str, Any]] = {
    "replay": {"env": dict, "rows": list, "rows[]": {"task": str, "placement": str, "mode": str}},
    "dflash-throughput": {"env": dict, "shape": str, "graphs": str, "args": dict, "threaded": dict,
                          "sequential": dict, "ratio": OPTIONAL_NUMBER},
    "dflash-trainer": {},  # one trainer --json output, or runs under names: checked by trainer_runs_of
    "dflash-tau-reproducibility": {"env": dict, "builds": list, "bit_identical": bool, "differing_files": list,
                                   "tau": dict},
    "gil-profile": {"env": dict, "args": dict, "gil_busy": NUMBER, "tokens_per_s_steady": OPTIONAL_NUMBER},
    "fence-matrix": {"cells": list, "repro": dict},
    "fence-overhead": {"rows": list, "rows[]": {"task": str, "workers": int, "fenced_p50_ms": NUMBER,
                                                "unfenced_p50_ms": NUMBER, "ratio_fenced_over_unfenced": NUMBER}},
    "install-overhead": {"env": dict, "summary": dict},
    "call-overhead": {"env": dict, "rows": list, "rows[]": {"variant": str, "per_call_us": NUMBER, "ratio_to_none": NUMBER}},
    "conformance": {"placements": list, "cases": int, "equal": int, "rows": list},
    "gpu-scenarios": {},  # phases by label, each a dict: checked below
    "dflash-loss-memory": {"env": dict, "vocab": int, "dense_peak_bytes": int, "chunked_peak_bytes": int},
    "regenerate-throughput": {"env": dict, "shape": str, "args": dict, "rows": list,
                              "rows[]": {"decode": str, "threads": int, "batch": int}},
}
TRAINER_RUN = {"eval": dict, "baseline": dict, "mode": str, "total_steps": int, "placement": str}


def family(theme: str) -> str:
    """The family of THEMES a theme belongs to; a theme of none is refused."""
    for prefix in sorted(THEMES, key=len, reverse=True):
        if theme == prefix or theme.startswith(prefix + "-"):
            return prefix
    raise KeyError(f"no results theme {theme!r}: add its fields to THEMES in benchmarks/results_schema.py "
                   "and its headlines to benchmarks/headlines.py")


def _check_fields(file: str, data: dict, fields: dict, where: str = "") -> None:
    for field, types in fields.items():
        if field.endswith("[]"):
            for i, entry in enumerate(data[field[:-2]]):
                if not isinstance(entry, dict):
                    raise ResultsError(file, f"{where}{field[:-2]}[{i}]", f"expected an object, found {type(entry).__name__}")
                _check_fields(file, entry, types, f"{where}{field[:-2]}[{i}].")
            continue
        if field not in data:
            raise ResultsError(file, where + field, "missing")
        value, allowed = data[field], types if isinstance(types, tuple) else (types,)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):  # True is an int too
            kind = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ResultsError(file, where + field, f"expected {kind}, found {type(value).__name__}")


def trainer_runs_of(data: dict) -> dict:
    """A dflash-trainer file's runs by name: a trainer's --json output is one run named ''; else the
    entries that hold an ``eval`` (the others, such as ``env`` and ``resume``, say how they were made)."""
    if "losses" in data:
        return {"": data}
    return {name: run for name, run in data.items() if isinstance(run, dict) and "eval" in run}


def _check_header(file: str, name: Name, data: dict) -> None:
    """What the JSON says of its machine, torch and date agrees with its name. An ``env`` says it
    as common.environment() does (``gpu`` None on a CPU); a file without one may say it at the top."""
    env = data.get("env") if isinstance(data.get("env"), dict) else None
    source, where = (env, "env.") if env is not None else (data, "")
    machine_key = "gpu" if env is not None else next((k for k in ("machine", "gpu") if data.get(k)), None)
    stored = {"torch": source.get("torch"), "date": source.get("date")}
    if machine_key is not None and machine_key in source:
        stored[machine_key] = machine_of(source[machine_key])
    for field, value in stored.items():
        if value is None:
            continue
        value, expected = str(value), getattr(name, "machine" if field in ("gpu", "machine") else field)
        if (value.split("+")[0] if field == "torch" else value) != expected:
            raise ResultsError(file, where + field, f"says {value!r}, the file's name {expected!r}")


def validate(file_name: str, data: Any) -> Name:
    """Check a results JSON against its name's theme; its header (from the name) when it passes."""
    name = parse_name(file_name)
    if name is None or name.ext != "json":
        raise ResultsError(file_name, "name", f"not {RULE.replace('{json,md}', 'json')}")
    if not isinstance(data, dict):
        raise ResultsError(file_name, "(top level)", f"expected an object, found {type(data).__name__}")
    try:
        kind = family(name.theme)
    except KeyError as exc:
        raise ResultsError(file_name, "theme", exc.args[0]) from None
    _check_fields(file_name, data, THEMES[kind])
    if kind == "dflash-trainer":
        for run_name, run in trainer_runs_of(data).items():
            _check_fields(file_name, run, TRAINER_RUN, f"{run_name}." if run_name else "")
    if kind == "gpu-scenarios":
        for label, phase in data.items():
            if not isinstance(phase, dict):
                raise ResultsError(file_name, label, f"expected a phase (an object), found {type(phase).__name__}")
    _check_header(file_name, name, data)
    return name


class Results(NamedTuple):
    """One checked results file: its header (from the name) and its JSON."""
    path: Path
    theme: str
    machine: str
    torch: str
    date: str
    data: dict

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def env(self) -> dict:
        """The run's environment; files without one get what their name says."""
        return self.data.get("env") or {"machine": self.machine, "torch": self.torch, "date": self.date}


def load(path: Path) -> Results:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ResultsError(path.name, "(file)", f"not JSON ({exc})") from None
    name = validate(path.name, data)
    return Results(path, name.theme, name.machine, name.torch, name.date, data)


def load_folder(folder: Path) -> list[Results]:
    """Every results JSON of a folder, checked, oldest first (``recency``)."""
    return [load(p) for p in sorted(Path(folder).glob("*.json"), key=lambda p: recency(p.name))]


def newest(runs: list[Results], theme: str) -> Optional[Results]:
    """The newest of ``runs`` (oldest first, as ``load_folder`` gives them) of exactly ``theme``, or None."""
    found = [r for r in runs if r.theme == theme]
    return found[-1] if found else None


def misnamed(folder: Path) -> list[str]:
    """Files of a results folder that break the naming rule (its index aside)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.name != INDEX and parse_name(p.name) is None)


# An absolute path as results files must not hold one: a '/' that starts a word (not a URL's, a
# relative path's or a ratio's), then one or more path parts.
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/<>~-])/[\w.+-]+(?:/[\w.+-]+)*/?")


# How results files write the threadgraph cache (the DFlash assets and shape targets): ``<cache>/...``.
CACHE = "<cache>"


def cache_root() -> Path:
    """The threadgraph cache, as the DFlash assets resolve it (``assets.default_cache_root``, which
    imports torch): ``$THREADGRAPH_CACHE``, else ``$XDG_CACHE_HOME/threadgraph``, else ``~/.cache/threadgraph``."""
    if os.environ.get("THREADGRAPH_CACHE"):
        return Path(os.environ["THREADGRAPH_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "threadgraph"


def neutral(value: Any, root: Path = Path(__file__).resolve().parent.parent, cache: Optional[Path] = None) -> Any:
    """``value`` (text, or JSON data: every string in it) with each absolute path written so that no
    results file names the folders of the machine that wrote it: inside the threadgraph cache as
    ``<cache>/...``; inside the repository relative to it, but for a hidden folder of the checkout (a
    virtual environment, a cache kept there), cut to its last part as every other path is (a temporary
    folder, a site-packages file)."""
    cache = cache_root() if cache is None else cache
    if isinstance(value, dict):
        return {neutral(k, root, cache): neutral(v, root, cache) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [neutral(v, root, cache) for v in value]
    if not isinstance(value, str):
        return value

    def shown(found: re.Match) -> str:
        path = Path(found.group(0))
        for base, label in ((cache, CACHE), (root, ".")):
            try:
                inside = path.relative_to(base)
            except ValueError:
                continue
            if label == CACHE:
                return f"{CACHE}/{inside}" if inside.parts else CACHE
            if not inside.parts:
                return "."
            if not inside.parts[0].startswith("."):
                return str(inside)
        return path.name or "."
    return ABSOLUTE_PATH.sub(shown, value)


# What a results file's ``env`` never holds: the name of the machine that wrote it.
PRIVATE_ENV = ("host", "hostname")


def write(path: Path, data: dict) -> Path:
    """Check ``data`` against the schema of ``path``'s name, then write it (one space indent) with no
    absolute path in it (``neutral``) and no machine name in its ``env`` (PRIVATE_ENV)."""
    path = Path(path)
    data = neutral(json.loads(json.dumps(data, default=str)))
    if isinstance(data.get("env"), dict):
        data["env"] = {k: v for k, v in data["env"].items() if k not in PRIVATE_ENV}
    validate(path.name, data)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def inductor_cache(cell: dict) -> str:
    """The Inductor cache a dflash-throughput cell started on. A cell without ``inductor_cache`` started
    on an empty one when it has ``compile_phases_s``, else on the threaded cell's."""
    return cell.get("inductor_cache", EMPTY if "compile_phases_s" in cell else SHARED)


def startup_comparable(sequential: dict) -> bool:
    """Whether the sequential cell's startup is a first run's, as the threaded cell's always is: it
    started on an empty Inductor cache of its own (``inductor_cache``)."""
    return inductor_cache(sequential) == EMPTY
