"""The trainer end to end on CPU: the debug run, metrics files, torchrun parity, dry-run, FLOPs, errors."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from hola_titan.config import ConfigError, parse_config, validate
from hola_titan.flops import flops_per_token, matmul_params, mean_visible_keys
from hola_titan.models.args import model_args, replace
from hola_titan.models.model import build_model
from hola_titan.optim import lr_lambda
from hola_titan.train import Trainer, main

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")
# Small enough for CI: 128 tokens x 4 rows per step.
FAST = ["--training.seq_len", "128", "--training.local_batch_size", "4", "--validation.steps", "1"]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HOLA_TITAN_CACHE"] = env.get("HOLA_TITAN_CACHE", str(ROOT / ".pytest_cache" / "hola_titan"))
    return env


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_debug_run_loss_falls_and_writes_metrics(tmp_path):
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "50",
                           "--metrics.log_freq", "10", "--validation.freq", "50", *FAST])
    Trainer(config).train()
    rows = _rows(tmp_path)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 10, 20, 30, 40, 50]
    for row in train_rows:
        for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu", "memory_gib"):
            assert key in row and row[key] is not None, key
        assert math.isfinite(row["loss"]) and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0  # 9.0 at init; well below after 50 steps
    val = [r for r in rows if "val_loss" in r]
    assert len(val) == 1 and val[0]["step"] == 50 and val[0]["val_ppl"] == pytest.approx(math.exp(val[0]["val_loss"]))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    resolved = (tmp_path / "config.toml").read_text()
    assert "seq_len = 128" in resolved


@pytest.mark.parametrize("gc_freq", [0, 2])
def test_garbage_collection_runs_every_gc_freq_steps_and_is_restored(tmp_path, monkeypatch, gc_freq):
    """training.gc_freq: automatic collection off while training, generation-1 collections at the start and every
    gc_freq steps, automatic collection back on afterwards (also after an error); 0 leaves it alone."""
    import gc
    calls, enabled_during = [], []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: (calls.append(generation), real_collect(generation))[1])
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "5",
                           "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
                           "--training.gc_freq", str(gc_freq), *FAST])
    trainer = Trainer(config)
    real_step = trainer.train_step
    trainer.train_step = lambda micro: (enabled_during.append(gc.isenabled()), real_step(micro))[1]
    assert gc.isenabled()
    trainer.train()
    assert gc.isenabled()
    if gc_freq:
        assert calls == [1, 1, 1] and enabled_during == [False] * 5  # start, steps 2 and 4
    else:
        assert calls == [] and enabled_during == [True] * 5
    with pytest.raises(ValueError, match=r"training\.gc_freq"):
        parse_config(["--training.gc_freq", "-1"])


def test_profiling_traces_one_step_per_window(tmp_path):
    """[profiling]: with freq 3 and warmup 1, steps 3 and 6 of 7 are traced; each trace is a gzipped Chrome trace
    with the step's operators, plus a table of the operators with the most self time."""
    import gzip

    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "7",
                           "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
                           "--profiling.enable", "--profiling.freq", "3", "--profiling.warmup", "1", *FAST])
    Trainer(config).train()
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["step-3", "step-6"]
    for step in ("step-3", "step-6"):
        events = json.loads(gzip.decompress((traces / step / "rank0.json.gz").read_bytes()))["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names), sorted(names)[:20]
        assert "Self CPU" in (traces / step / "rank0.txt").read_text()
    with pytest.raises(ValueError, match=r"profiling\.freq: must exceed profiling\.warmup"):
        from hola_titan.config import validate
        validate(parse_config(["--profiling.enable", "--profiling.freq", "2", "--profiling.warmup", "2"]),
                 world_size=1)


def _torchrun_losses(tmp_path: Path, nproc: int, extra: list[str]) -> list[float]:
    env = _env() | {"NGPU": str(nproc), "CONFIG_FILE": DEBUG, "LOG_RANK": "0", "PYTHON": sys.executable}
    result = subprocess.run([str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                             "--metrics.log_freq", "1", "--validation.enable", "false", *FAST, *extra],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [r["loss"] for r in _rows(tmp_path)]


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path):
    """Same global batch (8 rows): one process with 2 accumulation steps of 4 rows vs two FSDP ranks of 4."""
    one = _torchrun_losses(tmp_path / "one", 1, ["--training.global_batch_size", "8"])
    two = _torchrun_losses(tmp_path / "two", 2, ["--training.global_batch_size", "8"])
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (one, two)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    base = ["--job.config_file", DEBUG, "--training.steps", "3", "--metrics.log_freq", "1",
            "--validation.enable", "false", "--training.seq_len", "128"]
    big = Trainer(parse_config([*base, "--job.dump_folder", str(tmp_path / "a"), "--training.local_batch_size", "8"]))
    acc = Trainer(parse_config([*base, "--job.dump_folder", str(tmp_path / "b"), "--training.local_batch_size", "4",
                                "--training.global_batch_size", "8"]))
    assert acc.degrees.grad_accum_steps == 2
    la = [r["loss"] for r in big.train()]
    lb = [r["loss"] for r in acc.train()]
    assert la == pytest.approx(lb, rel=1e-5, abs=1e-5)


def test_validation_rows_carry_each_cache_layer_s_gate_sink_and_gammas(tmp_path):
    """Each validation row holds, per HOLA layer, the mean cache weight sigmoid(gate) and sink logit (read from the
    parameters); a model without a cache logs neither."""
    from hola_titan.models.model import GatedDeltaMixer

    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path / "hola"),
                           "--training.steps", "2", "--metrics.log_freq", "1", "--validation.freq", "2", *FAST])
    trainer = Trainer(config)
    mixers = [m for m in trainer.model.modules() if isinstance(m, GatedDeltaMixer)]
    with torch.no_grad():
        for i, mixer in enumerate(mixers):
            mixer.gate.copy_(torch.tensor([float(i), float(i) + 2.0]))
            mixer.sink.fill_(-float(i))
            mixer.gamma_q.copy_(torch.arange(mixer.gamma_q.numel(), dtype=torch.float32) + 1.0)
            mixer.gamma_k.copy_(torch.arange(mixer.gamma_k.numel(), dtype=torch.float32) * float(i))
    scalars = trainer.cache_scalars()
    assert scalars["cache_gate"] == pytest.approx([(0.5 + torch.sigmoid(torch.tensor(2.0)).item()) / 2,
                                                   torch.sigmoid(torch.tensor([1.0, 3.0])).mean().item()], abs=1e-6)
    assert scalars["cache_sink"] == pytest.approx([0.0, -1.0])
    d = mixers[0].gamma_k.numel()
    # The mean of gamma_q * gamma_k (not of either alone): sum_j (j + 1) j i / d = i (d^2 - 1) / 3.
    assert scalars["cache_gamma_qk"] == pytest.approx([0.0, (d * d - 1) / 3])
    trainer.train()
    val = [r for r in _rows(tmp_path / "hola") if "val_loss" in r]
    assert len(val) == 1 and len(val[0]["cache_gate"]) == len(val[0]["cache_sink"]) == len(mixers) == 2
    assert len(val[0]["cache_gamma_qk"]) == 2
    assert val[0]["cache_gate"] != scalars["cache_gate"]  # two steps moved the gates
    gdn = Trainer(parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path / "gdn"),
                                "--model.flavour", "gdn", *FAST]))
    assert gdn.cache_scalars() == {}


