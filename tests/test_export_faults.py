"""Exports and imports under faults: each test first makes the fault (a folder in the way, a flipped bit, a truncated
file, a full disk, a file-size limit), then checks the one-line refusal and that nothing already on disk was lost.

The full disk is a safetensors or DCP write raising what it raises on ENOSPC (the test cannot fill a disk); the
file-size limit is real: ``RLIMIT_FSIZE`` in a subprocess that ignores ``SIGXFSZ``, as a shell's ``ulimit -f`` does.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hola_titan.hf_model  # noqa: F401  (registers the transformers classes)
from hola_titan.checkpoint import CheckpointCorruptError, MANIFEST, read_metadata, step_folder, verify_manifest
from hola_titan.config import parse_config
from hola_titan.eval.cli import main as eval_main
from hola_titan.export import (MANIFEST_FILE, SAFETENSORS_FILE, ExportCorruptError, load_pretrained, save_pretrained,
                               verify_export)
from hola_titan.models.args import model_args, replace
from hola_titan.models.model import build_model
from hola_titan.staging import FolderWriteError
from hola_titan.train import Trainer

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
FAST = ["--job.config_file", DEBUG, "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--validation.enable", "false", "--metrics.enable_tensorboard", "false"]
EVAL = ["--device", "cpu", "--threads", "1", "--no-progress"]

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.xdist_group("test_export_faults")]


def _tiny(seed: int = 0):
    args = replace(model_args("gdn", "debug", vocab_size=97), dim=32, head_dim=16, mlp_hidden=64, n_layers=2)
    torch.manual_seed(seed)
    return build_model(args, device="cpu").eval()


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes: equal snapshots mean nothing was touched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    """Hidden staging folders a failed write would leave beside its destination."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and ".partial-" in p.name
                  or ".old-" in p.name)


