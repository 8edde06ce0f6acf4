"""What conftest.py promises the suite: every cache in the session's own folder, seen alike by the
tests and the processes they start, and hypothesis derandomised where CI is set."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import CACHE_VARIABLES

ROOT = Path(__file__).resolve().parents[1]


def test_every_cache_is_in_the_sessions_folder_and_none_in_the_users(isolated_caches, tiny_assets):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from examples.dflash_trainer.assets.assets import default_cache_root
    from examples.dflash_trainer.data.cache import default_cache_dir

    assert {v: os.environ[v] for v in CACHE_VARIABLES} == {v: str(isolated_caches / f) for v, f in CACHE_VARIABLES.items()}
    user_cache = Path.home() / ".cache"
    for path in (default_cache_root(), default_cache_dir(), Path(cache_dir()), tiny_assets.root):
        assert path.is_relative_to(isolated_caches) and not path.is_relative_to(user_cache), path
    assert tiny_assets.root.parent == default_cache_root()  # where a benchmark's own default_assets() looks


def test_a_process_a_test_starts_finds_the_same_caches(isolated_caches):
    code = ("import json; from examples.dflash_trainer.assets.assets import default_cache_root; "
            "print(json.dumps(str(default_cache_root())))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=_pythonpath()), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == str(isolated_caches / CACHE_VARIABLES["THREADGRAPH_CACHE"])


def _hypothesis_settings(**env):
    """Hypothesis's settings once the suite's conftest is imported, in a process with ``env``
    (and none of the variables by which Hypothesis itself recognises a CI)."""
    code = ("import json, hypothesis, tests.conftest; s = hypothesis.settings.default; "
            "print(json.dumps([s.derandomize, s.database is None]))")
    base = {k: v for k, v in os.environ.items() if k not in _ci_variables()}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(base, **env, PYTHONPATH=_pythonpath()),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def _ci_variables():
    from hypothesis import _settings

    return {"CI", *getattr(_settings, "_CI_VARS", {})}


def _pythonpath():
    return os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])


def test_hypothesis_is_derandomised_where_ci_is_set_and_the_ci_script_sets_it():
    assert _hypothesis_settings(CI="true") == [True, True]  # derandomised, no example database
    assert _hypothesis_settings() == [False, False]
    assert re.search(r"^export CI=true$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
