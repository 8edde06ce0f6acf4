"""GPU scenarios for threadgraph, each meant to run in a fresh process.

    python -m tests.helpers.gpu_scenarios NAME [--steps N] [--workers N] [--out result.json]

Every scenario prints one JSON object (and writes it to --out): what ran, what was compared,
per-worker step times. ``tests/library/test_gpu.py`` runs them in subprocesses and asserts on the
results; run directly they double as measurements. The workers and references they use are in
``tests/helpers/gpu_workers.py``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import threading
import time

import torch

import threadgraph
from tests.helpers.gpu_workers import (BATCH, WIDTH, Inferer, Trainer, close, divergence, steady_seconds, throughput,
                                checksum, cudagraph_skips, main_thread_reference, make_data, make_model, manual_floor,
                                run_group)


def _trees():
    return importlib.import_module("torch._inductor.cudagraph_trees")


def _generation_patches() -> frozenset:
    """The patches that keep generations per worker (hazard global-generation), by threadgraph's own account."""
    return frozenset(p["name"] for p in threadgraph.patches() if p["hazard"] == "global-generation")


# -- scenarios -------------------------------------------------------------------------------


def plain_thread_bug(args):
    """Upstream #123177: a plain thread calling a reduce-overhead function, no threadgraph.

    The TLS belongs to the thread that first imported cudagraph_trees; in a real program that
    is the main thread (it compiled something, or imported a library that did)."""
    import torch._inductor.cudagraph_trees  # noqa: F401

    box = {}

    def body():
        try:
            fn = torch.compile(make_model(0, "cuda"), mode="reduce-overhead")
            x = torch.randn(BATCH, WIDTH, device="cuda")
            for _ in range(3):
                fn(x)
            box["outcome"] = "ran"
        except BaseException as exc:
            box["outcome"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=body)
    t.start()
    t.join(300)
    # lazy_tls applies exactly where get_obj asserts in a thread without the TLS (hazard tls-assert)
    lazy_tls = next(p for p in threadgraph.patches() if p["name"] == "lazy_tls")
    return {"outcome": box.get("outcome"), "get_obj_asserts": lazy_tls["applies"]}


def one_worker(args):
    """1 worker trains and 1 infers; compared with the main thread; graphs must replay."""
    steps = args.steps
    reference = main_thread_reference(0, steps)
    ref_model = make_model(1, "cuda").eval()
    xs, _ = make_data(1, steps, "cuda")
    with torch.no_grad():
        ref_sums = [checksum(ref_model(xs[i])).item() for i in range(steps)]
    skips_before = cudagraph_skips()
    trainer, inferer = Trainer("cuda:0", 0, steps, name="trainer"), Inferer("cuda:0", 1, steps, name="inferer")
    run_group([trainer])  # one at a time: "1 worker"
    run_group([inferer])
    return {
        "reference": reference,
        "trainer": trainer.result(),
        "ref_sums": ref_sums,
        "inferer": inferer.result(),
        "cudagraph_skips": cudagraph_skips() - skips_before,
    }