def _one_error(text: str, *needles: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder of the debug model with a verified checkpoint at step 1 (and its config.toml, metrics)."""
    dump = tmp_path_factory.mktemp("faults") / "run"
    Trainer(parse_config([*FAST, "--job.dump_folder", str(dump), "--training.steps", "1", "--checkpoint.enable",
                          "--checkpoint.interval", "1"])).train()
    assert verify_manifest(step_folder(dump / "checkpoint", 1)) is not None
    return dump


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return save_pretrained(_tiny(), None, tmp_path_factory.mktemp("exported") / "tiny")


# ---------------------------------------------------------------------------------------------------------------
# Tools that would destroy what they were not asked to touch
# ---------------------------------------------------------------------------------------------------------------


def test_import_into_an_existing_folder_is_refused_unless_overwrite(exported, run, tmp_path, capsys):
    imported = load_script("import_safetensors")
    out = shutil.copytree(run, tmp_path / "run")
    before = _snapshot(out)
    assert imported.main([str(exported), str(out)]) == 2
    _one_error(capsys.readouterr().err, str(out), "--overwrite", "config.toml")
    assert _snapshot(out) == before

    assert imported.main([str(exported), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([".metadata", MANIFEST, "__0_0.distcp"])
    assert verify_manifest(out) is not None and read_metadata(out) is not None
    assert _leftovers(tmp_path) == []


def test_import_overwrite_keeps_the_old_folder_when_the_disk_fills(exported, tmp_path, capsys, monkeypatch):
    imported = load_script("import_safetensors")
    out = tmp_path / "ckpt"
    assert imported.main([str(exported), str(out)]) == 0
    before = _snapshot(out)
    real = imported.write_model_only

    def fills_up(state, folder):
        real(state, folder)  # the new files are written, then the disk is full (the manifest's write, say)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(folder) / MANIFEST))

    monkeypatch.setattr(imported, "write_model_only", fills_up)
    assert imported.main([str(exported), str(out), "--overwrite"]) == 2
    _one_error(capsys.readouterr().err, str(out), "no space left on the device", "MiB free", "unchanged")
    assert _snapshot(out) == before and _leftovers(tmp_path) == []


def test_convert_refuses_an_out_that_is_not_an_export(run, tmp_path, capsys):
    convert = load_script("convert_to_safetensors")
    other = shutil.copytree(run, tmp_path / "other_run")
    before = _snapshot(other)
    assert convert.main([str(run), str(other)]) == 2
    _one_error(capsys.readouterr().err, str(other), "not a safetensors export")
    assert _snapshot(other) == before


def _disk_fills_in_save_file(monkeypatch) -> None:
    """safetensors' ``save_file`` writes its file, then fails as its Rust writer does when the disk is full."""
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file

    def fills_up(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", fills_up)


def test_reexport_on_a_full_disk_leaves_the_old_export_loadable(exported, tmp_path, monkeypatch):
    out = shutil.copytree(exported, tmp_path / "tiny")
    (out / "README.md").write_text("a model card the user wrote\n")
    before = _snapshot(out)
    _disk_fills_in_save_file(monkeypatch)
    with pytest.raises(FolderWriteError, match=r"no space left on the device \(\d+\.\d MiB free in .*unchanged"):
        save_pretrained(_tiny(seed=1), None, out)
    assert _snapshot(out) == before and _leftovers(tmp_path) == []
    monkeypatch.undo()
    assert verify_export(out) is not None
    load_pretrained(out)

    # The same export without a fault replaces the old one and keeps the file the user added.
    save_pretrained(_tiny(seed=1), None, out)
    assert (out / "README.md").read_text() == "a model card the user wrote\n"
    assert _snapshot(out)[SAFETENSORS_FILE] != before[SAFETENSORS_FILE] and _leftovers(tmp_path) == []
    assert "README.md" not in json.loads((out / MANIFEST_FILE).read_text())["files"]


def test_convert_on_a_full_disk_is_one_line_and_leaves_the_earlier_export(run, tmp_path, capsys, monkeypatch):
    convert = load_script("convert_to_safetensors")
    out = tmp_path / "export"
    assert convert.main([str(run), str(out)]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    _disk_fills_in_save_file(monkeypatch)
    assert convert.main([str(run), str(out)]) == 2
    _one_error(capsys.readouterr().err, str(out), "no space left on the device", "MiB free", "unchanged")
    assert _snapshot(out) == before and _leftovers(tmp_path) == []
    monkeypatch.undo()
    assert verify_export(out) is not None


def test_reexport_through_a_link_replaces_the_folder_it_names_and_keeps_the_link(exported, tmp_path):
    """``exports/latest -> run-5``: the new export replaces run-5's, the link stays, nothing is left beside them."""
    target = shutil.copytree(exported, tmp_path / "run-5")
    link = tmp_path / "latest"
    link.symlink_to(target.name)
    before = _snapshot(target)
    save_pretrained(_tiny(seed=2), None, link)
    assert link.is_symlink() and (tmp_path / os.readlink(link)).resolve() == target.resolve()
    assert _snapshot(target)[SAFETENSORS_FILE] != before[SAFETENSORS_FILE] and verify_export(target) is not None
    assert _leftovers(tmp_path) == []


def _with_file_size_limit(limit: int):
    def setup():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as `ulimit -f` under a shell: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return setup


@pytest.mark.parametrize("tool", ["convert", "import"])
def test_file_size_limit_is_named_and_the_old_output_stays(tool, run, exported, tmp_path):
    script = {"convert": "convert_to_safetensors.py", "import": "import_safetensors.py"}[tool]
    source = str(step_folder(run / "checkpoint", 1)) if tool == "convert" else str(exported)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts" / script), source, str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _snapshot(out)
    again = cmd + (["--overwrite"] if tool == "import" else [])
    limit = 8192  # below the weights' size, above everything Python writes to start
    result = subprocess.run(again, capture_output=True, text=True, env=env, timeout=300,
                            preexec_fn=_with_file_size_limit(limit))
    assert result.returncode == 2, result.stderr[-3000:]
    _one_error(result.stderr, str(out), "file size limit", f"{limit:,} bytes", "not a full disk")
    assert _snapshot(out) == before and _leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# Exports that are not what they were: every reader checks the manifest
# ---------------------------------------------------------------------------------------------------------------


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 7] ^= 0x10  # a bit of the last weight: the header still parses, the numbers are plausible
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


DAMAGE = {"flipped": (_flip_bit, "does not match its sha256"), "truncated": (_truncate, "truncated"),
          "missing": (Path.unlink, "missing")}


@pytest.mark.parametrize("damage", DAMAGE)
def test_every_reader_refuses_a_damaged_export_naming_the_file(damage, exported, run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    folder = shutil.copytree(exported, tmp_path / "tiny")
    hurt, message = DAMAGE[damage]
    hurt(folder / SAFETENSORS_FILE)
    named = f"{folder / SAFETENSORS_FILE}: "

    with pytest.raises(ExportCorruptError, match=message) as error:
        load_pretrained(folder)
    assert str(error.value).startswith(named)
    with pytest.raises(ExportCorruptError, match=message):
        AutoModelForCausalLM.from_pretrained(folder)

    assert eval_main(["ppl", "--checkpoint", str(folder), *EVAL]) == 2
    _one_error(capsys.readouterr().err, named, message)
    assert load_script("import_safetensors").main([str(folder), str(tmp_path / "ckpt")]) == 2
    _one_error(capsys.readouterr().err, named, message)
    assert not (tmp_path / "ckpt").exists()

    # The debug model is not the tiny one: the checksums are checked before the weights' names.
    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "from_export"),
                                    "--checkpoint.enable", "--checkpoint.initial_load_path", str(folder)]))
    with pytest.raises(CheckpointCorruptError, match=message) as error:
        trainer.checkpointer.load()
    assert named in str(error.value)


