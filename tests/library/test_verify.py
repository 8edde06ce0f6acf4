"""A changed torch, replayed on the CPU: install() checks every patch's targets, assumed symbols and
feature detections against the verified releases' record, warns once per difference, refuses in
strict mode before patching anything, and doctor says which patch changed and how."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import threadgraph
from threadgraph import _compat
from threadgraph._diagnostics.doctor import format_report, report
from threadgraph._errors import SettingError, ThreadgraphWarning, UnsupportedTorchError
from threadgraph._patches import PATCHES, fingerprint, verify

TREES = _compat.cudagraph_trees()
MANAGER = TREES.CUDAGraphTreeManager
RUNNING = ".".join(map(str, _compat.release()))
RECORDED = fingerprint.load()["releases"]
on_a_verified_torch = pytest.mark.skipif(RUNNING not in RECORDED, reason=f"torch {RUNNING} is not a verified release")


@pytest.fixture
def fresh(monkeypatch, clean_patches):
    """Each test sees its differences reported anew, outside strict mode."""
    monkeypatch.delenv(verify.STRICT_ENV, raising=False)
    monkeypatch.setattr(verify, "_reported", set())
    yield


def _run_eager_replaced(monkeypatch):
    def run_eager(self, new_inputs, function_id):  # a body another library (or a new torch) put there
        return None

    monkeypatch.setattr(MANAGER, "run_eager", run_eager)


def _messages(caught):
    return [str(w.message) for w in caught if issubclass(w.category, ThreadgraphWarning)]


def test_the_verified_releases_are_recorded():
    assert {"2.11.0", "2.13.0", "2.14.1", "2.15.0"} <= set(RECORDED)
    assert _compat.NEWEST_VERIFIED == max(fingerprint.release_key(v) for v in RECORDED)
    for version, record in RECORDED.items():
        targets = {t for p in PATCHES for t in p.targets() if t in record["symbols"]}
        assert "torch._inductor.cudagraph_trees:CUDAGraphTreeManager.record_function" in targets, version


def test_a_fingerprint_ignores_layout_comments_and_docstrings_but_not_code():
    first = "def f(x):\n    '''Doc.'''\n    return x + 1  # one\n"
    relaid = "def f( x ):\n\n    # a comment\n    return (x +\n            1)\n"
    assert fingerprint.of_source(first) == fingerprint.of_source(relaid)
    assert fingerprint.of_source(first) != fingerprint.of_source("def f(x):\n    return x + 2\n")


def test_live_and_source_tree_fingerprints_agree_for_every_symbol(clean_patches):
    tree = fingerprint.SourceTree(Path(torch.__file__).parent.parent)
    symbols = [s for p in PATCHES for s in [*p.targets(), *p.assumes]]
    recorded = RECORDED.get(RUNNING, {}).get("symbols", {})
    with_source = {s for s in symbols if recorded.get(s) is not None}  # this release's Python definitions
    for installed in (False, True):  # threadgraph's own replacements are seen through
        if installed:
            threadgraph.install()
        compared = set()
        for symbol in symbols:
            try:
                fingerprint.resolve(symbol.removesuffix(".__code__"))
            except (ImportError, AttributeError):
                continue
            live = fingerprint.live(symbol)
            assert live == tree.fingerprint(symbol), symbol
            if live is not None:
                compared.add(symbol)
        # The skip above must leave something compared: every symbol this release's record has the
        # source of, and never fewer than the oldest recorded release's 42 (2.11.0; 47 from 2.13.0).
        assert with_source <= compared, sorted(with_source - compared)
        assert len(compared) >= 42, (installed, sorted(compared))


@on_a_verified_torch
def test_a_verified_torch_as_installed_shows_no_difference(fresh):
    version, verified, found = verify.differences(PATCHES)
    assert (version, verified, found) == (RUNNING, True, [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threadgraph.install()
    assert _messages(caught) == []


@on_a_verified_torch
def test_a_replaced_body_warns_once_naming_patch_symbol_and_difference(fresh, monkeypatch):
    _run_eager_replaced(monkeypatch)
    expected = (r"patch gate_warmup: torch\._inductor\.cudagraph_trees\.CUDAGraphTreeManager\.run_eager: its code "
                rf"differs from torch {RUNNING}'s .*verified release, so something in this process changed it")
    with pytest.warns(ThreadgraphWarning, match=expected):
        threadgraph.install()
    threadgraph.uninstall()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threadgraph.install()
    assert not [m for m in _messages(caught) if "run_eager" in m]  # once per process


@on_a_verified_torch
def test_strict_mode_refuses_before_patching_anything(fresh, monkeypatch):
    _run_eager_replaced(monkeypatch)
    monkeypatch.setenv(verify.STRICT_ENV, "1")
    with pytest.raises(UnsupportedTorchError, match=r"THREADGRAPH_STRICT=1 .*nothing was patched:\n.*patch gate_warmup"):
        threadgraph.install()
    assert not threadgraph.installed()


@on_a_verified_torch
def test_doctor_names_the_changed_patch_and_fails_in_strict_mode(fresh, monkeypatch):
    _run_eager_replaced(monkeypatch)
    text = format_report(report())
    line = next(line for line in text.splitlines() if line.strip().startswith("gate_warmup "))
    assert f"target changed since torch {RUNNING}: torch._inductor.cudagraph_trees.CUDAGraphTreeManager.run_eager" in line
    assert "1 difference(s)" in text
    from threadgraph.__main__ import main

    assert main(["doctor"]) == 0
    monkeypatch.setenv(verify.STRICT_ENV, "1")
    assert main(["doctor"]) == 1


@on_a_verified_torch
def test_a_renamed_target_is_missing_and_a_renamed_assumption_a_difference(fresh, monkeypatch):
    monkeypatch.setattr(TREES, "mark_step_begin_renamed", TREES.mark_step_begin, raising=False)
    monkeypatch.delattr(TREES, "mark_step_begin")
    with pytest.raises(UnsupportedTorchError, match=r"lacks torch\._inductor\.cudagraph_trees\.mark_step_begin "
                                                    r"\(needed by worker_mark_step\)"):
        threadgraph.install()
    status = report()["verification"]["status"]
    assert status["worker_mark_step"] == "missing: this torch lacks torch._inductor.cudagraph_trees.mark_step_begin"
    monkeypatch.undo()
    monkeypatch.setattr(verify, "_reported", set())
    monkeypatch.delattr(MANAGER, "can_start_new_generation")
    with pytest.warns(ThreadgraphWarning, match=r"patch worker_generation: .*CUDAGraphTreeManager\.can_start_new_generation: "
                                                rf"missing \(present in torch {RUNNING}\)"):
        threadgraph.install()


@on_a_verified_torch
@pytest.mark.skipif(not _compat.has_graph_capture_lock(), reason="this torch has no module-level capture lock")
def test_a_moved_capture_lock_switches_its_patch_off_loudly(fresh, monkeypatch):
    monkeypatch.delattr(TREES, "graph_capture_lock")  # moved elsewhere, as a refactor upstream might
    expected = (r"patch capture_lock_gives_up_slots: threadgraph\._compat check has_graph_capture_lock: answers False "
                rf"where torch {RUNNING} answered True")
    with pytest.warns(ThreadgraphWarning, match=expected):
        applied = threadgraph.install()
    assert "capture_lock_gives_up_slots" not in applied
    line = next(line for line in format_report(report()).splitlines()
                if line.strip().startswith("capture_lock_gives_up_slots "))
    assert f"target changed since torch {RUNNING}: threadgraph._compat check has_graph_capture_lock" in line
    threadgraph.uninstall()
    monkeypatch.setenv(verify.STRICT_ENV, "1")
    with pytest.raises(UnsupportedTorchError, match="has_graph_capture_lock"):
        threadgraph.install()
    assert not threadgraph.installed()


def test_an_unverified_release_is_compared_with_the_newest_verified_one_before_it(fresh, monkeypatch):
    newest = max(RECORDED, key=fingerprint.release_key)
    major, minor, _ = fingerprint.release_key(newest)
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor + 1}.0")
    assert verify.reference() == (newest, False)
    oldest = min(RECORDED, key=fingerprint.release_key)
    assert verify.reference("2.0.0") == (oldest, False)
    assert verify.reference("2.12.0") == ("2.11.0", False)
    _run_eager_replaced(monkeypatch)
    with pytest.warns(ThreadgraphWarning, match=rf"run_eager: .*not a verified release: upstream changed it since {newest}"):
        threadgraph.install()


def test_a_bad_strict_setting_is_one_clear_error(fresh, monkeypatch):
    monkeypatch.setenv(verify.STRICT_ENV, "yes")
    with pytest.raises(SettingError, match=r"THREADGRAPH_STRICT='yes' is not 0 or 1; set it to 1"):
        threadgraph.install()
    proc = subprocess.run([sys.executable, "-m", "threadgraph", "doctor"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, verify.STRICT_ENV: "yes"})
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: threadgraph: THREADGRAPH_STRICT='yes' is not 0 or 1")


def test_the_record_command_reads_a_source_tree_and_refuses_a_wrong_folder(tmp_path):
    root = Path(torch.__file__).parent.parent
    proc = subprocess.run([sys.executable, "-m", "threadgraph", "fingerprints", "--torch-root", str(root)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout[proc.stdout.index("{"):])
    live = verify.record_live(PATCHES)["symbols"]
    assert {k: v for k, v in record["symbols"].items() if k in live} == live
    proc = subprocess.run([sys.executable, "-m", "threadgraph", "fingerprints", "--torch-root", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "holds no torch source tree" in proc.stderr and "Traceback" not in proc.stderr


def test_without_the_record_every_install_says_nothing_is_verified(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(fingerprint, "DATA", tmp_path / "fingerprints.json")
    with pytest.warns(ThreadgraphWarning, match=r"fingerprints\.json: no verified release is recorded, so nothing"):
        threadgraph.install()
    assert "error: no verified release is recorded" in format_report(report())
