"""Parallel layouts on CPU (gloo, torchrun processes) reproduce the single-process run.

Every layout trains the debug model from the same seed on the same global batch; the first 3 losses and the
gradients of step 1 (full tensors, gathered from the shards) must match one process. Bounds: losses within
1e-5 relative; the whole gradient within 1e-5 in relative L2 norm, each tensor within 1e-4. Both sides compute
in fp32 and differ only in the order of reductions (sharded matmuls, reduce-scatter), which moves results by a
few ulps times sqrt(n).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hola_titan.config import parse_config
from hola_titan.train import Trainer
from helpers import run_parallel_runs

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--training.steps", "3",
          "--metrics.log_freq", "1", "--validation.enable", "false", "--training.seq_len", "64",
          "--training.local_batch_size", "2", "--training.global_batch_size", "4",
          "--metrics.enable_tensorboard", "false"]

LAYOUTS = {
    "fsdp2": (2, []),
    "tp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x1": (2, ["--parallelism.data_parallel_shard_degree", "1",
                    "--parallelism.data_parallel_replicate_degree", "2"]),
    "fsdp2_tp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_shard_degree", "2",
                    "--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "1"]),
}


INIT_LAYOUTS = {**{name: LAYOUTS[name] for name in ("fsdp2", "tp2", "fsdp2_tp2")},
                # Transformer++ under context parallelism takes unpacked rows; the data does not touch the init.
                "cp2": (2, ["--parallelism.data_parallel_shard_degree", "1",
                            "--parallelism.context_parallel_degree", "2", "--data.varlen", "false"])}
FLAVOURS = ("hola", "transformer")

# One module of this file runs in one pytest-xdist worker (the runs below are shared by its tests).
pytestmark = pytest.mark.xdist_group("test_parallel")
_RUNS: dict[int, dict[str, dict | str]] = {}


def _run(tmp_path_factory, nproc: int, name: str) -> dict:
    """The worker's result of run ``name`` (``flavour-layout``, ``flavour-single``). Every run of ``nproc``
    processes trains in one torchrun launch, once per session (one after another in the same processes: their
    start-up costs more than the runs): the layout tests and the initial-weight tests of a layout read the same
    run (the initial weights are gathered before the first step); layouts that only the initial-weight test
    reads run one step."""
    if nproc not in _RUNS:
        runs = {}
        for flavour in FLAVOURS:
            if nproc == 1:
                runs[f"{flavour}-single"] = [*COMMON, "--model.flavour", flavour]
            for layout, (n, args) in {**INIT_LAYOUTS, **LAYOUTS}.items():
                if n == nproc:
                    steps = [] if layout in LAYOUTS else ["--training.steps", "1"]
                    runs[f"{flavour}-{layout}"] = [*COMMON, *args, "--model.flavour", flavour, *steps]
        _RUNS[nproc] = run_parallel_runs(tmp_path_factory.mktemp(f"runs{nproc}"), nproc, runs)
    got = _RUNS[nproc][name]
    assert isinstance(got, dict), f"{name}: {got}"
    return got


@pytest.fixture(scope="module", params=FLAVOURS)
def single(request, tmp_path_factory):
    flavour = request.param
    return flavour, _run(tmp_path_factory, 1, f"{flavour}-single")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(single, layout, tmp_path_factory):
    flavour, ref = single
    got = _run(tmp_path_factory, LAYOUTS[layout][0], f"{flavour}-{layout}")
    assert len(got["losses"]) == len(ref["losses"]) == 3
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (layout, flavour, got["losses"], ref["losses"])
    assert set(got["grads"]) == set(ref["grads"])
    names = sorted(ref["grads"])
    whole = torch.cat([(got["grads"][n] - ref["grads"][n]).flatten() for n in names]).norm()
    whole = whole / torch.cat([ref["grads"][n].flatten() for n in names]).norm()
    assert whole <= 1e-5, f"{layout} {flavour}: gradient differs by {whole:.2e} (relative L2 over all parameters)"
    for name in names:
        # Per tensor 1e-4: sums with cancellation (A_log's gradient over every token) lose a few digits to
        # the reduction order; a layout error (a missing or doubled reduction) is off by O(1).
        diff = (got["grads"][name] - ref["grads"][name]).norm() / ref["grads"][name].norm().clamp(min=1e-30)
        assert diff <= 1e-4, f"{layout} {flavour}: gradient of {name} differs by {diff:.2e} (relative L2)"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(INIT_LAYOUTS))
def test_initial_weights_are_identical_at_every_layout(single, layout, tmp_path_factory):
    """Built on the meta device and initialised shard by shard (hola_titan/parallelisms/init.py): the gathered initial
    weights equal the single process's bit for bit. Layouts that train above read their 3-step runs (the
    weights are gathered before the first step); the others run one step."""
    flavour, ref = single
    got = _run(tmp_path_factory, INIT_LAYOUTS[layout][0], f"{flavour}-{layout}")
    assert set(got["init"]) == set(ref["init"])
    for name, value in ref["init"].items():
        assert torch.equal(got["init"][name], value), f"{layout} {flavour}: {name}"


def _losses(tmp_path: Path, extra: list[str]) -> list[float]:
    config = parse_config([*COMMON, "--job.dump_folder", str(tmp_path), *extra])
    return [r["loss"] for r in Trainer(config).train() if "loss" in r]


@pytest.mark.parametrize("flavour", ["hola", "transformer"])
def test_activation_checkpointing_keeps_losses(tmp_path, flavour):
    base = _losses(tmp_path / "base", ["--model.flavour", flavour])
    for mode in (["--activation_checkpoint.mode", "full"],
                 ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
                 ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]):
        got = _losses(tmp_path / (mode[1] + mode[-1]), ["--model.flavour", flavour, *mode])
        assert got == pytest.approx(base, rel=1e-6, abs=1e-6), mode


@pytest.mark.slow
def test_compile_keeps_losses(tmp_path):
    """Per-block torch.compile on CPU (the reference backend has data-dependent shapes, so not fullgraph)."""
    base = _losses(tmp_path / "base", ["--model.flavour", "gdn"])
    got = _losses(tmp_path / "compiled", ["--model.flavour", "gdn", "--compile.enable", "--compile.fullgraph",
                                          "false"])
    assert got == pytest.approx(base, rel=1e-6, abs=1e-6)


def test_float8_refuses_cpu_with_a_clear_error():
    from hola_titan.parallelisms.float8 import apply_float8

    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="float8.enable: float8 needs a CUDA GPU"):
        apply_float8(model, device=torch.device("cpu"), recipe="rowwise", filter_fqns=["output"])


@pytest.mark.gpu
def test_float8_converts_block_linears_and_trains_like_bf16(tmp_path):
    """200 steps of a small model in float8 land within 2% of the bf16 loss (one GPU, SM89+)."""
    from hola_titan.parallelisms.float8 import float8_supported

    if not torch.cuda.is_available() or not float8_supported(torch.device("cuda"))[0]:
        pytest.skip("needs a CUDA GPU with float8 (SM89+)")
    common = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--training.device", "cuda",
              "--training.steps", "200", "--metrics.log_freq", "50", "--validation.enable", "false",
              "--training.mixed_precision_param", "bfloat16", "--model.size", "debug", "--training.seq_len", "256",
              "--metrics.enable_tensorboard", "false"]
    bf16 = Trainer(parse_config([*common, "--job.dump_folder", str(tmp_path / "bf16")]))
    bf16_loss = [r["loss"] for r in bf16.train() if "loss" in r][-1]
    fp8 = Trainer(parse_config([*common, "--job.dump_folder", str(tmp_path / "fp8"), "--float8.enable"]))
    converted = fp8.model.float8_converted
    assert any(name.endswith("feed_forward.w1") for name in converted)
    assert not any(name.endswith(("a_proj", "b_proj", "output")) for name in converted)
    fp8_loss = [r["loss"] for r in fp8.train() if "loss" in r][-1]
    assert abs(fp8_loss - bf16_loss) <= 0.02 * bf16_loss
