import inspect
import threading

import pytest
import torch

import threadgraph
from threadgraph import _compat

from tests.helpers.threads import run_in_thread

trees = _compat.cudagraph_trees()


ABSENT = object()


def held(owner, attribute):
    """What the owner holds under ``attribute``: its own entry, or a slot of its type (a function's
    ``__code__``, which a patch swaps while the function object stays); ABSENT for neither."""
    if inspect.isdatadescriptor(getattr(type(owner), attribute, None)):
        return getattr(owner, attribute)
    return vars(owner).get(attribute, ABSENT)


def _targets():
    """(patch name, target) -> (owner, attribute), for every target of every patch."""
    out = {}
    for patch in threadgraph.patches():
        for target in patch["targets"]:
            module_path, _, qualname = target.partition(":")
            owner = __import__(module_path, fromlist=["_"])
            *parents, attribute = qualname.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            out[patch["name"], target] = (owner, attribute)
    return out


def test_install_is_idempotent_and_uninstall_restores_the_exact_originals(clean_patches):
    targets = _targets()
    assert len(targets) > 50  # the fence's RNG entry points and ATen overloads are each a target
    originals = {key: held(owner, attr) for key, (owner, attr) in targets.items()}
    first = threadgraph.install()
    assert first, "nothing was patched"
    wrapped = {key: held(owner, attr) for key, (owner, attr) in targets.items()}
    applied = {p["name"] for p in threadgraph.patches() if p["active"]}
    assert all(wrapped[key] is not originals[key] for key in targets if key[0] in applied)
    assert threadgraph.install() == []
    assert all(held(owner, attr) is wrapped[key] for key, (owner, attr) in targets.items())
    assert sorted(threadgraph.uninstall()) == sorted(first)
    for key, (owner, attr) in targets.items():
        assert held(owner, attr) is originals[key], key  # inherited ones are deleted again
    assert threadgraph.uninstall() == []


def test_patches_report_names_hazard_and_activity(clean_patches):
    before = {p["name"]: p for p in threadgraph.patches()}
    assert not any(p["active"] for p in before.values())
    for p in before.values():
        assert p["hazard"] and ":" in p["target"]
    threadgraph.install()
    after = {p["name"]: p["active"] for p in threadgraph.patches()}
    assert after == {name: p["applies"] for name, p in before.items()}


def test_patched_context_manager_restores_on_exit(clean_patches):
    original = vars(trees)["mark_step_begin"]
    with threadgraph.patched():
        assert vars(trees)["mark_step_begin"] is not original
        assert threadgraph.installed() is True
    assert vars(trees)["mark_step_begin"] is original
    assert threadgraph.installed() is False


def test_patched_leaves_an_outer_install_in_place(clean_patches):
    threadgraph.install()
    with threadgraph.patched():
        pass
    assert any(p["active"] for p in threadgraph.patches())
    assert threadgraph.installed() is True


def test_installed_is_a_question_not_an_always_true_context_manager(clean_patches):
    assert threadgraph.installed() is False  # was a context manager object: `if installed():` always true
    threadgraph.install()
    assert threadgraph.installed() is True


def test_missing_symbol_is_named(monkeypatch):
    monkeypatch.delattr(trees, "mark_step_begin")
    with pytest.raises(threadgraph.UnsupportedTorchError, match="cudagraph_trees.mark_step_begin"):
        threadgraph.install()


# -- simulated torch <= 2.12 ------------------------------------------------------------------


def _asserting_get_obj(local, attr_name):
    # torch 2.1 - 2.12, verbatim in behaviour: no lazy initialisation
    if hasattr(local, attr_name):
        return getattr(local, attr_name)
    assert torch._C._is_key_in_tls(attr_name)
    return torch._C._get_obj_in_tls(attr_name)


@pytest.fixture
def old_torch(monkeypatch, clean_patches):
    monkeypatch.setattr(trees, "get_obj", _asserting_get_obj)
    if hasattr(trees, "_initialize_tls"):
        monkeypatch.delattr(trees, "_initialize_tls")
    assert _compat.get_obj_asserts()
    yield


