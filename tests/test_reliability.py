"""Runs that cannot be corrupted (CPU): one writer per run folder, workers that end with their launcher.

Each test reproduces a failure seen on a main branch without the protection (issue "runs that cannot be
corrupted") and fails there.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hola_titan.checkpoint import list_checkpoints, recorded_healthy
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


def _descendants(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        todo = [c for p in todo for c in _children(p)]
        tree += todo
    return tree


def test_kill_9_of_run_train_sh_alone_ends_the_run_and_frees_its_folder(tmp_path):
    """``kill -9`` of the ``run_train.sh`` process alone (issue 50, item 6; not its process group, which the test
    above kills): torchrun ends with it, and its worker, orphaned, stops as on SIGTERM (the step's checkpoint
    written) instead of training on with the run folder's lock. Without the fix torchrun and the worker outlive it."""
    scratch = tmp_path / "tmp"  # run_train.sh's work folder goes here
    scratch.mkdir()
    env = _env() | {"NGPU": "1", "CONFIG_FILE": DEBUG, "PYTHON": sys.executable, "TMPDIR": str(scratch)}
    run = [*LONG[2:], "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "100000",
           "--job.dump_folder", str(tmp_path)]
    launcher = subprocess.Popen([str(ROOT / "run_train.sh"), *run], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    tree = []
    try:
        _rows_when(tmp_path, 2)
        tree = _descendants(launcher.pid)
        worker = _lock_holder(tmp_path)
        assert worker in tree and len(tree) >= 3, tree  # the output filter, torchrun and its worker
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.time() + 20
        while any(_alive(pid) for pid in tree) and time.time() < deadline:
            time.sleep(0.2)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
                for pid in tree if _alive(pid)}
        assert not left, f"processes of the run outlived run_train.sh by 20 s: {left}"
        assert _lock_free(tmp_path)
        assert list_checkpoints(tmp_path / "checkpoint"), "the orphaned worker stopped without its checkpoint"
        assert not [p.name for p in scratch.iterdir() if p.name.startswith("run_train.")]
    finally:
        for pid in [launcher.pid, *tree]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


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
    assert "another model: model.flavour" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "config.toml").read_text() == record
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    export = subprocess.run([sys.executable, "scripts/convert_to_safetensors.py",
                             str(tmp_path / "checkpoint" / "step-3"), str(tmp_path / "export")],
                            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]


def _poison(trainer: Trainer, *, from_step: int, factor: float) -> None:
    """Multiply every loss from step ``from_step`` on by ``factor`` (nan: non-finite; 100: a finite blow-up)."""
    original = trainer.loss_sum

    def loss_sum(batch):
        value = original(batch)
        return value * factor if trainer.state.step + 1 >= from_step else value

    trainer.loss_sum = loss_sum


def _strict_rows(folder: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"bare {name} in metrics.jsonl")
    return [json.loads(line, parse_constant=refuse) for line in (folder / "metrics.jsonl").read_text().splitlines()]


FAST = ["--job.config_file", DEBUG, "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"]


def test_skipping_stops_after_max_consecutive_skips_and_metrics_stay_strict_json(tmp_path):
    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "50",
                                    "--training.skip_nan_inf", "--training.max_consecutive_skips", "3"]))
    _poison(trainer, from_step=3, factor=float("nan"))
    with pytest.raises(RuntimeError, match=r"3 consecutive steps skipped, up to step 5 \(training.max_consecutive"):
        trainer.train()
    assert trainer.state.skipped_steps == 3 and trainer.state.step == 4
    rows = _strict_rows(tmp_path)  # no bare NaN
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["loss"] is None and rows[0]["loss"] > 0


def test_a_finite_loss_blow_up_stops_before_its_update(tmp_path):
    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "10",
                                    "--training.loss_spike_warmup", "3"]))
    _poison(trainer, from_step=6, factor=60.0)
    with pytest.raises(RuntimeError, match=r"at step 6 is more than 4 times the running mean .*loss_spike_factor"):
        trainer.train()
    assert trainer.state.step == 5 and [r["step"] for r in _strict_rows(tmp_path)] == [1, 2, 3, 4, 5]
    # The guard off: the same blow-up trains on.
    other = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "off"), "--training.steps", "7",
                                  "--training.loss_spike_factor", "0"]))
    _poison(other, from_step=6, factor=60.0)
    other.train()
    assert other.state.step == 7


def test_the_spike_guard_resumes_with_its_running_mean(tmp_path):
    """The guard's running mean is part of the checkpoint, so a resumed run judges spikes as the uninterrupted run
    would."""
    run = [*FAST, "--checkpoint.enable", "--checkpoint.interval", "4", "--training.loss_spike_warmup", "2"]
    first = Trainer(parse_config([*run, "--job.dump_folder", str(tmp_path), "--training.steps", "4"]))
    first.train()
    ema = first.state.loss_ema
    assert ema > 0 and first.state.loss_ema_steps == 4
    second = Trainer(parse_config([*run, "--job.dump_folder", str(tmp_path), "--training.steps", "5"]))
    second.checkpointer.load()
    assert second.state.loss_ema == ema and second.state.loss_ema_steps == 4


def test_a_checkpoint_from_before_the_guard_counters_loads(tmp_path, monkeypatch):
    from hola_titan.train import TrainState

    run = [*FAST, "--checkpoint.enable", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)]
    full = TrainState.state_dict
    with monkeypatch.context() as patch:  # the counters a checkpoint of an earlier version holds
        patch.setattr(TrainState, "state_dict", lambda self: {k: v for k, v in full(self).items()
                                                              if k in ("step", "tokens_seen", "skipped_steps")})
        Trainer(parse_config([*run, "--training.steps", "2"])).train()
    resumed = Trainer(parse_config([*run, "--training.steps", "3"]))
    assert resumed.checkpointer.load() == 2
    assert resumed.state.loss_ema == 0.0 and resumed.state.loss_ema_steps == 0


def _rows_when(folder: Path, count: int, timeout: float = 120.0) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            if len(rows) >= count:
                return rows
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} metric rows in {folder} after {timeout} s")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


@pytest.mark.parametrize("mode, sig", [("one_process", signal.SIGTERM), ("run_train_sh", signal.SIGTERM),
                                       ("whole_job", signal.SIGTERM), ("one_process", signal.SIGINT),
                                       ("run_train_sh", signal.SIGINT)])