def test_an_export_without_a_manifest_loads_with_a_warning_and_a_truncated_one_is_one_line(exported, tmp_path,
                                                                                           caplog, capsys):
    folder = shutil.copytree(exported, tmp_path / "old")
    (folder / MANIFEST_FILE).unlink()  # as exports were written before manifests
    with caplog.at_level(logging.WARNING, logger="hola_titan"):
        model, _ = load_pretrained(folder)
    warned = [r.getMessage() for r in caplog.records if MANIFEST_FILE in r.getMessage()]
    assert len(warned) == 1 and "cannot be verified" in warned[0], caplog.text
    reference, _ = load_pretrained(exported)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference.state_dict()[name]), name

    _truncate(folder / SAFETENSORS_FILE)
    assert eval_main(["ppl", "--checkpoint", str(folder), *EVAL]) == 2
    _one_error(capsys.readouterr().err, f"{folder / SAFETENSORS_FILE}: not a readable safetensors file")


# ---------------------------------------------------------------------------------------------------------------
# The converter verifies the checkpoint it reads
# ---------------------------------------------------------------------------------------------------------------


def test_convert_refuses_an_unverified_or_damaged_checkpoint(run, tmp_path, capsys):
    convert = load_script("convert_to_safetensors")
    dump = shutil.copytree(run, tmp_path / "run")
    step = step_folder(dump / "checkpoint", 1)
    data = sorted(step.glob("*.distcp"))[0]
    original = data.read_bytes()
    _flip_bit(data)
    assert convert.main([str(step), str(tmp_path / "flipped")]) == 2
    _one_error(capsys.readouterr().err, str(step), data.name, "checksum")
    assert not (tmp_path / "flipped").exists()

    (step / MANIFEST).unlink()
    assert convert.main([str(step), str(tmp_path / "unverified")]) == 2
    _one_error(capsys.readouterr().err, str(step), f"no {MANIFEST}", "--allow-unverified")
    assert not (tmp_path / "unverified").exists()

    data.write_bytes(original)
    assert convert.main([str(step), str(tmp_path / "allowed"), "--allow-unverified"]) == 0
    assert verify_export(tmp_path / "allowed") is not None
