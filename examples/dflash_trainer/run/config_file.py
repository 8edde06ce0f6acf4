"""``--config FILE``: a run's flags from a YAML or TOML file (keys are the flags, with - or _), and
the run's settings written into its directory (``config.toml``), where ``--resume`` reads them again.

Flags on the command line override the file's values."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..errors import BadInput

SAVED = "config.toml"
NOT_SAVED = ("resume", "overwrite")  # how this start runs, not what the run is


class ConfigFileError(BadInput, ValueError):
    """A --config file that cannot be read, or names no flag; the message says which."""


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings of a YAML (.yaml, .yml) or TOML (.toml) file, as TrainConfig field names."""
    path = Path(path)
    if not path.is_file():
        raise ConfigFileError(f"--config {path} does not exist or is not a file; pass a .toml or .yaml file of flags")
    suffix = path.suffix.lower()
    if suffix == ".toml":
        import tomllib

        parse = tomllib.loads
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigFileError(f"--config {path}: YAML needs pyyaml (pip install pyyaml), or write the file as "
                                  f"TOML") from None
        parse = yaml.safe_load
    else:
        raise ConfigFileError(f"--config {path}: unknown format {suffix or '(no suffix)'}; name it .toml, .yaml or "
                              f".yml")
    try:
        values = parse(path.read_text(encoding="utf-8"))
    except Exception as err:  # tomllib.TOMLDecodeError, yaml.YAMLError, bad UTF-8
        raise ConfigFileError(f"--config {path} is not valid {'TOML' if suffix == '.toml' else 'YAML'} "
                              f"({type(err).__name__}: {_one_line(err)}); fix the file") from None
    if values is None:  # an empty YAML file
        values = {}
    if not isinstance(values, dict):
        raise ConfigFileError(f"--config {path} must hold a table of flags (key = value), not "
                              f"{type(values).__name__}")
    return _as_fields(values, path)


def _one_line(err: Exception) -> str:
    """A parser's error as one line: YAML's spans several (its context, each position quoted, the problem)."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is not None and problem:
        context = getattr(err, "context", None)
        return f"{context + ': ' if context else ''}{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def _as_fields(values: dict, path: Path) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(TrainConfig)} - set(NOT_SAVED)
    out = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known:
            raise ConfigFileError(f"--config {path}: {key!r} is not a flag of the trainer; valid keys: "
                                  f"{', '.join(sorted(known))}")
        out[name] = value
    return out


def write(config: TrainConfig, out_dir: str | os.PathLike[str]) -> Path:
    """The run's settings as ``OUT/config.toml`` (written under a temporary name, then renamed)."""
    lines = ["# The settings of this run; --resume reads them again (flags on its command line win)."]
    for name, value in config.to_dict().items():
        if name in NOT_SAVED or value is None:
            continue
        lines.append(f"{name} = {_toml_value(value)}")
    final = Path(out_dir) / SAVED
    tmp = final.with_name(f".{SAVED}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, final)
    return final


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string