def test_validation_loss_does_not_depend_on_the_layout(tmp_path):
    """validation.steps counts global batches: local batch 4 and local batch 2 with 2 accumulation steps (one global
    batch of 4 rows) validate the same rows of the same weights, hence the same val_loss (it was over 4 rows
    against 2)."""
    base = ["--job.config_file", DEBUG, "--validation.enable", "true", "--validation.steps", "2",
            "--training.seq_len", "64", "--training.global_batch_size", "4", "--metrics.enable_tensorboard", "false"]
    losses, trainers = {}, {}
    for local in (4, 2):
        trainers[local] = Trainer(parse_config([*base, "--job.dump_folder", str(tmp_path / str(local)),
                                                "--training.local_batch_size", str(local)]))
        losses[local] = trainers[local].validate()["val_loss"]
    assert losses[2] == pytest.approx(losses[4], rel=1e-6)
    assert [len(trainers[local]._validation) for local in (4, 2)] == [2, 4]  # micro-batches: 2 x 1, 2 x 2


def _write_tokenizer(folder: Path, vocab_size: int) -> Path:
    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = HFTokenizer(WordLevel(vocab, unk_token="t1"))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("flavour,expected", [("gdn", 341_597_376), ("hola", 341_609_856),
                                              ("hola_recency", 341_609_856), ("transformer", 341_099_520)])