def generation(args):
    """A runs forward; B runs a whole step with its own mark-step; then A's backward + optimizer.

    ``--variant unpatched`` leaves the generation patches out (expected to corrupt or raise).
    Ordered with events, so the interleaving is the same every run.
    """
    exclude = _generation_patches() if args.variant == "unpatched" else frozenset()
    threadgraph.install(exclude=exclude)
    warm = 4
    a_fwd_done, b_done = threading.Event(), threading.Event()
    box = {}

    def plain_thread_training(seed):
        """What a plain thread (no CompiledWorkerThread) sets up: TLS, device, model, compiled loss."""
        threadgraph.ensure_cudagraph_tls()
        torch.cuda.set_device(0)
        model = make_model(seed, "cuda")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        fn = torch.compile(lambda x, y: torch.nn.functional.mse_loss(model(x), y), mode="reduce-overhead")
        return model, opt, fn, *make_data(seed, warm + 1, "cuda")

    def run_a(interleave):
        model, opt, fn, xs, ys = plain_thread_training(0)
        for i in range(warm + 1):
            torch.compiler.cudagraph_mark_step_begin()
            loss = fn(xs[i], ys[i])
            if i == warm and interleave:
                torch.cuda.current_stream().synchronize()
                a_fwd_done.set()
                assert b_done.wait(300), "B did not finish"
                manager = _trees().get_manager(0, create_if_none_exists=False)
                box["a_sees_new_generation"] = bool(manager.in_new_torch_compile_invocation())
            loss.backward()
            opt.step()
            if i < warm:
                opt.zero_grad(set_to_none=True)
        return torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()

    def run_b():
        model, opt, fn, xs, ys = plain_thread_training(7)
        # B starts only once A's forward is pending: all of B's warmup, captures and mark-steps
        # happen while A holds live outputs it still needs for backward.
        assert a_fwd_done.wait(300), "A did not run its forward"
        for i in range(warm + 1):
            torch.compiler.cudagraph_mark_step_begin()
            loss = fn(xs[i], ys[i])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.current_stream().synchronize()
        b_done.set()

    def guarded(key, fn, *a):
        try:
            box[key] = fn(*a)
        except BaseException as exc:
            box[key + "_error"] = f"{type(exc).__name__}: {exc}"
            a_fwd_done.set()
            b_done.set()

    reference_thread = threading.Thread(target=guarded, args=("reference", run_a, False))
    reference_thread.start()
    reference_thread.join(300)
    ta = threading.Thread(target=guarded, args=("a", run_a, True))
    tb = threading.Thread(target=guarded, args=("b", run_b))
    ta.start()
    tb.start()
    ta.join(300)
    tb.join(300)
    out = {"variant": args.variant, "errors": {k: v for k, v in box.items() if k.endswith("_error")},
           "a_sees_new_generation": box.get("a_sees_new_generation")}
    if "a" in box and "reference" in box:
        out["grads_equal"] = bool(torch.allclose(box["a"], box["reference"], rtol=1e-4, atol=1e-6))
        out["max_abs_diff"] = float((box["a"] - box["reference"]).abs().max())
    return out


def many(args):
    """N training workers on one GPU vs each alone, and vs the same workers in eager threads.
    ``--variant unpatched`` leaves the generation patches out (hazard global-generation shows)."""
    if args.variant == "unpatched":
        threadgraph.install(exclude=_generation_patches())
    n, steps = args.workers, args.steps
    alone = []
    for i in range(n):
        w = Trainer("cuda:0", i, steps, name=f"alone-{i}")
        run_group([w])
        alone.append(w)
    together = [Trainer("cuda:0", i, steps, name=f"worker-{i}") for i in range(n)]
    # Reported, not raised: the unpatched test asserts on the error's text (any other failure of
    # this process fails that test instead of passing it).
    together_error = None
    started = time.perf_counter()
    try:
        run_group(together)
    except threadgraph.WorkerError as exc:
        together_error = str(exc)
    wall = time.perf_counter() - started
    if together_error is not None:  # their losses stop where the error struck; nothing to compare
        return {"workers": n, "steps": steps, "variant": args.variant, "together_error": together_error}
    eager = [Trainer("cuda:0", i, steps, mode="eager", name=f"eager-{i}") for i in range(n)]
    eager_wall = run_group(eager)
    again = Trainer("cuda:0", 1 % n, steps, name="alone-again")
    run_group([again])
    return {
        "workers": n,
        "steps": steps,
        "variant": args.variant,
        "together_error": None,
        "divergence": [divergence(t.result()["losses"], a.result()["losses"]) for t, a in zip(together, alone)],
        "alone_twice_equal": again.result()["losses"] == alone[1 % n].result()["losses"],
        "losses_allclose": [
            bool(torch.allclose(torch.tensor(t.result()["losses"]), torch.tensor(a.result()["losses"]), rtol=1e-4, atol=1e-6))
            for t, a in zip(together, alone)
        ],
        "alone_p50_ms": [a.stats.p50_ms for a in alone],
        "together": [t.result() | {"losses": None} for t in together],
        "eager_p50_ms": [e.stats.p50_ms for e in eager],
        "together_steps_per_s": throughput(together, steady_seconds(together)),
        "alone_steps_per_s": 1e3 / alone[0].stats.p50_ms,
        "eager_steps_per_s": throughput(eager, steady_seconds(eager)),
        "wall_s": {"together": round(wall, 1), "eager": round(eager_wall, 1)},
    }


