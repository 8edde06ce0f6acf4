"""``python -m tests.conformance.one_case NAME PLACEMENT``: run one case in one placement, in this
fresh process, and print the observation as one JSON line (the last line of output).

A fresh process per placement: torch says some things once per process (the TF32 hint, for
one), and a case's earlier placement must not use them up or warm what a later one measures.
"""

from __future__ import annotations

import json
import sys

from . import registry
from .placements import PLACEMENTS, run_in, show_skip_messages


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in registry.ALL or argv[1] not in PLACEMENTS:
        print(f"usage: python -m tests.conformance.one_case NAME PLACEMENT; NAME is one of {sorted(registry.ALL)}, "
              f"PLACEMENT one of {list(PLACEMENTS)}", file=sys.stderr)
        return 2
    show_skip_messages()
    observed = run_in(argv[1], registry.ALL[argv[0]])
    print(json.dumps({"case": argv[0], "placement": argv[1], "observed": observed}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