def test_dry_run_340M(tmp_path, capsys, flavour, expected):
    tok = _write_tokenizer(tmp_path / "tok32k", 32000)
    code = main(["--job.config_file", str(ROOT / "train_configs" / f"{flavour}_340M.toml"), "--dry-run",
                 "--model.tokenizer_path", str(tok), "--training.device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"{expected:,} parameters" in out
    assert "training FLOPs per token" in out and 'flavour = "' + flavour + '"' in out
    if flavour == "gdn":
        assert abs(expected - 341.6e6) / 341.6e6 < 0.005


def test_dry_run_prints_the_accumulation_and_a_memory_estimate(capsys):
    """Issue 50, item 11: the batch with its accumulation and a per-device memory estimate, said to be one."""
    code = main(["--job.config_file", DEBUG, "--dry-run", "--training.local_batch_size", "4",
                 "--training.global_batch_size", "16", "--training.device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert ("batch: micro-batch 4 row(s) x 256 tokens per data-parallel rank (training.local_batch_size) x 1 "
            "data-parallel rank(s) = 4 rows; 4 accumulation step(s); global batch 16 rows = 4,096 tokens") in out
    assert "memory estimate per process (CPU) (an estimate from the model's shapes, not a measurement" in out
    for part in ("  state: parameters ", "  activations: ", "activation_checkpoint.mode none (other modes: full ",
                 "  total: "):
        assert part in out, out[-2000:]


def _estimate(*extra: str, world_size: int = 1):
    from hola_titan.config import resolve_degrees
    from hola_titan.memory import estimate_memory

    config = parse_config(["--job.config_file", str(ROOT / "train_configs" / "hola_340M.toml"), *extra])
    args = model_args("hola", "340M", vocab_size=32000)
    degrees = resolve_degrees(config.parallelism, config.training, world_size=world_size)
    return estimate_memory(args, config, degrees, build_model(args, device="meta"))


def test_the_memory_estimate_scales_with_the_layout_and_the_micro_batch():
    one, two, four = (_estimate(world_size=n) for n in (1, 2, 4))
    assert two.state_shards == 2 and four.state_shards == 4
    for part in ("params", "grads", "optimizer"):  # doubling the FSDP degree halves the sharded state
        assert getattr(two, part) == pytest.approx(getattr(one, part) / 2)
        assert getattr(four, part) == pytest.approx(getattr(two, part) / 2)
    assert one.optimizer == pytest.approx(2 * one.params)  # AdamW's two float32 moments
    assert two.activations == one.activations  # a data-parallel rank's micro-batch is the same
    double = _estimate("--training.local_batch_size", "32")
    for mode in ("none", "full"):  # activations grow with the micro-batch, in every checkpointing mode
        assert double.activations[mode] == pytest.approx(2 * one.activations[mode])
    assert one.activations["full"] < one.activations["none"] / 4
    selective = _estimate("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                          "2").activations
    assert one.activations["full"] < selective["selective 2"] < one.activations["none"]
    # Context parallelism splits every row's tokens; the state is sharded over it too (FSDP over dp_shard x cp).
    cp = _estimate("--parallelism.context_parallel_degree", "2", world_size=2)
    assert cp.activations["none"] == pytest.approx(one.activations["none"] / 2) and cp.state_shards == 2
    offload = _estimate("--parallelism.fsdp_cpu_offload", "true", world_size=2)
    assert offload.state == 0 and offload.total < two.total
    # float32 compute: no bf16 weight copies, and every saved tensor but the float32 norms' inputs doubles.
    fp32 = _estimate("--training.mixed_precision_param", "float32")
    assert fp32.compute_weights == 0
    assert one.activations["none"] < fp32.activations["none"] < 2 * one.activations["none"]


def test_the_memory_estimate_is_near_the_measured_peak():
    """The calibration point (hola_titan/memory.py): HOLA 340M, 16 x 2048 tokens, one H200, bf16 compute, no
    checkpointing, measured peak 38.18 GiB (docs/training.md). Guards the formula against silent drift."""
    estimate = _estimate("--training.global_batch_size", "16")
    assert estimate.total / 2**30 == pytest.approx(38.18, rel=0.05)


def test_flop_formula_matches_counted_matmuls():
    """The dense and attention parts of the formula against a FLOP count of one forward of tiny models."""
    seq_len = 48
    for flavour in ("gdn", "transformer"):
        args = replace(model_args(flavour, "debug", vocab_size=97), n_layers=2, dim=32, mlp_hidden=64, head_dim=16)
        model = build_model(args, device="cpu")
        tokens = torch.randint(0, 97, (2, seq_len))
        # The math SDPA backend runs attention as bmm calls, which the counter sees.
        with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
            model(tokens)
        counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
        dense = counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)
        assert dense == 2 * matmul_params(args) * tokens.numel()
        formula = flops_per_token(args, seq_len)
        assert formula["dense"] == 3 * 2 * matmul_params(args)
        if flavour == "transformer":
            # SDPA counts the full T x T square; the formula counts the causal (T + 1) / 2 keys per query.
            causal = counts["aten.bmm"] * (seq_len + 1) / (2 * seq_len)
            assert formula["attention"] == pytest.approx(3 * causal / tokens.numel(), rel=1e-9)


def test_mean_visible_keys_counts_cache_and_block():
    # block 4, window 3: positions 0-3 see t+1 keys; from the second block on, min(3, done) cache rows.
    expected = [1, 2, 3, 4] + [3 + 1, 3 + 2, 3 + 3, 3 + 4]
    assert mean_visible_keys(8, window=3, block=4) == pytest.approx(sum(expected) / 8)
    assert mean_visible_keys(5, window=None, block=None) == pytest.approx(3.0)


def test_lr_schedule_warmup_and_cosine_floor():
    kw = dict(warmup_steps=10, total_steps=110, decay_type="cosine", min_lr_factor=0.1)
    assert lr_lambda(0, **kw) == pytest.approx(1 / 11)
    assert lr_lambda(10, **kw) == pytest.approx(1.0)
    assert lr_lambda(60, **kw) == pytest.approx(0.55)
    assert lr_lambda(110, **kw) == pytest.approx(0.1)
    assert lr_lambda(500, **kw) == pytest.approx(0.1)


def test_optimizer_settings_apply_at_build_and_over_restored_ones_by_parameter():
    """apply_settings sets every ``schedule`` key (hola_titan/resume.py) over what a checkpoint restored; the groups
    that decay are found by their parameters, in whatever order the restored optimizer lists them."""
    from hola_titan.optim import apply_settings, build_optimizer
    from hola_titan.resume import SCHEDULE

    model = torch.nn.Linear(4, 4)
    model.no_weight_decay_names = lambda: {"bias"}
    config = parse_config([])
    adamw, scheduler = build_optimizer(model, optimizer=config.optimizer, lr_scheduler=config.lr_scheduler,
                                       steps=10, device_type="cpu")
    assert [[p is model.weight for p in g["params"]] for g in adamw.param_groups] == [[True], [False]]
    assert [g["weight_decay"] for g in adamw.param_groups] == [config.optimizer.weight_decay, 0.0]
    for _ in range(3):
        adamw.step()
        scheduler.step()
    adamw.param_groups.reverse()
    new = {"optimizer.lr": "1e-3", "optimizer.weight_decay": "0.2", "optimizer.betas": "0.8,0.9",
           "optimizer.eps": "1e-6", "lr_scheduler.warmup_steps": "1", "lr_scheduler.decay_type": "linear",
           "lr_scheduler.min_lr_factor": "0.5", "training.steps": "20"}
    assert set(new) == set(SCHEDULE)  # a new schedule key needs its place here and in apply_settings
    config = parse_config([word for key, value in new.items() for word in (f"--{key}", value)])
    change = apply_settings(adamw, scheduler, model=model, optimizer=config.optimizer,
                            lr_scheduler=config.lr_scheduler, steps=config.training.steps)
    schedule = scheduler.lr_lambdas[0]
    assert change.startswith("schedule from step 3: warmup_steps 1, total_steps 20, decay_type linear")
    assert schedule.settings() == dict(warmup_steps=1, total_steps=20, decay_type="linear", min_lr_factor=0.5)
    assert schedule.anchor_step == 3 and schedule.anchor_factor == lr_lambda(3, warmup_steps=200, total_steps=10,
                                                                             decay_type="cosine", min_lr_factor=0.1)
    for group in adamw.param_groups:
        assert group["weight_decay"] == (0.2 if group["params"][0] is model.weight else 0.0)
        assert group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6 and group["initial_lr"] == 1e-3
        assert group["lr"] == pytest.approx(1e-3 * schedule(3))
    scheduler.step()
    assert all(g["lr"] == pytest.approx(1e-3 * schedule(4)) for g in adamw.param_groups)
    assert apply_settings(adamw, scheduler, model=model, optimizer=config.optimizer,
                          lr_scheduler=config.lr_scheduler, steps=config.training.steps) is None


@pytest.mark.parametrize("argv,key", [
    (["--training.seq_len", "abc"], "training.seq_len"),
    (["--training.bogus", "1"], "training.bogus"),
    (["--parallelism.tensor_parallel_degree", "4"], "parallelism"),
    (["--training.seq_len", "100"], "training.seq_len"),
    # More than any host holds: refused before the run folder or any weight exists (it grew until killed).
    (["--model.n_layers", "100000000"], "model.n_layers"),
    (["--training.local_batch_size", "100000000"], "training.local_batch_size"),
])
def test_config_errors_exit_with_one_line(tmp_path, argv, key):
    result = subprocess.run([sys.executable, "-m", "hola_titan.train", "--job.config_file", DEBUG,
                             "--job.dump_folder", str(tmp_path / "run"), *argv],
                            env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and key in lines[0], result.stderr
    assert not (tmp_path / "run").exists(), "the run folder must not be created before the config is valid"


def _poison_after(trainer: Trainer, step: int) -> None:
    original = trainer.loss_sum

    def loss_sum(batch):
        value = original(batch)
        return value * float("nan") if trainer.state.step + 1 >= step else value

    trainer.loss_sum = loss_sum


def test_nan_loss_stops_with_clear_message(tmp_path):
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "5",
                           "--metrics.log_freq", "1", "--validation.enable", "false", *FAST])
    trainer = Trainer(config)
    _poison_after(trainer, 3)
    with pytest.raises(RuntimeError, match="step 3 is not finite"):
        trainer.train()
    assert trainer.state.step == 2
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]  # the failed step logged nothing


def test_nan_loss_skipped_when_allowed(tmp_path):
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                           "--metrics.log_freq", "1", "--validation.enable", "false", "--training.skip_nan_inf",
                           *FAST])
    trainer = Trainer(config)
    params_before = [p.detach().clone() for p in trainer.model.parameters()]
    _poison_after(trainer, 3)
    trainer.train()
    assert trainer.state.step == 4 and trainer.state.skipped_steps == 2
    changed = [not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), params_before)]
    assert any(changed)  # steps 1 and 2 updated the weights
    for p in trainer.model.parameters():
        assert torch.isfinite(p).all()


