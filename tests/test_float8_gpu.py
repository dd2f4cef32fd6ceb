"""Float8 training on one CUDA GPU of compute capability 8.9+ (marker ``gpu``).

Which linears torchao converts (the block projections and the MLP; not the tied output head, not the per-head
gate projections), and that 200 steps of a small model in float8 land within 2% of the same run in bf16.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers import run_parallel_worker

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hola_titan.models.args import model_args  # noqa: E402
from hola_titan.models.model import build_model  # noqa: E402
from hola_titan.parallelisms.float8 import apply_float8, float8_supported  # noqa: E402

if not float8_supported(torch.device("cuda"))[0]:
    pytest.skip(float8_supported(torch.device("cuda"))[1], allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200


@pytest.mark.parametrize("flavour", ["hola", "transformer"])
def test_float8_converts_the_block_linears_only(flavour):
    from torchao.float8.float8_linear import Float8Linear

    # An untied output head, so that the filter (not the tying) is what keeps it in bf16.
    args = dataclasses.replace(model_args(flavour, "340M", vocab_size=8192, n_layers=2), tie_embeddings=False)
    model = build_model(args, device="meta")
    converted = apply_float8(model, device=torch.device("cuda"), recipe="rowwise", filter_fqns=["output"])
    expected = [f"layers.{i}.{name}" for i in range(2) for name in
                ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    assert sorted(converted) == sorted(expected)
    modules = dict(model.named_modules())
    assert all(isinstance(modules[name], Float8Linear) for name in expected)
    if flavour == "hola":
        # H = 4 outputs: below torchao's 16-multiple rule and too small to gain.
        for i in range(2):
            for name in ("attn.a_proj", "attn.b_proj"):
                assert type(modules[f"layers.{i}.{name}"]) is torch.nn.Linear
    assert type(modules["output"]) is torch.nn.Linear


def _losses(out: Path, extra: list[str]) -> list[float]:
    args = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--model.size", "340M",
            "--model.n_layers", "2", "--training.device", "cuda", "--training.mixed_precision_param", "bfloat16",
            "--training.steps", str(STEPS), "--training.seq_len", "2048", "--training.local_batch_size", "4",
            "--training.global_batch_size", "4", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "20",
            "--metrics.log_freq", "1", "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
            *extra]
    got = run_parallel_worker(out, 1, args, timeout=900)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][5:]
    print(f"\n{extra or ['bf16']}: tokens/s {sum(tps) / max(len(tps), 1):,.0f}", flush=True)
    return got["losses"]


def test_float8_training_lands_within_two_percent_of_bf16(tmp_path):
    bf16 = _losses(tmp_path / "bf16", [])
    fp8 = _losses(tmp_path / "float8", ["--float8.enable"])
    assert len(bf16) == len(fp8) == STEPS
    # The last 20 steps' mean: single-step losses move by more than 2% between batches.
    tail_bf16, tail_fp8 = sum(bf16[-20:]) / 20, sum(fp8[-20:]) / 20
    rel = abs(tail_fp8 - tail_bf16) / tail_bf16
    print(f"float8 {tail_fp8:.4f} vs bf16 {tail_bf16:.4f} (first {fp8[0]:.4f} / {bf16[0]:.4f}): {rel:.2%}")
    assert bf16[-1] < bf16[0] - 1.0, "the bf16 run did not train"
    assert rel <= 0.02, (tail_fp8, tail_bf16)
