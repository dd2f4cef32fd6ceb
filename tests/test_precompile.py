"""Compile plans and the precompile workers (``hola_titan/kernels/runtime/precompile.py``), on the CPU.

Triton cannot compile here (no GPU driver), so the compile itself is a stand-in where a test needs it to succeed;
what is real: the plan's text form, which plan a run takes, the node-wide once-only division of the work between
workers (threads, and processes with their own file locks) in the plan's order, the workers' failures
reported rather than raised, the resolution of a kernel's name to its ``JITFunction``, and the trainer's record
of what it did.
"""

from __future__ import annotations

import json
import threading
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("triton")

from hola_titan.kernels.runtime import precompile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _spec(name: str, *, warps: int = 4, stages: int = 2, bk: int = 64, extern="/some/machine/libdevice.10.bc"):
    """A specialisation as Triton serialises it (``serialize_specialization_data``): a kernel with one pointer,
    one integer and one constexpr ``BK``."""
    return json.dumps({
        "name": name, "signature": {"x": "*bf16", "n": "i32", "BK": "constexpr"},
        "constant_keys": [[2]], "constant_vals": [{"constexpr": bk}], "attrs_keys": [[0]],
        "attrs_vals": [[["tt.divisibility", 16]]],
        "options": {"num_warps": warps, "num_stages": stages, "extern_libs": [["libdevice", extern]],
                    "arch": "sm90"},
        "key": f"[('*bf16', 'D'), ('i32', '')]{{'extern_libs': '{extern}'}}"})


def test_a_plan_keeps_no_machine_path_and_only_our_and_fla_kernels():
    kept = precompile.sanitize(_spec("fla.ops.x.kernel"))
    spec = json.loads(kept)
    assert "extern_libs" not in spec["options"] and "/some/machine" not in kept
    assert spec["key"].startswith("plan:") and spec["options"]["num_warps"] == 4
    assert list(spec["signature"]) == ["x", "n", "BK"]  # argument order: constexprs are read by position
    # The same kernel recorded on another machine (another libdevice path) is the same plan entry.
    assert precompile.sanitize(_spec("fla.ops.x.kernel", extern="/elsewhere/libdevice.10.bc")) == kept
    assert precompile.sanitize(_spec("hola_titan.kernels.fused.short_conv._fwd")) is not None
    assert precompile.sanitize(_spec("torch._inductor.kernel")) is None


def test_the_recorder_keeps_what_triton_reports_once():
    triton_runtime = precompile._hooks()
    before = triton_runtime.jit_post_compile_hook
    with precompile.Recorder() as recorder:
        hook = triton_runtime.jit_post_compile_hook
        for name in ("fla.ops.a", "fla.ops.a", "other.b", "hola_titan.kernels.c"):
            hook(key="k", repr="r", fn=None, compile={"specialization_data": _spec(name)}, is_manual_warmup=False,
                 already_compiled=False)
    assert [json.loads(s)["name"] for s in recorder.specs] == ["fla.ops.a", "hola_titan.kernels.c"]
    assert triton_runtime.jit_post_compile_hook is before


def test_a_run_takes_its_plan_or_the_same_kind_of_another_flavour():
    plans = {"hola/d128/h2/float32/plain": ["a", "b"], "gdn/d128/h2/float32/plain": ["a", "c"],
             "hola/d256/h4/bfloat16/packed": ["d"], "hola/d256/h16/bfloat16/packed": ["e"]}
    assert precompile.select(plans, "hola/d128/h2/float32/plain") == (["a", "b"], "plan hola/d128/h2/float32/plain")
    specs, source = precompile.select(plans, "hola_recency/d128/h2/float32/plain")
    assert specs == ["a", "c", "b"] and "gdn/d128/h2/float32/plain, hola/d128/h2/float32/plain" in source
    assert precompile.select(plans, "hola/d128/h2/bfloat16/plain") == ([], "no plan for hola/d128/h2/bfloat16/plain")
    # Another head count is another plan (fla's kernels take the heads as a constant): none is borrowed.
    assert precompile.select(plans, "hola/d256/h8/bfloat16/packed") == ([], "no plan for hola/d256/h8/bfloat16/packed")
    assert precompile.select(plans, "hola/d256/h4/bfloat16/packed")[0] == ["d"]
    assert precompile.plan_key("gdn", 256, 4, "bfloat16", packed=True) == "gdn/d256/h4/bfloat16/packed"