def test_fused_optimizer_skips_non_finite_steps_on_the_device(tmp_path):
    """With the fused AdamW (the GPU default; also on a CPU), a non-finite step is skipped by the optimizer itself
    (``found_inf``): weights, moments and AdamW's step count stay as they were, and the skip is counted when the
    step's numbers are read."""
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                           "--metrics.log_freq", "10", "--validation.enable", "false", "--training.skip_nan_inf",
                           "--optimizer.fused", "true", *FAST])
    trainer = Trainer(config)
    assert trainer.paths["optimizer"].startswith("fused AdamW")
    batches = iter(trainer.dataloader)
    trainer.train_step([next(batches)])
    trainer.train_step([next(batches)])
    trainer.resolve_pending()
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    moments = [trainer.optimizer.state[p]["exp_avg"].clone() for p in trainer.model.parameters()]
    steps = [trainer.optimizer.state[p]["step"].clone() for p in trainer.model.parameters()]
    _poison_after(trainer, 3)
    pending = trainer.train_step([next(batches)])
    assert trainer.resolve_pending()["finite"] is False and pending.result()["finite"] is False
    assert trainer.state.skipped_steps == 1 and trainer.state.step == 3
    for p, w, m, n in zip(trainer.model.parameters(), weights, moments, steps):
        assert torch.equal(p, w) and torch.equal(trainer.optimizer.state[p]["exp_avg"], m)
        assert torch.equal(trainer.optimizer.state[p]["step"], n)


