"""Checkpoints on CPU: exact resume, async saves killed mid-write, torchrun restarts, resharding, model-only starts,
corrupt folders, and conversion of a sharded checkpoint.

Every run is the debug model at 128 tokens x 4 rows per micro-batch, global batch 8, deterministic, with the SDPA
HOLA backend (the reference backend is ~10x slower on CPU and computes the same function). One process runs two
accumulation micro-batches of 4 rows; two FSDP processes run one each, so both see the same rows per step.

Tolerances: a resumed run in the same process must repeat the uninterrupted losses bit for bit (same ops on the
same bits). Across processes and layouts the rows and weights are the same but reductions are ordered differently
(all-reduce of two halves vs. one sum), so losses are compared to 1e-6 relative: float32 rounding of a ~8.0 loss
over one step is ~1e-7, and any wrong weight, optimizer moment or data row moves it by 1e-3 or more.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hola_titan.checkpoint import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError,
                                   create_seed_checkpoint, list_checkpoints, step_folder)
from hola_titan.config import parse_config
from hola_titan.export import load_pretrained
from hola_titan.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
STEPS = 12
RUN = ["--job.config_file", DEBUG, "--training.seq_len", "128", "--training.local_batch_size", "4",
       "--training.global_batch_size", "8", "--training.steps", str(STEPS), "--training.deterministic",
       "--validation.enable", "false", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
       "--model.attention_backend", "sdpa", "--checkpoint.enable", "--checkpoint.interval", "6"]
REL = 1e-6


# One pytest-xdist worker runs the module: its module-scoped fixtures are made once.
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.xdist_group("test_checkpoint")]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HOLA_TITAN_CACHE"] = env.get("HOLA_TITAN_CACHE", str(ROOT / ".pytest_cache" / "hola_titan"))
    env["OMP_NUM_THREADS"] = "1"
    # torchrun restarts: workers that share the rendezvous store read the previous attempt's gloo addresses and
    # fail to connect in about 2 of 3 restarts (pytorch/pytorch#135712); a store per attempt avoids that.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env | extra


def _losses(folder: Path) -> dict[int, float]:
    """Step -> loss from metrics.jsonl; a step logged twice (a restarted run) keeps its last value."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(1.0, abs(b))


def _train_in_process(dump: Path, *extra: str) -> Trainer:
    trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(dump), *extra]))
    trainer.train()
    return trainer


