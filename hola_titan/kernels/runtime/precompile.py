"""Compile a run's Triton kernels side by side before its first launch.

Triton compiles each kernel specialisation at its first launch, one after another in the launching process. On a
fresh H200, with every autotuning served from the shipped configurations, the debug-width MQAR step still spent
about 50 s there (docs/LOG.md, 2026-12-02): compiling, mostly ``ptxas``, one kernel at a time on one core.

The configurations file (``hola_titan/kernels/runtime/tuned_configs.py``) therefore also holds *plans*: per kind of run
(flavour, fla head dim, heads per rank, compute dtype, packed or plain rows; :func:`plan_key`) the specialisations that
a training step and a chunked prefill of that kind compiled, in Triton's own serialised form (the
``specialization_data`` that ``JITFunction.preload`` takes back), recorded by ``scripts/tune_kernels.py`` with
:class:`Recorder`.
:func:`start` compiles the run's plan in worker threads of the run's own process (Triton's compiler spends most
of its time in ``ptxas`` subprocesses and native passes, so threads overlap, and a thread needs no second import of
torch and fla) while the trainer builds the model; :meth:`Precompile.wait`, before the first launch, joins them.
A plan lists its specialisations slowest to compile first, as recorded, and the workers take them in that order:
the plan cannot end before its slowest compile, so that one starts first (the float32 cache kernels of the MQAR
step took 7-21 s each until they got tiles of their own, 2026-12-06; plans recorded before keep that order).
The binaries land in Triton's on-disk cache, where the run's own launches find them. The workers of every process
on a node take one lock and leave one marker per specialisation in Triton's cache folder, so nine runs started
together compile each kernel once, not nine times.

Each worker also builds the kernel's launcher (Triton compiles a small C module per kernel signature with the
system's C compiler at the first launch, about a second each, in the launching thread).

A specialisation that the run does not in fact launch (another shape changed an argument's divisibility, say)
costs a worker one compile and nothing else; one the plan lacks compiles at its launch, as without a plan. The
binaries are Triton's, made on this machine: the plan is text (names, argument types, constants, options), not
code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import json
import os
import threading
import time
from pathlib import Path

# Kernels recorded in and compiled from a plan: fla's and this project's (not Inductor's, not torch's own).
MODULE_PREFIXES = ("fla.", "hola_titan.kernels.")
MARKER_FOLDER = "hola_titan_precompile"


def plan_key(flavour: str, head_dim: int, heads: int, dtype: str, packed: bool) -> str:
    """The plan a run takes: ``hola/d128/h2/float32/plain``. ``head_dim`` is the one fla's kernels see (padded where
    the #640 workaround pads), ``heads`` the heads per rank (fla's kernels take the head count as a compile-time
    constant, and the fused convolution its width: a plan recorded at 16 heads serves a 4-head run nothing, seen on
    an H200, 2026-12-02), ``dtype`` the compute dtype (``bfloat16`` under autocast)."""
    return f"{flavour}/d{head_dim}/h{heads}/{dtype}/{'packed' if packed else 'plain'}"


def select(plans: dict[str, list[str]], key: str) -> tuple[list[str], str]:
    """The specialisations for ``key`` and where they came from: the plan itself, else the union of the plans of
    other flavours at the same head dim, heads, dtype and rows (mostly the same fla kernels), else none."""
    if key in plans:
        return list(plans[key]), f"plan {key}"
    suffix = key.split("/", 1)[1]
    others = sorted(k for k in plans if k.split("/", 1)[1] == suffix)
    if not others:
        return [], f"no plan for {key}"
    specs = list(dict.fromkeys(s for k in others for s in plans[k]))
    return specs, f"no plan for {key}; the plans of {', '.join(others)}"


# ----------------------------------------------------------------------------------------------------------------
# Recording (scripts/tune_kernels.py, on the GPU).


def sanitize(specialization_data: str) -> str | None:
    """A specialisation as a plan keeps it, or None for a kernel outside :data:`MODULE_PREFIXES`.

    Two fields are machine-specific and dropped: the options' ``extern_libs`` (the path of Triton's libdevice on
    the recording machine; Triton fills in its own, and hashes the file, not the path) and the in-process cache
    ``key`` (which repeats the options), replaced by a digest of the rest.
    """
    spec = json.loads(specialization_data)
    if not str(spec.get("name", "")).startswith(MODULE_PREFIXES):
        return None
    spec.get("options", {}).pop("extern_libs", None)
    spec.pop("key", None)
    # Triton's own field order is kept: the signature lists the kernel's arguments in order (chosen_only reads
    # constexpr arguments by position).
    body = json.dumps(spec)
    spec["key"] = "plan:" + hashlib.sha256(body.encode()).hexdigest()[:24]
    return json.dumps(spec)


def plan_difference(spec: str, plan: list[str]) -> str:
    """Why a specialisation compiled at its launch was not one of ``plan``'s (both sanitised, :func:`sanitize`):
    ``""`` when the plan holds it (its launch found the binary on disk), else the fields where it differs from the
    plan's closest specialisation of the same kernel (``kernel not in the plan`` when there is none). For the
    run's own diagnosis (``scripts/first_step.py``): a plan recorded at other shapes or settings than the run's
    (a window, a divisibility, warps) compiles at launch on the main thread."""
    if spec in plan:
        return ""
    mine = json.loads(spec)
    same = [json.loads(s) for s in plan if json.loads(s).get("name") == mine.get("name")]
    if not same:
        return "kernel not in the plan"

    def fields(data: dict) -> dict:
        names = list(data.get("signature", {}))
        out = {f"signature {k}": v for k, v in data.get("signature", {}).items()}
        out.update({f"constexpr {names[k[0]] if k and k[0] < len(names) else k}": v
                    for k, v in zip(data.get("constant_keys", []), data.get("constant_vals", []))})
        out.update({f"attrs {names[k[0]] if k and k[0] < len(names) else k}": v
                    for k, v in zip(data.get("attrs_keys", []), data.get("attrs_vals", []))})
        out.update({f"option {k}": v for k, v in data.get("options", {}).items()})
        return out

    have = fields(mine)
    diffs = []
    for other in same:
        theirs = fields(other)
        diffs.append(sorted(k for k in have.keys() | theirs.keys() if have.get(k) != theirs.get(k)))
    closest = min(diffs, key=len)
    if not closest:  # not in the plan, yet equal in every field compared: a field this reading does not know
        return "differs from the plan's outside the signature, constants, attributes and options"
    theirs = fields(same[diffs.index(closest)])
    return "; ".join(f"{k}: {json.dumps(have.get(k))} (plan: {json.dumps(theirs.get(k))})" for k in closest)


def _hooks():
    from triton import knobs
    return knobs.runtime


class Recorder:
    """Within ``with Recorder() as rec:``, every specialisation Triton compiles for a kernel under
    :data:`MODULE_PREFIXES` is kept (``rec.specs``, sanitised, in compile order, without repeats), with the seconds
    its compile took (``rec.seconds``; from Triton's hook before a compile to its hook after, in that thread).

    The plan lists its specialisations slowest first (:func:`slowest_first`): the workers take them in that order,
    so the longest compiles start at once and the plan ends soon after its slowest kernel does.
    """

    def __init__(self):
        self.specs: list[str] = []
        self.seconds: dict[str, float] = {}
        self._previous = (None, None)
        self._began = threading.local()

    def _before(self, **_) -> None:
        self._began.at = time.perf_counter()  # returns None: Triton compiles as usual

    def _hook(self, *, compile, **_):  # noqa: A002 (Triton's keyword)
        spec = sanitize(compile["specialization_data"])
        if spec is not None and spec not in self.specs:
            self.specs.append(spec)
            began = getattr(self._began, "at", None)
            self.seconds[spec] = round(time.perf_counter() - began, 3) if began is not None else 0.0
        self._began.at = None

    def __enter__(self) -> Recorder:
        runtime = _hooks()
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._hook
        return self

    def __exit__(self, *exc) -> None:
        runtime = _hooks()
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._previous

    def slowest_first(self, specs: list[str]) -> list[str]:
        """``specs`` ordered by their recorded compile seconds, longest first (ties keep their order)."""
        return sorted(specs, key=lambda spec: -self.seconds.get(spec, 0.0))


def chosen_only(specs: list[str], chosen: dict[str, list[dict]]) -> list[str]:
    """Drop the specialisations an autotuner compiled only to time them: for a kernel in ``chosen`` (its full name
    -> the configurations its autotuner settled on, as ``tuned_configs.config_to_json`` writes them), keep a
    specialisation only when its warps, stages and every configuration argument equal one chosen configuration."""
    kept = []
    for text in specs:
        spec = json.loads(text)
        configs = chosen.get(spec["name"])
        if configs is None:
            kept.append(text)
            continue
        names = _constant_names(spec)
        options = spec.get("options", {})
        for config in configs:
            if (options.get("num_warps") == config["num_warps"] and options.get("num_stages") == config["num_stages"]
                    and all(names.get(k) == v for k, v in config["kwargs"].items())):
                kept.append(text)
                break
    return kept


def _constant_names(spec: dict) -> dict:
    """The specialisation's constexpr arguments by name (their values as the kernel saw them)."""
    arg_names = list(spec["signature"])
    out = {}
    for path, value in zip(spec["constant_keys"], spec["constant_vals"]):
        if len(path) == 1 and path[0] < len(arg_names):
            out[arg_names[path[0]]] = value["constexpr"] if isinstance(value, dict) and "constexpr" in value else value
    return out


# ----------------------------------------------------------------------------------------------------------------
# Compiling (the workers).


def jit_function(name: str):
    """The ``triton.JITFunction`` named ``module.function`` (through the autotuner and heuristics that wrap it)."""
    from triton.runtime.jit import JITFunction

    module_name, _, attr = name.rpartition(".")
    obj = getattr(importlib.import_module(module_name), attr)
    for _ in range(8):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
    raise LookupError(f"{name} is not a Triton kernel")


def compile_one(spec: str) -> None:
    """Compile one specialisation, and its launcher, into Triton's on-disk cache (nothing is launched)."""
    data = json.loads(spec)
    fn = jit_function(data["name"])
    # The kernel's arguments in their order (plans recorded before order was kept list them sorted): the launcher's
    # C source follows this order, and only the same source finds the launcher the run looks for.
    data["signature"] = {name: data["signature"][name] for name in fn.arg_names if name in data["signature"]}
    kernel = fn.preload(json.dumps(data))
    # Triton builds a small C launcher per kernel signature at the kernel's first launch (a C compiler run of
    # about a second, in the launching thread); built here, the run's first launch finds it in Triton's cache.
    from triton.runtime.driver import driver
    driver.active.launcher_cls(kernel.src, kernel.metadata)


def marker_folder() -> Path:
    """Where the node's workers keep their locks and markers: inside Triton's cache folder, so clearing that cache
    clears them too."""
    from triton import knobs
    return Path(knobs.cache.dir) / MARKER_FOLDER


def digest(spec: str) -> str:
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


class SpecQueue:
    """A process's plan, handed to its worker threads one specialisation at a time in plan order (slowest first):
    every worker takes the longest compile not yet taken.

    Imports stay on the main thread. A worker that imported a module while the main thread imported another one
    of the same package could deadlock on Python's module locks; Python breaks such a cycle by raising in one of
    the two threads, and when that was the main thread's import of fla, the run fell back to the PyTorch reference
    (seen on the H200). So a worker compiles only kernels whose modules the main thread has imported: this
    project's kernel modules at :func:`start`, fla's once the run says its imports are done
    (:meth:`Precompile.imports_done`); until then it takes the next kernel whose module is ready, or waits.
    """

    def __init__(self, specs: list[str], *, ready_modules: set[str] | None = None):
        self.specs = list(specs)
        self._taken = [False] * len(self.specs)
        self._ready_modules = ready_modules  # None: every module may be imported
        self._cond = threading.Condition()
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def allow_all(self) -> None:
        with self._cond:
            self._ready_modules = None
            self._cond.notify_all()

    def take(self) -> str | None:
        with self._cond:
            while not self._stopped:
                waiting = False
                for i, spec in enumerate(self.specs):
                    if self._taken[i]:
                        continue
                    if self._ready_modules is None or module_of(spec) in self._ready_modules:
                        self._taken[i] = True
                        return spec
                    waiting = True
                if not waiting:
                    return None
                self._cond.wait()
            return None


def module_of(spec: str) -> str:
    """The module that defines a specialisation's kernel."""
    return json.loads(spec)["name"].rpartition(".")[0]


def import_modules(specs: list[str], *, prefix: str = "") -> set[str]:
    """Import (on this thread) the modules of ``specs`` that start with ``prefix``; returns those that imported. A
    module that does not import is left to the worker, which reports it as the kernel's failure."""
    done = set()
    for module in dict.fromkeys(module_of(spec) for spec in specs):
        if module.startswith(prefix):
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 (reported by the worker that compiles its kernels)
                continue
            done.add(module)
    return done


def work(queue: SpecQueue, *, folder: Path, compile_fn=compile_one) -> dict:
    """One worker: specialisations taken from ``queue`` and compiled unless their marker says a worker of this
    node already did. One that another process's worker holds is left for a second pass, which waits for that
    worker's lock (and then finds the marker)."""
    folder.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    counts = {"compiled": 0, "done_elsewhere": 0, "failed": [], "times": []}
    deferred = []

    def attempt(spec: str, *, block: bool) -> bool:
        name = digest(spec)
        marker = folder / f"{name}.done"
        if marker.exists():
            counts["done_elsewhere"] += 1
            return True
        with open(folder / f"{name}.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            try:
                if marker.exists():
                    counts["done_elsewhere"] += 1
                    return True
                began_one = time.perf_counter()
                try:
                    compile_fn(spec)
                except Exception as error:  # noqa: BLE001 (the launch compiles it; the run says which failed)
                    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
                    counts["failed"].append(f"{json.loads(spec)['name']} [{name[:8]}]: {first_line}")
                    return True
                marker.touch()
                counts["compiled"] += 1
                counts["times"].append([json.loads(spec)["name"].rsplit(".", 1)[-1], time.perf_counter() - began_one])
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return True

    while (spec := queue.take()) is not None:
        if not attempt(spec, block=False):
            deferred.append(spec)
    for spec in deferred:
        if queue.stopped:
            break
        attempt(spec, block=True)
    counts["seconds"] = time.perf_counter() - began
    return counts


# ----------------------------------------------------------------------------------------------------------------
# The run's side.


@dataclasses.dataclass
class Precompile:
    """A run's precompile: started by :func:`start`, joined by :meth:`wait`; what it did, for the log and the run
    folder."""
    source: str  # where the specialisations came from (select's description), or why nothing runs
    specs: int = 0
    workers: int = 0
    result: dict | None = None
    _threads: list = dataclasses.field(default_factory=list, repr=False)
    _counts: list = dataclasses.field(default_factory=list, repr=False)
    _started: float = 0.0
    _queue: SpecQueue | None = dataclasses.field(default=None, repr=False)
    stopped: str = ""  # why the workers were told to take nothing more (the run does not launch these kernels)

    def stop(self, why: str) -> None:
        """Take no further specialisation (those being compiled finish): the run will not launch the plan's
        kernels after all, e.g. its backend fell back to the PyTorch reference."""
        if self._queue is not None:
            self._queue.stop()
            self.stopped = why

    def imports_done(self) -> None:
        """The run has imported fla (its backend resolved, its configurations installed): import the rest of the
        plan's modules here, on the main thread, and let the workers compile every kernel (see :class:`SpecQueue`)."""
        if self._queue is not None and not self._queue.stopped:
            import_modules(self._queue.specs)
            self._queue.allow_all()

    def wait(self, timeout: float = 600.0) -> dict | None:
        """Join the workers (at most ``timeout`` seconds in all: a worker still compiling then goes on in the
        background, and a launch that needs its kernel compiles it itself)."""
        if self.result is not None or not self._threads:
            return self.result
        waited = time.perf_counter()
        for thread in self._threads:
            thread.join(max(0.0, timeout - (time.perf_counter() - waited)))
        totals = {"compiled": 0, "done_elsewhere": 0, "failed": [], "unfinished": 0, "slowest": []}
        for thread, counts in zip(self._threads, self._counts):
            if thread.is_alive() or "seconds" not in counts:
                totals["unfinished"] += 1
                continue
            totals["compiled"] += counts["compiled"]
            totals["done_elsewhere"] += counts["done_elsewhere"]
            totals["failed"].extend(f for f in counts["failed"] if f not in totals["failed"])
            totals["slowest"].extend(counts["times"])
        # The longest compiles, for the record: the plan cannot finish before its slowest kernel does.
        totals["slowest"] = [[name, round(sec, 2)] for name, sec in sorted(totals["slowest"], key=lambda t: -t[1])[:8]]
        totals["seconds"] = time.perf_counter() - self._started
        totals["waited_s"] = time.perf_counter() - waited
        self.result = totals
        self._threads = []
        return totals

    def describe(self) -> str:
        if not self.specs:
            return f"off ({self.source})"
        text = f"{self.specs} kernel specialisations from the {self.source}, {self.workers} worker threads"
        if self.result is not None:
            r = self.result
            text += (f": {r['compiled']} compiled here, the rest already compiled on this node, "
                     f"{len(r['failed'])} failed, in {r['seconds']:.1f} s (waited {r['waited_s']:.1f} s)")
            if r["unfinished"]:
                text += f"; {r['unfinished']} workers still compiling at the time limit"
        if self.stopped:
            text += f"; stopped early: {self.stopped}"
        return text

    @property
    def plan(self) -> list[str]:
        """The specialisations this precompile was given (the run's plan), none when it did not start."""
        return list(self._queue.specs) if self._queue is not None else []

    def record(self) -> dict:
        return {"source": self.source, "specs": self.specs, "workers": self.workers, "stopped": self.stopped,
                **(self.result or {})}


def auto_workers(specs: int, *, local_processes: int = 1) -> int:
    """Half the CPU cores shared among the node's processes, at most 8 per process and one per specialisation."""
    cores = os.cpu_count() or 1
    return max(1, min(8, specs, cores // (2 * max(1, local_processes))))


@contextlib.contextmanager
def stopped_on_error(job: Precompile, what: str):
    """Stop ``job``'s workers if the block raises: until :meth:`Precompile.imports_done` a worker may be waiting for
    the run's imports, and a run whose start failed (in a process that goes on, a notebook or a test) would leave it
    waiting for the life of the process."""
    try:
        yield job
    except BaseException as err:
        job.stop(f"{what} failed ({type(err).__name__})")
        raise


def start(specs: list[str], *, source: str, workers: int, compile_fn=compile_one,
          imports_done: bool = True) -> Precompile:
    """Start ``workers`` threads compiling ``specs`` (see the module docstring); returns at once.

    ``imports_done=False``: the caller is still importing (fla); the workers compile only this project's kernels
    (their modules imported here first) until it calls :meth:`Precompile.imports_done`, or :meth:`Precompile.stop`.
    """
    if not specs or workers <= 0:
        return Precompile(source=source)
    folder = marker_folder()
    if imports_done:
        import_modules(specs)
        queue = SpecQueue(specs)
    else:
        queue = SpecQueue(specs, ready_modules=import_modules(specs, prefix="hola_titan.kernels."))
    job = Precompile(source=source, specs=len(specs), workers=workers, _started=time.perf_counter(), _queue=queue)
    for i in range(workers):
        counts: dict = {}

        def run(counts=counts):
            counts.update(work(queue, folder=folder, compile_fn=compile_fn))

        thread = threading.Thread(target=run, name=f"hola-precompile-{i}", daemon=True)
        job._threads.append(thread)
        job._counts.append(counts)
        thread.start()
    return job