def test_sigterm_saves_at_the_next_step_boundary_and_exits_cleanly(tmp_path, mode, sig):
    """What a scheduler does before preempting: SIGTERM, to one trainer process, to ``run_train.sh`` with two FSDP
    ranks, or to every process of that job (as Slurm does); and Ctrl-C (SIGINT) to the trainer or the launcher. The
    run saves the step it is at, says so, and exits 0; the ranks agree on the step; torchrun neither kills the
    workers early nor ends with a traceback."""
    run = [*LONG[2:], "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "100000",
           "--job.dump_folder", str(tmp_path)]
    if mode == "one_process":
        cmd = [sys.executable, "-m", "hola_titan.train", "--job.config_file", DEBUG, *run]
        env = _env()
    else:
        cmd = [str(ROOT / "run_train.sh"), *run]
        env = _env() | {"NGPU": "2", "CONFIG_FILE": DEBUG, "PYTHON": sys.executable, "LOG_RANK": "0,1"}
    # As from a terminal: SIGINT and SIGQUIT at their defaults. A test run started in the background of a
    # non-interactive shell inherits them ignored, and bash cannot trap a signal ignored at its start, so Ctrl-C to
    # run_train.sh would never reach the workers (it did not, on such a run).
    cmd = [sys.executable, "-c", "import os, signal, sys\nfor s in (signal.SIGINT, signal.SIGQUIT): "
           "signal.signal(s, signal.SIG_DFL)\nos.execvp(sys.argv[1], sys.argv[1:])", *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        _rows_when(tmp_path, 3)
        if mode == "whole_job":
            agents = _children(proc.pid)
            targets = [proc.pid, *agents, *(w for a in agents for w in _children(a))]
            assert len(targets) >= 4, targets  # the script, torchrun and two workers
            for pid in targets:
                os.kill(pid, sig)
        else:
            proc.send_signal(sig)
        try:
            output, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # What the run did after the signal is the diagnosis (one CI run on 2 loaded cores went on training).
            # torchrun starts its workers in sessions of their own: the group kill alone would leave them running.
            tree, todo = [], [proc.pid]
            while todo:
                todo = [c for p in todo for c in _children(p)]
                tree += todo
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            output, _ = proc.communicate()
            rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
            pytest.fail(f"{sig.name} to {mode}: no exit within 120 s; descendant processes then {tree}; "
                        f"{len(rows)} metric rows; output:\n{output[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").glob("step-*") if "." not in p.name)
    assert saved and saved[-1] >= steps[-1], (saved, steps, output[-3000:])
    assert f"{sig.name} received: stopped after step {saved[-1]} with its checkpoint" in output, output[-3000:]
    assert proc.returncode == 0 and "Traceback" not in output, output[-3000:]
    assert "returned a view tensor" not in output  # FSDP2's warning about the loss's input (fixed at its cause)
    resumed = Trainer(parse_config([*LONG, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]))
    assert resumed.checkpointer.load() == saved[-1]


def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    # Steps of 4,096 tokens (a few hundred ms on a CPU), so that the second interrupt lands before the step ends.
    run = [*LONG, "--training.seq_len", "2048", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
           "--checkpoint.enable", "--checkpoint.interval", "3", "--job.dump_folder", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "-m", "hola_titan.train", *run], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _rows_when(tmp_path, 4)  # step 3's checkpoint is written
        # Signals sent back to back reach Python's handler as one; 50 ms apart they are two.
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "interrupted twice: stopped at once" in lines[0] and "Traceback" not in err, err[-3000:]
    resumed = Trainer(parse_config([*run, "--job.dump_folder", str(tmp_path)]))
    assert resumed.checkpointer.load() >= 3  # what was written before stays loadable


def test_dry_run_of_a_recipe_needs_no_tokenizer(tmp_path, capsys):
    from hola_titan.train import main

    recipe = str(ROOT / "train_configs" / "hola_340M.toml")
    assert main(["--dry-run", "--job.config_file", recipe]) == 0  # its Mistral tokenizer is not on disk here
    out = capsys.readouterr().out
    assert "341,609,856 parameters, vocab 32000" in out and "vocabulary 32000 from model.vocab_size" in out
    assert main(["--dry-run", "--job.config_file", DEBUG, "--model.tokenizer_path", str(tmp_path / "none")]) == 2
    assert "model.vocab_size: needed for a dry run without the tokenizer" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="model.vocab_size: 32000 differs from the 8192 entries"):
        Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), "--model.vocab_size", "32000"]))


@pytest.mark.parametrize("case", ["empty", "not_json", "not_utf8", "other_field", "no_such_folder", "tp_degree",
                                  "dump_is_a_file"])
def test_data_and_layout_errors_are_one_line_with_exit_2(tmp_path, case):
    data = tmp_path / "data.jsonl"
    extra = ["--data.dataset", str(data)]
    if case == "empty":
        data.write_text("")
        expected = "has no document with at least one token"
    elif case == "not_json":
        data.write_text('{"text": "one two three"}\nnot json\n')
        expected = f"{data} line 2: not valid JSON"
    elif case == "not_utf8":
        data = tmp_path / "data.txt"
        data.write_bytes(b"first document\n\nsecond one\nwith a Latin-1 caf\xe9\n")
        extra = ["--data.dataset", str(data)]
        expected = f"{data} line 4: not valid UTF-8 (byte 0xe9"
    elif case == "other_field":
        data.write_text("".join(json.dumps({"body": f"document {i} of words"}) + "\n" for i in range(20)))
        expected = "no text field 'text' (fields: body); set data.text_field"
    elif case == "no_such_folder":
        extra = ["--data.dataset", "my_corpus_folder"]
        expected = "'my_corpus_folder' is no local file or folder"
    elif case == "dump_is_a_file":
        (tmp_path / "run").write_text("a file where the run folder would go\n")
        extra = []
        expected = f"job.dump_folder: {tmp_path / 'run'}: {tmp_path / 'run'} is a file, not a folder"
    else:
        extra = ["--parallelism.tensor_parallel_degree", "3"]
        expected = "parallelism.tensor_parallel_degree: replicate 1 x tensor 3 x context 1 = 3 does not divide the 2"
    env = _env() | ({"WORLD_SIZE": "2"} if case == "tp_degree" else {})
    begin = time.time()
    result = subprocess.run([sys.executable, "-m", "hola_titan.train", *FAST, "--job.dump_folder",
                             str(tmp_path / "run"), "--training.steps", "2", *extra], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and time.time() - begin < 60


def test_validation_never_reads_the_training_documents(tmp_path):
    from hola_titan.data.sources import DataError, read_documents, resolve_source

    docs = [f"document number {i} with a few words, and some more of them to fill the rows" for i in range(250)]
    path = tmp_path / "one_file.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train = list(read_documents(resolve_source(str(path), split="train", holdout_every=10)))
    held = list(read_documents(resolve_source(str(path), split="validation", holdout_every=10)))
    assert held == docs[9::10] and len(train) == 225 and not set(train) & set(held)
    with pytest.raises(DataError, match="without a hold-out its validation rows would be training documents"):
        resolve_source(str(path), split="validation", holdout_every=0)
    # Through the trainer: validation on the one file is the held-out tenth.
    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "run"), "--data.dataset", str(path),
                                    "--data.holdout_every", "10", "--validation.enable", "true",
                                    "--training.seq_len", "32", "--validation.steps", "1"]))
    val = trainer._validation_loader()
    assert val.holdout == "validation/10" and trainer.dataloader.holdout == "train/10"