def _torchrun(dump: Path, nproc: int, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = (env or _env()) | {"NGPU": str(nproc), "CONFIG_FILE": DEBUG, "LOG_RANK": "0,1", "PYTHON": sys.executable}
    return subprocess.run([str(ROOT / "run_train.sh"), *RUN[2:], "--job.dump_folder", str(dump), *extra],
                          env=env, capture_output=True, text=True, timeout=400)


def _torchrun_with_fault(dump: Path, nproc: int, fault: list[str], *, max_restarts: int) -> subprocess.CompletedProcess:
    """torchrun over ``tests/fault_train.py`` (the trainer with ``fault`` injected in the first attempt)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "--max-restarts", str(max_restarts), "--local-ranks-filter", "0,1",
           "--tee", "3", str(ROOT / "tests" / "fault_train.py"), *fault, "--", *RUN, "--job.dump_folder", str(dump)]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)


def _copy_step(src_dump: Path, step: int, dst_dump: Path) -> None:
    shutil.copytree(step_folder(src_dump / "checkpoint", step), step_folder(dst_dump / "checkpoint", step))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The uninterrupted single-process run: 12 steps, checkpoints at 6 and 12."""
    dump = tmp_path_factory.mktemp("one_process")
    trainer = _train_in_process(dump)
    return {"dump": dump, "losses": _losses(dump), "model": trainer.model}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    """Two FSDP (gloo) processes under ``torchrun --max-restarts 1``, checkpoints at 6 and 12; rank 1 kills itself
    after step 11, torchrun restarts both ranks, and they resume from step 6 and finish. ``first`` and ``second``
    are the losses the two attempts logged (steps 1-11 and 7-12)."""
    dump = tmp_path_factory.mktemp("two_processes")
    result = _torchrun_with_fault(dump, 2, ["--kill-after-step", "11", "--kill-rank", "1"], max_restarts=1)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    losses = [r["loss"] for r in rows if "loss" in r]
    return {"dump": dump, "output": output, "first": dict(zip(steps[:restart], losses[:restart])),
            "second": dict(zip(steps[restart:], losses[restart:]))}


def test_resume_repeats_the_uninterrupted_run_bit_for_bit(one_process, tmp_path, caplog):
    assert list_checkpoints(one_process["dump"] / "checkpoint") == [6, 12]
    _copy_step(one_process["dump"], 6, tmp_path)
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        trainer = _train_in_process(tmp_path)
    assert "resuming from step 6" in caplog.text
    resumed = _losses(tmp_path)
    assert sorted(resumed) == list(range(7, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == one_process["losses"][step], (step, loss, one_process["losses"][step])
    assert trainer.state.step == STEPS and trainer.state.tokens_seen == STEPS * 8 * 128
    for (name, a), b in zip(trainer.model.named_parameters(), one_process["model"].parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("how", ["resume", "initial_load_path"])
def test_a_checkpoint_of_another_flavour_is_refused_naming_the_key(one_process, tmp_path, how):
    """A HOLA checkpoint resumed, or loaded, as GDN: one line naming model.flavour (from the config the checkpoint
    recorded), not the parameter names that differ; nothing is written."""
    if how == "resume":
        _copy_step(one_process["dump"], 6, tmp_path)
        extra = []
    else:
        extra = ["--checkpoint.initial_load_path", str(step_folder(one_process["dump"] / "checkpoint", 6))]
    with pytest.raises(CheckpointMismatchError, match=r"another model: model.flavour: 'hola' there, 'gdn' now"):
        _train_in_process(tmp_path, "--model.flavour", "gdn", *extra)
    assert not (tmp_path / "metrics.jsonl").exists() or not _losses(tmp_path)


def test_async_save_killed_midway_resumes_from_last_complete(one_process, tmp_path):
    """SIGKILL inside the background save of step 9: steps 3 and 6 survive, the restart resumes from 6."""
    run = [*RUN, "--job.dump_folder", str(tmp_path), "--checkpoint.async_mode", "async", "--checkpoint.interval", "3",
           "--checkpoint.keep_latest_k", "3"]
    command = [sys.executable, "-m", "hola_titan.train", *run]
    killed = subprocess.run([sys.executable, str(ROOT / "tests" / "fault_train.py"), "--kill-in-save", "9", "--", *run],
                            env=_env(), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    folder = tmp_path / "checkpoint"
    assert list_checkpoints(folder) == [3, 6]
    assert (folder / "step-9.tmp").is_dir() and not (folder / "step-9").exists()
    before = _losses(tmp_path)
    assert sorted(before) == list(range(1, 10))

    again = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-3000:]
    assert "resuming from step 6" in output and "step-9.tmp" in output
    assert list_checkpoints(folder) == [6, 9, 12]  # keep_latest_k = 3
    assert not list(folder.glob("*.tmp"))
    after = _losses(tmp_path)
    for step in range(1, STEPS + 1):
        assert _close(after[step], one_process["losses"][step]), (step, after[step], one_process["losses"][step])


@pytest.mark.slow
def test_two_processes_rank_killed_torchrun_restarts_and_resumes(two_processes):
    """The restarted pair resumes from the last checkpoint (6) and repeats the losses of steps 7-11."""
    first, second = two_processes["first"], two_processes["second"]
    assert "fault injection" in two_processes["output"] and "resuming from step 6" in two_processes["output"]
    assert sorted(first) == list(range(1, 12)) and sorted(second) == list(range(7, STEPS + 1))
    assert list_checkpoints(two_processes["dump"] / "checkpoint") == [6, 12]
    for step in range(7, 12):
        assert _close(second[step], first[step]), (step, second[step], first[step])


@pytest.mark.slow
def test_reshard_two_processes_to_one_and_back(one_process, two_processes, tmp_path):
    """FSDP 2 -> 1 process and 1 -> 2: the next step's data position and loss match the saving layout's."""
    _copy_step(two_processes["dump"], 6, tmp_path / "to_one")
    trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path / "to_one"), "--training.steps", "7"]))
    trainer.checkpointer.load()
    assert trainer.state.step == 6 and trainer.dataloader.state_dict()["global_rows_consumed"] == 6 * 8
    trainer.train()  # loads again (idempotent) and trains step 7
    loss = _losses(tmp_path / "to_one")[7]
    assert _close(loss, two_processes["first"][7]), (loss, two_processes["first"][7])

    _copy_step(one_process["dump"], 6, tmp_path / "to_two")
    result = _torchrun(tmp_path / "to_two", 2, "--training.steps", "7")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    loss = _losses(tmp_path / "to_two")[7]
    assert _close(loss, one_process["losses"][7]), (loss, one_process["losses"][7])