def test_the_shipped_plans_hold_the_head_count_their_key_names():
    """Every shipped plan's fla kernels were compiled for the heads its key says (a 16-head plan under a 4-head key
    served the 340M run nothing: its #640 check and first step compiled on the main thread, 2026-12-02)."""
    from hola_titan.kernels.runtime import tuned_configs
    files = sorted(tuned_configs.CONFIG_DIR.glob("*.json"))
    assert files
    for path in files:
        for key, specs in json.loads(path.read_text()).get("plans", {}).items():
            heads = int(key.split("/")[2].removeprefix("h"))
            for spec in specs:
                data = json.loads(spec)
                names = list(data["signature"])
                values = {names[k[0] if isinstance(k, list) else k]: v
                          for keys, v in zip(data["constant_keys"], data["constant_vals"]) for k in keys}
                if data["name"].startswith("fla.ops.") and "H" in values:
                    assert values["H"] == heads, f"{path.name}: plan {key} holds {data['name']} for H={values['H']}"


def test_the_shipped_plans_hold_the_cache_kernels_launches():
    """Every shipped plan's Triton cache-read kernels carry the tiles, warps and stages that the launch tables give
    their head dim and dtype: a plan holding another launch compiles, in its workers, kernels the run never asks
    for, while the run compiles its own on the main thread (the float32 table changed on 2026-12-06)."""
    import torch

    from hola_titan.kernels.hola import triton_kernels
    from hola_titan.kernels.runtime import tuned_configs
    kinds = {"_cache_fwd_kernel": "fwd", "_cache_bwd_dq_kernel": "dq", "_cache_bwd_dkdv_kernel": "dkdv"}
    dtypes = {"*fp32": torch.float32, "*bf16": torch.bfloat16, "*fp16": torch.float16}
    seen = set()
    for path in sorted(tuned_configs.CONFIG_DIR.glob("*.json")):
        for key, specs in json.loads(path.read_text()).get("plans", {}).items():
            for spec in specs:
                data = json.loads(spec)
                module, _, function = data["name"].rpartition(".")
                if module != "hola_titan.kernels.hola.triton_kernels" or function not in kinds:
                    continue
                names = list(data["signature"])
                values = {names[k[0]]: v for k, v in zip(data["constant_keys"], data["constant_vals"])}
                dtype = dtypes[data["signature"]["q_ptr"]]
                want = triton_kernels._config(kinds[function], values["D"], dtype, torch.device("cuda"))
                got = dict(BM=values["BM"], BN=values["BN"], num_warps=data["options"]["num_warps"],
                           num_stages=data["options"]["num_stages"])
                assert got == {k: want[k] for k in got}, f"{path.name}: plan {key}, {function} at D {values['D']}"
                seen.add((dtype, values["D"]))
    assert (torch.float32, 64) in seen  # the MQAR recipes' plans are among those checked