def _small_holdout(tmp_path: Path) -> list[str]:
    """A file whose held-out tenth (25 short documents, a few hundred tokens) is smaller than one global batch of 8
    rows x 128 tokens."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} of a few words"}) + "\n" for i in range(250)))
    return ["--data.dataset", str(path), "--data.holdout_every", "10", "--validation.enable", "true",
            "--training.seq_len", "128", "--training.local_batch_size", "8"]


def test_validation_data_smaller_than_a_global_batch_is_refused_before_the_first_step(tmp_path):
    """It was found at the first validation (validation.freq steps in, before that step's checkpoint)."""
    from hola_titan.data.sources import DataError

    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), *_small_holdout(tmp_path),
                                    "--training.steps", "3", "--validation.freq", "1000"]))
    with pytest.raises(DataError, match=r"has \d+ tokens, fewer than one global batch of 8 rows x 128 tokens"):
        trainer.train()
    assert trainer.state.step == 0 and not (tmp_path / "metrics.jsonl").exists()
    # More global batches than the validation data holds: refused at start too, naming the key.
    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "two"), "--training.steps", "3",
                                    "--validation.enable", "true", "--validation.steps", "100000"]))
    with pytest.raises(ConfigError, match=r"^validation.steps: 100000 global batches of 2 rows x 64 tokens, but the "
                                          r"validation data \(bundled\) holds \d+; at most \d+$"):
        trainer.train()
    assert trainer.state.step == 0


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_validation_that_fails_keeps_the_checkpoint_of_its_step(tmp_path, monkeypatch, mode):
    """validation.freq = checkpoint.interval: a validation that raises at step 4 costs no step, since that step's
    checkpoint is written (and, saved in the background, complete) before the error ends the run."""
    from hola_titan.data.sources import DataError

    def fail(self):
        raise DataError("validation data: unreadable (simulated)")

    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "6",
                                    "--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.async_mode",
                                    mode, "--validation.enable", "true", "--validation.freq", "4",
                                    "--validation.steps", "1"]))
    monkeypatch.setattr(Trainer, "validate", fail)
    with pytest.raises(DataError, match="simulated"):
        trainer.train()
    assert list_checkpoints(tmp_path / "checkpoint") == [4]
    assert not list((tmp_path / "checkpoint").glob("*.tmp"))


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    from hola_titan.checkpoint import CheckpointError

    run = [*FAST, "--checkpoint.enable", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)]
    Trainer(parse_config([*run, "--training.steps", "2"])).train()

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    trainer = Trainer(parse_config([*run, "--training.steps", "4"]))
    with pytest.raises(CheckpointError, match=r"writing .*step-4.tmp failed \(no space left on the device; .* GiB "
                                              r"free there\).* earlier checkpoints .* are intact"):
        trainer.train()
    # The checkpoint folder's lock file (.lock) aside, only the earlier step is there.
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.name != ".lock") == ["step-2"]


