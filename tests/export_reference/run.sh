#!/usr/bin/env bash
# Reference-implementation test of the DFlash export: tests/trainer/test_dflash_export_reference.py in a
# venv of its own with speculators 0.9.0, which cannot live in the project's environment:
#   - it pins transformers<=5.19 (the project resolves to a newer one);
#   - it requires torchvision and torchaudio, which it never imports for DFlash, and PyPI's
#     builds of those do not import beside the CPU torch 2.13.0 wheel. So speculators is
#     installed with --no-deps and its other requirements are listed here by hand.
# Usage: bash tests/export_reference/run.sh [pytest args]   (VENV=... to choose the venv path)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VENV:-/tmp/dflash-export-ref-venv}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import speculators" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q -e "$ROOT" -r "$ROOT/tests/requirements.txt"
  "$VENV/bin/pip" install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
  # speculators 0.9.0's requirements, less torchvision and torchaudio (see above)
  "$VENV/bin/pip" install -q aiohttp click "datasets>=4.0.0,<=5.1.0" httpx huggingface-hub \
    "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" protobuf psutil "pydantic>=2.0.0" \
    "pydantic-settings>=2.0.0" rich safetensors "tqdm>=4.66.3,<=4.70.1" "transformers>=5.0.0,<=5.19.0" \
    "typer>=0.12.0"
fi
cd "$ROOT"
"$VENV/bin/python" -c "from importlib.metadata import version as v; print('speculators', v('speculators'), 'transformers', v('transformers'), 'torch', v('torch'))"
exec "$VENV/bin/python" -m pytest -q -s -p no:cacheprovider tests/trainer/test_dflash_export_reference.py "$@"
