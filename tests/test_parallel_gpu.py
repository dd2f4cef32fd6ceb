"""Parallel layouts on two CUDA GPUs (NCCL, torchrun processes) against one GPU (marker ``gpu``).

The 340M width with 4 layers, bf16 compute over float32 master weights, the bundled data, the same seed and the
same global batch: FSDP 2, TP 2 and CP 2 must reproduce one GPU's first 10 losses within 0.5% relative and its
gradient norms within 2% (bf16 rounding differs between layouts: sharded matmuls, reduce-scatter in another
order, split sequences). FSDP 2 and TP 2 train HOLA and Transformer++ at T = 2048; CP 2 trains HOLA at T = 16384.
Each run's tokens/s is printed (the benchmark proper is ``scripts/composition_run.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_parallel_worker

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
COMMON = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--model.size", "340M",
          "--model.n_layers", "4", "--training.device", "cuda", "--training.mixed_precision_param", "bfloat16",
          "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--validation.enable", "false",
          "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "2"]
# Learning rates: Transformer++ at 1e-3 spikes (grad norm 4.0 -> 10.2 -> 2.8 over steps 2-4 on one GPU), which
# amplifies bf16 rounding differences between layouts into 3-11% grad-norm gaps by step 7 while the losses still
# agree to 5e-4 (measured on 2 x H200, docs/LOG.md); at 3e-4 it trains smoothly.
LR = {"hola": "1e-3", "transformer": "3e-4"}
T2K = ["--training.seq_len", "2048", "--training.local_batch_size", "4", "--training.global_batch_size", "8"]
T16K = ["--training.seq_len", "16384", "--training.local_batch_size", "1", "--training.global_batch_size", "1"]
LAYOUTS = {
    "fsdp2": (2, T2K, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, T2K, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "cp2": (2, T16K, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]),
}
CASES = [("fsdp2", "hola"), ("fsdp2", "transformer"), ("tp2", "transformer"), ("tp2", "hola"), ("cp2", "hola")]


def _run(out: Path, nproc: int, args: list[str]) -> dict:
    got = run_parallel_worker(out, nproc, [*COMMON, *args], timeout=900)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]
    got["tokens_per_s"] = sum(tps) / len(tps) if tps else float("nan")
    return got


_SINGLE: dict[tuple[str, str], dict] = {}


def _single(flavour: str, shape: list[str], tmp_path_factory) -> dict:
    key = (flavour, shape[1])
    if key not in _SINGLE:
        _SINGLE[key] = _run(tmp_path_factory.mktemp(f"single_{flavour}_{shape[1]}"), 1,
                            [*shape, "--model.flavour", flavour, "--optimizer.lr", LR[flavour]])
    return _SINGLE[key]


@pytest.mark.parametrize("layout,flavour", CASES)
def test_two_gpu_layout_matches_one_gpu(layout, flavour, tmp_path, tmp_path_factory):
    nproc, shape, args = LAYOUTS[layout]
    ref = _single(flavour, shape, tmp_path_factory)
    got = _run(tmp_path, nproc, [*shape, *args, "--model.flavour", flavour, "--optimizer.lr", LR[flavour]])
    loss_rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    norm_rel = [abs(a - b) / abs(b) for a, b in zip(got["grad_norms"], ref["grad_norms"])]
    print(f"\n{layout} {flavour}: tokens/s {got['tokens_per_s']:,.0f} (one GPU {ref['tokens_per_s']:,.0f}); "
          f"losses {[round(x, 4) for x in got['losses']]} vs {[round(x, 4) for x in ref['losses']]}; "
          f"max rel loss diff {max(loss_rel):.2e}, max rel grad-norm diff {max(norm_rel):.2e}")
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert len(got["grad_norms"]) == len(ref["grad_norms"]) == STEPS
    assert max(loss_rel) <= 5e-3, (layout, flavour, got["losses"], ref["losses"])
    assert max(norm_rel) <= 2e-2, (layout, flavour, got["grad_norms"], ref["grad_norms"])
