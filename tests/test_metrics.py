"""Metric records across attempts (issue 50, item 7): ``metrics.jsonl`` rows carry ``time`` and ``attempt``, a
resume is the run folder's next attempt, readers keep the last attempt's row of each step, TensorBoard shows one
point per step after a resume, and the console's step line ends with an ETA from recent steps."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import pytest

import hola_titan.metrics as metrics
from hola_titan.checkpoint import step_folder
from hola_titan.config import parse_config
from hola_titan.metrics import MetricsLogger, format_duration
from hola_titan.metrics_records import ATTEMPTS_FILE, latest_records, read_metrics
from hola_titan.train import Trainer

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
RUN = ["--job.config_file", DEBUG, "--training.seq_len", "64", "--training.local_batch_size", "2",
       "--training.steps", "4", "--validation.enable", "false", "--metrics.log_freq", "1",
       "--model.attention_backend", "sdpa", "--checkpoint.enable", "--checkpoint.interval", "2"]

pytestmark = pytest.mark.usefixtures("single_thread")


def _tensorboard_losses(folder: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("loss")]


def test_a_resume_is_the_next_attempt_and_its_replayed_steps_replace_the_earlier_ones(tmp_path):
    """Steps 1-4 with checkpoints at 2 and 4; the step-4 checkpoint lost (a kill before its save): the next run
    resumes after step 2 and logs steps 3 and 4 again as attempt 2. Every row has its time and attempt; read_metrics
    keeps attempt 2's rows of steps 3 and 4; TensorBoard shows each step once, with attempt 2's value."""
    before = time.time()
    Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)])).train()
    shutil.rmtree(step_folder(tmp_path / "checkpoint", 4))
    Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)])).train()
    rows = read_metrics(tmp_path / "metrics.jsonl", all_attempts=True)
    assert [(r["step"], r["attempt"]) for r in rows] == [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2)]
    assert all(before <= r["time"] <= time.time() for r in rows)
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)
    attempts = [json.loads(line) for line in (tmp_path / ATTEMPTS_FILE).read_text().splitlines()]
    assert [(a["attempt"], a["start_step"]) for a in attempts] == [(1, 0), (2, 2)]
    history = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["attempt"]) for r in history] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    shown = _tensorboard_losses(tmp_path / "tb")
    assert [step for step, _ in shown] == [1, 2, 3, 4], shown
    for (step, value), row in zip(shown, history):
        assert value == pytest.approx(row["loss"], rel=1e-6), step


def test_latest_records_by_attempt_kind_and_before_attempts_were_recorded():
    rows = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}, {"step": 2, "loss": 7.9},  # a replay, no attempts
            {"step": 2, "loss": 7.8, "attempt": 1}, {"step": 3, "loss": 7.0, "attempt": 1},
            {"step": 3, "val_loss": 7.5, "attempt": 1}, {"step": 4, "loss": 6.0, "attempt": 1},
            {"step": 4, "loss": 6.5, "attempt": 2}, {"step": 5, "loss": 5.0, "attempt": 2},
            {"step": 5, "val_loss": 5.5, "attempt": 2}]
    kept = latest_records(rows)
    assert [(r["step"], r.get("attempt"), r.get("loss", r.get("val_loss"))) for r in kept] == [
        (1, None, 9.0), (2, 1, 7.8), (3, 1, 7.0), (3, 1, 7.5), (4, 2, 6.5), (5, 2, 5.0), (5, 2, 5.5)]


def test_a_line_cut_by_a_kill_is_ended_before_the_next_attempt_writes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0, "attempt": 1}\n{"step": 2, "lo')
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, tb_folder="tb", start_step=1)
    logger.log({"step": 2, "loss": 8.0})
    logger.close()
    assert logger.attempt == 1  # the cut run wrote no attempts.jsonl: this is the folder's first recorded attempt
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl", all_attempts=True)] == [
        (1, 9.0), (2, 8.0)]


def test_ablate_small_reads_the_last_attempt_of_each_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 10, "loss": 5.0, "attempt": 1}, {"step": 20, "loss": 4.0, "attempt": 1},
        {"step": 30, "loss": 3.9, "attempt": 1}, {"step": 30, "loss": 3.0, "attempt": 2}]))
    ablate = load_script("ablate_small")
    assert [(r["step"], r["loss"]) for r in ablate.read_jsonl(path)] == [(10, 5.0), (20, 4.0), (30, 3.0)]
    assert ablate.read_jsonl(tmp_path / "absent.jsonl") == []


def test_the_step_line_ends_with_an_eta_from_recent_steps(tmp_path, monkeypatch, caplog):
    """The first logged step (compilation) is outside the window; steps of 2 s after it give 2 s x steps left.
    The line before the ETA is the one it always was."""
    clock = iter([300.0, 302.0, 304.0, 306.0])
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, tb_folder="tb", total_steps=100)
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        for step in (1, 2, 3):
            logger.log({"step": step, "loss": 1.0, "lr": 1e-3})
        logger.log({"step": 100, "loss": 1.0, "lr": 1e-3})
    logger.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step      1  loss 1.0000  lr 1.000e-03",
                     "step      2  loss 1.0000  lr 1.000e-03  eta 3m16s",
                     "step      3  loss 1.0000  lr 1.000e-03  eta 3m14s",
                     "step    100  loss 1.0000  lr 1.000e-03"]
    assert [format_duration(s) for s in (3720, 307, 42.4)] == ["1h02m", "5m07s", "42s"]


def test_the_log_handler_writes_to_the_stderr_of_the_moment(monkeypatch):
    """A trainer run in-process under a swapped ``sys.stderr`` (a capture file, closed afterwards) must not leave the
    console handler bound to the closed stream: a later warning once printed logging's own traceback instead."""
    import io
    import sys

    logger = logging.getLogger("hola_titan")
    monkeypatch.setattr(logger, "handlers", [])  # setup_logging's handler and settings go with the test
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "level", logger.level)
    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)
    metrics.setup_logging(0)
    logger.warning("first")
    swapped.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logger.warning("second")
    assert "second" in later.getvalue() and "Logging error" not in later.getvalue(), later.getvalue()
