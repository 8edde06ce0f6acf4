"""The trainer's one kind of user error: bad input (a flag, a file, a directory) found at any time.

The command line prints its message as one line and exits ``EXIT_BAD_INPUT``, whether the config
rejected it up front or the run found it later (a corrupt checkpoint, an unreadable data file).
Each message names the flag or file and the fix. SAFETY.md lists the exit codes.
"""

from __future__ import annotations

import json

from threadgraph import WorkerError

EXIT_BAD_INPUT = 2  # argparse's own code for a bad flag
EXIT_FAILED = 1  # the run itself failed (a worker raised, the loss diverged, a rank hung)


class BadInput(Exception):
    """Bad input found before or during the run; the message names the flag or file and the fix."""


class MissingInput(BadInput, FileNotFoundError):
    """A file or directory a flag names does not exist."""


class InputError(BadInput, ValueError):
    """A bad flag value found after the config was built (the config's own checks raise ValueError)."""


def json_object(text: str, where: str, error: type, formats: str) -> dict:
    """One line of a JSONL file as its object; else ``error`` (a BadInput) naming ``where``, what is
    wrong and the ``formats`` to write instead."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{where}: invalid JSON ({err.msg} at column {err.colno}); write one JSON object per "
                    f"line") from None
    if not isinstance(record, dict):
        raise error(f"{where}: expected a JSON object, got {type(record).__name__}; use {formats}")
    return record


def bad_input_behind(err: BaseException) -> "BadInput | None":
    """The BadInput behind ``err`` (also when a worker thread raised it and another error wraps it), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, BadInput):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def report_failure(err: Exception, hint: str, debug: bool) -> int:
    """A command line's last word on ``err``: one line on stderr, and its exit code. Bad input says
    what to do (``EXIT_BAD_INPUT``); any other failure names the worker that raised it, the cause and
    ``hint`` (``EXIT_FAILED``)."""
    import sys
    import traceback

    if debug:
        traceback.print_exc()
    bad = bad_input_behind(err)
    if bad is not None:
        print(f"error: {bad}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cause = err.__cause__ or err
    who = f"{err.thread_name} failed: " if isinstance(err, WorkerError) else ""
    print(f"error: {who}{type(cause).__name__}: {cause}{hint}" + ("" if debug else " (--debug prints the traceback)"),
          file=sys.stderr)
    return EXIT_FAILED