def test_only_the_configurations_an_autotuner_chose_stay_in_a_plan():
    tried = [_spec("fla.ops.t", warps=w, stages=s, bk=bk) for w in (2, 4) for s in (2, 3) for bk in (32, 64)]
    fixed = _spec("hola_titan.kernels.k")
    chosen = {"fla.ops.t": [{"kwargs": {"BK": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}]}
    kept = precompile.chosen_only([*tried, fixed], chosen)
    assert kept == [_spec("fla.ops.t", warps=4, stages=3, bk=64), fixed]


def test_the_workers_of_a_node_compile_each_specialisation_once(tmp_path):
    """Two processes' worth of workers (two queues over one plan, two threads each; each worker takes its own file
    locks, as processes do): every specialisation is compiled exactly once, and every queue accounts for all."""
    specs = [_spec(f"fla.ops.k{i}") for i in range(12)]
    compiled, lock = [], threading.Lock()

    def slow_compile(spec):
        time.sleep(0.02)
        with lock:
            compiled.append(json.loads(spec)["name"])

    queues = [precompile.SpecQueue(specs), precompile.SpecQueue(specs)]
    results = [None] * 4

    def worker(i):
        results[i] = precompile.work(queues[i // 2], folder=tmp_path, compile_fn=slow_compile)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(compiled) == sorted(f"fla.ops.k{i}" for i in range(12))
    assert sum(r["compiled"] for r in results) == 12
    for pair in (results[:2], results[2:]):
        assert sum(r["compiled"] + r["done_elsewhere"] for r in pair) == 12 and not any(r["failed"] for r in pair)
    # A later run on the node finds everything done.
    again = precompile.work(precompile.SpecQueue(specs), folder=tmp_path, compile_fn=slow_compile)
    assert again["compiled"] == 0 and again["done_elsewhere"] == 12 and len(compiled) == 12


def test_workers_take_the_plan_in_its_order_and_a_stopped_queue_gives_nothing_more(tmp_path, monkeypatch):
    """The workers of one process take the plan's specialisations in order (the plan lists the slowest first), each
    once; after stop() nothing further starts, and the run's record says why."""
    specs = [_spec(f"fla.ops.k{i}") for i in range(6)]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "first"))
    started = []
    job = precompile.start(specs, source="plan test", workers=1, compile_fn=lambda spec: started.append(spec))
    job.wait(timeout=30)
    assert started == specs
    assert job.plan == specs and precompile.Precompile(source="none here").plan == []  # what first_step checks
    gate, seen = threading.Event(), []

    def blocking(spec):
        seen.append(spec)
        gate.wait(30)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "second"))  # nothing marked done yet
    job = precompile.start(specs, source="plan test", workers=2, compile_fn=blocking)
    deadline = time.time() + 10
    while len(seen) < 2 and time.time() < deadline:
        time.sleep(0.01)
    job.stop("the backend is the PyTorch reference")
    gate.set()
    result = job.wait(timeout=30)
    assert sorted(seen) == sorted(specs[:2]) and result["compiled"] == 2
    assert "stopped early: the backend is the PyTorch reference" in job.describe()
    assert job.record()["stopped"] == "the backend is the PyTorch reference"


