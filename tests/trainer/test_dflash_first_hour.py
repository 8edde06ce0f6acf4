"""Issue 57, the trainer: what a new user's first hour ran into. Every flag says what it does, the
data formats are documented, and bad input (a flag, a file, a directory) is one line naming the flag
and exit 2, never a raw error."""

import re
from pathlib import Path

import pytest

from examples.dflash_trainer import __main__ as cli

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "examples" / "dflash_trainer"

pytestmark = pytest.mark.timeout(300)


def test_every_flag_has_a_help_line_that_says_more_than_its_default():
    bare = []
    for action in cli._parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        words = re.sub(r"(^|;\s*)default: .*$", "", action.help or "").strip()
        if len(words) < 10:
            bare.append(f"{action.option_strings[0]}: {action.help!r}")
    assert not bare, "flags whose --help says nothing but a default:\n" + "\n".join(bare)
