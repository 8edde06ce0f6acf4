"""Conformance: CUDAGraph Trees behaves the same in a worker thread under ``threadgraph.install()``
as on the main thread without it.

Each case (``cases_compile.py``: what runs on a CPU; ``cases_trees.py``: what needs a GPU) is a
function that does something a user does and returns what a user can observe of it: outputs,
the tree manager's counts and modes, live memory blocks, warnings, skip messages and errors.
``placements.py`` runs a case on the main thread without threadgraph, on the main thread after
``install()``, in a plain ``threading.Thread`` after ``install()`` and in a
``CompiledWorkerThread``; ``python -m tests.conformance`` runs cases in fresh processes and
writes the cases x placements table; ``tests/library/test_conformance.py`` fails on any difference.
"""
