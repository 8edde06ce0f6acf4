"""Bad input and missing torch symbols get one clear threadgraph error; torch is left as it was."""

import copy
import dataclasses
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import threadgraph
from threadgraph import _compat, _patches
from threadgraph._diagnostics import doctor as _doctor
from threadgraph._device import gate as _gate

ROOT = Path(__file__).resolve().parents[2]
trees = _compat.cudagraph_trees()
ABSENT = object()


def _resolve(target):
    module_path, _, qualname = target.partition(":")
    owner = __import__(module_path, fromlist=["_"])
    *parents, attribute = qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attribute


def _snapshot():
    """What every resolvable target's owner holds now (``ABSENT`` where it inherits the attribute)."""
    out = {}
    for patch in threadgraph.patches():
        for target in patch["targets"]:
            try:
                owner, attribute = _resolve(target)
            except AttributeError:
                continue
            out[target] = (owner, attribute, vars(owner).get(attribute, ABSENT))
    return out


def _assert_unchanged(before):
    assert not threadgraph.installed()
    assert not any(p["active"] for p in threadgraph.patches())
    for target, (owner, attribute, original) in before.items():
        assert vars(owner).get(attribute, ABSENT) is original, target


# -- A: a torch that lacks a patch target ------------------------------------------------------


def test_a_missing_patch_target_is_named_and_nothing_is_patched(clean_patches, monkeypatch):
    monkeypatch.delattr(trees.CUDAGraphTreeManager, "record_function")
    before = _snapshot()
    pattern = (rf"torch {re.escape(torch.__version__)} lacks torch\._inductor\.cudagraph_trees\.CUDAGraphTreeManager"
               r"\.record_function \(needed by gate_record\); nothing was patched.*please report it.*"
               r"install\(exclude=\['gate_record'\]\)")
    with pytest.raises(threadgraph.UnsupportedTorchError, match=pattern):
        threadgraph.install()
    _assert_unchanged(before)
    with pytest.raises(threadgraph.UnsupportedTorchError, match="record_function"):
        threadgraph.CompiledWorkerThread("cpu")
    _assert_unchanged(before)


def _applying_patches():
    return [p["name"] for p in threadgraph.patches() if p["applies"]]


@pytest.mark.parametrize("name", _applying_patches())
def test_a_every_target_of_every_patch_is_checked_before_anything_is_applied(clean_patches, monkeypatch, name):
    # The check comes from the patch definitions: remove any applying patch's target and install refuses.
    target = next(p["target"] for p in threadgraph.patches() if p["name"] == name)
    owner, attribute = _resolve(target)
    if attribute not in vars(owner):
        pytest.skip(f"{target} is inherited; removing it from {owner} changes nothing")
    monkeypatch.delattr(owner, attribute)
    if hasattr(owner, attribute):
        pytest.skip(f"{target} is still reachable through a base class")
    if not next(p for p in threadgraph.patches() if p["name"] == name)["missing"]:  # its condition no longer holds
        pytest.skip(f"{name} is feature-detected on {target}: without it, it does not apply")
    before = _snapshot()
    with pytest.raises(threadgraph.UnsupportedTorchError, match=rf"{re.escape(target.replace(':', '.'))} \(needed by [^)]*{name}"):
        threadgraph.install()
    _assert_unchanged(before)


def test_a_required_and_patched_symbols_missing_together_are_one_error(clean_patches, monkeypatch):
    monkeypatch.delattr(trees.CUDAGraphTreeManager, "record_function")
    monkeypatch.delattr(trees, "MarkStepBox")
    with pytest.raises(threadgraph.UnsupportedTorchError, match=r"lacks \S+\.record_function \(needed by gate_record\); "
                                                          r"\S+\.MarkStepBox \(needed by threadgraph\); nothing was patched"):
        threadgraph.install()
    assert not threadgraph.installed()


def test_a_required_symbols_do_not_repeat_patch_targets():
    targets = {t.replace(":", ".") for p in threadgraph.patches() for t in p["targets"]}
    assert not targets & {f"{module}.{attribute}" for module, attribute in _compat.REQUIRED_SYMBOLS}


def test_a_failure_part_way_reverts_every_patch_of_that_call(clean_patches, monkeypatch):
    before = _snapshot()
    fence = _patches._registry._patches["fence_rng"]  # after most patches, and has many targets
    calls = []

    def replace_then_fail(original):
        calls.append(original)
        if len(calls) == 5:
            raise RuntimeError("simulated failure on the fifth target")
        return fence.replace(original)

    monkeypatch.setitem(_patches._registry._patches, "fence_rng", dataclasses.replace(fence, replace=replace_then_fail))
    with pytest.raises(RuntimeError, match="fifth target"):
        threadgraph.install()
    _assert_unchanged(before)
    monkeypatch.undo()
    assert "fence_rng" in threadgraph.install()  # the registry kept no half state