@pytest.mark.parametrize("case", ["config", "data"])
def test_run_train_sh_ends_a_one_line_error_with_exit_2_and_no_torchrun_report(tmp_path, case):
    """A config mistake stops in the preflight, before torchrun starts; an error a worker stops on (here the
    data) is its one line, without torchrun's failure report."""
    if case == "config":
        extra, expected = ["--parallelism.tensor_parallel_degree", "3"], "parallelism.tensor_parallel_degree:"
    else:
        data = tmp_path / "data.jsonl"
        data.write_text('{"text": "one two three"}\nnot json\n')
        extra, expected = ["--data.dataset", str(data)], "line 2: not valid JSON"
    env = _env() | {"NGPU": "2", "CONFIG_FILE": DEBUG, "PYTHON": sys.executable, "LOG_RANK": "0"}
    result = subprocess.run([str(ROOT / "run_train.sh"), *FAST[2:], "--job.dump_folder", str(tmp_path / "run"),
                             "--training.steps", "2", *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0], output[-3000:]
    assert "ChildFailedError" not in output and "Traceback" not in output, output[-3000:]


def test_a_hub_dataset_neither_reachable_nor_cached_is_one_line_in_the_preflight(tmp_path, monkeypatch, capsys):
    """--data.dataset cerebras/SlimPajama-627B on a node without network: half a minute of retries, then a 70-line
    traceback (exit 1). Now the preflight says in one line, at once, that it is neither reachable nor cached and
    how to download it; the hub is asked once (mocked here: the test needs no network and makes no request)."""
    import datasets.config
    import huggingface_hub
    from datasets.naming import camelcase_to_snakecase
    from huggingface_hub.errors import RepositoryNotFoundError

    from hola_titan.data.sources import DataError, hub_documents, resolve_source
    from hola_titan.preflight import main as preflight_main

    name = "cerebras/SlimPajama-627B"
    argv = ["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path / "run"), "--data.dataset", name]
    # HF_HUB_OFFLINE=1 and an empty cache, as a user would launch it.
    begin = time.time()
    env = {k: v for k, v in _env().items() if k not in ("HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE")}
    result = subprocess.run([sys.executable, "-m", "hola_titan.preflight", *argv], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=env | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: data.dataset: {name!r} is not in the datasets cache {tmp_path / 'hf'}")
    for part in ("HF_HUB_OFFLINE is set", f"datasets.load_dataset({name!r})", "HF_DATASETS_CACHE",
                 f"hf download --repo-type dataset {name}"):
        assert part in line, line
    assert time.time() - begin < 30
    # Without HF_HUB_OFFLINE: one request of the hub, which does not answer.
    calls = []

    def unreachable(self, repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("timeout")))
        raise ConnectionError("simulated: [Errno -2] Name or service not known")

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    assert preflight_main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert (f"error: data.dataset: {name!r} is not reachable on the Hugging Face hub from this node (ConnectionError: "
            f"simulated: [Errno -2] Name or service not known) and not in the datasets cache {tmp_path / 'cache'}; "
            "on a machine with network") in line
    assert calls == [(name, 10.0)]
    # In datasets' cache (as load_dataset leaves it), it is read from there: a warning, and the launch goes on.
    owner, _, short = name.partition("/")
    (tmp_path / "cache" / f"{owner}___{camelcase_to_snakecase(short)}" / "default" / "0.0.0" / "abc").mkdir(
        parents=True)
    assert preflight_main(argv) == 0
    assert "will be read from the datasets cache" in capsys.readouterr().err
    # A name the hub does not know.
    def not_found(self, repo_id, **kwargs):
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its constructor wants an HTTP response
        Exception.__init__(error, "404 Client Error")
        raise error

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", not_found)
    assert preflight_main([*argv[:-1], "cerebras/SlimPajamas"]) == 2
    assert "the Hugging Face hub has no dataset 'cerebras/SlimPajamas'" in capsys.readouterr().err
    # A worker started without the preflight: datasets' own error, once its retries are spent, is one line too.
    def no_hub(*args, **kwargs):
        raise ConnectionError(f"Couldn't reach {name!r} on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(DataError, match=r"Couldn't reach .* on the Hub \(LocalEntryNotFoundError\), and it is not in "
                                        r"the datasets cache; on a machine with network"):
        next(hub_documents(resolve_source(name, split="train"), streaming=True))


RESUME = [*FAST, "--checkpoint.enable", "--checkpoint.interval", "4", "--lr_scheduler.warmup_steps", "2",
          "--optimizer.lr", "1e-3"]


def _lrs(folder: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in _strict_rows(folder) if "lr" in r}


def test_a_changed_learning_rate_is_applied_on_resume_and_logged(tmp_path, caplog):
    Trainer(parse_config([*RESUME, "--job.dump_folder", str(tmp_path), "--training.steps", "4"])).train()
    reference = tmp_path / "reference"
    Trainer(parse_config([*RESUME, "--job.dump_folder", str(reference), "--training.steps", "4"])).train()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        Trainer(parse_config([*RESUME, "--job.dump_folder", str(tmp_path), "--training.steps", "6",
                              "--optimizer.lr", "5e-4"])).train()
    assert "resume: optimizer.lr changed: 0.001 -> 0.0005" in caplog.text
    from hola_titan.optim import Schedule
    schedule = Schedule(warmup_steps=2, total_steps=4, decay_type="cosine", min_lr_factor=0.1)
    # Step 5 runs at the new peak times the factor the old schedule had reached at step 4 (its end: 0.1), and
    # the longer run continues from there without a jump.
    assert _lrs(tmp_path)[5] == pytest.approx(5e-4 * schedule(4))
    assert "schedule from step 4" in caplog.text  # training.steps 4 -> 6 after the warmup: anchored at step 4


def test_more_steps_on_resume_continue_the_decay_without_a_jump(tmp_path, caplog):
    uninterrupted = tmp_path / "uninterrupted"
    Trainer(parse_config([*RESUME, "--job.dump_folder", str(uninterrupted), "--training.steps", "8",
                          "--checkpoint.enable", "false"])).train()
    Trainer(parse_config([*RESUME, "--job.dump_folder", str(tmp_path), "--training.steps", "8"])).train()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        Trainer(parse_config([*RESUME, "--job.dump_folder", str(tmp_path), "--training.steps", "16",
                              "--checkpoint.load_step", "4"])).train()
    assert "resume: training.steps changed: 8 -> 16" in caplog.text and "schedule from step 4" in caplog.text
    lrs, before = _lrs(tmp_path), _lrs(uninterrupted)
    assert lrs[5] == pytest.approx(before[5])  # the first resumed step keeps the learning rate it would have had
    assert all(lrs[s + 1] <= lrs[s] + 1e-12 for s in range(5, 16))  # and it decays monotonically
    from hola_titan.optim import Schedule
    old = Schedule(warmup_steps=2, total_steps=8, decay_type="cosine", min_lr_factor=0.1)
    new = Schedule(warmup_steps=2, total_steps=16, decay_type="cosine", min_lr_factor=0.1, anchor_step=4,
                   anchor_factor=old(4))
    assert lrs[16] == pytest.approx(1e-3 * new(15)) and lrs[8] > before[8]  # toward the floor, over 16 steps
    assert new(16) == pytest.approx(0.1)


@pytest.mark.parametrize("key, value", [("training.seq_len", "32"), ("model.flavour", "hola_recency"),
                                        ("data.holdout_every", "7"), ("model.window", "4")])
def test_a_resume_that_would_change_the_model_or_the_data_is_refused_naming_the_key(tmp_path, key, value):
    from hola_titan.checkpoint import CheckpointMismatchError

    Trainer(parse_config([*RESUME, "--job.dump_folder", str(tmp_path), "--training.steps", "4"])).train()
    record = (tmp_path / "config.toml").read_text()
    trainer = Trainer(parse_config([*RESUME, "--job.dump_folder", str(tmp_path), "--training.steps", "6",
                                    f"--{key}", value]))
    with pytest.raises(CheckpointMismatchError, match=rf"^{key}: .* in the run that wrote .*step-4, .* now; a resumed "
                                                      "run cannot change it"):
        trainer.train()
    assert (tmp_path / "config.toml").read_text() == record


def test_the_global_batch_is_kept_across_layouts_unless_set(tmp_path, caplog):
    from hola_titan.checkpoint import CheckpointMismatchError

    run = [*RESUME, "--job.dump_folder", str(tmp_path)]
    Trainer(parse_config([*run, "--training.steps", "4", "--training.local_batch_size", "4"])).train()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        half = Trainer(parse_config([*run, "--training.steps", "5", "--training.local_batch_size", "2"]))
        half.checkpointer.load()
    assert half.degrees.global_batch_size == 4 and half.degrees.grad_accum_steps == 2
    assert "keeping the global batch of 4 rows" in caplog.text
    with pytest.raises(CheckpointMismatchError, match="training.global_batch_size: .* global batch of 4 rows; 3 rows"):
        Trainer(parse_config([*run, "--training.steps", "5", "--training.local_batch_size", "3"])).checkpointer.load()
    explicit = Trainer(parse_config([*run, "--training.steps", "5", "--training.local_batch_size", "2",
                                     "--training.global_batch_size", "2"]))
    explicit.checkpointer.load()
    assert explicit.degrees.global_batch_size == 2 and explicit.degrees.grad_accum_steps == 1


def test_a_run_says_what_it_runs_at_the_start_and_how_it_ended(tmp_path, caplog, monkeypatch):
    from hola_titan.data import token_stream

    monkeypatch.setattr(token_stream, "_PROGRESS_S", -1.0)  # every chunk of documents reports
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(1200)))
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2",
                              "--data.dataset", str(docs), "--data.holdout_every", "10",
                              "--job.description", "a test of the summary"])).train()
    text = caplog.text
    order = [text.index(part) for part in ("starting a hola debug run", "tokenising", ": step 0, training to step")]
    assert order == sorted(order)
    for part in ("(a test of the summary): step 0", "model: hola debug, 1,578,000 parameters",
                 "layout: 1 process(es) on cpu", "token mixer reference",
                 "every 10th document held out for validation", "checkpoints: off", "MFU against"):
        assert part in text, part
    assert "run ended at step 2 of 2, last logged loss" in text