def test_a_step_is_read_by_the_next_step_not_by_itself(tmp_path):
    """``train_step`` queues its work and returns; its numbers are read by the next step, before that step's
    update (or by the loop when it logs, saves or validates)."""
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                           "--validation.enable", "false", *FAST])
    trainer = Trainer(config)
    batches = iter(trainer.dataloader)
    first = trainer.train_step([next(batches)])
    assert first._result is None and trainer._pending is first
    second = trainer.train_step([next(batches)])
    assert first._result is not None and first._result["finite"] and second._result is None
    assert trainer.resolve_pending() == second.result() and trainer.resolve_pending() is None


def test_the_run_folder_names_the_paths_that_ran(tmp_path, monkeypatch):
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), "--training.steps", "1",
                           "--validation.enable", "false", *FAST])
    trainer = Trainer(config)
    trainer.train()
    paths = json.loads((tmp_path / "paths.json").read_text())
    assert paths == trainer.paths
    assert paths["short_conv"] == "PyTorch reference"
    assert paths["attention_backend"] == "reference (auto: no CUDA device)"
    assert paths["cross_entropy"].startswith("PyTorch") and paths["precision"] == "float32"
    with pytest.raises(ConfigError, match="model.kernels"):  # this process's kernels are not interpreted
        Trainer(parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path / "b"),
                              "--model.kernels", "triton", *FAST]))


