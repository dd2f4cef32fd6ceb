"""Shipped launch configurations for fla's autotuned kernels (``hola_titan/kernels/runtime/tuned_configs.py``), on the
CPU.

The tables are exercised through Triton's own ``Autotuner.run``: the kernel launch itself is replaced by a
recorder and the benchmarking by a function that fails, so a test shows which configuration a launch would run
and that nothing was timed.
"""

from __future__ import annotations

import json
import sys
import types

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from hola_titan.kernels.runtime import tuned_configs  # noqa: E402
from hola_titan.kernels.runtime.tuned_configs import ConfigTable, Served  # noqa: E402

CONFIGS = [triton.Config({"BT": bt}, num_warps=w, num_stages=s) for bt in (32, 64) for w in (2, 4) for s in (2, 3)]


def _make_kernel():
    @triton.autotune(configs=list(CONFIGS), key=["H", "K", "USE_G"])
    @triton.jit
    def toy_kernel(x, H, K: tl.constexpr, USE_G: tl.constexpr, BT: tl.constexpr):
        pass

    return toy_kernel


class FakeTensor:
    dtype = "torch.bfloat16"


class Recorder:
    """Stands in for the compiled kernel: records the meta-parameters a launch would run with."""

    def __init__(self):
        self.calls = []

    def run(self, *args, **kwargs):
        self.calls.append(kwargs)


def _entry(h, k, use_g, config):
    return {"key": [h, k, use_g, "torch.bfloat16"], "config": tuned_configs.config_to_json(config)}


def _launch(tuner, *, h, k, use_g=True):
    tuner.fn = recorder = Recorder()

    def no_bench(*a, **kw):
        raise AssertionError("the autotuner benchmarked a configuration")

    tuner._bench = no_bench
    tuner.run(FakeTensor(), h, k, use_g, grid=(1,), warmup=False)
    return recorder.calls[-1]


def _table(tuner, entries, served=None):
    import threading
    served = served or Served()
    tuner.cache = ConfigTable(tuner, "tests.toy_kernel", entries, list(tuner.keys), served, threading.Lock())
    return served


def test_an_exact_entry_runs_its_configuration_without_tuning():
    tuner = _make_kernel()
    chosen = CONFIGS[5]
    served = _table(tuner, [_entry(4, 256, True, CONFIGS[0]), _entry(4, 128, True, chosen)])
    call = _launch(tuner, h=4, k=128)
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (64, 2, 3)
    assert tuner.best_config is chosen  # one of the autotuner's own candidates, not a copy
    assert (served.exact, served.nearest, served.tuned) == (1, 0, [])
    _launch(tuner, h=4, k=128)  # a known key is not looked up again
    assert served.exact == 1


def test_heads_are_matched_to_the_nearest_tuned_value_but_head_dims_and_flags_are_not():
    tuner = _make_kernel()
    served = _table(tuner, [_entry(2, 128, True, CONFIGS[1]), _entry(16, 128, True, CONFIGS[6]),
                            _entry(8, 256, True, CONFIGS[7])])
    call = _launch(tuner, h=12, k=128)  # log2 distance: 16 is nearer than 2
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (64, 4, 2)
    assert served.nearest == 1
    with pytest.raises(AssertionError, match="benchmarked"):
        _launch(tuner, h=8, k=64)  # no entry at K = 64: Triton would tune
    assert served.tuned == ["tests.toy_kernel [8, 64, True, 'torch.bfloat16']"]
    with pytest.raises(AssertionError, match="benchmarked"):
        _launch(tuner, h=8, k=256, use_g=False)  # a flag differs
    assert len(served.tuned) == 2


def test_a_configuration_the_kernel_does_not_offer_is_stale_and_tuned():
    tuner = _make_kernel()
    foreign = triton.Config({"BT": 128}, num_warps=8, num_stages=1)
    served = _table(tuner, [_entry(4, 128, True, foreign)])
    with pytest.raises(AssertionError, match="benchmarked"):
        _launch(tuner, h=4, k=128)
    assert served.stale == 1 and len(served.tuned) == 1


def test_bools_never_match_integers():
    """``True == 1`` in Python: a flag must not take an entry recorded for an integer value."""
    entries = [{"key": [4, 1], "config": {}}]
    assert tuned_configs.nearest_entry([4, True], entries, ["H", "USE_G"]) is None


def test_tuned_entries_leave_out_what_a_table_served_and_round_trip_through_a_file(tmp_path, monkeypatch):
    tuner = _make_kernel()
    module = types.ModuleType("hola_titan.kernels._toy_for_test")
    module.toy_kernel = tuner
    tuner.base_fn.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    name = f"{module.__name__}.{tuner.base_fn.__qualname__}"
    assert tuned_configs.find_autotuners()[name] is tuner
    _table(tuner, [_entry(4, 128, True, CONFIGS[2])])
    _launch(tuner, h=4, k=128)  # served from the table
    tuner.cache[(4, 256, True, "torch.bfloat16")] = CONFIGS[3]  # as Triton stores a key it tuned itself
    kernels = tuned_configs.tuned_entries()
    assert kernels[name]["entries"] == [_entry(4, 256, True, CONFIGS[3])]
    assert kernels[name]["key_names"] == ["H", "K", "USE_G"]
    path = tmp_path / "configs.json"
    path.write_text(json.dumps({"format": tuned_configs.FORMAT, "meta": {}, "kernels": kernels}))
    assert tuned_configs.read_file(path)["kernels"] == kernels
    merged = tuned_configs.merge([kernels, {name: {"key_names": ["H", "K", "USE_G"],
                                                   "entries": [_entry(4, 256, True, CONFIGS[0]),
                                                               _entry(2, 256, True, CONFIGS[1])]}}])
    assert merged[name]["entries"] == [_entry(4, 256, True, CONFIGS[3]), _entry(2, 256, True, CONFIGS[1])]