def test_a_doctor_reports_a_patch_with_a_missing_target_as_not_applicable(clean_patches, monkeypatch):
    monkeypatch.delattr(trees.CUDAGraphTreeManager, "record_function")
    info = _doctor.report()
    row = next(p for p in info["patches"] if p["name"] == "gate_record")
    symbol = "torch._inductor.cudagraph_trees.CUDAGraphTreeManager.record_function"
    assert row["applies"] is False and row["missing"] == [symbol]
    text = _doctor.format_report(info)
    line = next(line for line in text.splitlines() if line.split()[:1] == ["gate_record"])
    assert line.split()[1] == "missing:" and f"this torch lacks {symbol}" in line
    assert f"error: torch {torch.__version__} lacks {symbol}; install() refuses" in text


def test_a_doctor_names_a_missing_required_symbol_and_still_reports(monkeypatch):
    monkeypatch.delattr(trees, "MarkStepBox")
    info = _doctor.report()
    assert info["missing_symbols"] == ["torch._inductor.cudagraph_trees.MarkStepBox"]
    text = _doctor.format_report(info)
    assert f"error: torch {torch.__version__} lacks torch._inductor.cudagraph_trees.MarkStepBox; install() refuses" in text
    assert "cannot detect them: threadgraph needs torch._inductor.cudagraph_trees.MarkStepBox" in text


# -- B: errors survive pickle and copy ---------------------------------------------------------

ERRORS = [
    (threadgraph.WorkerError, {"thread_name": "w0", "device": "cuda:1"}),
    (threadgraph.GateTimeout, {"thread_name": "w1", "device": "cuda:0"}),
    (threadgraph.CaptureConflictError, {"device": "cuda:0", "capturing_thread": "w2", "op": "torch.rand"}),
    (threadgraph.UsageError, {}),
    (threadgraph.JoinTimeout, {}),
]


@pytest.mark.parametrize("cls, attributes", ERRORS, ids=[c.__name__ for c, _ in ERRORS])
@pytest.mark.parametrize("roundtrip", [lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy],
                         ids=["pickle", "copy", "deepcopy"])
def test_b_errors_round_trip_with_message_and_attributes(cls, attributes, roundtrip):
    error = cls("threadgraph: it failed", **attributes)
    again = roundtrip(error)
    assert type(again) is cls and str(again) == "threadgraph: it failed" and again.args == error.args
    assert {name: getattr(again, name) for name in attributes} == attributes


# -- C: environment variables ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", "10s", "-5", "0", "nan", "inf"])
def test_c_a_bad_gate_timeout_names_the_variable_value_and_what_it_takes(monkeypatch, value):
    monkeypatch.setenv("THREADGRAPH_GATE_TIMEOUT", value)
    with pytest.raises(ValueError, match=rf"THREADGRAPH_GATE_TIMEOUT={re.escape(repr(value))} is not a timeout; "
                                         r"it takes a number of seconds greater than 0"):
        _gate.timeout_from_env()


def test_c_a_good_or_unset_gate_timeout_is_used(monkeypatch):
    monkeypatch.setenv("THREADGRAPH_GATE_TIMEOUT", "1.5")
    assert _gate.timeout_from_env() == 1.5
    monkeypatch.delenv("THREADGRAPH_GATE_TIMEOUT")
    assert _gate.timeout_from_env() == 600.0