def test_importing_the_hf_model_prints_nothing():
    result = subprocess.run([sys.executable, "-c", "import hola_titan.hf_model"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result.stderr[-2000:]


def test_the_checkout_root_hides_no_installed_package():
    """Launched from the checkout (``python -m``, ``python -c``, run_train.sh), the root is the first entry of
    sys.path, so a package or module there would take the place of an installed distribution of the same name. A
    top-level ``kernels/`` did: transformers 5 imports Hugging Face's ``kernels`` package, and got ours."""
    names = sorted(p.stem for p in ROOT.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py")
    assert names == ["hola_titan"], f"importable from the checkout root besides hola_titan: {names}"


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_two_node_run_on_one_host_equals_one_process(tmp_path):
    """Two ``run_train.sh`` launches with ``NNODES=2`` and ``NODE_RANK`` 0 and 1 (one process each, FSDP over
    both, gloo) train the same steps as one process with the same global batch: the multi-node launch path."""
    steps = ["--training.steps", "3", "--training.global_batch_size", "4", "--training.deterministic",
             "--model.attention_backend", "sdpa"]
    single = Trainer(parse_config([*FAST, *steps, "--job.dump_folder", str(tmp_path / "one"),
                                   "--training.local_batch_size", "4"]))
    expected = [r["loss"] for r in single.train() if "loss" in r]
    port = str(_free_port())
    env = _env() | {"NGPU": "1", "NNODES": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": port,
                    "CONFIG_FILE": DEBUG, "PYTHON": sys.executable}
    launches = [subprocess.Popen([str(ROOT / "run_train.sh"), *FAST[2:], *steps, "--training.local_batch_size", "2",
                                  "--job.dump_folder", str(tmp_path / "two")], cwd=ROOT,
                                 env=env | {"NODE_RANK": str(node)}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
                for node in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in launches]
    for p, out in zip(launches, outputs):
        assert p.returncode == 0, out[-3000:]
    assert "layout: 2 process(es) on cpu: data-parallel 1 x 2" in outputs[0]
    losses = [r["loss"] for r in _strict_rows(tmp_path / "two") if "loss" in r]
    assert len(losses) == len(expected) == 3
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(losses, expected)), (losses, expected)


def test_a_full_disk_while_logging_is_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    from hola_titan.metrics import MetricsLogger
    from hola_titan.train import main

    def full(self, row):
        raise OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(MetricsLogger, "log", full)
    assert main([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "2"]) == 2
    err = capsys.readouterr().err
    assert (f"error: writing {tmp_path / 'metrics.jsonl'} failed: no space left on the device (" in err
            and " MiB free in " in err and "intact" in err), err


def test_a_fallback_of_auto_is_explained_and_can_be_refused(monkeypatch):
    """The backend is decided once per model with its reason; an auto fallback to the reference on a GPU warns,
    or refuses with model.require_fast_path; an explicit backend that cannot take the head dim is an error."""
    import torch

    from hola_titan.kernels import dispatch
    from hola_titan.kernels.gdn import fla_bridge
    from hola_titan.ops import explain_backend
    from hola_titan.train import fast_path_check

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert explain_backend("auto", cpu, head_dim=64) == ("reference", "auto: no CUDA device")
    assert explain_backend("reference", cpu, head_dim=64) == ("reference", "as set")
    with pytest.raises(ValueError, match="head dim 48"):
        explain_backend("sdpa", cpu, head_dim=48)
    monkeypatch.setattr(dispatch, "gpu_kernels_available", lambda: False)
    monkeypatch.setattr(fla_bridge, "fla_version", lambda: "0.5.0")
    chosen, why = explain_backend("auto", cuda, head_dim=256)
    assert chosen == "reference" and why == "auto: fla-core 0.5.0 is installed, the adapter is written against 0.6.0"
    assert "falls back to the PyTorch reference on this GPU (auto: fla-core 0.5.0" in fast_path_check(
        chosen, why, device_type="cuda", backend="auto", require=False)
    with pytest.raises(ConfigError, match="model.require_fast_path: the Triton kernels cannot run here"):
        fast_path_check(chosen, why, device_type="cuda", backend="auto", require=True)
    assert fast_path_check("reference", "auto: no CUDA device", device_type="cpu", backend="auto",
                           require=True) is None


def test_keeping_the_cache_output_needs_the_triton_backend(tmp_path):
    """``model.save_cache_output`` on a run whose backend is not Triton (here the CPU's reference) is refused at
    the start, naming the key, before the run folder holds more than its lock."""
    folder = tmp_path / "run"
    with pytest.raises(ConfigError, match="model.save_cache_output: needs the Triton attention backend; this run "
                                          "uses reference"):
        Trainer(parse_config([*FAST, "--model.save_cache_output", "true", "--job.dump_folder", str(folder)]))
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]


def test_choosing_the_cache_kernels_needs_the_triton_backend(tmp_path):
    """``model.cache_kernels = triton`` on a run whose auto backend resolved to the reference (a CPU) is refused
    at the start, naming the key, as the config check refuses an explicit reference or sdpa backend."""
    folder = tmp_path / "run"
    with pytest.raises(ConfigError, match="model.cache_kernels: needs the Triton attention backend; this run "
                                          "uses reference"):
        Trainer(parse_config([*FAST, "--model.cache_kernels", "triton", "--job.dump_folder", str(folder)]))
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]


def test_bytes_that_are_not_utf8_or_not_gzip_are_named_by_file_and_line(tmp_path):
    from hola_titan.data.sources import DataError, read_documents, resolve_source

    cases = {"a.jsonl": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "a.jsonl line 2: not valid UTF-8"),
             "b.jsonl.gz": (b"not gzip at all", "b.jsonl.gz: not a readable gzip file"),
             "c.jsonl.gz": (gzip.compress(b'{"text": "x"}\n\xff\n'), "c.jsonl.gz line 2: not valid UTF-8")}
    for name, (raw, expected) in cases.items():
        path = tmp_path / name
        path.write_bytes(raw)
        with pytest.raises(DataError, match=re.escape(expected)):
            list(read_documents(resolve_source(str(path), split="train")))