@pytest.mark.parametrize("backend, flavour, device, argv, padded, cp, expected", [
    ("triton", "hola", "cuda", [], False, 1, ", overlapped backward"),
    ("triton", "hola", "cuda", [], False, 2, ", overlapped backward; context-parallel shards run the layered form"),
    ("triton", "hola_recency", "cuda", ["--model.overlap_backward", "true"], False, 1, ", overlapped backward"),
    ("triton", "hola", "cuda", ["--model.save_cache_output"], False, 1, ", layered backward (model.save_cache_output)"),
    ("triton", "hola", "cuda", ["--model.overlap_backward", "false"], False, 1,
     ", layered backward (model.overlap_backward false)"),
    ("triton", "hola", "cuda", [], True, 1, ", layered backward (head dim 256 is padded for fla on this GPU)"),
    ("triton", "hola", "cpu", [], False, 1, ", layered backward (the overlapped op runs on CUDA only)"),
    ("triton", "hola", "cuda", ["--model.cache_mix", "after_norm"], False, 1,
     ", layered backward (model.cache_mix after_norm: the overlapped op fuses the sum)"),
    ("triton", "gdn", "cuda", [], False, 1, ""),  # no cache read: nothing to overlap
    ("reference", "hola", "cuda", [], False, 1, ""),
])
def test_the_paths_line_says_which_layer_backward_runs(monkeypatch, backend, flavour, device, argv, padded, cp,
                                                        expected):
    """``model.overlap_backward`` as resolved for the run, and the cases where the layered form runs instead."""
    from types import SimpleNamespace

    from hola_titan.builder import build_model_args
    from hola_titan.kernels.hola import triton_layer

    monkeypatch.setattr(triton_layer, "padded_head_dim", lambda d, device: max(d, 512) if padded else d)
    config = parse_config(["--model.flavour", flavour, "--model.size", "340M", *argv])
    fake = SimpleNamespace(attention_backend=backend, config=config, device=torch.device(device),
                           model_args=build_model_args(config, 8), dims=SimpleNamespace(cp=cp))
    assert fake.model_args.head_dim == 256
    assert Trainer._layer_backward(fake) == expected