def mixed(args):
    """5 inference + 3 training workers on one GPU; training compared with each alone."""
    steps = args.steps
    alone = []
    for i in range(3):
        w = Trainer("cuda:0", i, steps, name=f"alone-{i}")
        run_group([w])
        alone.append(w)
    trainers = [Trainer("cuda:0", i, steps, name=f"train-{i}") for i in range(3)]
    inferers = [Inferer("cuda:0", 10 + i, steps, name=f"infer-{i}") for i in range(5)]
    run_group(trainers + inferers)
    ref = []
    for i in range(5):
        model = make_model(10 + i, "cuda").eval()
        xs, _ = make_data(10 + i, steps, "cuda")
        with torch.no_grad():
            ref.append(torch.stack([checksum(model(xs[j])) for j in range(steps)]).cpu())
    return {
        "train_allclose": [bool(torch.allclose(torch.tensor(t.result()["losses"]), torch.tensor(a.result()["losses"]), rtol=1e-4, atol=1e-6)) for t, a in zip(trainers, alone)],
        "infer_allclose": [bool(torch.allclose(torch.tensor(w.result()["sums"], dtype=torch.float64), r, rtol=1e-3, atol=1e-2)) for w, r in zip(inferers, ref)],
        "train_p50_ms": [t.stats.p50_ms for t in trainers],
        "infer_p50_ms": [w.stats.p50_ms for w in inferers],
    }


def capture_failure(args):
    """One worker raises inside a real capture; in a group the rest stop cleanly, alone they carry on."""
    trees = _trees()
    original_record = trees.CUDAGraphNode._record

    def record(self, model, inputs):
        # A worker's forward graphs are recorded in its own thread, before any of its backward ones
        # (those in autograd's device thread): a bad worker fails at its first recording.
        if threading.current_thread().name.startswith("bad"):
            def failing(inputs):
                model(inputs)  # kernels were captured, then the user's code raises mid-capture
                raise RuntimeError("injected failure inside capture")

            return original_record(self, failing, inputs)
        return original_record(self, model, inputs)

    trees.CUDAGraphNode._record = record
    steps = args.steps
    out = {}
    group_workers = [Trainer("cuda:0", i, steps, name=f"good-{i}") for i in range(2)] + [Trainer("cuda:0", 9, steps, name="bad-group")]
    started = time.perf_counter()
    try:
        run_group(group_workers)
        out["group_error"] = None
    except threadgraph.WorkerError as exc:
        out["group_error"] = str(exc)
    out["group_seconds"] = round(time.perf_counter() - started, 1)
    out["group_all_stopped"] = not any(w.is_alive() for w in group_workers)
    # independent workers: the good ones carry on and stay correct
    alone = Trainer("cuda:0", 0, steps, name="alone-0")
    run_group([alone])
    good = Trainer("cuda:0", 0, steps, name="good-solo")
    bad = Trainer("cuda:0", 9, steps, name="bad-solo")
    good.start()
    bad.start()
    good.join(300)
    try:
        bad.join(300)
        out["solo_bad_error"] = None
    except threadgraph.WorkerError as exc:
        out["solo_bad_error"] = str(exc)
    out["solo_good_allclose"] = bool(torch.allclose(torch.tensor(good.result()["losses"]), torch.tensor(alone.result()["losses"]), rtol=1e-4, atol=1e-6))
    out["solo_good_steps"] = good.stats.steps
    return out