@pytest.mark.slow
def test_reshard_tensor_parallel_to_one_process(one_process, tmp_path):
    """TP 2 -> 1 process: head-sharded weights and optimizer state saved by two tensor-parallel ranks load into one
    process; the data position and the next step's loss match the uninterrupted one-process run."""
    tp = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]
    result = _torchrun(tmp_path / "tp", 2, "--training.steps", "6", *tp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list_checkpoints(tmp_path / "tp" / "checkpoint") == [6]
    _copy_step(tmp_path / "tp", 6, tmp_path / "one")
    trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path / "one"), "--training.steps", "7"]))
    trainer.checkpointer.load()
    assert trainer.state.step == 6 and trainer.dataloader.state_dict()["global_rows_consumed"] == 6 * 8
    trainer.train()
    loss = _losses(tmp_path / "one")[7]
    assert _close(loss, one_process["losses"][7]), (loss, one_process["losses"][7])


@pytest.mark.slow
def test_convert_sharded_checkpoint_matches_loaded_model(two_processes, tmp_path):
    """scripts/convert_to_safetensors.py on a step saved by two FSDP ranks gives the weights a one-process load
    of the same step has."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import convert_to_safetensors
    finally:
        sys.path.pop(0)
    step = step_folder(two_processes["dump"] / "checkpoint", 12)
    assert convert_to_safetensors.main([str(step), str(tmp_path / "export")]) == 0
    exported, tokenizer = load_pretrained(tmp_path / "export", backend="sdpa")
    _copy_step(two_processes["dump"], 12, tmp_path / "run")
    trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path / "run")]))
    trainer.checkpointer.load()
    loaded = trainer.model.state_dict()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, loaded[name]), name
    tokens = torch.tensor([tokenizer.encode("Once upon a time there was a little cottage by the sea.")])
    with torch.no_grad():
        assert torch.equal(exported(tokens), trainer.model(tokens))


def test_model_only_starts_seed_initial_path_and_safetensors(one_process, tmp_path, caplog):
    """A seed checkpoint (step-0), initial_load_path to a DCP folder, and to a safetensors export: weights only,
    starting at step 0 with a fresh data position."""
    seed_config = parse_config([*RUN, "--job.dump_folder", str(tmp_path / "seeded"), "--training.seed", "7"])
    create_seed_checkpoint(seed_config)
    seeded = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path / "seeded")]))  # seed 0: other init
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        seeded.checkpointer.load()
    assert "model only" in caplog.text and seeded.state.step == 0
    reference = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path / "ref"), "--training.seed", "7"]))
    for (name, a), b in zip(seeded.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name

    trained = one_process["model"]
    step12 = step_folder(one_process["dump"] / "checkpoint", 12)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import convert_to_safetensors
        import import_safetensors
    finally:
        sys.path.pop(0)
    assert convert_to_safetensors.main([str(step12), str(tmp_path / "export")]) == 0
    assert import_safetensors.main([str(tmp_path / "export"), str(tmp_path / "imported")]) == 0
    for source in (step12, tmp_path / "imported", tmp_path / "export"):
        trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path / f"from_{source.name}"),
                                        "--checkpoint.initial_load_path", str(source)]))
        trainer.checkpointer.load()
        assert trainer.state.step == 0 and trainer.dataloader.state_dict()["global_rows_consumed"] == 0
        for (name, a), b in zip(trainer.model.named_parameters(), trained.parameters()):
            assert torch.equal(a, b), (source, name)


def _data_file(step: Path) -> Path:
    return sorted(step.glob("*.distcp"))[0]


def test_corrupt_checkpoint_falls_back_or_fails_naming_it(one_process, tmp_path, caplog):
    for step in (6, 12):
        _copy_step(one_process["dump"], step, tmp_path)
    folder = tmp_path / "checkpoint"
    data = _data_file(step_folder(folder, 12))
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:100])
    trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)]))
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        assert trainer.checkpointer.load() == 6
    assert "step-12" in caplog.text and "truncated" in caplog.text and "falling back" in caplog.text
    assert "resuming from step 6" in caplog.text

    explicit = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path), "--checkpoint.load_step", "12"]))
    with pytest.raises(CheckpointCorruptError, match="step-12.*truncated"):
        explicit.checkpointer.load()

    # Whole files of garbage pass the size check: the checksums catch them; without a manifest DCP's read fails.
    # The same fallback either way.
    data.write_bytes(bytes(size))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        assert Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)])).checkpointer.load() == 6
    assert "does not match its checksum" in caplog.text and "resuming from step 6" in caplog.text
    (step_folder(folder, 12) / "manifest.json").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        assert Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)])).checkpointer.load() == 6
    assert "step-12: no manifest.json, so its bytes cannot be verified" in caplog.text
    assert "resuming from step 6" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hola_titan"):  # allowed, DCP's read is what fails
        assert Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path), "--checkpoint.allow_unverified",
                                     "true"])).checkpointer.load() == 6
    assert "step-12: read error" in caplog.text and "resuming from step 6" in caplog.text

    (step_folder(folder, 6) / ".metadata").unlink()  # now neither is usable
    with pytest.raises(CheckpointCorruptError, match="no loadable checkpoint.*step-12"):
        Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)])).checkpointer.load()
    with pytest.raises(CheckpointCorruptError, match="step-6: no .metadata"):
        Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path),
                              "--checkpoint.load_step", "6"])).checkpointer.load()


def test_changed_bytes_are_caught_by_the_checksums(one_process, tmp_path, caplog):
    """A few KiB flipped in the middle of the newest checkpoint's data file (size unchanged, DCP reads it without
    complaint): the manifest names the file, the run falls back to the previous checkpoint, and an explicit
    load_step refuses. Each checkpoint carries its manifest; the seed checkpoint too."""
    for step in (6, 12):
        _copy_step(one_process["dump"], step, tmp_path)
        assert (step_folder(tmp_path / "checkpoint", step) / "manifest.json").is_file()
    data = _data_file(step_folder(tmp_path / "checkpoint", 12))
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 4096] = bytes(b ^ 0xFF for b in raw[middle:middle + 4096])
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        assert Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)])).checkpointer.load() == 6
    assert f"{data.name} does not match its checksum" in caplog.text and "falling back" in caplog.text
    assert "step-6 verified" in caplog.text and "resuming from step 6" in caplog.text
    explicit = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path), "--checkpoint.load_step", "12"]))
    with pytest.raises(CheckpointCorruptError, match=f"step-12: {data.name} does not match its checksum"):
        explicit.checkpointer.load()
    # A folder from before manifests is refused by name, unless the key allows it: then it loads, saying that it
    # is not verified.
    (step_folder(tmp_path / "checkpoint", 6) / "manifest.json").unlink()
    with pytest.raises(CheckpointCorruptError, match="step-6: no manifest.json.*checkpoint.allow_unverified"):
        Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path)])).checkpointer.load()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hola_titan"):
        assert Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path), "--checkpoint.allow_unverified",
                                     "true"])).checkpointer.load() == 6
    assert "step-6 has no manifest.json" in caplog.text and "not verified" in caplog.text


def test_checkpoint_of_another_model_is_a_mismatch_not_a_fallback(one_process, tmp_path):
    _copy_step(one_process["dump"], 6, tmp_path)
    trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path), "--model.flavour", "gdn"]))
    with pytest.raises(CheckpointMismatchError, match="step-6 was written by a run with another model: model.flavour"):
        trainer.checkpointer.load()


def test_finished_save_whose_rename_was_cut_short_is_promoted(one_process, tmp_path):
    """A complete step-N.tmp (e.g. a background save finished but the process died before renaming it) is
    promoted at the next start instead of being thrown away; an incomplete one is removed."""
    folder = tmp_path / "checkpoint"
    folder.mkdir(parents=True)
    shutil.copytree(step_folder(one_process["dump"] / "checkpoint", 6), folder / "step-6.tmp")
    shutil.copytree(step_folder(one_process["dump"] / "checkpoint", 12), folder / "step-12.tmp")
    (folder / "step-12.tmp" / ".metadata").unlink()  # cut short before DCP wrote its metadata
    trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(tmp_path), "--training.steps", "7"]))
    assert trainer.checkpointer.load() == 6
    assert list_checkpoints(folder) == [6] and not list(folder.glob("*.tmp"))


def test_seed_command_writes_step_0_with_its_manifest(tmp_path, capsys):
    from hola_titan.seed import main as seed_main

    assert seed_main(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path)]) == 0
    assert list_checkpoints(tmp_path / "checkpoint") == [0]
    assert (step_folder(tmp_path / "checkpoint", 0) / "manifest.json").is_file()
    assert seed_main(["--job.config_file", DEBUG, "--no.such_key", "1"]) == 2
    # Never over what is there: a second seed, or a seed into a run's checkpoint folder, is one line, nothing lost.
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.name != ".lock"}  # the lock records its holder
    assert seed_main(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path)]) == 2
    assert "already holds checkpoints (steps 0)" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.name != ".lock"} == before


def _scripts():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import convert_to_safetensors
        import import_safetensors
    finally:
        sys.path.pop(0)
    return convert_to_safetensors, import_safetensors


def test_initial_load_path_loads_without_checkpoint_enable_and_the_run_says_so(one_process, tmp_path, caplog):
    """The route back from safetensors in docs/checkpoints.md (convert, import, --checkpoint.initial_load_path) with
    checkpoint.enable false: the first step runs on the source's weights (checkpoint.enable governs saving and
    resuming only), and the log and paths.json name the weights the run started from."""
    convert, imported = _scripts()
    assert convert.main([str(step_folder(one_process["dump"] / "checkpoint", 12)), str(tmp_path / "export")]) == 0
    assert imported.main([str(tmp_path / "export"), str(tmp_path / "imported")]) == 0
    trained = dict(one_process["model"].named_parameters())
    first_losses = {}
    for source in (tmp_path / "imported", tmp_path / "export", one_process["dump"], None):
        dump = tmp_path / f"from_{source.name if source else 'nothing'}"
        extra = ["--checkpoint.initial_load_path", str(source)] if source else []
        trainer = Trainer(parse_config([*RUN, "--job.dump_folder", str(dump), "--checkpoint.enable", "false",
                                        "--training.steps", "1", *extra]))
        seen = {}
        # After the backward of step 1, before its update: the weights that step ran on.
        trainer.gradient_probe = lambda t: seen.update({n: p.detach().clone() for n, p in t.model.named_parameters()})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hola_titan"):
            trainer.train()
        first_losses[source] = _losses(dump)[1]
        if source is not None:
            for name, tensor in trained.items():
                assert torch.equal(seen[name], tensor), (source, name)
        else:
            assert any(not torch.equal(seen[n], trained[n]) for n in trained)
        weights = json.loads((dump / "paths.json").read_text())["weights"]
        assert f"weights: {weights}" in caplog.text and not (dump / "checkpoint").exists()
        if source is None:
            assert weights == "random init (training.seed 0)"
            continue
        assert weights.startswith(f"checkpoint.initial_load_path {source}") and "weights only" in weights, weights
        if source == one_process["dump"]:  # a run folder: its newest complete step, named in the record
            assert f"({step_folder(source / 'checkpoint', 12)})" in weights, weights
    assert first_losses[tmp_path / "imported"] == first_losses[tmp_path / "export"] == first_losses[one_process["dump"]]
    assert first_losses[None] != first_losses[tmp_path / "imported"]


def test_initial_load_path_that_names_no_checkpoint_is_refused_in_one_line(tmp_path):
    from hola_titan.preflight import main as preflight_main

    (tmp_path / "empty").mkdir()
    for path, match in ((tmp_path / "nowhere", "no such folder"), (tmp_path / "empty", "is not a checkpoint")):
        argv = [*RUN, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "false",
                "--checkpoint.initial_load_path", str(path)]
        assert preflight_main(argv) == 2
        trainer = Trainer(parse_config(argv))
        with pytest.raises(CheckpointError, match=f"^checkpoint.initial_load_path: {path}.*{match}.*pass a step"):
            trainer.train()
        assert not (tmp_path / "run" / "paths.json").exists()


def test_convert_takes_a_run_checkpoint_or_step_folder_and_says_what_to_pass_otherwise(one_process, tmp_path,
                                                                                       capsys):
    convert, _ = _scripts()
    dump = one_process["dump"]
    trained = one_process["model"].state_dict()
    for i, (given, chosen) in enumerate(((dump, 12), (dump / "checkpoint", 12), (dump / "checkpoint" / "step-6", 6))):
        capsys.readouterr()
        assert convert.main([str(given), str(tmp_path / f"out{i}")]) == 0
        out = capsys.readouterr().out
        step = step_folder(dump / "checkpoint", chosen)
        # The model comes from the config the checkpoint recorded (the run folder's file is only a cross-check).
        assert f"from {step} using the config recorded in {step}" in out, out
        if given.name != "step-6":  # a folder above a step: the newest complete one, and it says so
            assert f"converting {step}: step 12, the newest complete checkpoint of the" in out, out
    exported, _ = load_pretrained(tmp_path / "out0", backend="sdpa")
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, trained[name]), name

    # A partial newest step is passed over; pointed at, it is named partial with the folder to pass instead.
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    shutil.copy(dump / "config.toml", run / "config.toml")
    for step in (6, 12):
        _copy_step(dump, step, run)
    (step_folder(run / "checkpoint", 12) / ".metadata").unlink()
    capsys.readouterr()
    assert convert.main([str(run), str(tmp_path / "partial")]) == 0
    assert f"converting {step_folder(run / 'checkpoint', 6)}: step 6, the newest complete" in capsys.readouterr().out
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    shutil.copy(dump / "config.toml", empty_run / "config.toml")
    (tmp_path / "plain").mkdir()
    for given, match in ((step_folder(run / "checkpoint", 12), "partial checkpoint.*pass a complete step, or its "
                          f"checkpoint folder {run / 'checkpoint'}"),
                         (tmp_path / "nowhere", "no such folder; pass a step folder"),
                         (tmp_path / "plain", "is not a checkpoint .*; pass a step folder"),
                         (empty_run, "is a run folder with no complete checkpoint .*--checkpoint.enable"),
                         (tmp_path / "out0", "is an exported safetensors folder, not a training checkpoint; pass")):
        assert convert.main([str(given), str(tmp_path / "never")]) == 2
        line, = capsys.readouterr().err.splitlines()
        assert re.match(f"error: .*{match}", line), line
        assert not (tmp_path / "never").exists()