def _container_in_fresh_thread():
    return run_in_thread(lambda: trees.get_container(0))


def test_simulated_old_torch_asserts_in_a_plain_thread(old_torch):
    with pytest.raises(AssertionError):
        _container_in_fresh_thread()


def test_shim_restores_function_on_simulated_old_torch(old_torch):
    assert "lazy_tls" in threadgraph.install()
    a = _container_in_fresh_thread()
    b = _container_in_fresh_thread()
    assert a is not b and a.device_index == 0
    threadgraph.uninstall()
    assert vars(trees)["get_obj"] is _asserting_get_obj
    with pytest.raises(AssertionError):
        _container_in_fresh_thread()


def test_lazy_tls_is_applied_exactly_where_get_obj_asserts_and_doctor_says_which(clean_patches):
    from threadgraph._diagnostics.doctor import format_report, report

    asserts = _compat.get_obj_asserts()  # the simulated tests above cover the asserting side too
    if not asserts:  # no hazard: a plain thread gets a container of its own with nothing patched
        first, second = _container_in_fresh_thread(), _container_in_fresh_thread()
        assert first is not second
    assert ("lazy_tls" in threadgraph.install()) is asserts
    text = format_report(report())
    assert f"{'[x]' if asserts else '[ ]'} tls-assert" in text
    state = next(line.split()[1] for line in text.splitlines() if line.split()[:1] == ["lazy_tls"])
    assert state == ("active" if asserts else "not")
    if asserts:
        assert _container_in_fresh_thread() is not _container_in_fresh_thread()


def test_ensure_tls_alone_fixes_a_thread_on_simulated_old_torch(old_torch):
    def body():
        threadgraph.ensure_cudagraph_tls()
        return trees.get_container(0)

    assert run_in_thread(body).device_index == 0


def test_concurrent_first_use_from_many_threads(old_torch):
    threadgraph.install()
    barrier = threading.Barrier(8)

    def body():
        barrier.wait(30)
        return trees.get_container(0)

    results = []
    threads = [threading.Thread(target=lambda: results.append(body())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len({id(c) for c in results}) == 8


def test_exclude_leaves_named_patches_out_and_rejects_unknown_names(clean_patches):
    applied = threadgraph.install(exclude={"worker_mark_step"})
    assert "worker_mark_step" not in applied and "worker_generation" in applied
    with pytest.raises(ValueError, match="no patch named"):
        threadgraph.install(exclude={"nonsense"})


def test_an_exclusion_holds_for_later_installs_until_uninstall(clean_patches):
    threadgraph.install(exclude={"worker_mark_step"})
    assert "worker_mark_step" not in threadgraph.install()  # e.g. a worker starting later
    threadgraph.uninstall()
    assert "worker_mark_step" in threadgraph.install()


def test_install_after_graphs_were_recorded_warns(clean_patches):
    def body():
        threadgraph.ensure_cudagraph_tls()
        containers = torch._C._get_obj_in_tls("tree_manager_containers")
        containers[0] = type("Container", (), {"tree_manager": object()})()  # a recorded tree
        try:
            with pytest.warns(threadgraph.ThreadgraphWarning, match="before the first torch.compile"):
                threadgraph.install()
        finally:
            containers.clear()

    run_in_thread(body)


def test_install_before_any_graph_is_silent(clean_patches):
    import warnings

    def body():
        with warnings.catch_warnings():
            warnings.simplefilter("error", threadgraph.ThreadgraphWarning)
            threadgraph.install()

    run_in_thread(body)


def test_uninstall_of_named_patches_restores_only_those(clean_patches):
    threadgraph.install()
    rand, synchronize = vars(torch)["rand"], vars(torch.cuda)["synchronize"]
    assert threadgraph.uninstall(["fence_rng"]) == ["fence_rng"]
    assert torch.rand.__class__.__name__ == "builtin_function_or_method" and torch.cuda.synchronize is synchronize
    assert vars(torch)["rand"] is not rand
    with pytest.raises(ValueError, match="no patch named \\['nope'\\]"):
        threadgraph.uninstall(["nope"])
    assert "fence_rng" in threadgraph.install()  # not left out: it comes back
