"""Tuned launch configurations for fla-core's autotuned Triton kernels, shipped with the project.

fla-core picks every kernel's tile sizes, warps and stages with ``triton.autotune``: the first launch of each
kernel at each new key (head dim, heads, flags, dtypes) compiles and times every candidate configuration. On a
fresh machine that is minutes per process and head dim before the first training step (docs/LOG.md,
2026-12-02). This module removes that wait: ``scripts/tune_kernels.py`` runs the tuning once on a GPU, at the
shapes of the recipes, and writes the winning configurations to
``hola_titan/kernels/runtime/configs/<GPU>__fla-<v>__triton-<v>.json``; :func:`install` gives each of fla's autotuners a
table that answers from that file, so a launch compiles the one configuration it will run.

The same file holds the compile plans of ``hola_titan/kernels/runtime/precompile.py`` (``plans``: what a step of each
kind of run compiled), which :func:`install` hands on (``Installed.plans``).

The table is consulted where Triton's autotuner asks whether it already knows a key. The answer is one of:
- **exact**: the file holds this kernel at this key (the configuration tuned there);
- **nearest**: the file holds the kernel at a key that differs only in extents that do not change the kernel's
  code (``EXTENT_KEYS``: batch, tokens, heads), equal in every head dim, tile, flag and dtype; the closest by
  log ratio is taken;
- **tuned**: nothing applies; Triton autotunes as it would without the file, and the key is recorded.
Only configurations among the autotuner's own candidates are ever used: an entry that names one the installed fla
does not offer (another release) counts as **stale** and is tuned instead.

fla-core has a mechanism of its own (``FLA_CACHE_MODE`` / ``FLA_CONFIG_DIR``, ``fla/ops/utils/cache.py``), read
from the environment at its import and applied only to the kernels decorated with ``fla_cache_autotune``; several
kernels on the GDN path use plain ``triton.autotune`` and would still tune. The table here serves both kinds, is
chosen by an argument rather than the environment, and counts what it served, so a run can say which path ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import re
import sys
import threading
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
FORMAT = "hola_titan.tuned_configs/1"
# Key names whose values scale the launch grid but not the compiled code, so a configuration tuned at one value
# serves another: batch, tokens (``NB``: blocks of a token count in fla's l2norm) and heads. Head dims (``K``,
# ``V``, ``D``), tiles (``BT``, ``BK``, ``BV``, ``BC``), flags and dtypes must match exactly.
EXTENT_KEYS = frozenset({"B", "T", "NB", "NT", "H", "HV"})
# The choice of configurations as a script's ``--kernel-configs`` describes it (model.kernel_configs in a run).
CHOICE_HELP = ("fla's launch configurations (hola_titan/kernels/runtime/tuned_configs.py): auto (the file shipped "
               "for this GPU and these fla-core and Triton versions, when there is one: no minutes of autotuning on a "
               "fresh machine), off (autotune), or the path of a file written by scripts/tune_kernels.py")
# Modules whose autotuners the table serves and the tuning script records.
MODULE_PREFIXES = ("fla.", "hola_titan.kernels.")
# The mark on an entry served from another GPU's table of the same architecture (Served.filled counts them).
FILLED_FROM = "filled_from"
# The mark on an entry autotuned by this job or node at run time (kept in the run folder or job.cache_folder, not
# shipped): a key it serves is still the job's to share (tuned_entries(served_here=True)), since another node's
# cache may hold another choice for it.
TUNED_HERE = "tuned_here"


def sanitize_gpu_name(name: str) -> str:
    """``NVIDIA H200`` -> ``NVIDIA_H200`` (the file-name form)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def versions() -> dict[str, str | None]:
    """The versions a tuned configuration depends on (torch is recorded, not matched: the kernels are Triton's)."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    import torch
    return {"fla": version("fla-core"), "triton": version("triton"), "torch": torch.__version__,
            "cuda": torch.version.cuda}


def shipped_file(gpu_name: str, fla: str | None, triton: str | None) -> Path:
    """Where the configurations for this GPU and these versions live (the file may not exist)."""
    return CONFIG_DIR / f"{sanitize_gpu_name(gpu_name)}__fla-{fla}__triton-{triton}.json"


def sm(capability: tuple[int, int] | list[int]) -> str:
    """``(9, 0)`` -> ``sm_90``."""
    return f"sm_{capability[0]}{capability[1]}"


def nearest_shipped(gpu_name: str, capability: tuple[int, int], fla: str | None,
                    triton: str | None) -> Path | None:
    """The shipped file of another GPU of the same architecture (compute capability) and the same fla-core and
    Triton versions, or None.

    Why it serves: Triton compiles a kernel for the architecture, so a configuration tuned on an H200 is valid
    and compiles to the same code on an H100 (both sm_90); only which candidate is fastest can differ with the
    memory system, by a few percent. A table of another architecture is never taken (its tiles may not even
    fit: shared memory and the MMA instructions differ), nor one of other versions (fla's candidates change).
    Among several, the GPU whose name shares the longest prefix with this one's wins, then the name's order.
    """
    own = sanitize_gpu_name(gpu_name)
    found = []
    for path in sorted(CONFIG_DIR.glob(f"*__fla-{fla}__triton-{triton}.json")):
        if path == shipped_file(gpu_name, fla, triton):
            continue
        try:
            meta = read_file(path).get("meta", {})
        except ValueError:
            continue  # a broken shipped file is the tests' concern (test_kernel_configs), not a run's
        if list(meta.get("capability") or []) != list(capability):
            continue
        name = path.name.split("__", 1)[0]
        prefix = next((i for i, (a, b) in enumerate(zip(own, name)) if a != b), min(len(own), len(name)))
        found.append((-prefix, name, path))
    return min(found)[2] if found else None


# ----------------------------------------------------------------------------------------------------------------
# Finding the autotuners.


def _autotuner_class():
    from triton.runtime.autotuner import Autotuner
    return Autotuner


def _unwrap_autotuner(obj):
    """The ``Autotuner`` inside a kernel object (``triton.heuristics`` wraps it in fla), or None."""
    autotuner_cls = _autotuner_class()
    seen = 0
    while obj is not None and seen < 8:
        if isinstance(obj, autotuner_cls):
            return obj
        obj = getattr(obj, "fn", None)
        seen += 1
    return None


def kernel_name(autotuner) -> str:
    """``module.function`` of the Python function under the autotuner: stable across re-exports."""
    fn = autotuner.base_fn
    return f"{fn.__module__}.{fn.__qualname__}"


def find_autotuners(prefixes: tuple[str, ...] = MODULE_PREFIXES) -> dict[str, Any]:
    """Every autotuned Triton kernel defined in the imported modules under ``prefixes``, by :func:`kernel_name`."""
    found: dict[str, Any] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        for value in list(vars(module).values()):
            tuner = _unwrap_autotuner(value)
            if tuner is not None and kernel_name(tuner).startswith(prefixes):
                found.setdefault(kernel_name(tuner), tuner)
    return found


def import_fla_kernels() -> None:
    """Import fla-core (its package imports every op module, so every autotuner exists afterwards)."""
    import fla  # noqa: F401
    import fla.ops.gated_delta_rule  # noqa: F401


# ----------------------------------------------------------------------------------------------------------------
# Configurations as JSON.


def config_to_json(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def _same_config(config, spec: dict) -> bool:
    return config_to_json(config) == {**{"num_ctas": 1, "maxnreg": None}, **spec}


def key_to_json(key: tuple) -> list:
    return [k if isinstance(k, (bool, int, float, str)) or k is None else str(k) for k in key]


def _is_extent_value(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def nearest_entry(key: list, entries: list[dict], key_names: list[str]) -> dict | None:
    """The entry whose key equals ``key`` except at extent positions (``EXTENT_KEYS``), closest by log ratio."""
    best, best_distance = None, math.inf
    for entry in entries:
        other = entry["key"]
        if len(other) != len(key):
            continue
        distance = 0.0
        for i, (a, b) in enumerate(zip(key, other)):
            if a == b and type(a) is type(b):
                continue
            if i < len(key_names) and key_names[i] in EXTENT_KEYS and _is_extent_value(a) and _is_extent_value(b):
                distance += abs(math.log2(max(a, 1) / max(b, 1)))
                continue
            distance = math.inf
            break
        if distance < best_distance:
            best, best_distance = entry, distance
    return best


# ----------------------------------------------------------------------------------------------------------------
# The table each autotuner consults.


@dataclasses.dataclass
class Served:
    """What the tables answered since :func:`install` (all autotuners together)."""
    exact: int = 0
    nearest: int = 0
    stale: int = 0
    # Of exact and nearest: served by the entries of another GPU of the same architecture (FILLED_FROM), where
    # the GPU's own table lacks the kernel at that key.
    filled: int = 0
    tuned: list[str] = dataclasses.field(default_factory=list)  # "kernel key" of each launch key autotuned

    def summary(self) -> str:
        text = f"{self.exact} exact, {self.nearest} nearest"
        if self.filled:
            text += f" ({self.filled} of them from another GPU's table of the same architecture)"
        if self.stale:
            text += f", {self.stale} stale"
        if self.tuned:
            names = sorted({t.split(" ", 1)[0].rsplit(".", 1)[-1] for t in self.tuned})
            text += f"; {len(self.tuned)} key(s) autotuned at run time ({', '.join(names)})"
        else:
            text += "; nothing autotuned at run time"
        return text


class ConfigTable(dict):
    """An autotuner's ``cache`` (key -> chosen ``triton.Config``) that fills a missing key from shipped entries.

    Triton's autotuner asks ``key not in self.cache`` before tuning; answering from the file there means the
    autotuner compiles and runs only the configuration chosen, and is otherwise unchanged.
    """

    def __init__(self, autotuner, name: str, entries: list[dict], key_names: list[str], served: Served,
                 lock: threading.Lock):
        super().__init__(autotuner.cache)
        self._candidates = list(autotuner.configs)
        self._name = name
        # This GPU's own entries first; another GPU's (marked FILLED_FROM) only for a key the own ones serve neither
        # exactly nor by extent: an own configuration at another batch or head count compiles to the same code as
        # the one its compile plan lists, and was timed on this GPU.
        own = [e for e in entries if FILLED_FROM not in e]
        self._groups = [g for g in (own, [e for e in entries if FILLED_FROM in e]) if g]
        self._key_names = key_names
        self._served = served
        self._lock = lock
        self.from_file: set = set()  # keys this table answered (not tuned in this process)
        self.from_tuned_here: set = set()  # of those, the keys an entry marked TUNED_HERE answered

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        wanted = key_to_json(key)
        entry = config = None
        how, stale = "exact", False
        for group in self._groups:
            found = next((e for e in group if e["key"] == wanted and all(
                type(a) is type(b) for a, b in zip(e["key"], wanted))), None)
            how = "exact"
            if found is None:
                found, how = nearest_entry(wanted, group, self._key_names), "nearest"
            if found is None:
                continue
            config = next((c for c in self._candidates if _same_config(c, found["config"])), None)
            if config is not None:
                entry = found
                break
            stale = True  # a configuration this fla does not offer: the next group may hold one it does
        with self._lock:
            if config is None:
                if stale:
                    self._served.stale += 1
                self._served.tuned.append(f"{self._name} {wanted}")
                return False
            setattr(self._served, how, getattr(self._served, how) + 1)
            if FILLED_FROM in entry:
                self._served.filled += 1
        self[key] = config
        self.from_file.add(key)
        if TUNED_HERE in entry:
            self.from_tuned_here.add(key)
        return True

    def lead_with(self, entries: list[dict]) -> None:
        """Consult ``entries`` (another process's choices: :func:`adopt`) before every group this table holds."""
        self._groups.insert(0, entries)


@dataclasses.dataclass
class Installed:
    """The decision :func:`install` made, for the log and the run folder."""
    source: str  # "shipped", "nearest_gpu" (another GPU's shipped file, same architecture), "file" or "off"
    path: str | None
    why: str
    kernels: int = 0
    served: Served = dataclasses.field(default_factory=Served)
    # The file's compile plans (hola_titan/kernels/runtime/precompile.py): plan key -> serialised Triton
    # specialisations.
    plans: dict = dataclasses.field(default_factory=dict, repr=False)
    # The file as read, between locate() and install() (install() drops it).
    data: dict | None = dataclasses.field(default=None, repr=False)
    # Configurations autotuned by earlier processes on this node (node_tuned_file), served beside the file's.
    node_path: str | None = None
    # Another GPU's shipped file of the same architecture, serving the keys and run kinds this GPU's own lacks.
    fill_path: str | None = None
    # Configurations the job's rank 0 autotuned at an earlier start (kept in the run folder): served first.
    job_path: str | None = None

    def describe(self) -> str:
        if self.path is None:
            return f"autotuned at run time ({self.why})"
        return f"{self.source} {self.path} ({self.kernels} kernels; {self.why})"

    def record(self) -> dict:
        """For the run folder: the decision and what was served so far."""
        return {"source": self.source, "path": self.path, "why": self.why, "kernels": self.kernels,
                "fill_path": self.fill_path, "job_path": self.job_path, "node_path": self.node_path,
                "exact": self.served.exact,
                "nearest": self.served.nearest,
                "from_other_gpu": self.served.filled, "stale": self.served.stale,
                "autotuned": list(self.served.tuned)}


def read_file(path: Path) -> dict:
    """A configurations file, checked: ``ValueError`` naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"kernel configurations {path}: cannot be read ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("kernels"), dict):
        raise ValueError(f"kernel configurations {path}: not a {FORMAT} file")
    for name, kernel in data["kernels"].items():
        if not isinstance(kernel, dict) or not isinstance(kernel.get("entries"), list) or not all(
                isinstance(e, dict) and isinstance(e.get("key"), list) and isinstance(e.get("config"), dict)
                for e in kernel["entries"]):
            raise ValueError(f"kernel configurations {path}: kernel {name!r} is malformed")
    plans = data.get("plans", {})
    if not isinstance(plans, dict) or not all(isinstance(v, list) and all(isinstance(s, str) for s in v)
                                              for v in plans.values()):
        raise ValueError(f"kernel configurations {path}: its plans are malformed")
    return data


def node_tuned_file(folder: Path, gpu_name: str, fla: str | None, triton: str | None) -> Path:
    """Where a node keeps what its processes autotuned (``job.cache_folder``/``kernel_configs``): one file per GPU
    model and fla-core and Triton versions, so a table of other versions is never read."""
    return Path(folder) / "kernel_configs" / shipped_file(gpu_name, fla, triton).name


def keep_node_tuned(path: Path, kernels: dict[str, dict], *, gpu: str, versions: dict) -> int:
    """Add ``kernels`` (what :func:`tuned_entries` returns) to the node's file at ``path``: the file's entries win a
    key tuned twice; written to a temporary sibling and renamed, so a reader sees a whole file, and processes that
    write at once lose at most each other's additions, not the file. Returns the entries added."""
    before = {}
    if path.exists():
        try:
            before = read_file(path)["kernels"]
        except ValueError:
            before = {}  # a broken file is replaced by what this process tuned
    merged = merge([before, kernels])
    added = sum(len(k["entries"]) for k in merged.values()) - sum(len(k["entries"]) for k in before.values())
    if added == 0:
        return 0
    record = {"format": FORMAT, "kernels": merged,
              "meta": {"gpu": gpu, "fla": versions.get("fla"), "triton": versions.get("triton"),
                       "torch": versions.get("torch"), "source": "autotuned at run time on this node"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{threading.get_native_id()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return added


def locate(choice: str, device, *, node_cache: Path | None = None, job_cache: Path | None = None,
           plan_key: str | None = None) -> Installed:
    """Which configurations file ``choice`` names for ``device`` (read and checked), without importing fla or
    changing anything: the decision :func:`install` then applies. The file's plans are known from here on, so a
    run can start compiling them (hola_titan/kernels/runtime/precompile.py) while fla imports.

    ``choice``: ``auto`` (the shipped file for this GPU and these fla and Triton versions, when there is one),
    ``off`` (autotune as fla does), or the path of a file written by ``scripts/tune_kernels.py``.
    ``node_cache``: with ``auto``, a folder (``job.cache_folder``) whose :func:`node_tuned_file` holds what earlier
    processes on this node autotuned; its entries are served beside the shipped ones (which win a key both hold),
    or alone where nothing is shipped, so only the first process on a node pays for what no table covers.
    ``job_cache``: with ``auto``, the run folder, whose :func:`node_tuned_file` holds what the job's rank 0
    autotuned at an earlier start (:func:`adopt` gave it to every rank then): served like the node's, ahead of it, so
    a job started again on other nodes tunes nothing it tuned before and every node serves the same choices.
    ``plan_key``: with ``auto``, the run's kind (:func:`hola_titan.kernels.runtime.precompile.plan_key`). A GPU's own
    table leads, filled from another GPU's of its architecture where it lacks entries or plans, unless the other has a
    plan for this kind and the own has none: then the other's table serves the run alone, as for a GPU without a
    table, so that the configurations served are the ones its plan compiled.
    """
    import torch

    device = torch.device(device)
    if choice == "off":
        return Installed("off", None, "model.kernel_configs = off")
    if device.type != "cuda":
        return Installed("off", None, f"no tuned configurations on {device.type}")
    v = versions()
    gpu = torch.cuda.get_device_name(device)
    nearest_why = ""
    data = fill = None
    if choice == "auto":
        path, source = shipped_file(gpu, v["fla"], v["triton"]), "shipped"
        capability = tuple(torch.cuda.get_device_capability(device))
        if path.exists():
            # A GPU's own table may cover fewer recipes than another of its architecture (a tuning lease that
            # ended early): the other's entries serve what the own one lacks rather than minutes of autotuning.
            data = read_file(path)
            other_path = nearest_shipped(gpu, capability, v["fla"], v["triton"])
            if other_path is not None:
                fill = (read_file(other_path), other_path)
                if plan_key is not None and _plan_only_in(fill[0], data, plan_key):
                    nearest_why = (f"; {gpu}'s own table ({path.name}) has no compile plan for {plan_key} and this "
                                   f"one has: it serves this run alone (same architecture, {sm(capability)})")
                    (data, path), source, fill = fill, "nearest_gpu", None
        else:
            none = (f"none shipped for {gpu} ({sm(capability)}) with fla-core {v['fla']} and Triton "
                    f"{v['triton']}")
            path, source = nearest_shipped(gpu, capability, v["fla"], v["triton"]), "nearest_gpu"
            node, job = _node_tuned(node_cache, gpu, v), _node_tuned(job_cache, gpu, v)
            if path is None and node is None and job is None:
                return Installed("off", None, f"{none}, nor for another {sm(capability)} GPU; "
                                 "scripts/tune_kernels.py writes them")
            if path is None:
                # The job's table leads (every rank of the job serves the same choices), the node's fills it.
                lead_path, lead = job or node
                source = "job_tuned" if job is not None else "node_tuned"
                why = (f"{none}: autotuned at an earlier start of this job by its rank 0" if job is not None else
                       f"{none}: autotuned by earlier processes on this node")
                data, node_path = {**lead, "kernels": mark_tuned_here(lead["kernels"])}, None
                if job is not None and node is not None:
                    data = {**lead, "kernels": mark_tuned_here(merge([lead["kernels"], node[1]["kernels"]]))}
                    node_path = str(node[0])
                    why += f"; with the entries autotuned by earlier processes on this node ({node[0]})"
                return Installed(source, str(lead_path), why, kernels=len(data["kernels"]), data=data,
                                 node_path=node_path, job_path=str(job[0]) if job is not None else None)
            nearest_why = (f"; {none}: this table is another GPU's of the same architecture ({sm(capability)}), "
                           "whose configurations compile to the same code here; scripts/tune_kernels.py writes "
                           "this GPU's own")
    else:
        path, source = Path(choice).expanduser(), "file"
        if not path.exists():
            raise FileNotFoundError(f"model.kernel_configs: {path} does not exist")
    if data is None:
        data = read_file(path)
    meta = data.get("meta", {})
    why = f"tuned on {meta.get('gpu')} with fla-core {meta.get('fla')}, Triton {meta.get('triton')}{nearest_why}"
    if source == "file" and (meta.get("gpu") != gpu or meta.get("fla") != v["fla"]
                             or meta.get("triton") != v["triton"]):
        why += f"; this process: {gpu}, fla-core {v['fla']}, Triton {v['triton']}"
    node = _node_tuned(node_cache, gpu, v) if choice == "auto" else None
    job = _node_tuned(job_cache, gpu, v) if choice == "auto" else None
    tuned_here = []  # the job's rank-0 entries first: they win a key the node's processes tuned too
    for found, words in ((job, "autotuned at an earlier start of this job by its rank 0"),
                         (node, "autotuned by earlier processes on this node")):
        if found is not None:
            extra = sum(len(k["entries"]) for k in found[1]["kernels"].values())
            why += f"; with {extra} entries {words} ({found[0]})"
            tuned_here.append(found[1]["kernels"])
    data, filled_why = _compose(data, merge(tuned_here) if tuned_here else None, fill)
    why += filled_why
    fill_path = str(fill[1]) if filled_why else None
    return Installed(source, str(path), why, kernels=len(data["kernels"]), plans=data.get("plans", {}),
                     data=data, node_path=None if node is None else str(node[0]),
                     job_path=None if job is None else str(job[0]), fill_path=fill_path)


def _plan_only_in(other: dict, own: dict, plan_key: str) -> bool:
    """Whether the table ``other`` has a compile plan for the run kind ``plan_key`` (or one of another flavour at
    the same head dim, heads, dtype and rows: :func:`~hola_titan.kernels.runtime.precompile.select`) and ``own`` has
    none."""
    from hola_titan.kernels.runtime.precompile import select

    return not select(own.get("plans", {}), plan_key)[0] and bool(select(other.get("plans", {}), plan_key)[0])


def _compose(data: dict, node_kernels: dict | None, fill: tuple[dict, Path] | None) -> tuple[dict, str]:
    """A table as served: ``data`` (the lead file), then what this node autotuned (``node_kernels``: this GPU's own
    timings, they win over another GPU's), then another GPU's table of the same architecture (``fill``: the table
    and its path) where the lead lacks entries or plans (:func:`_filled`). Returns the table and the words for
    ``why`` about the fill ("" when it adds nothing)."""
    if node_kernels is not None:
        data = {**data, "kernels": merge([data["kernels"], mark_tuned_here(node_kernels)])}
    if fill is None:
        return data, ""
    return _filled(data, *fill)


def mark_tuned_here(kernels: dict[str, dict]) -> dict[str, dict]:
    """``kernels`` with every entry marked :data:`TUNED_HERE` (what a job or node autotuned, served from its file)."""
    return {name: {**kernel, "entries": [{**e, TUNED_HERE: True} for e in kernel["entries"]]}
            for name, kernel in kernels.items()}


def _filled(own: dict, other: dict, other_path: Path) -> tuple[dict, str]:
    """``own`` with ``other``'s kernels at the keys it lacks (each marked ``FILLED_FROM``) and ``other``'s plans for
    the run kinds it lacks, and the words for ``why``. A key both hold is always ``own``'s: its configuration was
    timed on this GPU (and ConfigTable serves ``other``'s entries only where ``own`` has none at the key, not even
    at another batch or head count). A run kind both have a plan for takes ``own``'s, which lists what ``own``'s
    configurations compile; one only ``other`` has keeps ``other``'s plan."""
    gpu = other.get("meta", {}).get("gpu")
    marked, added = {}, 0
    for name, kernel in other["kernels"].items():
        mine = own["kernels"].get(name)
        names = list((mine or kernel).get("key_names", []))
        # Only what the own table serves neither exactly nor by extent: the rest could never be served, and
        # would change the table's digest (and so the kept #640 verdicts) for nothing.
        entries = [{**e, FILLED_FROM: gpu} for e in kernel["entries"]
                   if mine is None or nearest_entry(e["key"], mine["entries"], names) is None]
        if entries:
            marked[name] = {**kernel, "entries": entries}
            added += len(entries)
    plans = {k: specs for k, specs in other.get("plans", {}).items() if k not in own.get("plans", {})}
    if not added and not plans:
        return own, ""
    why = (f"; {added} entries and {len(plans)} of {len(plans) + len(own.get('plans', {}))} run kinds' compile "
           f"plans it lacks from {gpu}'s table of the same architecture ({other_path.name})")
    return {**own, "kernels": merge([own["kernels"], marked]), "plans": {**plans, **own.get("plans", {})}}, why


def _node_tuned(folder: Path | None, gpu: str, v: dict) -> tuple[Path, dict] | None:
    """This node's autotuned configurations for this GPU and these versions, if any; an unreadable file counts as
    none (the next process that autotunes writes it again)."""
    if folder is None:
        return None
    path = node_tuned_file(folder, gpu, v["fla"], v["triton"])
    if not path.exists():
        return None
    try:
        return path, read_file(path)
    except ValueError:
        return None


def install(choice: str | Installed, device) -> Installed:
    """Choose the configurations for this process and give fla's autotuners tables that serve them.

    ``choice``: as :func:`locate` takes it, or what :func:`locate` returned. Idempotent for the same choice; call
    it before the first launch of an fla kernel (kernels launched earlier keep the configurations they tuned).
    """
    located = choice if isinstance(choice, Installed) else locate(choice, device)
    if located.path is None:
        return located
    path = Path(located.path)
    data = located.data
    extra = [p for p in (located.job_path, located.node_path) if p not in (None, located.path)]
    if data is None:  # an Installed passed again: the job's, node's and other GPU's entries as locate() served them
        fill = None if located.fill_path is None else Path(located.fill_path)
        tuned_here = [read_file(Path(p))["kernels"] for p in extra]
        lead = read_file(path)
        if located.source in ("job_tuned", "node_tuned"):  # the lead file is itself what the job or node tuned
            lead = {**lead, "kernels": mark_tuned_here(lead["kernels"])}
        data = _compose(lead, merge(tuned_here) if tuned_here else None,
                        None if fill is None else (read_file(fill), fill))[0]
    import_fla_kernels()
    digest = hashlib.sha256(path.read_bytes())
    for p in extra:
        digest.update(Path(p).read_bytes())
    if located.fill_path is not None:
        digest.update(Path(located.fill_path).read_bytes())
    _active.append(digest.hexdigest()[:12])
    served = _installed_served.setdefault(str(path), Served())
    lock = threading.Lock()
    for name, tuner in find_autotuners().items():
        kernel = data["kernels"].get(name)
        if kernel is None or isinstance(tuner.cache, ConfigTable):
            continue
        tuner.cache = ConfigTable(tuner, name, kernel["entries"], list(kernel.get("key_names", [])), served, lock)
    return dataclasses.replace(located, served=served, data=None)


_installed_served: dict[str, Served] = {}
_active: list[str] = []


def active_tag() -> str:
    """Which configurations this process's fla kernels take: the installed file's hash, or ``autotuned``."""
    return _active[0] if _active else "autotuned"


def uninstall() -> None:
    """Give every autotuner a plain, empty cache again (the next launch of each key autotunes)."""
    for tuner in find_autotuners().values():
        tuner.cache = {}
    _installed_served.clear()
    _active.clear()


def tuned_entries(*, served_here: bool = False) -> dict[str, dict]:
    """What this process's autotuners chose (not served from a file), as the ``kernels`` of a configurations file;
    with ``served_here``, also what a job's or node's autotuned file served (:data:`TUNED_HERE`): a job shares both,
    so that every rank and node runs one choice per key whatever its node's cache held."""
    out: dict[str, dict] = {}
    for name, tuner in sorted(find_autotuners().items()):
        cache = tuner.cache
        served_keys = cache.from_file if isinstance(cache, ConfigTable) else set()
        if served_here and isinstance(cache, ConfigTable):
            served_keys = served_keys - cache.from_tuned_here
        entries = [{"key": key_to_json(key), "config": config_to_json(config)}
                   for key, config in cache.items() if key not in served_keys]
        if entries:
            out[name] = {"key_names": list(tuner.keys), "entries": entries}
    return out


def adopt(kernels: dict[str, dict]) -> int:
    """Serve ``kernels`` (another process's :func:`tuned_entries`: in a job, rank 0's) in this process ahead of its
    own choices, so that every rank launches the same configurations: a key this process autotuned too takes the
    other's configuration from its next launch on (one more compile), a key only the other tuned is served at this
    process's first launch of it instead of being tuned. A configuration this fla does not offer is passed over.
    Returns how many of this process's keys changed configuration."""
    changed = 0
    lock = threading.Lock()
    served = _installed_served.setdefault("adopted", Served())
    for name, tuner in find_autotuners().items():
        kernel = kernels.get(name)
        if kernel is None:
            continue
        entries = [dict(e) for e in kernel["entries"]]
        if isinstance(tuner.cache, ConfigTable):
            tuner.cache.lead_with(entries)
        else:
            tuner.cache = ConfigTable(tuner, name, entries, list(kernel.get("key_names", [])), served, lock)
        theirs = {json.dumps(e["key"]): e["config"] for e in entries}
        for key, config in list(tuner.cache.items()):
            wanted = theirs.get(json.dumps(key_to_json(key)))
            if wanted is None or _same_config(config, wanted):
                continue
            candidate = next((c for c in tuner.configs if _same_config(c, wanted)), None)
            if candidate is not None:
                tuner.cache[key] = candidate
                changed += 1
    return changed


def merge(files: list[dict]) -> dict[str, dict]:
    """The ``kernels`` of several tuning runs in one (the first run's configuration wins a key tuned twice)."""
    out: dict[str, dict] = {}
    for kernels in files:
        for name, kernel in kernels.items():
            mine = out.setdefault(name, {"key_names": kernel["key_names"], "entries": []})
            known = {json.dumps(e["key"]) for e in mine["entries"]}
            mine["entries"].extend(e for e in kernel["entries"] if json.dumps(e["key"]) not in known)
    return out