@pytest.mark.parametrize("text, problem", [("{", "cannot be read"), ('{"format": "x", "kernels": {}}', "not a"),
                                           (json.dumps({"format": tuned_configs.FORMAT,
                                                        "kernels": {"k": {"entries": [{"key": 1}]}}}), "malformed")])
def test_a_bad_file_is_refused_naming_it(tmp_path, text, problem):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as err:
        tuned_configs.read_file(path)
    assert str(path) in str(err.value)


def test_install_off_and_on_a_cpu_tunes_as_fla_does():
    assert tuned_configs.install("off", "cpu").describe() == "autotuned at run time (model.kernel_configs = off)"
    installed = tuned_configs.install("auto", "cpu")
    assert installed.path is None and "cpu" in installed.describe()


def test_the_shipped_files_are_well_formed():
    """Every file in hola_titan/kernels/runtime/configs/ reads, names its GPU and versions, and matches its own file
    name."""
    for path in sorted(tuned_configs.CONFIG_DIR.glob("*.json")):
        data = tuned_configs.read_file(path)
        meta = data["meta"]
        assert tuned_configs.shipped_file(meta["gpu"], meta["fla"], meta["triton"]) == path
        assert data["kernels"] and all(kernel["entries"] for kernel in data["kernels"].values())


def test_every_kernel_a_shipped_table_or_plan_names_resolves():
    """Tables and compile plans name kernels by the module that defines them (``kernel_name``): a kernel renamed or
    moved would silently stop being served or precompiled. Every name in every shipped file is a Triton kernel of
    the installed fla-core or of this package, defined under that very name (a re-export under an old path would
    resolve, but the table, keyed by the defining module, would no longer serve it). A plan's specialisation names
    only arguments its kernel takes, and its key is the one ``precompile.sanitize`` gives it (names rewritten by hand
    after a move must have their keys recomputed)."""
    from hola_titan.kernels.runtime import precompile

    paths = sorted(tuned_configs.CONFIG_DIR.glob("*.json"))
    assert paths, f"no shipped tables in {tuned_configs.CONFIG_DIR}"
    for path in paths:
        data = tuned_configs.read_file(path)
        names = set(data["kernels"])  # fla's autotuned kernels
        arguments: dict[str, set[str]] = {}  # each plan kernel -> every argument a specialisation passes it
        for key, specs in data.get("plans", {}).items():
            for spec in specs:
                assert precompile.sanitize(spec) == spec, f"{path.name}: a specialisation of {key} has a stale key"
                spec = json.loads(spec)
                arguments.setdefault(spec["name"], set()).update(spec["signature"])
        names |= set(arguments)
        assert any(n.startswith("hola_titan.") for n in names) and any(n.startswith("fla.") for n in names), path.name
        for name in sorted(names):
            try:
                fn = precompile.jit_function(name)
            except (ImportError, AttributeError, LookupError) as error:
                pytest.fail(f"{path.name}: {name} does not resolve to a Triton kernel ({type(error).__name__}: "
                            f"{error})")
            assert f"{fn.fn.__module__}.{fn.fn.__qualname__}" == name, f"{path.name}: {name} is defined elsewhere"
            assert arguments.get(name, set()) <= set(fn.arg_names), f"{path.name}: {name} takes other arguments"
    # The check can fail: a module path that no longer holds the kernel.
    with pytest.raises(ModuleNotFoundError):
        precompile.jit_function("hola_titan.kernels.hola_triton_attn._cache_fwd_kernel")


def test_the_trainer_records_its_choice(tmp_path):
    from hola_titan.config import parse_config
    from hola_titan.train import Trainer

    trainer = Trainer(parse_config(["--training.steps", "1", "--training.device", "cpu", "--job.dump_folder",
                                    str(tmp_path), "--validation.enable", "false"]))
    assert trainer.paths["kernel_configs"] == "autotuned at run time (no fla kernels in this run)"
    # The kind it would hand locate() (which table leads) and the precompile (which plan): one key for both.
    assert trainer._plan_key() == "hola/d64/h2/bfloat16/packed"  # the debug model, bf16 parameters, packed rows


def test_the_fla640_verdict_is_kept_only_when_it_passed_under_this_tolerance(tmp_path):
    from hola_titan.kernels.gdn import fla_bridge

    errors = {"o": 4e-3, "dq": 5e-3, "dk": 5e-3, "dv": 4e-3, "dg": 8e-3, "dbeta": 4e-3}
    path = tmp_path / "node" / "fla640.json"
    fla_bridge.write_verdict(path, errors)
    assert fla_bridge.read_verdict(path) == errors
    record = json.loads(path.read_text())
    for changed in ({"tolerance": fla_bridge.CHECK_TOLERANCE * 2}, {"errors": {**errors, "dg": 0.5}},
                    {"errors": {k: v for k, v in errors.items() if k != "dbeta"}}):
        path.write_text(json.dumps({**record, **changed}))
        assert fla_bridge.read_verdict(path) is None
    path.write_text("{not json")
    assert fla_bridge.read_verdict(path) is None
    assert fla_bridge.read_verdict(tmp_path / "absent.json") is None