def test_a_dataset_smaller_than_a_batch_or_repeated_is_said_at_start(tmp_path, caplog):
    from hola_titan.data.loader import repetition_note

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "one short sentence, the whole dataset."}) + "\n")
    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2",
                                    "--data.dataset", str(data)]))
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if "fewer than one global batch" in r.getMessage()]
    assert len(lines) == 1 and "2 rows x 64 tokens = 128" in lines[0], caplog.text[-2000:]
    bundled = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "run2"), "--training.steps", "2"]))
    assert repetition_note(bundled.dataloader, steps=2, rows_per_step=2) is None
    note = repetition_note(bundled.dataloader, steps=10**7, rows_per_step=2)
    assert note is not None and "read it" in note and "times (epochs reshuffled)" in note


def test_a_run_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A read-only file system (simulated: the tests may run as root, whom permissions do not stop)."""
    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match=r"job.dump_folder: .*run: the run folder cannot be written \(Permission "
                                          r"denied\)"):
        Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "run")]))
    with pytest.raises(ConfigError, match="job.dump_folder: .* is a file, not a folder"):
        Trainer(parse_config([*FAST, "--job.dump_folder", str(Path(__file__) / "run")]))


def test_a_resume_on_changed_data_is_refused_naming_the_file(tmp_path, caplog):
    from hola_titan.checkpoint import CheckpointMismatchError

    data = tmp_path / "docs.jsonl"

    def write(word):
        data.write_text("".join(json.dumps({"text": f"{word} document {i} " * 20}) + "\n" for i in range(40)))

    write("first")
    run = [*FAST, "--job.dump_folder", str(tmp_path / "run"), "--data.dataset", str(data), "--data.holdout_every",
           "0", "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "2"]
    Trainer(parse_config(run)).train()
    longer = [*run[:-1], "4"]
    stamp = data.stat().st_mtime_ns
    os.utime(data, ns=(stamp + 10**9, stamp + 10**9))  # touched, same bytes: resumes, and says so
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        Trainer(parse_config([*longer[:-1], "3"])).train()
    assert "have new modification times but the same content" in caplog.text
    write("other")  # replaced at the same path
    with pytest.raises(CheckpointMismatchError, match=f"data.dataset: {re.escape(str(data))} changed since the "
                                                      f"checkpoint's run read it .*data.allow_changed_data"):
        Trainer(parse_config(longer)).train()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hola_titan"):
        rows = Trainer(parse_config([*longer, "--data.allow_changed_data", "true"])).train()
    assert rows[-1]["step"] == 4 and "continuing on the new data" in caplog.text
def test_the_start_shows_a_small_matmul_rate_and_warns_of_a_warmup_past_the_end(tmp_path, caplog, monkeypatch):
    import hola_titan.train as train_module

    monkeypatch.setattr(train_module, "measured_matmul_tflops", lambda device: 0.0123)  # a loaded CPU
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "a"), "--training.steps", "2",
                              "--lr_scheduler.warmup_steps", "5"])).train()
    assert "MFU against 0.0123 TFLOP/s" in caplog.text and "matmul rate measured here 0.0123" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if "lr_scheduler.warmup_steps 5 >= training.steps 2" in
                r.getMessage()]
    assert len(warnings) == 1 and "still warming up when the run ends" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "b"), "--training.steps", "2",
                              "--lr_scheduler.warmup_steps", "1"])).train()
    assert "warming up" not in caplog.text


def test_the_first_steps_after_a_resume_are_held_to_the_checkpoint_s_running_mean(tmp_path):
    """A damaged checkpoint that loads (here: its first steps' losses 60 times the recorded running mean, what
    flipped weight bytes gave) stops the run before anything is saved over it, although the spike guard's warm-up
    of 20 steps has not passed."""
    run = [*FAST, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.interval", "4"]
    Trainer(parse_config([*run, "--training.steps", "8"])).train()
    resumed = Trainer(parse_config([*run, "--training.steps", "12"]))
    _poison(resumed, from_step=9, factor=60.0)
    with pytest.raises(RuntimeError, match="first steps after the resume do not continue the checkpoint's run .*"
                                           "at step 9 is more than 4 times the running mean.*checkpoint.load_step"):
        resumed.train()
    assert list_checkpoints(tmp_path / "checkpoint") == [4, 8]
    healthy = Trainer(parse_config([*run, "--training.steps", "10"]))
    healthy.train()  # an ordinary resume passes the same watch
    assert healthy.state.step == 10


def test_retention_keeps_the_newest_healthy_checkpoint(tmp_path):
    """keep_latest_k 1 and a checkpoint every step: step 9's loss blows up (finite, before the spike guard is armed),
    step 10's is not finite. A checkpoint is judged by the first loss from its weights: step 8's by step 9's (so it
    is unhealthy, and removed), step 9's by step 10's. Step 7, the newest healthy one, is still there."""
    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "12",
                                    "--checkpoint.enable", "--checkpoint.interval", "1",
                                    "--checkpoint.keep_latest_k", "1"]))
    _poison(trainer, from_step=9, factor=60.0)
    _poison(trainer, from_step=10, factor=float("nan"))
    with pytest.raises(RuntimeError, match="at step 10 is not finite"):
        trainer.train()
    folder = tmp_path / "checkpoint"
    assert list_checkpoints(folder) == [7, 9]
    assert recorded_healthy(folder / "step-7") and not recorded_healthy(folder / "step-9")


def test_a_data_file_edited_in_its_middle_is_refused_on_resume_and_tokenised_again(tmp_path):
    """One byte changed in the middle of a file larger than 2 MiB, its size and modification time put back: the
    bytes at both ends, all the fingerprint once held, are the same, and the run trained on other tokens."""
    from hola_titan.checkpoint import CheckpointMismatchError

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"entry {i}: " + "lorem ipsum " * 200}) + "\n" for i in range(900)))
    assert data.stat().st_size > 2 << 20
    cache = tmp_path / "cache"
    run = [*FAST, "--job.dump_folder", str(tmp_path / "run"), "--job.cache_folder", str(cache), "--data.dataset",
           str(data), "--data.holdout_every", "0", "--checkpoint.enable", "--checkpoint.interval", "2",
           "--training.steps", "2"]
    first = Trainer(parse_config(run))
    first.train()
    before = data.stat()
    raw = bytearray(data.read_bytes())
    middle = raw.index(b"lorem", len(raw) // 2)
    raw[middle:middle + 5] = b"LOREM"
    data.write_bytes(raw)
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(CheckpointMismatchError, match=f"data.dataset: {re.escape(str(data))} changed since the "
                                                      f"checkpoint's run read it \\({re.escape(str(data))}: other "
                                                      "content at the same size"):
        Trainer(parse_config([*run[:-1], "4"])).train()
    # The refused start tokenised the edited file anew (its content hash is in the token cache's key).
    assert len(list((cache / "tokens").glob("*.npz"))) == 2 and len(list((cache / "data_hashes").glob("*.json"))) == 2


def test_a_checkpoint_with_the_earlier_data_fingerprint_resumes_with_one_warning(tmp_path, caplog):
    from hola_titan.config import Data
    from hola_titan.data import build_dataloader, load_tokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    kwargs = dict(data=Data(dataset=str(data), holdout_every=0), tokenizer=load_tokenizer("bundled"), seq_len=32,
                  local_batch_size=2)
    loader = build_dataloader(**kwargs)
    next(iter(loader))
    state = loader.state_dict()
    old = json.loads(state["fingerprint"])
    for entry in old["files"]:  # what checkpoints held before content hashes
        del entry["sha256"]
    state["fingerprint"] = json.dumps(old)
    with caplog.at_level(logging.WARNING, logger="hola_titan"):
        build_dataloader(**kwargs).load_state_dict(state)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "could not be compared by content" in lines[0] and str(data) in lines[0], lines


def _without_root_s_permission_override() -> list[str]:
    """A command prefix under which permission bits stop this user: none for another user; for root, ``setpriv``
    without the capabilities that let root write anywhere (skipped where it cannot drop them)."""
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    try:
        dropped = subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0
    except OSError:
        dropped = False
    if not dropped:
        pytest.skip("root writes into a read-only folder, and setpriv cannot drop that capability here")
    return prefix


def _listing(folder: Path) -> list[tuple[str, int]]:
    """Every path below ``folder`` (links not followed) with its mode: what a refused start must leave as it was."""
    return sorted((str(p.relative_to(folder)), p.lstat().st_mode) for p in folder.rglob("*"))


@pytest.mark.parametrize("case", ["symlink_loop", "name_too_long", "read_only_checkpoints", "toml_not_utf8"])
def test_a_bad_folder_or_config_file_is_one_line_at_start_with_exit_2_and_nothing_made(tmp_path, case):
    """Each stopped with a traceback (a loop, a long name, invalid UTF-8) or only at the first save (read-only)."""
    run = tmp_path / "run"
    args = [*FAST, "--job.cache_folder", "", "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval",
            "1"]
    launchers, prefix = ["train"], []
    if case == "symlink_loop":
        (tmp_path / "a").symlink_to(tmp_path / "b")
        (tmp_path / "b").symlink_to(tmp_path / "a")
        run = tmp_path / "a" / "run"
        expected = f"job.dump_folder: {run}: {tmp_path / 'a'} is a symbolic link loop"
    elif case == "name_too_long":
        run = tmp_path / ("r" * 300)
        expected = f"job.dump_folder: {run}: the name rrrr"
    elif case == "read_only_checkpoints":
        prefix = _without_root_s_permission_override()
        (run / "checkpoint").mkdir(parents=True)
        (run / "checkpoint").chmod(0o555)
        expected = f"checkpoint.folder: {run / 'checkpoint'}: cannot write files there (Permission denied)"
        launchers = ["train", "run_train.sh"]
    else:
        config = tmp_path / "latin1.toml"
        config.write_bytes(Path(DEBUG).read_bytes() + b'\n[job]\ndescription = "caf\xe9"\n')
        args = [*args, "--job.config_file", str(config)]
        line = config.read_bytes().count(b"\n")
        expected = f"job.config_file: '{config}' line {line} (byte offset "
        launchers = ["run_train.sh"]
    before = _listing(tmp_path)
    for launcher in launchers:
        if launcher == "train":
            command = [sys.executable, "-m", "hola_titan.train", *args, "--job.dump_folder", str(run)]
            env = _env()
        else:  # the launcher's one-process check, before torchrun (its arguments, without --job.config_file)
            command = [str(ROOT / "run_train.sh"), *args[2:], "--job.dump_folder", str(run)]
            env = _env() | {"NGPU": "1", "CONFIG_FILE": DEBUG, "PYTHON": sys.executable}
        result = subprocess.run([*prefix, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], (launcher, result.stderr[-3000:])
        assert "Traceback" not in result.stderr and "torchrun" not in result.stderr
    assert _listing(tmp_path) == before


def test_a_file_size_limit_is_named_and_not_reported_as_a_full_disk(tmp_path, monkeypatch, capsys):
    import resource

    from hola_titan.checkpoint import CheckpointError
    from hola_titan.metrics import MetricsLogger
    from hola_titan.train import main

    trainer = Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2",
                                    "--checkpoint.enable", "--checkpoint.interval", "2"]))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # the debug model's checkpoint is larger
    try:
        with pytest.raises(CheckpointError) as caught:
            trainer.train()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(caught.value)
    assert "a file reached the file size limit of 1.0 MiB (1,048,576 bytes" in message, message
    assert "no space" not in message and "free" not in message
    assert [p.name for p in (tmp_path / "run" / "checkpoint").iterdir()] == [".lock"]  # the run's lock only

    def too_large(self, row):
        raise OSError(27, "File too large", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(MetricsLogger, "log", too_large)
    assert main([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"error: writing {tmp_path / 'metrics.jsonl'} failed: a file reached " in err and "no space" not in err


def test_a_step_folder_without_metadata_is_named_and_skipped(tmp_path, caplog):
    run = [*FAST, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.interval", "2"]
    Trainer(parse_config([*run, "--training.steps", "4"])).train()
    (tmp_path / "checkpoint" / "step-4" / ".metadata").unlink()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        assert Trainer(parse_config([*run, "--training.steps", "6"])).checkpointer.load() == 2
    assert "step-4 has no .metadata file" in caplog.text and "resuming from step 2" in caplog.text


def test_two_runs_never_write_one_checkpoint_folder(tmp_path):
    """Two run folders that name one absolute checkpoint.folder: the second run is refused while the first runs."""
    shared = tmp_path / "shared_checkpoints"
    run = [*LONG, "--checkpoint.enable", "--checkpoint.folder", str(shared)]
    first = subprocess.Popen([sys.executable, "-m", "hola_titan.train", *run, "--job.dump_folder",
                              str(tmp_path / "a")], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        pid = _lock_holder(shared)
        with pytest.raises(ConfigError, match=rf"checkpoint.folder: {shared} is in use by process {pid} on .*"
                                              "choose another checkpoint.folder"):
            Trainer(parse_config([*run, "--job.dump_folder", str(tmp_path / "b")]))
        assert not (tmp_path / "b" / ".lock").exists() or _lock_free(tmp_path / "b")
    finally:
        first.kill()
        first.wait(timeout=60)


def _lock_free(folder: Path) -> bool:
    """Whether no process holds ``folder``'s lock (a refused run gave back what it took)."""
    from hola_titan.runfolder import FolderInUseError, RunFolderLock
    try:
        RunFolderLock(folder).probe()
    except FolderInUseError:
        return False
    return True