def test_a_plan_is_ordered_by_recorded_compile_time(monkeypatch):
    """The recorder times each compile between Triton's hook before it and its hook after (in the compiling thread);
    slowest_first puts the longest first and keeps the order of ties. The recorder's clock is a fake that the test
    moves: with real sleeps, a loaded machine timed one of two instant compiles at 1 ms and swapped the tie."""
    clock = [0.0]
    monkeypatch.setattr(precompile, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    triton_runtime = precompile._hooks()
    before = (triton_runtime.jit_cache_hook, triton_runtime.jit_post_compile_hook)
    names = ("fla.ops.quick", "hola_titan.kernels.slow", "fla.ops.middle", "fla.ops.tie")
    with precompile.Recorder() as recorder:
        for name, seconds in zip(names, (0.0, 0.2, 0.1, 0.0)):
            assert triton_runtime.jit_cache_hook(key="k", repr="r", fn=None, compile={}, is_manual_warmup=False,
                                                 already_compiled=False) is None  # never skips a compile
            clock[0] += seconds
            triton_runtime.jit_post_compile_hook(key="k", repr="r", fn=None,
                                                 compile={"specialization_data": _spec(name)},
                                                 is_manual_warmup=False, already_compiled=False)
    assert (triton_runtime.jit_cache_hook, triton_runtime.jit_post_compile_hook) == before
    ordered = [json.loads(s)["name"] for s in recorder.slowest_first(recorder.specs)]
    assert ordered == ["hola_titan.kernels.slow", "fla.ops.middle", "fla.ops.quick", "fla.ops.tie"]
    assert recorder.seconds[recorder.specs[1]] >= 0.2


def test_a_failed_compile_is_reported_and_left_for_the_launch(tmp_path):
    def broken(spec):
        raise RuntimeError("ptxas fatal: something\nmore")

    counts = precompile.work(precompile.SpecQueue([_spec("fla.ops.bad")]), folder=tmp_path, compile_fn=broken)
    assert counts["compiled"] == 0 and len(counts["failed"]) == 1
    assert counts["failed"][0].startswith("fla.ops.bad [") and counts["failed"][0].endswith("]: ptxas fatal: something")
    assert not list(tmp_path.glob("*.done"))  # nothing claims it was compiled


def test_a_kernel_name_resolves_through_autotuner_and_heuristics():
    from triton.runtime.jit import JITFunction

    fla_kernel = precompile.jit_function("fla.ops.utils.cumsum.chunk_local_cumsum_scalar_kernel")
    ours = precompile.jit_function("hola_titan.kernels.hola.triton_kernels._cache_fwd_kernel")
    assert isinstance(fla_kernel, JITFunction) and isinstance(ours, JITFunction)
    with pytest.raises(LookupError, match="not a Triton kernel"):
        precompile.jit_function("hola_titan.kernels.hola.triton_kernels.cache_attention_fwd")


def test_the_run_s_workers_report_what_they_could_not_compile(tmp_path, monkeypatch):
    """The real path of a run (worker threads, Triton's ``preload``): on a CPU Triton cannot compile, so each
    specialisation fails inside a worker; the run is told which (one line each), nothing raises, and nothing is
    marked done."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    specs = [precompile.sanitize(_spec("hola_titan.kernels.hola.triton_kernels._rstd_kernel", bk=b)) for b in (16, 32)]
    job = precompile.start(specs, source="plan test", workers=2)
    result = job.wait(timeout=300)
    assert result["compiled"] == 0 and result["unfinished"] == 0
    assert len(result["failed"]) == 2 and all("_rstd_kernel" in f for f in result["failed"]), result
    assert "2 kernel specialisations from the plan test, 2 worker threads: 0 compiled here" in job.describe()
    assert not list((tmp_path / "triton").rglob("*.done"))


def test_a_worker_past_the_time_limit_is_left_running_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    release = threading.Event()
    job = precompile.start([_spec("fla.ops.slow")], source="plan test", workers=1,
                           compile_fn=lambda spec: release.wait(30))
    result = job.wait(timeout=0.2)
    release.set()
    assert result["unfinished"] == 1 and "1 workers still compiling at the time limit" in job.describe()


def test_nothing_starts_without_a_plan():
    job = precompile.start([], source="no plan for hola/d128/float32/plain", workers=4)
    assert job.wait() is None and job.describe() == "off (no plan for hola/d128/float32/plain)"
    assert precompile.auto_workers(3) <= 3 and precompile.auto_workers(100, local_processes=64) == 1


def test_workers_compile_only_kernels_whose_modules_the_main_thread_imported(tmp_path, monkeypatch):
    """Until the run's imports are done, the workers take only this project's kernels (their modules imported by
    start() on the calling thread), however the plan orders them; fla's wait, and compile once imports_done() has
    imported their modules on the calling thread. A worker importing fla beside the main thread's import of fla
    deadlocked on the module locks, and Python's way out failed the main thread's import (a silent fallback to the
    reference backend, seen on the H200)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    fla_spec = _spec("fla.ops.utils.cumsum.chunk_local_cumsum_scalar_kernel")
    ours = _spec("hola_titan.kernels.hola.triton_kernels._rstd_kernel")
    queue = precompile.SpecQueue([fla_spec, ours], ready_modules={"hola_titan.kernels.hola.triton_kernels"})
    assert queue.take() == ours
    got = []
    waiter = threading.Thread(target=lambda: got.append(queue.take()))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # waits for the imports rather than importing fla itself
    queue.allow_all()
    waiter.join(10)
    assert got == [fla_spec] and queue.take() is None

    threads_seen, compiled = [], []

    def compile_fn(spec):
        threads_seen.append(threading.current_thread().name)
        compiled.append(json.loads(spec)["name"])

    job = precompile.start([fla_spec, ours], source="plan test", workers=2, compile_fn=compile_fn,
                           imports_done=False)
    deadline = time.time() + 10
    while not compiled and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert compiled == ["hola_titan.kernels.hola.triton_kernels._rstd_kernel"]
    job.imports_done()
    result = job.wait(timeout=30)
    assert result["compiled"] == 2 and compiled[1] == "fla.ops.utils.cumsum.chunk_local_cumsum_scalar_kernel"
    assert all(name.startswith("hola-precompile-") for name in threads_seen)


def test_a_failed_run_start_releases_workers_waiting_for_its_imports(tmp_path, monkeypatch):
    """A worker waiting for the run's imports (an fla kernel before imports_done) ends when the run's start raises
    inside ``stopped_on_error``, instead of waiting for the life of the process; the error goes on unchanged."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    compiled = []
    job = precompile.start([_spec("fla.ops.utils.cumsum.chunk_local_cumsum_scalar_kernel")], source="plan test",
                           workers=1, compile_fn=lambda spec: compiled.append(spec), imports_done=False)
    time.sleep(0.2)
    assert job._threads[0].is_alive()  # parked: the run has not said its imports are done
    with pytest.raises(RuntimeError, match="model build"):
        with precompile.stopped_on_error(job, "the run's start"):
            raise RuntimeError("model build")
    job._threads[0].join(10)
    assert not job._threads[0].is_alive() and not compiled
    assert "stopped early: the run's start failed (RuntimeError)" in job.describe()


def _plan_topw(specs: list[str]) -> set[tuple]:
    """The selection kernels' launches a plan holds: ``(kernel, sorted constexprs, warps)``."""
    held = set()
    for spec in specs:
        data = json.loads(spec)
        function = data["name"].rpartition(".")[2]
        if function in ("_block_topw_kernel", "_merge_topw_kernel"):
            names = list(data["signature"])
            values = {names[k[0]]: v for k, v in zip(data["constant_keys"], data["constant_vals"])}
            values.pop("HAS_INIT", None)
            held.add((function, tuple(sorted(values.items())), data["options"]["num_warps"]))
    return held


def test_the_shipped_plans_hold_every_recipe_s_selection_launches():
    """Each recipe of ``train_configs/`` with score eviction launches the two top-W selection kernels with its own
    window and block; the plan of its kind (in every shipped table that has one) must hold those launches, or the
    run compiles both on its main thread at the first step (the MQAR recipe's window 16 against the plan's 8 cost
    1.3 s of a fresh H100's first step on 2026-12-06). The recipes' plans come from ``tune_kernels.py``, which
    records them."""
    from helpers import load_script

    from hola_titan.kernels.gdn import fla_bridge
    from hola_titan.kernels.runtime import tuned_configs
    from hola_titan.kernels.hola.selection import topw_launches

    # The shipped tables are Hopper's, where fla's #640 workaround pads head dims below 128.
    recipes = load_script("tune_kernels").recipe_selections(lambda d: max(d, fla_bridge.PAD_HEAD_DIM))
    checked = set()
    for path in sorted(tuned_configs.CONFIG_DIR.glob("*.json")):
        for key, specs in json.loads(path.read_text()).get("plans", {}).items():
            for window, block in recipes.get(key, []):
                block_launch, merge_launch = topw_launches(window, block)
                want = {(kernel, tuple(sorted((k, v) for k, v in launch.items() if k != "num_warps")),
                         launch["num_warps"])
                        for kernel, launch in (("_block_topw_kernel", block_launch),
                                               ("_merge_topw_kernel", merge_launch))}
                assert want <= _plan_topw(specs), f"{path.name}: plan {key} lacks window {window}, block {block}"
                checked.add(key)
    assert {"hola/d128/h2/float32/plain", "hola/d256/h4/bfloat16/packed"} <= checked  # MQAR's and 340M's


def test_a_launch_the_plan_lacks_is_told_by_what_it_differs():
    """``plan_difference``: empty for a held specialisation, the differing fields against the closest one of the
    same kernel otherwise (what ``scripts/first_step.py`` prints for the main thread's slow compiles)."""
    plan = [precompile.sanitize(_spec("fla.ops.k", warps=4, bk=64)), precompile.sanitize(_spec("fla.ops.k", warps=8,
                                                                                               bk=32))]
    assert precompile.plan_difference(plan[0], plan) == ""
    other = precompile.sanitize(_spec("fla.ops.k", warps=4, bk=128))
    assert precompile.plan_difference(other, plan) == 'constexpr BK: {"constexpr": 128} (plan: {"constexpr": 64})'
    unaligned = json.loads(plan[1])
    unaligned["attrs_vals"] = [[]]
    unaligned.pop("key")
    told = precompile.plan_difference(precompile.sanitize(json.dumps(unaligned)), plan)
    assert told == 'attrs x: [] (plan: [["tt.divisibility", 16]])'
    assert precompile.plan_difference(precompile.sanitize(_spec("fla.ops.other")), plan) == "kernel not in the plan"
    elsewhere = json.loads(plan[0])
    elsewhere["target"] = {"backend": "cuda", "arch": 90}  # a field the comparison does not read
    elsewhere.pop("key")
    assert precompile.plan_difference(precompile.sanitize(json.dumps(elsewhere)), plan).startswith("differs from")