def test_first_step_reports_every_phase(tmp_path):
    """``scripts/first_step.py`` on the debug recipe (CPU): the phases add up to the first step's time."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "first.json"
    subprocess.run([sys.executable, str(root / "scripts" / "first_step.py"), "--out", str(out), "--job.config_file",
                    str(root / "train_configs" / "debug_model.toml"), "--training.device", "cpu",
                    "--job.dump_folder", str(tmp_path / "run"), "--validation.enable", "false"],
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert set(phases) == {"imports", "build", "model_args", "backend", "kernel_configs", "fla640_check",
                           "first_batch", "first_forward", "first_backward", "first_optimizer", "second_step"}
    first = sum(v for k, v in phases.items() if k != "second_step")
    assert all(v >= 0 for v in phases.values()) and abs(first - result["first_step_s"]) < 0.5
    assert result["kernel_configs"]["source"] == "off" and result["paths"]["kernel_configs"]


def _tune_kernels_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "tune_kernels.py"
    spec = importlib.util.spec_from_file_location("tune_kernels_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_kernels_counts_a_plan_child_without_a_plan_as_failed(tmp_path):
    """A plan child whose file holds no plan (or none at all) is a failed part, not a crash of the whole run (an
    H200 run of 2026-12-02 lost every plan to a KeyError when one child's file held tuning tables instead)."""
    read = _tune_kernels_script().read_child_output
    out = tmp_path / "plan_debug_hola_float32_plain.json"
    assert read("plan", out, 0) == (None, "0 without a plan")
    out.write_text(json.dumps({"kernels": {}, "seconds": {}}))
    assert read("plan", out, 0) == (None, "0 without a plan")
    assert read("plan", out, 1) == (None, 1)
    plan = {"plan": "hola/d64/float32/plain", "specs": ["{}"], "recorded": 1, "autotuned": 0}
    out.write_text(json.dumps(plan))
    assert read("plan", out, 0) == (plan, 0)
    tables = {"kernels": {"k": {}}, "seconds": {}}
    out.write_text(json.dumps(tables))
    assert read("tune", out, "timeout") == (tables, "timeout")  # a stopped tuning child keeps what it tuned


def test_tune_kernels_keeps_the_file_notes_when_it_merges():
    """A merged file keeps the notes written into its meta (a re-recording dropped them on 2026-12-03)."""
    meta = _tune_kernels_script().file_meta({"notes": ["plans migrated by hand"], "runs": [{"date": "d"}]},
                                           gpu="G", capability=(9, 0), versions={"torch": "t"},
                                           runs=[{"date": "d"}, {"date": "e"}])
    assert meta == {"gpu": "G", "capability": [9, 0], "torch": "t", "runs": [{"date": "d"}, {"date": "e"}],
                    "notes": ["plans migrated by hand"]}
    assert "notes" not in _tune_kernels_script().file_meta({}, gpu="G", capability=[8, 0], versions={}, runs=[])


def _fake_gpu(monkeypatch, tmp_path, *, name: str, capability: tuple[int, int], files: dict[str, dict]):
    """A CUDA device of this name and capability, with ``files`` (file name -> meta) as the shipped tables."""
    import torch

    folder = tmp_path / "configs"
    folder.mkdir()
    for file_name, meta in files.items():
        data = {"format": tuned_configs.FORMAT, "meta": meta,
                "kernels": {"k": {"entries": [{"key": [1], "config": {}}], "key_names": ["B"]}}}
        (folder / file_name).write_text(json.dumps(data))
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", folder)
    monkeypatch.setattr(tuned_configs, "versions",
                        lambda: {"fla": "0.6.0", "triton": "3.6.0", "torch": "t", "cuda": "c"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


H200_META = {"gpu": "NVIDIA H200", "capability": [9, 0], "fla": "0.6.0", "triton": "3.6.0"}


def test_a_gpu_without_a_table_takes_one_of_its_architecture_and_says_so(tmp_path, monkeypatch, capsys):
    files = {"NVIDIA_H200__fla-0.6.0__triton-3.6.0.json": H200_META,
             # Another architecture and other versions are never taken, though their names are closer.
             "NVIDIA_H100_PCIe__fla-0.6.0__triton-3.6.0.json": {**H200_META, "gpu": "NVIDIA H100 PCIe",
                                                               "capability": [8, 0]},
             "NVIDIA_H100_80GB_HBM3__fla-0.5.0__triton-3.6.0.json": {**H200_META, "gpu": "NVIDIA H100 80GB HBM3",
                                                                     "fla": "0.5.0"}}
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA H100 80GB HBM3", capability=(9, 0), files=files)
    located = tuned_configs.locate("auto", "cuda")
    assert located.source == "nearest_gpu" and located.path.endswith("NVIDIA_H200__fla-0.6.0__triton-3.6.0.json")
    assert "none shipped for NVIDIA H100 80GB HBM3 (sm_90)" in located.why
    assert "same architecture (sm_90)" in located.describe() and located.kernels == 1
    assert _tune_kernels_script().check(__import__("torch"), tuned_configs) == 1
    assert "not current" in capsys.readouterr().out


def test_the_nearest_table_prefers_the_closest_name_and_a_gpu_s_own_wins(tmp_path, monkeypatch, capsys):
    files = {"NVIDIA_H200__fla-0.6.0__triton-3.6.0.json": H200_META,
             "NVIDIA_H100_SXM__fla-0.6.0__triton-3.6.0.json": {**H200_META, "gpu": "NVIDIA H100 SXM"},
             "NVIDIA_H800__fla-0.6.0__triton-3.6.0.json": {**H200_META, "gpu": "NVIDIA H800"}}
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA H100 80GB HBM3", capability=(9, 0), files=files)
    assert tuned_configs.locate("auto", "cuda").path.endswith("NVIDIA_H100_SXM__fla-0.6.0__triton-3.6.0.json")
    (tmp_path / "configs" / "NVIDIA_H100_80GB_HBM3__fla-0.6.0__triton-3.6.0.json").write_text(
        (tmp_path / "configs" / "NVIDIA_H200__fla-0.6.0__triton-3.6.0.json").read_text())
    assert tuned_configs.locate("auto", "cuda").source == "shipped"
    assert _tune_kernels_script().check(__import__("torch"), tuned_configs) == 0
    assert capsys.readouterr().out.startswith("current: NVIDIA H100 80GB HBM3 takes its own table")


def test_a_gpu_of_another_architecture_autotunes_and_says_why(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA A100-SXM4-80GB", capability=(8, 0),
              files={"NVIDIA_H200__fla-0.6.0__triton-3.6.0.json": H200_META})
    located = tuned_configs.locate("auto", "cuda")
    assert located.path is None and "nor for another sm_80 GPU" in located.describe()


def test_the_shipped_files_name_their_architecture():
    """nearest_shipped matches on it: a shipped file without it would serve no other GPU."""
    for path in sorted(tuned_configs.CONFIG_DIR.glob("*.json")):
        capability = tuned_configs.read_file(path)["meta"].get("capability")
        assert isinstance(capability, list) and len(capability) == 2, path.name


@pytest.mark.parametrize("flavour,packed", [("hola", True), ("hola", False), ("gdn", True)])
def test_tune_kernels_shard_calls_continue_with_gradients(flavour, packed):
    """The tuning run's context-parallel calls (an incoming state and cache with their gradients, with and without a
    final state; a fresh call passing its final state on) run with the model's shapes, the packed ones over their
    documents, and give the incoming state (or q) a gradient (here on the reference path; on a GPU they reach fla's
    state kernels with the initial-state and final-state arguments)."""
    from types import SimpleNamespace

    import torch

    from hola_titan.models.args import model_args

    trainer = SimpleNamespace(model_args=model_args(flavour, "debug", vocab_size=256), device=torch.device("cpu"))
    ran = _tune_kernels_script()._shard_calls(trainer, "float32", packed=packed)
    assert len(ran) == (6 if packed else 3), ran
    assert sum("incoming state" in line for line in ran) == (4 if packed else 2)
    assert sum("fresh, final state out" in line for line in ran) == (2 if packed else 1)
    assert any("3 packed documents" in line for line in ran) == packed


def _kernels(name: str, *keys: int) -> dict:
    return {name: {"key_names": ["B"], "entries": [{"key": [k], "config": {"num_warps": k}} for k in keys]}}


def test_what_a_node_autotuned_is_kept_merged_and_served_to_its_next_processes(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA B200", capability=(10, 0),
              files={"NVIDIA_H200__fla-0.6.0__triton-3.6.0.json": H200_META})
    node = tmp_path / "node"
    assert tuned_configs.locate("auto", "cuda", node_cache=node).path is None  # nothing shipped, nothing kept yet
    path = tuned_configs.node_tuned_file(node, "NVIDIA B200", "0.6.0", "3.6.0")
    v = tuned_configs.versions()
    assert tuned_configs.keep_node_tuned(path, _kernels("k", 1, 2), gpu="NVIDIA B200", versions=v) == 2
    # A second process tuned key 2 again (another choice: the kept one wins) and key 3 anew.
    assert tuned_configs.keep_node_tuned(path, {**_kernels("k", 2, 3), **_kernels("j", 5)}, gpu="NVIDIA B200",
                                         versions=v) == 2
    kept = tuned_configs.read_file(path)["kernels"]
    assert [e["key"] for e in kept["k"]["entries"]] == [[1], [2], [3]] and kept["j"]["entries"][0]["key"] == [5]
    assert tuned_configs.keep_node_tuned(path, _kernels("k", 1), gpu="NVIDIA B200", versions=v) == 0
    located = tuned_configs.locate("auto", "cuda", node_cache=node)
    assert located.source == "node_tuned" and located.path == str(path) and located.kernels == 2
    assert "autotuned by earlier processes on this node" in located.describe()
    # Another fla-core version reads another file: this one is never served to it.
    monkeypatch.setattr(tuned_configs, "versions", lambda: {"fla": "0.7.0", "triton": "3.6.0"})
    assert tuned_configs.locate("auto", "cuda", node_cache=node).path is None


def test_a_node_s_entries_are_served_beside_a_shipped_table_which_wins_a_key_both_hold(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA H100 80GB HBM3", capability=(9, 0),
              files={"NVIDIA_H200__fla-0.6.0__triton-3.6.0.json": H200_META})
    node = tmp_path / "node"
    path = tuned_configs.node_tuned_file(node, "NVIDIA H100 80GB HBM3", "0.6.0", "3.6.0")
    tuned_configs.keep_node_tuned(path, {**_kernels("k", 1, 7), **_kernels("j", 5)}, gpu="g",
                                  versions=tuned_configs.versions())
    located = tuned_configs.locate("auto", "cuda", node_cache=node)
    assert located.source == "nearest_gpu" and located.node_path == str(path)
    kernels = located.data["kernels"]
    assert set(kernels) == {"k", "j"}
    assert [e["config"] for e in kernels["k"]["entries"]] == [{}, {"num_warps": 7}]  # the shipped key 1 wins
    assert "3 entries autotuned by earlier processes on this node" in located.why
    assert tuned_configs.locate("auto", "cuda").node_path is None  # no node cache named: the shipped table alone


def _by_head_dim(name: str, *dims: int) -> dict:
    """A kernel keyed by head dim alone (no extent: an entry serves only its own value)."""
    return {name: {"key_names": ["K"], "entries": [{"key": [d], "config": {"num_warps": d}} for d in dims]}}


def test_a_gpu_s_own_table_takes_what_it_lacks_from_one_of_its_architecture(tmp_path, monkeypatch, capsys):
    """An own table tuned for fewer recipes (the H100's first lease tuned the 340M packed kinds only) must not send
    the other recipes back to minutes of autotuning: another sm_90 table serves the keys and run kinds it lacks,
    and the own table wins every key and run kind both hold."""
    own_name, other_name = ("NVIDIA_H100_80GB_HBM3__fla-0.6.0__triton-3.6.0.json",
                            "NVIDIA_H200__fla-0.6.0__triton-3.6.0.json")
    own_meta = {**H200_META, "gpu": "NVIDIA H100 80GB HBM3"}
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA H100 80GB HBM3", capability=(9, 0),
              files={other_name: H200_META, own_name: own_meta})
    folder = tmp_path / "configs"

    def write(name, meta, kernels, plans):
        (folder / name).write_text(json.dumps({"format": tuned_configs.FORMAT, "meta": meta, "kernels": kernels,
                                               "plans": plans}))

    write(own_name, own_meta, {**_by_head_dim("k", 256), **_kernels("c", 8)}, {"hola/d256/h4/bf16/packed": ["own"]})
    # Key 8 of c serves 2 by extent (B): the other GPU's entry there could never be served and is left out.
    write(other_name, H200_META, {**_by_head_dim("k", 256, 128), **_kernels("j", 5), **_kernels("c", 2)},
          {"hola/d256/h4/bf16/packed": ["h200"], "gdn/d128/h2/float32/plain": ["h200"]})
    located = tuned_configs.locate("auto", "cuda")
    assert located.source == "shipped" and located.path.endswith(own_name)
    assert located.fill_path.endswith(other_name) and located.kernels == 3
    k = located.data["kernels"]["k"]["entries"]
    assert [(e["key"], tuned_configs.FILLED_FROM in e) for e in k] == [([256], False), ([128], True)]
    assert located.data["kernels"]["j"]["entries"][0][tuned_configs.FILLED_FROM] == "NVIDIA H200"
    assert [e["key"] for e in located.data["kernels"]["c"]["entries"]] == [[8]]
    assert located.plans == {"hola/d256/h4/bf16/packed": ["own"], "gdn/d128/h2/float32/plain": ["h200"]}
    assert "2 entries and 1 of 2 run kinds' compile plans it lacks from NVIDIA H200's table" in located.why
    assert located.record()["fill_path"] == located.fill_path
    assert _tune_kernels_script().check(__import__("torch"), tuned_configs) == 0
    assert "it lacks from NVIDIA H200's table" in capsys.readouterr().out
    # A run kind only the other table has a plan for: that table serves the run alone, so that what is served is
    # what its plan compiled; a kind the own table plans keeps the own table.
    located = tuned_configs.locate("auto", "cuda", plan_key="gdn/d128/h2/float32/plain")
    assert located.source == "nearest_gpu" and located.path.endswith(other_name) and located.fill_path is None
    assert "has no compile plan for gdn/d128/h2/float32/plain" in located.why
    assert tuned_configs.locate("auto", "cuda", plan_key="hola/d256/h4/bf16/packed").path.endswith(own_name)
    # What this node autotuned is this GPU's timing: it wins a key the other GPU's table holds too.
    node = tmp_path / "node"
    path = tuned_configs.node_tuned_file(node, "NVIDIA H100 80GB HBM3", "0.6.0", "3.6.0")
    tuned_configs.keep_node_tuned(path, _by_head_dim("k", 128), gpu="g", versions=tuned_configs.versions())
    k = tuned_configs.locate("auto", "cuda", node_cache=node).data["kernels"]["k"]["entries"]
    assert [(e["key"], tuned_configs.FILLED_FROM in e) for e in k] == [([256], False), ([128], False)]
    # Another architecture's table never fills.
    (folder / other_name).unlink()
    write("NVIDIA_A100__fla-0.6.0__triton-3.6.0.json", {**H200_META, "gpu": "NVIDIA A100", "capability": [8, 0]},
          _kernels("j", 5), {})
    located = tuned_configs.locate("auto", "cuda")
    assert located.fill_path is None and set(located.data["kernels"]) == {"k", "c"}


def test_a_table_that_already_serves_everything_is_not_filled(tmp_path, monkeypatch):
    """The H200's table serves every key of the H100's by extent and plans every kind it does: nothing to add, so
    no fill and no change to the table's digest (which names the kept #640 verdicts)."""
    own_name, other_name = ("NVIDIA_H200__fla-0.6.0__triton-3.6.0.json",
                            "NVIDIA_H100_80GB_HBM3__fla-0.6.0__triton-3.6.0.json")
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA H200", capability=(9, 0), files={own_name: H200_META})
    (tmp_path / "configs" / other_name).write_text(json.dumps({
        "format": tuned_configs.FORMAT, "meta": {**H200_META, "gpu": "NVIDIA H100 80GB HBM3"},
        "kernels": _kernels("k", 4, 16), "plans": {}}))
    located = tuned_configs.locate("auto", "cuda")
    assert located.source == "shipped" and located.fill_path is None and "lacks" not in located.why


def test_a_launch_served_by_another_gpu_s_entry_is_counted_as_such():
    tuner = _make_kernel()
    filled = {**_entry(4, 128, True, CONFIGS[3]), tuned_configs.FILLED_FROM: "NVIDIA H200"}
    served = _table(tuner, [_entry(4, 256, True, CONFIGS[0]), filled])
    _launch(tuner, h=4, k=256)
    assert (served.exact, served.filled) == (1, 0)
    call = _launch(tuner, h=8, k=128)  # nearest by heads, from the other GPU's entry
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (32, 4, 3)
    assert (served.nearest, served.filled) == (1, 1)
    assert "1 of them from another GPU's table" in served.summary()
    # An own entry at another head count wins over the other GPU's exact one: it is what the own plan compiled.
    tuner = _make_kernel()
    served = _table(tuner, [_entry(2, 64, True, CONFIGS[6]),
                            {**_entry(8, 64, True, CONFIGS[1]), tuned_configs.FILLED_FROM: "NVIDIA H200"}])
    call = _launch(tuner, h=8, k=64)
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (64, 4, 2)
    assert (served.nearest, served.filled) == (1, 0)
    # An own entry naming a configuration this fla does not offer falls back to the other GPU's entry.
    tuner = _make_kernel()
    foreign = triton.Config({"BT": 128}, num_warps=8, num_stages=1)
    served = _table(tuner, [_entry(4, 128, True, foreign),
                            {**_entry(4, 128, True, CONFIGS[2]), tuned_configs.FILLED_FROM: "NVIDIA H200"}])
    call = _launch(tuner, h=4, k=128)
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (32, 4, 2)
    assert (served.exact, served.filled, served.stale, served.tuned) == (1, 1, 0, [])


def _toy_module(monkeypatch):
    """A toy autotuned kernel that :func:`tuned_configs.find_autotuners` finds, and its full name."""
    tuner = _make_kernel()
    module = types.ModuleType("hola_titan.kernels._toy_for_adopt")
    module.toy_kernel = tuner
    tuner.base_fn.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return tuner, f"{module.__name__}.{tuner.base_fn.__qualname__}"


def _theirs(name, *entries):
    return {name: {"key_names": ["H", "K", "USE_G"], "entries": list(entries)}}


def test_adopt_serves_another_process_s_choices_ahead_of_this_one_s(monkeypatch):
    """A job's ranks launch one set of configurations: a key this process tuned takes the other's choice, a key only
    the other tuned is served without tuning, a configuration this fla does not offer is passed over."""
    tuner, name = _toy_module(monkeypatch)
    tuner.cache = {(4, 128, True, "torch.bfloat16"): CONFIGS[0], (8, 128, True, "torch.bfloat16"): CONFIGS[1]}
    foreign = triton.Config({"BT": 128}, num_warps=8, num_stages=1)
    changed = tuned_configs.adopt(_theirs(name, _entry(4, 128, True, CONFIGS[5]), _entry(2, 64, False, CONFIGS[6]),
                                          _entry(8, 128, True, foreign)))
    assert changed == 1
    call = _launch(tuner, h=4, k=128)
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (64, 2, 3)  # CONFIGS[5], not its own CONFIGS[0]
    call = _launch(tuner, h=2, k=64, use_g=False)  # never tuned here: served, not benchmarked
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (64, 4, 2)
    call = _launch(tuner, h=8, k=128)  # the other's configuration is not on offer: its own stays
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (32, 2, 3)
    assert tuned_configs.adopt(_theirs(name, _entry(4, 128, True, CONFIGS[5]))) == 0  # already the same


def test_adopt_leads_a_table_already_installed(monkeypatch):
    """On a GPU with a shipped table, the other rank's entries come before the table's at a key it autotuned."""
    tuner, name = _toy_module(monkeypatch)
    _table(tuner, [_entry(4, 128, True, CONFIGS[2])])
    tuned_configs.adopt(_theirs(name, _entry(4, 128, True, CONFIGS[7]), _entry(4, 256, True, CONFIGS[3])))
    call = _launch(tuner, h=4, k=256)
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (32, 4, 3)  # CONFIGS[3]
    call = _launch(tuner, h=4, k=128)
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (64, 4, 3)  # CONFIGS[7]


def test_every_rank_takes_the_lowest_rank_s_choice_and_keeps_keys_only_others_tuned(monkeypatch):
    """share_autotuned: rank 1's view of a two-rank job (``gather`` stands in for all_gather_object)."""
    from hola_titan.train import share_autotuned

    tuner, name = _toy_module(monkeypatch)
    tuner.cache = {(4, 128, True, "torch.bfloat16"): CONFIGS[0], (16, 128, True, "torch.bfloat16"): CONFIGS[4]}
    mine = tuned_configs.tuned_entries()
    rank0 = _theirs(name, _entry(4, 128, True, CONFIGS[5]))
    merged = share_autotuned(mine, distributed=True, gather=lambda value: [rank0, value])
    assert merged[name]["entries"] == [_entry(4, 128, True, CONFIGS[5]), _entry(16, 128, True, CONFIGS[4])]
    call = _launch(tuner, h=4, k=128)
    assert (call["BT"], call["num_warps"], call["num_stages"]) == (64, 2, 3)
    assert share_autotuned(mine, distributed=False) is mine  # one process: nothing to share


def test_a_job_s_table_is_kept_in_its_run_folder_and_leads_at_its_next_start(tmp_path, monkeypatch):
    """What a job autotuned at its first start is kept in the run folder (rank 0) and the node's cache (each node's
    first local rank); at the job's next start on another node (an empty node cache) it is served first, and where a
    node's own processes tuned the same key, the job's choice wins."""
    from types import SimpleNamespace

    import torch

    from hola_titan.train import Trainer

    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA B200", capability=(10, 0), files={})
    monkeypatch.setattr(tuned_configs, "tuned_entries", lambda served_here=False: _kernels("k", 1, 2))
    dump, node = tmp_path / "run", tmp_path / "node"
    config = SimpleNamespace(model=SimpleNamespace(kernel_configs="auto", attention_backend="auto"),
                             job=SimpleNamespace(cache_folder=str(node)), data=SimpleNamespace(token_cache=True))
    trainer = SimpleNamespace(config=config, device=torch.device("cuda", 0), attention_backend="triton",
                              model_args=SimpleNamespace(is_recurrent=True), world_size=1, rank=0, dump=dump,
                              _control_group=None)
    Trainer._keep_autotuned(trainer)
    job_file = tuned_configs.node_tuned_file(dump, "NVIDIA B200", "0.6.0", "3.6.0")
    node_file = tuned_configs.node_tuned_file(node, "NVIDIA B200", "0.6.0", "3.6.0")
    assert tuned_configs.read_file(job_file)["kernels"] == tuned_configs.read_file(node_file)["kernels"]
    # A rank that is neither rank 0 nor a node's first local rank writes nothing, but it takes part in the gather,
    # even where its kernels fell back to the reference (every rank must reach the collective, or the others wait).
    import hola_titan.train as train_module

    calls = []
    monkeypatch.setattr(train_module, "share_autotuned",
                        lambda kernels, **kw: calls.append((kernels, kw["distributed"])) or _kernels("k", 1))
    other = tmp_path / "other_run"
    for backend in ("triton", "reference"):
        Trainer._keep_autotuned(SimpleNamespace(**{**vars(trainer), "rank": 3, "world_size": 2, "dump": other,
                                                   "device": torch.device("cuda", 1), "attention_backend": backend}))
    assert not other.exists()
    assert calls == [(_kernels("k", 1, 2), True), ({}, True)]
    # The next start on a node whose own processes tuned key 1 otherwise (and key 5).
    elsewhere = tmp_path / "elsewhere"
    tuned_configs.keep_node_tuned(tuned_configs.node_tuned_file(elsewhere, "NVIDIA B200", "0.6.0", "3.6.0"),
                                  {"k": {"key_names": ["B"], "entries": [{"key": [1], "config": {"num_warps": 9}},
                                                                         {"key": [5], "config": {"num_warps": 5}}]}},
                                  gpu="g", versions=tuned_configs.versions())
    located = tuned_configs.locate("auto", "cuda", node_cache=elsewhere, job_cache=dump)
    assert located.source == "job_tuned" and located.path == str(job_file) and located.job_path == str(job_file)
    assert "earlier start of this job by its rank 0" in located.describe()
    entries = {e["key"][0]: e["config"] for e in located.data["kernels"]["k"]["entries"]}
    assert entries == {1: {"num_warps": 1}, 2: {"num_warps": 2}, 5: {"num_warps": 5}}
    assert tuned_configs.locate("auto", "cuda", job_cache=dump).kernels == 1
    monkeypatch.setattr(tuned_configs, "versions", lambda: {"fla": "0.7.0", "triton": "3.6.0"})
    assert tuned_configs.locate("auto", "cuda", job_cache=dump).path is None  # another fla: never this file


def test_a_job_s_entries_are_served_beside_a_shipped_table_and_again_by_install(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, tmp_path, name="NVIDIA H100 80GB HBM3", capability=(9, 0),
              files={"NVIDIA_H200__fla-0.6.0__triton-3.6.0.json": H200_META})
    job, node = tmp_path / "run", tmp_path / "node"
    v = tuned_configs.versions()
    tuned_configs.keep_node_tuned(tuned_configs.node_tuned_file(job, "NVIDIA H100 80GB HBM3", "0.6.0", "3.6.0"),
                                  _kernels("k", 1, 7), gpu="g", versions=v)
    tuned_configs.keep_node_tuned(tuned_configs.node_tuned_file(node, "NVIDIA H100 80GB HBM3", "0.6.0", "3.6.0"),
                                  {"k": {"key_names": ["B"], "entries": [{"key": [7], "config": {"num_warps": 3}},
                                                                         {"key": [8], "config": {"num_warps": 8}}]}},
                                  gpu="g", versions=v)
    located = tuned_configs.locate("auto", "cuda", node_cache=node, job_cache=job)
    assert located.source == "nearest_gpu" and located.job_path and located.node_path
    entries = {e["key"][0]: e["config"] for e in located.data["kernels"]["k"]["entries"]}
    assert entries == {1: {}, 7: {"num_warps": 7}, 8: {"num_warps": 8}}  # shipped, then the job's, then the node's
    assert "earlier start of this job by its rank 0" in located.why and "on this node" in located.why
    assert located.record()["job_path"] == located.job_path
    # install() given the decision again (its data dropped, as a second install of the same run does) recomposes it:
    # the shipped table's entry, then the job's, then the node's, and the digest covers the job's file.
    import dataclasses

    tuner = _make_kernel()
    monkeypatch.setattr(tuned_configs, "find_autotuners", lambda prefixes=None: {"k": tuner})
    monkeypatch.setattr(tuned_configs, "import_fla_kernels", lambda: None)
    try:
        tuned_configs.install(dataclasses.replace(located, data=None), "cuda")
        assert isinstance(tuner.cache, ConfigTable)
        served = {e["key"][0]: e["config"] for group in tuner.cache._groups for e in group}
        assert served == entries
        tag = tuned_configs.active_tag()
    finally:
        tuned_configs.uninstall()
    tuned_configs.keep_node_tuned(tuned_configs.node_tuned_file(job, "NVIDIA H100 80GB HBM3", "0.6.0", "3.6.0"),
                                  _kernels("k", 9), gpu="g", versions=v)
    try:
        tuned_configs.install(dataclasses.replace(located, data=None), "cuda")
        assert tuned_configs.active_tag() != tag
    finally:
        tuned_configs.uninstall()


def test_a_key_a_job_or_node_file_served_is_the_job_s_to_share(monkeypatch):
    """Another node's cache may hold another choice for a key this node served from its own file: the job shares
    what such files served (tuned_entries(served_here=True)), never what the shipped table served."""
    tuner, name = _toy_module(monkeypatch)
    node_entry = {**_entry(4, 256, True, CONFIGS[3]), tuned_configs.TUNED_HERE: True}
    _table(tuner, [_entry(4, 128, True, CONFIGS[2]), node_entry])
    _launch(tuner, h=4, k=128)
    _launch(tuner, h=4, k=256)
    assert tuned_configs.tuned_entries() == {}
    assert tuned_configs.tuned_entries(served_here=True) == _theirs(name, _entry(4, 256, True, CONFIGS[3]))
    # What locate serves from a job's or node's file carries the mark.
    marked = tuned_configs.mark_tuned_here(_kernels("k", 1))
    assert marked["k"]["entries"][0][tuned_configs.TUNED_HERE] is True


def test_tune_kernels_records_the_selection_launches_of_each_recipe_of_a_combination():
    """The plan phase also launches the selection kernels at the window and block of every recipe whose runs take
    its plan (its steps run at the size's defaults): MQAR's window 16 beside the debug model's 8; on the small size's
    plan the 46M recipe's and the small configs' block 256 beside the small screens' pinned 64."""
    recipes = _tune_kernels_script().recipe_selections(lambda d: max(d, 128))  # Hopper: fla's #640 pads below 128
    assert recipes["hola/d128/h2/float32/plain"] == [(16, 32)]  # mqar_hola.toml
    assert recipes["hola/d128/h2/float32/packed"] == [(8, 32)]  # debug_model.toml
    assert recipes["hola/d256/h2/bfloat16/packed"] == [(64, 256), (64, 64)]  # hola_46M and small_hola_text; screens
    assert recipes["hola/d256/h4/bfloat16/packed"] == [(64, 256)]  # hola_340M
    assert not any(key.startswith(("gdn/", "hola_recency/")) for key in recipes)  # no score selection there
    unpadded = _tune_kernels_script().recipe_selections(lambda d: d)  # an A100: no padding
    assert unpadded["hola/d64/h2/float32/plain"] == [(16, 32)]


def test_the_pinned_recipes_are_the_scripts_pins():
    """tune_kernels.PINNED_RECIPES holds what ablate_small.py's recipes and replicate_small.py's text runs add to a
    config, so the plans record the launches those runs make."""
    from pathlib import Path

    from helpers import load_script

    pinned = {(name, tuple(keys)) for name, keys in _tune_kernels_script().PINNED_RECIPES}
    ablate, replicate = load_script("ablate_small"), load_script("replicate_small")
    wanted = {(Path(r.config.format(flavour="hola")).name, tuple(r.base)) for r in ablate.RECIPES.values() if r.base}
    wanted.add((Path(replicate.TASKS["text"].config.format(flavour="hola")).name, tuple(replicate.TEXT_PIN)))
    assert pinned == wanted



def test_first_step_keeps_each_main_thread_compile_s_specialisation_for_the_plan_check():
    """``first_step.watch_compiles``: a compile on the main thread is recorded with its sanitised specialisation (the
    plan check's input), one on another thread is not recorded; Triton's hooks are the script's afterwards."""
    import importlib.util
    import threading
    from pathlib import Path

    pytest.importorskip("triton")
    from triton import knobs

    from hola_titan.kernels.runtime import precompile

    path = Path(__file__).resolve().parents[1] / "scripts" / "first_step.py"
    spec = importlib.util.spec_from_file_location("first_step_under_test", path)
    first_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(first_step)
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    try:
        compiles = first_step.watch_compiles(["first_forward"])
        data = json.dumps({"name": "fla.ops.k", "signature": {"x": "*fp32"}, "constant_keys": [], "constant_vals": [],
                           "attrs_keys": [[0]], "attrs_vals": [[["tt.divisibility", 16]]],
                           "options": {"num_warps": 4}, "key": "k"})
        fn = types.SimpleNamespace(module="fla.ops", name="k")

        def launch():
            knobs.runtime.jit_cache_hook(key="k1")
            knobs.runtime.jit_post_compile_hook(key="k1", fn=fn, compile={"specialization_data": data})

        launch()
        worker = threading.Thread(target=launch)
        worker.start()
        worker.join()
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
    assert len(compiles) == 1 and compiles[0]["phase"] == "first_forward"
    assert compiles[0]["spec"] == precompile.sanitize(data)
    assert precompile.plan_difference(compiles[0]["spec"], [compiles[0]["spec"]]) == ""