def new_shapes(args):
    """One worker meets a new input shape mid-run (recompile + capture) while others replay."""
    steps = args.steps
    alone = [Trainer("cuda:0", i, steps, name=f"alone-{i}", switch_shape_at=steps // 2 if i == 0 else None) for i in range(3)]
    for w in alone:
        run_group([w])
    together = [Trainer("cuda:0", i, steps, name=f"worker-{i}", switch_shape_at=steps // 2 if i == 0 else None) for i in range(3)]
    run_group(together)
    return {
        "losses_allclose": [bool(torch.allclose(torch.tensor(t.result()["losses"]), torch.tensor(a.result()["losses"]), rtol=1e-4, atol=1e-6)) for t, a in zip(together, alone)],
        "captures": [t.stats.captures for t in together],
        "p50_ms": [t.stats.p50_ms for t in together],
    }


def two_gpus(args):
    """One worker per GPU, capturing concurrently; each compared with the same worker alone."""
    n = torch.cuda.device_count()
    steps = args.steps
    alone = [Trainer(f"cuda:{i}", i, steps, name=f"alone-{i}") for i in range(n)]
    for w in alone:
        run_group([w])
    together = [Trainer(f"cuda:{i}", i, steps, name=f"gpu-{i}") for i in range(n)]
    run_group(together)
    return {
        "gpus": n,
        "losses_allclose": [bool(torch.allclose(torch.tensor(t.result()["losses"]), torch.tensor(a.result()["losses"]), rtol=1e-4, atol=1e-6)) for t, a in zip(together, alone)],
        "alone_p50_ms": [a.stats.p50_ms for a in alone],
        "together_p50_ms": [t.stats.p50_ms for t in together],
    }


def whole_step(args):
    """Issue 7: the whole step as one graph per worker, against eager and CUDAGraph Trees."""
    steps = args.steps
    n_gpus = torch.cuda.device_count()
    cells = {}
    for mode in ("eager", "reduce-overhead", "whole-step", "whole-step-compiled"):
        w = Trainer("cuda:0", 0, steps, mode=mode, name=f"one-{mode}")
        run_group([w])
        cells[mode] = w
    floor = manual_floor(steps)
    shared = [Trainer("cuda:0", i, steps, mode="whole-step", name=f"shared-{i}") for i in range(3)]
    run_group(shared)
    shared_alone = [cells["whole-step"]] + [Trainer("cuda:0", i, steps, mode="whole-step", name=f"alone-{i}") for i in (1, 2)]
    for w in shared_alone[1:]:
        run_group([w])
    out = {
        "losses_allclose_eager": close(cells["whole-step"].result()["losses"], cells["eager"].result()["losses"]),
        "params_allclose_eager": close(cells["whole-step"].params(), cells["eager"].params()),
        # Inductor may fuse differently from eager: compared with a looser tolerance
        "compiled_inner_close_eager": bool(torch.allclose(torch.tensor(cells["whole-step-compiled"].result()["losses"]),
                                                          torch.tensor(cells["eager"].result()["losses"]), rtol=1e-3, atol=1e-5)),
        "p50_ms": {m: w.stats.p50_ms for m, w in cells.items()},
        "floor_ms": floor,
        "shared_one_gpu_allclose": [close(a.result()["losses"], b.result()["losses"]) for a, b in zip(shared, shared_alone)],
        "shared_one_gpu_p50_ms": [w.stats.p50_ms for w in shared],
    }
    if n_gpus > 1:
        per_gpu = [Trainer(f"cuda:{i}", 0, steps, mode="whole-step", name=f"gpu-{i}") for i in range(n_gpus)]
        run_group(per_gpu)
        out["per_gpu_p50_ms"] = [w.stats.p50_ms for w in per_gpu]
        out["per_gpu_allclose"] = [close(w.result()["losses"], cells["whole-step"].result()["losses"]) for w in per_gpu]
        trees = [Trainer(f"cuda:{i}", 0, steps, name=f"trees-gpu-{i}") for i in range(n_gpus)]
        run_group(trees)
        out["per_gpu_trees_p50_ms"] = [w.stats.p50_ms for w in trees]
    return out


SCENARIOS = {f.__name__: f for f in [plain_thread_bug, one_worker, generation, many, mixed, capture_failure, new_shapes, two_gpus, whole_step]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--variant", choices=["patched", "unpatched"], default="patched")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_scenarios needs a CUDA GPU")
    started = time.perf_counter()
    result = SCENARIOS[args.scenario](args)
    result["scenario"] = args.scenario
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["torch"] = torch.__version__
    result["gpu"] = torch.cuda.get_device_name(0)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)  # a crash at interpreter exit must not eat the result


if __name__ == "__main__":
    main()