def test_conversion_takes_the_model_the_checkpoint_records(tmp_path):
    """A later run in the same folder (another window, no checkpoints) rewrote config.toml: the export of the
    earlier step still has the window it was trained with, and the script says the folder's file differs."""
    Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "2", "--checkpoint.enable",
                          "--checkpoint.interval", "2"])).train()
    Trainer(parse_config([*FAST, "--job.dump_folder", str(tmp_path), "--training.steps", "1",
                          "--model.window", "16"])).train()
    assert "window = 16" in (tmp_path / "config.toml").read_text()
    result = subprocess.run([sys.executable, "scripts/convert_to_safetensors.py", str(tmp_path / "checkpoint" /
                             "step-2"), str(tmp_path / "export")], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "export" / "config.json").read_text())["window"] == 8
    # None: the run left model.window to its size's value (8).
    assert "model.window (16 there, None in the checkpoint)" in result.stderr, result.stderr[-2000:]
    assert "using the config recorded in" in result.stdout


def test_the_cause_of_a_failed_write_is_found_behind_chains_and_per_rank_failures():
    """One walk (staging.error_chain) finds a full disk behind a wrapped error, behind DCP's per-rank failures and in a
    Rust writer's text, and ends on a cause loop; the checkpointer and the exporters both read it."""
    import errno as errno_module

    from hola_titan.staging import _errno_of, describe_write_error, error_chain

    full = OSError(errno_module.ENOSPC, "No space left on device", "/ckpt/step-9.tmp/__0_0.distcp")
    wrapped = RuntimeError("unexpected pos 512 vs 4096")
    wrapped.__cause__ = full
    per_rank = RuntimeError("CheckpointException ranks:dict_keys([1])")
    per_rank._failures = {1: (wrapped, "traceback text")}
    assert _errno_of(per_rank) == (errno_module.ENOSPC, "/ckpt/step-9.tmp/__0_0.distcp")
    assert [type(e) for e in error_chain(per_rank)] == [RuntimeError, RuntimeError, OSError]
    assert describe_write_error(per_rank, Path("/")).startswith("no space left on the device")

    loop_a, loop_b = ValueError("a"), ValueError("b (os error 27)")
    loop_a.__context__, loop_b.__context__ = loop_b, loop_a
    assert len(error_chain(loop_a)) == 2
    assert _errno_of(loop_a) == (errno_module.EFBIG, None)
    assert _errno_of(ValueError("a wrong key")) == (None, None)


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_64"])
def test_one_folder_check_serves_both_manifests(tmp_path, hash_name):
    """hola_titan/manifests.py: a truncated file is named from the sizes before any digest is read (a changed byte
    in an earlier file is found only after), a missing one as missing, a changed byte by its digest."""
    from hola_titan.manifests import file_records, first_mismatch

    (tmp_path / "a.bin").write_bytes(b"a" * 1000)
    (tmp_path / "b.bin").write_bytes(b"b" * 1000)
    (tmp_path / "manifest.json").write_text("{}")
    records = file_records(tmp_path, hash_name=hash_name, key="d", skip=lambda name: name == "manifest.json")
    assert list(records) == ["a.bin", "b.bin"]
    files = {name: (r["size"], r["d"]) for name, r in records.items()}
    assert first_mismatch(tmp_path, files, hash_name=hash_name) is None
    (tmp_path / "a.bin").write_bytes(b"x" + b"a" * 999)
    (tmp_path / "b.bin").write_bytes(b"b" * 999)
    wrong = first_mismatch(tmp_path, files, hash_name=hash_name)
    assert (wrong.name, wrong.kind, wrong.found, wrong.expected) == ("b.bin", "size", 999, 1000)
    (tmp_path / "b.bin").write_bytes(b"b" * 1000)
    assert first_mismatch(tmp_path, files, hash_name=hash_name).kind == "digest"
    assert first_mismatch(tmp_path, files, hash_name=hash_name, checksums=False) is None
    (tmp_path / "b.bin").unlink()
    assert first_mismatch(tmp_path, files, hash_name=hash_name).kind == "missing"
    with pytest.raises(ValueError, match="expected one of"):
        first_mismatch(tmp_path, {"a.bin": (1000, "0")}, hash_name="md5")
