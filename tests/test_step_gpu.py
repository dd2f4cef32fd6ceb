"""A training step's forward and backward read nothing back from the GPU (marker ``gpu``).

A host-device synchronisation inside the step leaves the GPU idle while the host issues the next launches (the
profile in docs/LOG.md measured 3.6 ms per layer call when ``cu_seqlens`` was read back in every layer). After
warm-up steps (autotuning, fla's #640 check), the forward and backward of a packed batch with new document
boundaries, and then a whole ``Trainer.train_step`` (optimizer included), run under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call. The step's numbers are read
afterwards, outside.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hola_titan.config import parse_config  # noqa: E402
from hola_titan.train import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def packed_batch(rows: int, seq_len: int, vocab: int, seed: int) -> dict:
    """Random tokens in ``rows`` rows with documents of random lengths (boundaries over the flattened rows)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=gen)
    cuts = set()
    for r in range(rows):
        cuts.add(r * seq_len)
        inner = torch.randint(1, seq_len, (3,), generator=gen).tolist()
        cuts.update(r * seq_len + c for c in inner)
    cu = torch.tensor(sorted(cuts) + [rows * seq_len], dtype=torch.int32)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "cu_seqlens": cu}


def _trainer(flavour: str, folder: Path, *extra: str) -> Trainer:
    """A 2-layer model of the 340M width on the GPU, T 2048 x 2 rows."""
    return Trainer(parse_config([
        "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--model.flavour", flavour,
        "--model.size", "340M", "--model.n_layers", "2", "--training.device", "cuda",
        "--training.mixed_precision_param", "bfloat16", "--training.seq_len", "2048",
        "--training.local_batch_size", "2", "--training.steps", "10", "--validation.enable", "false",
        "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(folder), *extra]))


@pytest.mark.parametrize("flavour", ["hola", "gdn"])
def test_forward_and_backward_of_a_step_do_not_synchronise(flavour, tmp_path):
    trainer = _trainer(flavour, tmp_path)
    vocab = trainer.model_args.vocab_size
    for step in range(2):
        trainer.train_step([packed_batch(2, 2048, vocab, seed=step)])
    batch = packed_batch(2, 2048, vocab, seed=7)  # new boundaries: nothing cached from the warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = trainer.loss_sum(batch)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


@pytest.mark.parametrize("flavour", ["hola", "gdn"])
def test_a_whole_training_step_does_not_synchronise(flavour, tmp_path):
    """The whole ``train_step`` (batch upload, forward, backward, gradient norm, clipping, the fused AdamW with
    its on-device skip, the schedule) after warm-up: the previous step's numbers are read before, outside."""
    trainer = _trainer(flavour, tmp_path)
    assert trainer.paths["short_conv"].startswith("triton") and trainer.paths["cross_entropy"].startswith("triton")
    vocab = trainer.model_args.vocab_size
    for step in range(2):
        trainer.train_step([packed_batch(2, 2048, vocab, seed=step)])
    first = trainer.resolve_pending()
    batch = packed_batch(2, 2048, vocab, seed=7)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = trainer.train_step([batch])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    result = pending.result()
    assert result["finite"] and result["loss"] < first["loss"] + 1.0 and trainer.state.step == 3


@pytest.mark.parametrize("flavour", ["hola", "gdn", "transformer"])
def test_a_compiled_training_step_runs_on_this_torch_and_matches_eager(flavour, tmp_path):
    """``compile.enable`` with the default ``fullgraph`` on the GPU's torch (torch 2.11's Dynamo refused a
    ``mappingproxy`` here once, which the CPU suite on a newer torch did not see). Two steps of the compiled trainer
    against the eager one; the bound is twice the eager bf16 run's distance from an eager float32 run (Inductor's
    fusions round differently, by about as much as bf16 compute itself) plus 1e-3 relative. At the debug width:
    the same code paths as 340M (fused convolution, custom ops, per-block compile), with the shipped kernel
    configurations of both precisions, so a fresh machine runs it in minutes."""
    def losses(name, *extra):
        trainer = _trainer(flavour, tmp_path / name, "--model.size", "debug", *extra)
        vocab = trainer.model_args.vocab_size
        out = []
        for step in range(2):
            trainer.train_step([packed_batch(2, 2048, vocab, seed=step)])
            out.append(trainer.resolve_pending()["loss"])
        return trainer, out

    compiled, got = losses("compiled", "--compile.enable", "true")
    assert compiled.paths["compile"] == "per block"
    _, eager = losses("eager")
    _, fp32 = losses("fp32", "--training.mixed_precision_param", "float32")
    for step, (c, e, f) in enumerate(zip(got, eager, fp32)):
        bound = 2 * abs(e - f) + 1e-3 * abs(f)
        assert abs(c - f) <= bound, f"step {step + 1}: compiled {c}, eager bf16 {e}, eager float32 {f}"
