"""Runs that cannot be corrupted (CPU): one writer per run folder, workers that end with their launcher.

Each test reproduces a failure seen on a main branch without the protection (issue "runs that cannot be
corrupted") and fails there.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hola_titan.config import ConfigError, parse_config
from hola_titan.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
# A run long enough to be caught alive: tiny steps, many of them.
LONG = ["--job.config_file", DEBUG, "--training.seq_len", "32", "--training.local_batch_size", "1",
        "--training.steps", "1000000", "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
        "--metrics.log_freq", "1000", "--model.attention_backend", "sdpa"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _lock_holder(folder: Path, timeout: float = 120.0) -> int:
    """The pid written into ``folder/.lock`` once a trainer holds it (waits for it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            pid = json.loads((folder / ".lock").read_text()).get("pid")
            if pid:
                return pid
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no trainer took {folder}/.lock within {timeout} s")


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_a_second_trainer_on_a_run_folder_is_refused(tmp_path, caplog):
    first = subprocess.Popen([sys.executable, "-m", "hola_titan.train", *LONG, "--job.dump_folder", str(tmp_path)],
                             cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid = _lock_holder(tmp_path)
        assert pid == first.pid
        with pytest.raises(ConfigError, match=rf"job.dump_folder: .* is in use by process {pid} on "):
            Trainer(parse_config([*LONG, "--job.dump_folder", str(tmp_path)]))
    finally:
        first.kill()
        first.wait(timeout=60)
    # kill -9 releases the lock with the process: the next run takes over and says from whom.
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        trainer = Trainer(parse_config([*LONG, "--job.dump_folder", str(tmp_path), "--training.steps", "1"]))
    assert f"last held by process {pid}" in caplog.text
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    del trainer


def test_the_worker_ends_with_run_train_sh(tmp_path):
    """``kill -9`` of ``run_train.sh``'s process group: torchrun's worker, in its own session, ends too."""
    env = _env() | {"NGPU": "1", "CONFIG_FILE": DEBUG, "PYTHON": sys.executable}
    launcher = subprocess.Popen([str(ROOT / "run_train.sh"), *LONG[2:], "--job.dump_folder", str(tmp_path)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    worker = _lock_holder(tmp_path)
    try:
        assert worker != launcher.pid and os.getsid(worker) != os.getsid(launcher.pid)  # its own session
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.time() + 30
        while _alive(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "the worker outlived its launcher"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


SHORT = ["--job.config_file", DEBUG, "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--model.attention_backend", "sdpa",
         "--checkpoint.enable", "--checkpoint.interval", "3"]


def test_a_refused_resume_leaves_the_run_record_as_it_was(tmp_path):
    """Resuming with another flavour fails; the run's config.toml (which export reads) and metrics stay those of
    the run that wrote the checkpoints, and the documented export still works."""
    Trainer(parse_config([*SHORT, "--job.dump_folder", str(tmp_path), "--training.steps", "3"])).train()
    record = (tmp_path / "config.toml").read_text()
    metrics = (tmp_path / "metrics.jsonl").read_text()
    result = subprocess.run([sys.executable, "-m", "hola_titan.train", *SHORT, "--job.dump_folder", str(tmp_path),
                             "--training.steps", "6", "--model.flavour", "gdn"],
                            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "does not fit this model" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "config.toml").read_text() == record
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    export = subprocess.run([sys.executable, "scripts/convert_to_safetensors.py",
                             str(tmp_path / "checkpoint" / "step-3"), str(tmp_path / "export")],
                            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
