"""Context parallelism (DESIGN §3) on CPU with gloo: layouts and sharding in-process; parity with one
process through torchrun (``tests/cp_worker.py``, 2, 4 and 8 ranks) and through the trainer
(``tests/parallel_worker.py``: the layouts of each process count in one launch).

Parity bounds. Float64 cases: 1e-10 of each tensor's scale (the CP run chunks the state path at other token
offsets, so only rounding differs: ~1e-15 is typical). Float32 ``hola_attention``: 1e-5 (~100x the roundoff).
Float32 whole model: at most twice the one-process float32 error against float64 (DESIGN §7; see the worker).
Trainer losses: 1e-5 absolute (losses are ~9).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hola_titan.parallelisms.context_parallel import build_layout, shard_batch
from helpers import run_parallel_runs

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "train_configs" / "debug_model.toml")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HOLA_TITAN_CACHE"] = env.get("HOLA_TITAN_CACHE", str(ROOT / ".pytest_cache" / "hola_titan"))
    env["OMP_NUM_THREADS"] = "1"
    return env


# ----------------------------------------------------------------------------------------------------------------
# Layout and sharding (no processes)
# ----------------------------------------------------------------------------------------------------------------

class _OneRankMesh:
    """What ContextParallel reads of its mesh outside collectives."""

    def get_local_rank(self):
        return 1

    def size(self):
        return 2


def test_layout_tensors_are_made_once_per_batch():
    """Index tensors built from a batch's layout are made once for that batch (every layer reuses them) and kept
    with it: the next batch's view makes its own, and the first batch's still answers with its own (a view that
    outlived its batch could otherwise point a recomputed forward at another batch's documents)."""
    from hola_titan.parallelisms.context_parallel import ContextParallel

    cp = ContextParallel(_OneRankMesh(), recurrent=True, conv_size=4)
    made = []

    def maker(view):
        def make():
            made.append(view.layout)
            return torch.tensor(view.layout.local_cu_seqlens)
        return make

    first = build_layout(cp_rank=1, cp_size=2, num_rows=1, row_len=32, cu_seqlens=[0, 20, 32])
    second = build_layout(cp_rank=1, cp_size=2, num_rows=1, row_len=32, cu_seqlens=[0, 8, 32])
    view1 = cp.batch(first)
    a = view1.memo("cu", maker(view1))
    assert view1.memo("cu", maker(view1)) is a and made == [first]  # every later layer of the batch reuses it
    view2 = cp.batch(second)
    b = view2.memo("cu", maker(view2))
    assert made == [first, second]
    assert a.tolist() == [0, 4, 16] and b.tolist() == [0, 16]
    assert view1.memo("cu", maker(view1)) is a  # the first batch's view is untouched by the second
    with torch.inference_mode():  # first made during validation, then used by a forward that records gradients
        c = cp.batch(first).memo("cu", maker(view1))
    assert not c.is_inference()
    with pytest.raises(ValueError, match="built for rank 0 of 2"):
        cp.batch(build_layout(cp_rank=0, cp_size=2, num_rows=1, row_len=32, cu_seqlens=[0, 32]))
    assert not hasattr(cp, "layout"), "the group must hold no batch"


def test_layout_of_documents_crossing_shards():
    # 4 shards of 8: [0,3) [3,13) crosses 8 with 5 tokens before it; [13,16) ends on the boundary 16;
    # [23,25) crosses 24 with one token before it.
    cu = [0, 3, 13, 16, 23, 25, 32]
    layouts = [build_layout(cp_rank=r, cp_size=4, num_rows=1, row_len=32, cu_seqlens=cu) for r in range(4)]
    assert layouts[0].first_offset == ((0,), (5,), (0,), (1,))
    assert layouts[0].end_offset == ((5,), (0,), (1,), (0,))
    one = layouts[1]
    assert one.local_cu_seqlens == [0, 5, 8] and one.seq_offset == (5, 0)
    assert one.in_seq == (0,) and one.out_seq == (-1,)
    two = layouts[2]
    assert two.in_seq == (-1,) and two.out_seq == (1,)
    assert layouts[3].local_cu_seqlens == [0, 1, 8] and layouts[3].seq_offset == (1, 0)


def test_layout_of_a_document_spanning_several_shards():
    cu = [0, 5, 30, 32]  # [5, 30) spans the boundaries 8, 16 and 24
    layouts = [build_layout(cp_rank=r, cp_size=4, num_rows=1, row_len=32, cu_seqlens=cu) for r in range(4)]
    assert [lay.in_seq for lay in layouts] == [(-1,), (0,), (0,), (0,)]
    assert [lay.out_seq for lay in layouts] == [(1,), (0,), (0,), (-1,)]
    assert layouts[2].in_seq == layouts[2].out_seq == (0,)
    assert layouts[3].first_offset[3] == (19,)


def test_unpacked_rows_continue_on_every_rank():
    layout = build_layout(cp_rank=1, cp_size=3, num_rows=2, row_len=24, cu_seqlens=None)
    assert layout.in_seq == (0, 1) and layout.out_seq == (0, 1)
    assert layout.local_cu_seqlens == [0, 8, 16] and layout.first_offset[2] == (16, 16)


def _batch(bsz: int, seq_len: int, cu: list[int] | None) -> dict:
    ids = torch.arange(bsz * seq_len).view(bsz, seq_len)
    batch = {"input_ids": ids, "labels": ids + 1000, "position_ids": ids % seq_len}
    if cu is not None:
        batch["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    return batch


def test_packed_batches_are_sharded_as_one_stream_with_labels():
    # Two rows of 8; the flattened stream of 16 tokens splits at 8 = the second row's start.
    local = shard_batch(_batch(2, 8, [0, 3, 8, 12, 16]), cp_rank=1, cp_size=4, recurrent=True,
                        conv_size=4)
    assert local["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert local["labels"].tolist() == [[1004, 1005, 1006, 1007]]
    assert local["cu_seqlens"].tolist() == [0, 4] and local["cu_seqlens"].dtype == torch.int32
    assert local["cp_layout"].seq_offset == (1,)


def test_unpacked_rows_are_sharded_by_columns():
    local = shard_batch(_batch(2, 8, None), cp_rank=1, cp_size=2, recurrent=False, conv_size=4)
    assert local["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert local["labels"].tolist() == [[1004, 1005, 1006, 1007], [1012, 1013, 1014, 1015]]
    assert "cu_seqlens" not in local and local["cp_layout"].shard_start == 4


@pytest.mark.parametrize("kwargs, key", [
    (dict(recurrent=False, cp_size=4, cu=[0, 16]), "data.varlen"),
    (dict(recurrent=True, cp_size=8, cu=[0, 16]), "training.seq_len"),  # shards of 2 tokens, tails of 3
])
def test_bad_batches_raise_naming_the_setting(kwargs, key):
    with pytest.raises(ValueError, match=key):
        shard_batch(_batch(1, 16, kwargs["cu"]), cp_rank=0, cp_size=kwargs["cp_size"],
                    recurrent=kwargs["recurrent"], conv_size=4)


# ----------------------------------------------------------------------------------------------------------------
# Parity with one process (torchrun workers)
# ----------------------------------------------------------------------------------------------------------------

# R = 4 runs every case but the Triton-interpreter ones (run at R = 2); R = 8 a subset (eight processes share the
# CI machine's two cores): documents spanning several shards, length-1 documents at edges, rows, GDN, the whole
# model with and without activation checkpointing, and a fresh start on every rank.
R8_CASES = ("attn:spanning_big_window", "attn:singles_score", "attn:rows_score", "attn:packed_gdn",
            "attn:fresh_starts_wait_for_nothing", "model:hola_packed",
            "model:hola_rows", "model:hola_packed_ac", "bytes")


@functools.cache
def _worker_results(nproc: int) -> dict[str, dict]:
    cases = {2: ("all", "bytes"), 4: ("all_but_triton", "bytes"), 8: R8_CASES}[nproc]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
         "--rdzv_endpoint", "localhost:0", str(ROOT / "tests" / "cp_worker.py"), *cases],
        env=_env() | {"PYTHONWARNINGS": "ignore::FutureWarning", "TRITON_INTERPRET": "1"}, capture_output=True,
        text=True, timeout=400)
    rows = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if "rank" in row:  # a failure seen on another rank
                row = {**rows.get(row["case"], {}), "failed": row["failed"]}
            rows[row["case"]] = row
    assert result.returncode == 0 and rows, result.stdout[-3000:] + result.stderr[-3000:]
    return rows


# The tests of one worker run share its results: under pytest-xdist they go to one xdist worker.
NPROCS = [pytest.param(n, marks=pytest.mark.xdist_group(f"cp_worker_{n}")) for n in (2, 4, 8)]


def _check_cases(nproc: int, prefix: str) -> None:
    rows = {name: row for name, row in _worker_results(nproc).items() if name.startswith(prefix)}
    assert rows, f"no {prefix} cases ran"
    failed = {name: row["failed"] for name, row in rows.items() if row["failed"]}
    assert not failed, failed


@pytest.mark.slow
@pytest.mark.parametrize("nproc", NPROCS)
def test_hola_attention_output_and_gradients_match_one_process(nproc):
    """Packed documents crossing one and several shards, block heads, a cache larger than a shard, length-1
    documents at shard edges, shards ending inside a block, recency, GDN, window 0, unpacked rows; float64 and
    float32; a fresh start on every rank, which waits for nothing and receives nothing."""
    _check_cases(nproc, "attn:")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", NPROCS)
def test_debug_model_logits_and_gradients_match_one_process(nproc):
    """HOLA (packed, packed rows, unpacked), HOLA+recency, GDN and Transformer++; with activation checkpointing
    of every block and op-level selective checkpointing."""
    _check_cases(nproc, "model:")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", NPROCS)
def test_bytes_received_per_layer_do_not_grow_with_sequence_length(nproc):
    """Per rank: the same bytes at shards of 8 and 32 tokens; rank 0 receives nothing, every later rank the
    message of the document that crosses into its shard."""
    counts = _worker_results(nproc)["bytes"]["bytes"]
    assert counts["shard_8"] == counts["shard_32"], counts
    assert counts["shard_8"][0] == 0 and all(c > 0 for c in counts["shard_8"][1:]), counts


# ----------------------------------------------------------------------------------------------------------------
# The trainer: debug_model.toml unchanged, context parallel from the command line
# ----------------------------------------------------------------------------------------------------------------

# name: (processes, cp degree, rows per step, replicate degree, activation checkpointing, more overrides)
TRAIN_LAYOUTS = {
    "cp2": (2, 2, 2, 1, "none", []),
    "cp4_ac": (4, 4, 2, 1, "full", []),
    "cp2_fsdp2": (4, 2, 4, 1, "none", []),
    "cp2_hsdp2x1": (4, 2, 4, 2, "none", []),
    "cp2_hsdp2x2": (8, 2, 4, 2, "none", []),
    # Compiled blocks around the eager handover (compile.fullgraph false; true is refused by the config check).
    "cp2_compile": (2, 2, 2, 1, "none", ["--compile.enable", "true", "--compile.fullgraph", "false"]),
}
TRAIN = ["--job.config_file", DEBUG, "--training.steps", "3", "--metrics.log_freq", "1", "--validation.freq", "3",
         "--validation.steps", "1", "--training.seq_len", "128", "--metrics.enable_tensorboard", "false"]


def _train_runs(nproc: int) -> dict[str, list[str]]:
    """The trainer runs of ``nproc`` processes: the layouts, or at 1 the one-process runs of 2 and 4 rows."""
    if nproc == 1:
        return {f"rows{rows}": [*TRAIN, "--training.local_batch_size", str(rows)] for rows in (2, 4)}
    runs = {}
    for name, (n, cp, rows, replicate, ac, extra) in TRAIN_LAYOUTS.items():
        if n == nproc:
            runs[name] = [*TRAIN, "--training.local_batch_size", str(rows * cp // nproc),
                          "--parallelism.context_parallel_degree", str(cp),
                          "--parallelism.data_parallel_replicate_degree", str(replicate),
                          "--parallelism.data_parallel_shard_degree", str(nproc // (cp * replicate)),
                          "--activation_checkpoint.mode", ac, *extra]
    return runs


@functools.cache
def _train_results(nproc: int) -> dict[str, dict | str]:
    """The runs of ``nproc`` processes, in one torchrun launch (tests/parallel_worker.py: one after another in the
    same processes, whose start costs more than the runs)."""
    with tempfile.TemporaryDirectory() as folder:
        return run_parallel_runs(Path(folder), nproc, _train_runs(nproc))


def _losses(nproc: int, name: str) -> list[float]:
    """The 3 training losses and the validation loss of run ``name``."""
    got = _train_results(nproc)[name]
    assert isinstance(got, dict), f"{name}: {got}"
    return got["losses"] + got["val_losses"]


@pytest.mark.slow
@pytest.mark.xdist_group("cp_training")  # the runs of each process count and the one-process runs are shared
@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
def test_training_with_context_parallel_matches_one_process(layout):
    """Same global batch of packed rows: 3 training losses and the validation loss agree with one process (with
    activation checkpointing of every block in ``cp4_ac``; compiled blocks in ``cp2_compile``)."""
    nproc, _, rows, *_ = TRAIN_LAYOUTS[layout]
    one = _losses(1, f"rows{rows}")
    many = _losses(nproc, layout)
    assert len(one) == len(many) == 4
    assert max(abs(a - b) for a, b in zip(one, many)) < 1e-5, (layout, one, many)
    # The cache layers' gates logged with the validation: gathered whole from their shards on every layout.
    gates_one = _train_results(1)[f"rows{rows}"]["cache_gates"]
    gates_many = _train_results(nproc)[layout]["cache_gates"]
    assert len(gates_one) == 1 and len(gates_one[0]) == 2 and gates_many[0] == pytest.approx(gates_one[0], abs=1e-6)
    gammas_one = _train_results(1)[f"rows{rows}"]["cache_gammas"]  # gamma_q * gamma_k: sharded over the head dim
    gammas_many = _train_results(nproc)[layout]["cache_gammas"]
    assert len(gammas_one[0]) == 2 and gammas_many[0] == pytest.approx(gammas_one[0], abs=1e-6)
