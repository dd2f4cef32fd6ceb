"""Retention, checkpoint health, the checkpoint folder's lock and its record (CPU, in-process trainers).

Each test reproduces a fault seen without the protection (issue "never lose a checkpoint ... and never report a
wrong number as fine") and fails there.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hola_titan.checkpoint import HEALTHY, UNHEALTHY, list_checkpoints, recorded_health
from hola_titan.config import ConfigError, parse_config
from hola_titan.train import Trainer
from helpers import load_script
from test_reliability import FAST, LONG, ROOT, _env, _lock_holder

CKPT = [*FAST, "--checkpoint.enable", "--checkpoint.interval", "2"]


def _flip_a_byte(step: Path) -> None:
    """Change one byte in the middle of the step's largest data file (same size: only the checksum sees it)."""
    data = max(step.glob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_retention_after_a_fallback_leaves_a_loadable_checkpoint(tmp_path, caplog):
    """keep_latest_k 1 after a resume that fell back past a corrupt newest step: the steps this run wrote and
    resumed from are kept, the corrupt one is not counted (left, said once), and the next start resumes."""
    run = [*CKPT, "--job.dump_folder", str(tmp_path)]
    Trainer(parse_config([*run, "--training.steps", "4"])).train()
    folder = tmp_path / "checkpoint"
    _flip_a_byte(folder / "step-4")
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        Trainer(parse_config([*run, "--training.steps", "3", "--checkpoint.keep_latest_k", "1"])).train()
    assert "resuming from step 2" in caplog.text
    assert list_checkpoints(folder) == [2, 3, 4]
    assert "step-4: __0_0.distcp does not match its checksum" in caplog.text
    assert "not counted among keep_latest_k = 1 and left in place for inspection" in caplog.text
    assert "this run resumed from it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        assert Trainer(parse_config([*run, "--training.steps", "5"])).checkpointer.load() == 3


def _diverge_at(trainer: Trainer, step: int, lr: float) -> None:
    """The optimizer update of ``step`` runs at learning rate ``lr`` (a divergence that the step's own loss, computed
    before the update, cannot show)."""
    original = trainer.optimizer.step

    def optimizer_step(*args, **kwargs):
        if trainer.state.step + 1 != step:
            return original(*args, **kwargs)
        rates = [group["lr"] for group in trainer.optimizer.param_groups]
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        try:
            return original(*args, **kwargs)
        finally:
            for group, rate in zip(trainer.optimizer.param_groups, rates):
                group["lr"] = rate

    trainer.optimizer.step = optimizer_step


def test_a_diverged_step_is_unhealthy_and_conversion_passes_it_over(tmp_path, capsys):
    """The update of step 6 diverges (lr 1e4), step 6 is saved, and step 7's loss stops the run. The checkpoint of
    step 6 is recorded unhealthy (the loss its weights gave), step 4 stays, and the converter exports step 4 saying
    why not 6; --allow-unhealthy exports 6 with a warning; step-6 named alone is refused."""
    trainer = Trainer(parse_config([*CKPT, "--job.dump_folder", str(tmp_path), "--training.steps", "10",
                                    "--checkpoint.keep_latest_k", "1", "--training.loss_spike_warmup", "3"]))
    _diverge_at(trainer, 6, lr=1e4)
    with pytest.raises(RuntimeError, match="at step 7"):
        trainer.train()
    folder = tmp_path / "checkpoint"
    assert list_checkpoints(folder) == [4, 6]
    assert recorded_health(folder / "step-4")[0] == HEALTHY
    health, why = recorded_health(folder / "step-6")
    assert health == UNHEALTHY and "at step 7 from its weights" in why, why

    convert = load_script("convert_to_safetensors")
    capsys.readouterr()
    assert convert.main([str(tmp_path), str(tmp_path / "export")]) == 0
    out = capsys.readouterr()
    assert "step 4" in out.out and "step-6 passed over: unhealthy" in out.out, out
    assert convert.main([str(tmp_path), str(tmp_path / "export6"), "--allow-unhealthy"]) == 0
    out = capsys.readouterr()
    assert "from " + str(folder / "step-6") in out.out and "warning: " in out.err and "unhealthy" in out.err, out
    assert convert.main([str(folder / "step-6"), str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-6 is recorded unhealthy" in err and "--allow-unhealthy" in err, err
    assert not (tmp_path / "refused").exists()


def test_conversion_of_a_run_folder_passes_over_a_newest_step_that_does_not_verify(tmp_path, capsys):
    """One flipped byte in a data file of the newest step (4): the converter, given the run folder, exports step 2
    and names step 4 as passed over because it does not verify, with the file whose checksum differs."""
    Trainer(parse_config([*CKPT, "--job.dump_folder", str(tmp_path), "--training.steps", "4"])).train()
    folder = tmp_path / "checkpoint"
    assert [recorded_health(folder / f"step-{s}")[0] for s in (2, 4)] == [HEALTHY, HEALTHY]
    _flip_a_byte(folder / "step-4")

    convert = load_script("convert_to_safetensors")
    capsys.readouterr()
    assert convert.main([str(tmp_path), str(tmp_path / "export")]) == 0
    out = capsys.readouterr().out
    said = next(line for line in out.splitlines() if line.startswith("converting "))
    assert said.startswith(f"converting {folder / 'step-2'}: step 2, the newest complete checkpoint"), said
    assert "step-4 passed over: does not verify" in said and "__0_0.distcp does not match its checksum" in said, said
    assert f"from {folder / 'step-2'} " in out, out


def _weights_poisoned_and_stopped_at(trainer: Trainer, step: int) -> None:
    """The optimizer update of ``step`` runs at an infinite learning rate (every weight it moves becomes
    non-finite; the step's own loss, computed before the update, is finite) and a SIGUSR1 arrives during it, as a
    scheduler's would: the run saves ``step`` at the stop with no later step to judge it by its loss."""
    _diverge_at(trainer, step, lr=float("inf"))
    diverging = trainer.optimizer.step

    def optimizer_step(*args, **kwargs):
        if trainer.state.step + 1 == step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return diverging(*args, **kwargs)

    trainer.optimizer.step = optimizer_step


def test_a_checkpoint_with_non_finite_weights_is_unhealthy_and_passed_over(tmp_path, capsys, caplog):
    """Step 3's update makes the weights non-finite and a stop signal saves step 3: no later loss judges it, so
    only its weights can. It is recorded unhealthy for them; retention (keep_latest_k 1) keeps step 2, the newest
    healthy, beside it, and the converter exports step 2 naming why not 3."""
    trainer = Trainer(parse_config([*CKPT, "--job.dump_folder", str(tmp_path), "--training.steps", "10",
                                    "--checkpoint.keep_latest_k", "1"]))
    _weights_poisoned_and_stopped_at(trainer, 3)
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        trainer.train()
    assert "SIGUSR1 received: stopped after step 3" in caplog.text
    folder = tmp_path / "checkpoint"
    assert list_checkpoints(folder) == [2, 3]
    assert recorded_health(folder / "step-2")[0] == HEALTHY
    assert recorded_health(folder / "step-3") == (UNHEALTHY, "its weights are not all finite")
    assert "keeping " + str(folder / "step-2") + " beyond keep_latest_k = 1: the newest recorded healthy" in caplog.text

    convert = load_script("convert_to_safetensors")
    capsys.readouterr()
    assert convert.main([str(tmp_path), str(tmp_path / "export")]) == 0
    out = capsys.readouterr().out
    assert f"converting {folder / 'step-2'}: step 2" in out, out
    assert "step-3 passed over: unhealthy (its weights are not all finite)" in out, out


def test_the_last_checkpoint_is_judged_and_a_resume_judges_an_unjudged_one(tmp_path):
    """A run's last checkpoint is judged by one more forward; a checkpoint saved unjudged (a stop) is judged by the
    first loss of the run that resumes from it."""
    run = [*CKPT, "--job.dump_folder", str(tmp_path)]
    Trainer(parse_config([*run, "--training.steps", "4"])).train()
    folder = tmp_path / "checkpoint"
    assert [recorded_health(folder / f"step-{s}")[0] for s in (2, 4)] == [HEALTHY, HEALTHY]
    from hola_titan.checkpoint import UNJUDGED, record_health
    record_health(folder / "step-4", UNJUDGED, "")  # as a stop signal leaves it
    Trainer(parse_config([*run, "--training.steps", "5", "--checkpoint.interval", "10"])).train()
    health, why = recorded_health(folder / "step-4")
    assert health == HEALTHY and "at step 5 from its weights" in why, why


def test_a_checkpoint_folder_inside_another_live_run_is_refused(tmp_path):
    """A run whose checkpoint.folder leads relatively, or through a link, into a live run's <dump>/checkpoint is
    refused at start naming the holder; list_checkpoints ignores the lock file."""
    first = subprocess.Popen([sys.executable, "-m", "hola_titan.train", *LONG, "--checkpoint.enable",
                              "--job.dump_folder", str(tmp_path / "a")], cwd=ROOT, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid = _lock_holder(tmp_path / "a" / "checkpoint")
        (tmp_path / "link").symlink_to(tmp_path / "a")
        for folder in ("../a/checkpoint", str(tmp_path / "link" / "checkpoint")):
            with pytest.raises(ConfigError, match=rf"checkpoint.folder: .* is in use by process {pid} on "):
                Trainer(parse_config([*LONG, "--checkpoint.enable", "--job.dump_folder", str(tmp_path / "b"),
                                      "--checkpoint.folder", folder]))
        assert list_checkpoints(tmp_path / "a" / "checkpoint") == []
    finally:
        first.kill()
        first.wait(timeout=60)


def test_a_resume_with_another_checkpoint_folder_is_refused_unless_allowed(tmp_path, caplog):
    run = [*CKPT, "--job.dump_folder", str(tmp_path), "--training.steps", "2"]
    Trainer(parse_config(run)).train()
    with pytest.raises(ConfigError, match=r"checkpoint.folder: .*elsewhere is not the folder this run wrote its "
                                          r"checkpoints to: .*config.toml records .*checkpoint, which holds "
                                          r"checkpoints; .*checkpoint.allow_folder_change"):
        Trainer(parse_config([*run, "--checkpoint.folder", "elsewhere"]))
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        trainer = Trainer(parse_config([*run, "--checkpoint.folder", "elsewhere",
                                        "--checkpoint.allow_folder_change", "true"]))
    assert "changed as checkpoint.allow_folder_change allows" in caplog.text
    assert trainer.checkpointer.load() is None
