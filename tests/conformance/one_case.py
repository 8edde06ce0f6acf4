"""``python -m tests.conformance.one_case NAME``: run one case in every placement, in this fresh
process, and print the observations as one JSON line (the last line of output)."""

from __future__ import annotations

import json
import sys

from . import registry
from .placements import run_everywhere, show_skip_messages


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in registry.ALL:
        print(f"usage: python -m tests.conformance.one_case NAME; NAME is one of {sorted(registry.ALL)}",
              file=sys.stderr)
        return 2
    show_skip_messages()
    observed = run_everywhere(registry.ALL[argv[0]])
    print(json.dumps({"case": argv[0], "observed": observed}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