def test_c_a_bad_gate_timeout_stops_install_and_workers_and_the_cli_says_it_in_one_line():
    env = {"THREADGRAPH_GATE_TIMEOUT": "10s", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    # Importing works (a command line can then say it in one line); every call that would wait refuses.
    script = ("import threadgraph\n"
              "for make in (threadgraph.install, lambda: threadgraph.CompiledWorkerThread('cpu'),\n"
              "             threadgraph.check_settings):\n"
              "    try:\n        make()\n    except threadgraph.SettingError as err:\n        print('refused:', err)\n"
              "print('installed:', threadgraph.installed())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.startswith("refused: threadgraph: THREADGRAPH_GATE_TIMEOUT='10s' is not a timeout") for line in lines[:3]] \
        == [True] * 3 and lines[3] == "installed: False", proc.stdout
    for command in (["-m", "threadgraph", "doctor"], ["-m", "examples.dflash_trainer", "--max-steps", "1"]):
        cli = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
        assert cli.returncode == 2, (command, cli.stderr)
        last = cli.stderr.strip().splitlines()[-1]
        assert last.startswith("error: threadgraph: THREADGRAPH_GATE_TIMEOUT='10s' is not a timeout"), cli.stderr
        assert last.endswith("Fix it, or unset it for the default of 600 s"), cli.stderr
        assert "Traceback" not in cli.stderr, cli.stderr


def test_c_a_bad_excluded_name_says_it_came_from_the_environment(clean_patches, monkeypatch):
    monkeypatch.setenv("THREADGRAPH_EXCLUDE_PATCHES", "worker_mark_step, nope")
    with pytest.raises(threadgraph.SettingError, match=r"no patch named \['nope'\] in the environment variable "
                                                       r"THREADGRAPH_EXCLUDE_PATCHES='worker_mark_step, nope'"):
        threadgraph.install()
    assert not threadgraph.installed()


BAD_SETTINGS = [("THREADGRAPH_GATE_TIMEOUT", "10s", "is not a timeout"),
                ("THREADGRAPH_STRICT", "yes", "is not 0 or 1"),
                ("THREADGRAPH_EXCLUDE_PATCHES", "bogus", r"no patch named \['bogus'\] in the environment variable")]


def test_c_every_variable_threadgraph_reads_is_in_the_settings_check():
    read = set()
    for path in (ROOT / "src" / "threadgraph").rglob("*.py"):
        read |= set(re.findall(r"THREADGRAPH_[A-Z_]+", path.read_text(encoding="utf-8")))
    assert read == {variable for variable, _, _ in BAD_SETTINGS}


@pytest.mark.parametrize("variable, value, says", BAD_SETTINGS, ids=[v for v, _, _ in BAD_SETTINGS])
def test_c_check_settings_and_doctor_refuse_a_bad_value_of_every_variable(variable, value, says):
    env = {variable: value, "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    script = "import threadgraph\ntry:\n    threadgraph.check_settings()\nexcept threadgraph.SettingError as err:\n    print(err)\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.match(rf"threadgraph: .*{variable}.*", proc.stdout) and re.search(says, proc.stdout), proc.stdout
    doctor = subprocess.run([sys.executable, "-m", "threadgraph", "doctor"], capture_output=True, text=True, env=env,
                            timeout=300, cwd=ROOT)
    assert doctor.returncode == 2 and doctor.stdout == "", (doctor.returncode, doctor.stdout[-500:])
    assert re.fullmatch(rf"error: threadgraph: .*{variable}=.*\n", doctor.stderr) and re.search(says, doctor.stderr)


# -- D: whole-step capture without a GPU -------------------------------------------------------


def test_d_capture_step_without_inputs_or_gpu_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    step = threadgraph.capture_step(lambda: None)
    with pytest.raises(threadgraph.CaptureError, match="capture_step needs a CUDA GPU.*sees none"):
        step()


def test_d_capture_step_with_cpu_inputs_and_no_gpu_says_there_is_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    step = threadgraph.capture_step(lambda x: x + 1)
    with pytest.raises(threadgraph.CaptureError, match=r"(?s)capture_step needs a CUDA GPU.*sees none.*"
                                                       r"pass fallback='uncaptured'") as info:
        step(torch.ones(2))
    assert ".to(device)" not in str(info.value)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_d_a_step_timer_takes_a_device_as_a_worker_does(monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # None: the CPU, as for a worker
    timer = threadgraph.StepTimer(device)
    timer.start()
    timer.stop()
    assert not timer.cuda and len(timer.finish()) == 1


@pytest.mark.parametrize("device, error, says", [
    ("meta", threadgraph.UsageError, "device type 'meta' is not supported; use 'cpu' or 'cuda:N'"),
    ("gibberish", threadgraph.UsageError, "bad device 'gibberish'"),
])
def test_d_a_step_timer_refuses_a_bad_device_as_a_worker_does(device, error, says):
    with pytest.raises(error, match=re.escape(says)):
        threadgraph.StepTimer(device)
    with pytest.raises(error, match=re.escape(says)):
        threadgraph.CompiledWorkerThread(device)


# -- E: patch names ----------------------------------------------------------------------------


def test_e_one_patch_name_is_one_name(clean_patches):
    applied = threadgraph.install(exclude="worker_mark_step")
    assert "worker_mark_step" not in applied and "worker_generation" in applied
    assert threadgraph.uninstall("fence_rng") == ["fence_rng"]
    with pytest.raises(ValueError, match=r"no patch named \['nope'\]"):
        threadgraph.uninstall("nope")


@pytest.mark.parametrize("call, names, argument", [
    (threadgraph.install, 3, "exclude"), (threadgraph.install, ["fence_rng", None], "exclude"),
    (threadgraph.uninstall, [1], "uninstall"),
])
def test_e_names_that_are_not_strings_are_a_type_error(clean_patches, call, names, argument):
    with pytest.raises(threadgraph.UsageError, match=rf"threadgraph: {argument} takes (a patch name or a list of them|patch names)") as info:
        call(names)
    assert isinstance(info.value, TypeError)
    assert not threadgraph.installed()