# Per group: (members: "rest" every parameter but those named, "decay_params" A_log and dt_bias, "cache" the cache's
# gammas, sink and gate; weight decay on; peak-rate multiplier).
@pytest.mark.parametrize("argv,groups", [
    ([], [({"rest"}, True, 1.0), ({"decay_params"}, False, 1.0)]),
    (["--optimizer.decay_cache_scalars", "false"], [({"rest"}, True, 1.0), ({"decay_params", "cache"}, False, 1.0)]),
    (["--optimizer.cache_lr_multiplier", "3"],
     [({"rest"}, True, 1.0), ({"decay_params"}, False, 1.0), ({"cache"}, True, 3.0)]),
    (["--optimizer.decay_cache_scalars", "false", "--optimizer.cache_lr_multiplier", "0.5"],
     [({"rest"}, True, 1.0), ({"decay_params"}, False, 1.0), ({"cache"}, False, 0.5)]),
])
def test_the_cache_parameters_decay_and_learn_as_set(argv, groups):
    """``optimizer.decay_cache_scalars`` moves the cache's gammas, sink and gate into the group that never decays;
    ``optimizer.cache_lr_multiplier`` gives them a group at their own peak rate, which the schedule scales and a
    restored optimizer keeps (found by its parameters). The default keeps the two groups of earlier checkpoints."""
    from hola_titan.optim import apply_settings, build_optimizer

    config = parse_config(["--optimizer.weight_decay", "0.1", "--optimizer.lr", "2e-3", *argv])
    model = build_model(model_args("hola", "debug", vocab_size=97), device="cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {"cache": {n for n in names.values() if n.rsplit(".", 1)[-1] in ("gamma_q", "gamma_k", "sink", "gate")},
             "decay_params": {n for n in names.values() if n.endswith(("A_log", "dt_bias"))}}
    assert model.cache_parameter_names() == kinds["cache"] and len(kinds["cache"]) == 4 * model.args.n_layers
    named = set().union(*(kinds[k] for members, _, _ in groups for k in members if k != "rest"))
    kinds["rest"] = set(names.values()) - named
    adamw, scheduler = build_optimizer(model, optimizer=config.optimizer, lr_scheduler=config.lr_scheduler,
                                       steps=50, device_type="cpu")
    assert len(adamw.param_groups) == len(groups)
    for group, (members, decays, multiplier) in zip(adamw.param_groups, groups):
        assert {names[id(p)] for p in group["params"]} == set().union(*(kinds[k] for k in members))
        assert group["weight_decay"] == (0.1 if decays else 0.0) and group["initial_lr"] == pytest.approx(
            2e-3 * multiplier)
    for _ in range(5):
        adamw.step()
        scheduler.step()
    factor = scheduler.lr_lambdas[0](5)
    assert [g["lr"] for g in adamw.param_groups] == pytest.approx([2e-3 * m * factor for _, _, m in groups])
    adamw.param_groups.reverse()  # as a restored optimizer may list them
    apply_settings(adamw, scheduler, model=model, optimizer=config.optimizer, lr_scheduler=config.lr_scheduler,
                   steps=50)
    assert [g["lr"] for g in adamw.param_groups] == pytest.approx([2e-3 * m * factor for _, _, m in reversed(groups)])


@pytest.mark.parametrize("argv,key", [
    (["--model.flavour", "gdn", "--model.gate_init", "-6"], "model.gate_init"),
    (["--model.flavour", "gdn", "--model.cache_mix", "after_norm"], "model.cache_mix"),
    (["--model.flavour", "gdn", "--optimizer.decay_cache_scalars", "false"], "optimizer.decay_cache_scalars"),
    (["--model.flavour", "transformer", "--optimizer.cache_lr_multiplier", "2"], "optimizer.cache_lr_multiplier"),
    (["--model.flavour", "transformer", "--model.state_read_scale", "one"], "model.state_read_scale"),
    (["--optimizer.cache_lr_multiplier", "0"], "optimizer.cache_lr_multiplier"),
    (["--model.state_read_scale", "half"], "model.state_read_scale"),
    (["--model.gate_init", "nan"], "model.gate_init"),
    (["--model.window", "100000"], "model.window"),
    (["--training.loss_chunk_size", "-5"], "training.loss_chunk_size"),
])
def test_the_layer_s_open_choices_refuse_what_does_not_apply(argv, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}:"):
        validate(parse_config(argv), world_size=1)


@pytest.mark.parametrize("wrap", [[], ["--activation_checkpoint.mode", "full"]])
def test_gdn_decay_parameters_get_no_weight_decay(tmp_path, wrap):
    """A_log and dt_bias are excluded from weight decay (as fla does), also when wrappers prefix their names."""
    config = parse_config(["--job.config_file", DEBUG, "--job.dump_folder", str(tmp_path), *FAST, *wrap])
    trainer = Trainer(config)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    plain = [names[id(p)] for group in trainer.optimizer.param_groups if group["weight_decay"] == 0.0
             for p in group["params"]]
    assert len(plain) == 2 * trainer.model_args.n_layers
    assert all(n.endswith(("A_log", "dt_bias")) for n in plain), plain
