"""The benchmark and measurement scripts of ``scripts/`` on the CPU: they run, write what they say, and compute their
summaries right. (Their numbers are measured on GPUs and logged in docs/LOG.md; here only tiny shapes.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], *, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _write_metrics(folder: Path, tokens_per_s: list[float], losses: list[float]) -> None:
    folder.mkdir(parents=True)
    rows = [{"step": i + 1, "loss": loss, "tokens_per_s": tps, "mfu": 0.1, "memory_gib": 1.0}
            for i, (tps, loss) in enumerate(zip(tokens_per_s, losses))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_composition_summary_uses_declared_baselines(tmp_path):
    """Runs made by separate calls are tabulated together; each scaling row is against its declared baseline
    (here FSDP 2 against one GPU, not against the T 64k single-GPU row that comes later in the list)."""
    losses = [9.0, 8.5, 8.0, 7.5]
    _write_metrics(tmp_path / "340M_1gpu", [1.0, 50.0, 100.0, 100.0], losses)
    _write_metrics(tmp_path / "340M_fsdp2", [1.0, 90.0, 180.0, 180.0], [x * 1.001 for x in losses])
    with (tmp_path / "340M_fsdp2" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 7.')  # a run stopped mid-write: the cut line is left out, not a traceback
    _write_metrics(tmp_path / "340M_T64k_1gpu", [1.0, 10.0, 40.0, 40.0], losses)
    result = _run([sys.executable, "scripts/composition_run.py", "--mode", "gpu2", "--out", str(tmp_path),
                   "--summarise-only"])
    summary = json.loads((tmp_path / "composition.json").read_text())
    rows = {e["layout"]: e for e in summary["rows"]}
    assert list(rows) == ["340M_1gpu", "340M_fsdp2", "340M_T64k_1gpu"]
    assert [name for name, e in rows.items() if "speedup" in e] == ["340M_fsdp2"]  # one-GPU rows have no baseline
    fsdp = rows["340M_fsdp2"]
    assert fsdp["baseline"] == "340M_1gpu" and fsdp["world_size"] == 2
    assert fsdp["tokens_per_s"] == pytest.approx(180.0)  # means after the first two steps
    assert fsdp["speedup"] == pytest.approx(1.8)
    assert fsdp["per_gpu_efficiency"] == pytest.approx(0.9)
    assert fsdp["loss_max_rel_diff"] == pytest.approx(0.001) and fsdp["loss_parity_ok"]
    assert "| 340M_fsdp2 | 2 | 180 | 1.80x vs 340M_1gpu | 90.0% |" in result.stdout


def test_composition_summary_without_runs_is_an_error(tmp_path):
    result = subprocess.run([sys.executable, "scripts/composition_run.py", "--mode", "gpu2", "--out", str(tmp_path),
                             "--summarise-only"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no <layout>/metrics.jsonl" in result.stderr


def test_saved_activations_reports_the_folded_mlp():
    result = _run([sys.executable, "scripts/saved_activations.py", "--flavour", "hola", "--size", "debug",
                   "--seq-len", "64", "--rows", "2"])
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("layers.0")}
    # SwiGLU's two inputs, not the product fed to w2 (recomputed in the backward), not silu(w1 x)
    assert lines["layers.0.feed_forward"].count("[1, 64, 512]") == 2
    assert "layers.0.feed_forward.w2" not in lines
    assert "x 2 rows, 2 blocks:" in result.stdout and "GiB outside the core" in result.stdout


def test_bench_decode_writes_rows(tmp_path):
    out = tmp_path / "decode.json"
    _run([sys.executable, "scripts/bench_decode.py", "--flavours", "hola,gdn", "--size", "debug", "--vocab", "256",
          "--prompt", "20", "--decode", "eager,buffers", "--batch-sizes", "1,3", "--new-tokens", "5",
          "--eager-new-tokens", "4", "--device", "cpu", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["flavour"], r["decode"], r["batch"]) for r in rows] == [
        (f, m, b) for f in ("hola", "gdn") for m in ("eager", "buffers") for b in (1, 3)]
    for r in rows:
        assert "error" not in r, r
        assert r["new_tokens"] == (4 if r["decode"] == "eager" else 5)
        assert 0 < r["step_ms"] < 60_000
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["step_ms"], rel=1e-9)
        assert r["path"]["decode"] == r["decode"] and r["cache_bytes"] > 0
    # The cache of a recurrent model has a fixed size per row.
    hola = {r["batch"]: r["cache_bytes"] for r in rows if r["flavour"] == "hola" and r["decode"] == "buffers"}
    assert hola[3] == 3 * hola[1]


def test_bench_context_parallel_runs_under_torchrun(tmp_path):
    out = tmp_path / "cp.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "scripts/bench_context_parallel.py",
          "--device", "cpu", "--seq-lens", "64", "--block", "8", "--window", "4", "--heads", "2", "--dim", "16",
          "--reps", "1", "--layers", "3", "--out", str(out)], timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert row["T"] == 64 and row["cp"] == 2
    assert 0 < row["cp_ms"] < 60_000 and 0 < row["single_ms"] < 60_000
    # Per layer, rank 1 receives rank 0's state [H, D, D] and cache (W + C rows of keys and values, scores,
    # positions) in float32: 5,288 bytes at these sizes (no convolution tails: the mixers run alone).
    assert row["comm_bytes_per_rank"] == [0, 3 * 5288], row["comm_bytes_per_rank"]
    assert row["cp_host_syncs"] is None  # counted on CUDA only


def test_bench_collectives_runs_under_torchrun(tmp_path):
    out = tmp_path / "collectives.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "scripts/bench_collectives.py",
          "--device", "cpu", "--params", "4e6", "--blocks", "4", "--reps", "2", "--large-mib", "0", "--out", str(out)],
         timeout=600)
    data = json.loads(out.read_text())
    assert data["world"] == 2 and len(data["rows"]) == 6
    assert all(r["ms"] > 0 and r["bus_gb_s"] > 0 for r in data["rows"])
    # The unoverlapped FSDP step: per block two parameter all-gathers (bf16) and one gradient reduce-scatter (fp32),
    # each at one block's size (4e6 parameters over 4 blocks: 2 MB of bf16, 4 MB of fp32).
    at_block = {r["collective"]: r["ms"] for r in data["rows"] if r["bytes"] in (2_000_000, 4_000_000)
                and r["collective"] in ("all_gather bf16", "reduce_scatter fp32")}
    assert len(at_block) == 2, data["rows"]
    expected = 4 * (2 * at_block["all_gather bf16"] + at_block["reduce_scatter fp32"])
    assert data["fsdp_step_ms_unoverlapped"] == pytest.approx(expected, rel=1e-9)


def test_kernel_profile_counts_device_kernels_once():
    """A custom op, an autograd node or an NCCL wrapper on the host reports its kernels' device time as its own,
    and a GPU-side range annotation spans them: only the kernels themselves count."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from hola_titan.profiling import is_device_kernel

    def event(device_type, annotation=False):
        return SimpleNamespace(device_type=device_type, is_user_annotation=annotation)

    assert is_device_kernel(event(DeviceType.CUDA))  # chunk_bwd_kernel_dqkwg, ncclDevKernel_AllGather, ...
    assert not is_device_kernel(event(DeviceType.CPU))  # hola::gdn_bwd, GeneratedBackwardFor_..., record_param_comms
    assert not is_device_kernel(event(DeviceType.CUDA, annotation=True))  # a range on the GPU timeline


def test_kernel_profile_names_the_host_s_aten_calls_per_call():
    """The profile lists which ATen calls a call issues, per call (the host work behind a GPU's idle time)."""
    import torch

    from hola_titan.profiling import kernel_profile

    a = torch.randn(8, 8)

    def call():
        for _ in range(3):
            torch.mm(a, a)
        torch.cumsum(a, 0)

    out = kernel_profile(call, device=torch.device("cpu"), timed_ms=None, iters=2, top=30)
    calls = {x["op"]: x["calls"] for x in out["aten_top"]}
    assert calls["aten::mm"] == 3 and calls["aten::cumsum"] == 1, calls
    assert out["aten_calls"] >= 4


def test_count_cp_ops_runs_under_torchrun():
    result = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "scripts/count_cp_ops.py",
                   "--seq-len", "128", "--block", "16", "--window", "4"], timeout=600)
    counts = {int(line.split()[1].rstrip(":")): int(line.split()[2]) for line in result.stdout.splitlines()
              if line.startswith("rank ")}
    assert set(counts) == {0, 1} and all(10 <= n <= 200_000 for n in counts.values()), counts
    # Rank 1 continues rank 0's document: its call runs the cached (extended row) layout, rank 0 the plain one.
    assert counts[1] > counts[0]


def test_profile_kinds_and_idle_gaps():
    """Kernels are sorted into kinds by name (Inductor's generated names first: they quote the ops they fuse, e.g.
    ``select``), and the GPU's idle time is the sum of the gaps between kernels, overlaps merged."""
    from hola_titan.profiling import idle_gaps, kernel_kind
    assert kernel_kind("triton_poi_fused__to_copy_add_mul_select_slice_view_where_zeros_12") == "inductor"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_kind("_cache_bwd_dkdv_kernel") == "hola_cache"
    assert kernel_kind("_short_conv_bwd_dz_kernel") == "hola_fused"
    assert kernel_kind("chunk_bwd_kernel_dqkwg") == "fla"
    assert kernel_kind("something_else") == "other"
    # Kernels [0, 10], [5, 20] (overlapping), a gap of 30 us, [50, 60], a gap of 2 us (below 5: not counted), [62, 70].
    gaps = idle_gaps([(0, 10, "a"), (5, 20, "b"), (50, 60, "c"), (62, 70, "d")])
    assert gaps["span_ms"] == pytest.approx(0.070) and gaps["idle_ms"] == pytest.approx(0.030)
    assert gaps["num_gaps"] == 1 and gaps["gaps"][0] == dict(us=30.0, after="b", before="c")
    # What the host ran inside the gaps: the gap [20, 50] overlaps "step" over [15, 30] (10 us) and "loss" over
    # [35, 40] (5 us) on another thread; 15 us of it no operation covers (Python). A host operation outside every
    # gap ([0, 12]) is not counted.
    host = [(15, 30, "step"), (35, 40, "loss"), (36, 38, "loss"), (0, 12, "data")]
    gaps = idle_gaps([(0, 10, "a"), (5, 20, "b"), (50, 60, "c"), (62, 70, "d")], host=host)
    assert gaps["gaps"][0]["host"] == {"no host operation": 15.0, "step": 10.0, "loss": 7.0}
    assert gaps["host_in_gaps"] == [dict(op="no host operation", us=15.0), dict(op="step", us=10.0),
                                    dict(op="loss", us=7.0)]
    assert "host_in_gaps" not in idle_gaps([(0, 10, "a"), (50, 60, "c")])


def test_compare_losses_runs_two_trainers_on_the_same_batches(tmp_path):
    out = tmp_path / "compare.json"
    result = _run([sys.executable, "scripts/compare_losses.py", "--steps", "2", "--kernels-a", "reference",
                   "--kernels-b", "auto", "--set-b", "metrics.log_freq=1", "--out", str(out), "--", "--job.config_file",
                   "train_configs/debug_model.toml", "--training.device", "cpu", "--training.seq_len", "64",
                   "--training.local_batch_size", "2"])
    data = json.loads(out.read_text())
    a, b = data["losses"]["a"], data["losses"]["b"]
    assert len(a) == len(b) == 2 and a == b  # auto is the reference on a CPU: the same function, bit for bit
    assert data["paths"]["b"]["short_conv"] == "PyTorch reference"
    assert data["runs"]["b"] == dict(label="model.kernels=auto metrics.log_freq=1",
                                     overrides=["--model.kernels", "auto", "--metrics.log_freq", "1"])
    assert "b: model.kernels=auto metrics.log_freq=1" in result.stdout
    assert "max |diff| 0.000e+00" in result.stdout


SAME = "the two runs have the same settings"


@pytest.mark.parametrize("flags,shared,message", [
    (["--set-a", "model.kernels"], [], "expected SECTION.KEY=VALUE"),
    (["--set-b", "training.steps=5"], [], "set by this script"),
    (["--kernels-b", "triton"], [], SAME),
    # the same settings however they are spelt: in another order, or given to both runs after "--" as well
    (["--kernels-b", "triton", "--set-a", "model.save_cache_output=true", "--set-a", "metrics.log_freq=2",
      "--set-b", "metrics.log_freq=2", "--set-b=--model.save_cache_output=true"], [], SAME),
    (["--kernels-b", "triton", "--set-a", "model.save_cache_output=true"], ["--model.save_cache_output", "true"],
     SAME),
    (["--kernels-a", "triton", "--kernels-b", "reference", "--set-a", "model.kernels=reference"], [], SAME)])
def test_compare_losses_refuses_a_bad_override_and_two_equal_runs(flags, shared, message):
    result = subprocess.run([sys.executable, "scripts/compare_losses.py", *flags, "--", "--job.config_file",
                             "train_configs/debug_model.toml", *shared], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_init_memory_reports_every_rank(tmp_path):
    out = tmp_path / "init.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
          "--rdzv_endpoint", "localhost:0", "scripts/init_memory.py", "--out", str(out), "--", "--job.config_file",
          "train_configs/debug_model.toml", "--training.device", "cpu"], timeout=600)
    rows = json.loads(out.read_text())
    assert [r["rank"] for r in rows] == [0, 1] and all(0 < r["peak_rss_gib"] < 8 for r in rows)
    assert rows[0]["num_params"] == 1_578_000


def test_bench_context_parallel_predicts_from_stage_timings(tmp_path):
    pred, out = tmp_path / "pred.json", tmp_path / "stages.json"
    _run([sys.executable, "scripts/bench_context_parallel.py", "--predict", "--device", "cpu", "--size", "debug",
          "--seq-lens", "64", "128", "--reps", "1", "--ranks", "2", "4", "--prediction-out", str(pred),
          "--out", str(out)])
    rows = json.loads(pred.read_text())
    assert [(r["R"], r["seq_len_per_rank"]) for r in rows] == [(2, 64), (4, 64), (2, 128), (4, 128)]
    # The state path alone, fresh and continuing, beside the mixer's two timings.
    stages = json.loads(out.read_text())["timings"]["64"]
    assert all(stages[name] > 0 for name in ("mixer_fresh", "mixer_cont", "state_fresh", "state_cont",
                                             "mixer_fresh_b2b", "mixer_cont_b2b")), stages
    # A continuing layer's extra time comes from the back-to-back pair, split as the fresh layer splits.
    extra = stages["mixer_cont_b2b"] - stages["mixer_fresh_b2b"]
    assert stages["mixer_extra_from"] == "back to back"
    assert (stages["layer_fwd_cont"] + stages["layer_bwd_cont"]
            == pytest.approx(stages["layer_fwd_fresh"] + stages["layer_bwd_fresh"] + extra))
    for r in rows:
        assert {"R", "seq_len_per_rank", "size", "predicted_speedup", "date", "device"} <= set(r)
        assert r["predicted_speedup"] == pytest.approx(r["one_gpu_step_ms"] / r["predicted_step_ms"])
    # One GPU at R x T comes from the stages measured there when they were (2 x 64), else from R x the work at T.
    assert [r["one_gpu_from"] for r in rows] == ["measured at R x T", "4 x the work at T", "2 x the work at T",
                                                 "4 x the work at T"]
    # Appends: a second run from the saved stages adds its rows after the first run's.
    _run([sys.executable, "scripts/bench_context_parallel.py", "--predict", "--device", "cpu", "--stages-json",
          str(out), "--ranks", "8", "--prediction-out", str(pred), "--out", str(tmp_path / "again.json")])
    again = json.loads(pred.read_text())
    assert again[:4] == rows and [(r["R"], r["seq_len_per_rank"]) for r in again[4:]] == [(8, 64), (8, 128)]


def test_bench_hola_attention_counts_the_pairs_the_cache_read_computes():
    """The cache read's FLOP count (TFLOP/s of the issue's targets) from the selection and the block table: two
    blocks of 3 and 2 tokens, two heads; head 0 has 2 filled slots in block 1, head 1 one, block 0 none."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    spec = importlib.util.spec_from_file_location("bench_hola_attention", "scripts/bench_hola_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sel = torch.tensor([[[-1, -1], [-1, -1]], [[0, 2], [1, -1]], [[-1, -1], [-1, -1]]])  # [NB, H, W]
    table = SimpleNamespace(blk_len=torch.tensor([3, 2, 0]))  # a padding row last
    # Cache: block 1's 2 queries read 2 + 1 slots over the heads; in-block: (3*4/2 + 2*3/2) per head, 2 heads.
    assert bench.cache_pairs(sel, table) == 2 * 3 + 2 * (6 + 3)


def test_bench_hola_attention_times_both_gathers_on_the_same_slots_with_the_same_gradients(monkeypatch):
    """The gather stage runs the backends' gather and the old advanced indexing on the gathered layout's slots (here
    on a CPU, each call once instead of timed): both give the token rows the same gradient, and the row counts the
    empty slots: W per head in each document's first block (3 documents, W 4, 2 heads: 24), and every slot of the
    block table's padding rows."""
    import importlib.util

    import torch

    from hola_titan.kernels.hola.sdpa import _select
    from hola_titan.kernels.runtime.documents import build_block_table

    spec = importlib.util.spec_from_file_location("bench_hola_attention", "scripts/bench_hola_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    grads = {}

    def once(fn, grad_to_none, rep_ms):
        fn()
        rows = grad_to_none[0]
        grads[len(grads)] = rows.grad.clone()
        rows.grad = None
        return 1.0

    monkeypatch.setattr(bench, "bench", once)
    h, d, block, window = 2, 8, 8, 4
    cu = torch.tensor([0, 16, 32, 48])
    k = torch.randn(1, 48, h, d)
    table = build_block_table(1, 48, cu, block, k.device)
    sel = _select(torch.rand(48, h), table, window=window, evict="score", num_heads=h)
    row = bench.gather_stages(k, sel, table, block, window, rep_ms=1)
    assert set(row) == {"stage_gather_ms", "stage_gather_indexing_ms", "stage_gather_empty_slots"}
    padding_rows = int((table.blk_len == 0).sum())  # the table's rows past its blocks: every slot empty
    assert row["stage_gather_empty_slots"] == 3 * window * h + padding_rows * (window + block) * h
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_bench_hola_attention_sweep_times_the_configuration_in_use_and_the_matching_ones(monkeypatch):
    """--sweep-match: the configurations whose names match, and the one in use whatever its name and whether or not
    the grid lists it (here a D whose configurations are not in the grid, one with a variant); each kind's
    configuration is restored afterwards."""
    import importlib.util
    import re
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("bench_hola_attention", "scripts/bench_hola_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    in_use = {"fwd": dict(BM=64, BN=64, num_warps=4, num_stages=3), "dq": dict(BM=64, BN=64, num_warps=4,
                                                                               num_stages=3, TWO_PASS=True),
              "dkdv": dict(BM=32, BN=32, num_warps=4, num_stages=2)}
    attn = SimpleNamespace(CONFIGS={kind: {64: dict(cfg)} for kind, cfg in in_use.items()})
    timed = []
    monkeypatch.setattr(bench, "bench", lambda fn, grads, rep_ms: timed.append(fn()) or 1.0)
    current = {}

    def fwd():
        current["fwd"] = dict(attn.CONFIGS["fwd"][64])
        return "fwd"

    def bwd():
        current["bwd"] = (dict(attn.CONFIGS["dq"][64]), dict(attn.CONFIGS["dkdv"][64]))
        return "bwd"

    out = bench.sweep(attn, fwd, bwd, 64, 1, match=re.compile("SEPARATETrue$"))
    names = list(out)
    assert "fwd_BM64_BN64_w4_s3" in names and "dq_BM64_BN64_w4_s3_TWO_PASSTrue" in names, names
    assert "dkdv_BM32_BN32_w4_s2" in names, names  # in use and in the grid: once
    assert names.count("dkdv_BM32_BN32_w4_s2") == 1
    others = [n for n in names if n not in ("fwd_BM64_BN64_w4_s3", "dq_BM64_BN64_w4_s3_TWO_PASSTrue",
                                            "dkdv_BM32_BN32_w4_s2")]
    assert others and all(n.endswith("SEPARATETrue") for n in others), others
    assert {kind: attn.CONFIGS[kind][64] for kind in in_use} == in_use
    # With the kept output the dk/dv entries go to the kept table, which the backward then reads; the plain one stays.
    attn.CONFIGS["dkdv_kept"] = {64: dict(in_use["dkdv"], DQ_ATOMIC=True)}
    seen = []
    out = bench.sweep(attn, fwd, lambda: seen.append(dict(attn.CONFIGS["dkdv_kept"][64])) or "bwd", 64, 1,
                      match=re.compile("SEPARATETrue$|TWO_PASS"), kept=True)
    assert "dkdv_BM32_BN32_w4_s2_DQ_ATOMICTrue" in out and any(c.get("SEPARATE") for c in seen), list(out)
    assert not [n for n in out if "TWO_PASS" in n and n != "dq_BM64_BN64_w4_s3_TWO_PASSTrue"], list(out)
    assert attn.CONFIGS["dkdv"][64] == in_use["dkdv"]
    assert attn.CONFIGS["dkdv_kept"][64] == dict(in_use["dkdv"], DQ_ATOMIC=True)


def test_bench_train_flavour_rows_variants_and_refusals():
    """``bench_train.py``'s row names: each flavour once, ``--keep-output`` adding ``<flavour>:kept`` and
    ``--layered-backward`` ``<flavour>:layered`` for the cache flavours on CUDA; an unknown variant, variant rows on
    a CPU or without a cache flavour stop before any row."""
    import importlib.util
    from types import SimpleNamespace

    import torch
    spec = importlib.util.spec_from_file_location("bench_train", "scripts/bench_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def rows(flavours, keep, device=cuda, layered=False, fa4=False):
        return bench._flavour_rows(SimpleNamespace(flavours=flavours, keep_output=keep, layered_backward=layered,
                                                   fa4=fa4), device)

    assert rows("hola,gdn,hola", False, cpu) == ["hola", "gdn"]
    assert rows("hola,gdn,hola_recency", True) == ["hola", "gdn", "hola_recency", "hola:kept", "hola_recency:kept"]
    assert rows("hola,hola:kept", True) == ["hola", "hola:kept"]
    assert rows("hola,gdn", False, layered=True) == ["hola", "gdn", "hola:layered"]
    assert rows("hola,gdn", True, layered=True) == ["hola", "gdn", "hola:kept", "hola:layered"]
    assert rows("hola:layered,gdn", False) == ["hola:layered", "gdn"]
    assert rows("hola,gdn", False, fa4=True) == ["hola", "gdn", "hola:fa4"]
    for flavours, keep, layered, device, message in [
            ("hola:foo", False, False, cuda, "the variants are :kept, :layered, :fa4"),
            ("gdn:kept", False, False, cuda, "the variants are"),
            ("gdn:layered", False, False, cuda, "the variants are"),
            ("hola:overlap", False, False, cuda, "the variants are"),
            ("hola", True, False, cpu, "--keep-output: model.save_cache_output needs the Triton backend"),
            ("hola", False, True, cpu, "--layered-backward: model.overlap_backward needs the Triton backend"),
            ("gdn,transformer", True, False, cuda, "--keep-output: none of --flavours"),
            ("gdn", False, True, cuda, "--layered-backward: none of --flavours")]:
        with pytest.raises(SystemExit, match=message):
            rows(flavours, keep, device, layered)


def test_predict_layouts_reads_the_committed_measurements(tmp_path):
    """Every multi-GPU layout of composition_run gets a prediction from the JSON under docs/results/, with the keys
    a measured row has; at the quoted link the FSDP 2 row hides its collectives (the step model's own arithmetic is
    tests/test_step_model.py)."""
    result = _run([sys.executable, "scripts/predict_layouts.py", "--out", str(tmp_path)])
    rows = {r["layout"]: r for r in json.loads((tmp_path / "predictions.json").read_text())["rows"]}
    assert {"340M_fsdp2", "340M_hsdp2", "340M_tp2", "340M_T64k_cp2", "1.3B_fsdp4", "1.3B_fsdp2_tp2_cp2",
            "7B_fsdp8"} <= set(rows)
    for r in rows.values():
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["one_gpu_tokens_per_s"])
        assert r["per_gpu_efficiency"] == pytest.approx(r["speedup"] / r["world_size"])
    assert rows["340M_fsdp2"]["exposed_ms"] < 0.01 * rows["340M_fsdp2"]["step_ms"]
    # A link 100x slower exposes the reduce-scatters: the same model must then miss the target.
    _run([sys.executable, "scripts/predict_layouts.py", "--bus-gbps", "2.84", "--out", str(tmp_path / "s")])
    slow_rows = {r["layout"]: r for r in json.loads((tmp_path / "s" / "predictions.json").read_text())["rows"]}
    assert slow_rows["340M_fsdp2"]["speedup"] < 1.85 < rows["340M_fsdp2"]["speedup"]
    assert "| 340M_fsdp2 | 2 |" in result.stdout


def test_bench_ops_takes_only_the_rows_it_has(capsys):
    """``bench_ops.py`` and ``bench_hola_attention.py --items``: their rows by default, any of them, and an unknown
    row (a typo, or a row the script no longer has) refused by name before any GPU work, not skipped without a
    word."""
    from helpers import load_script

    bench = load_script("bench_ops")
    assert bench._args([]).items.split(",") == list(bench.ITEMS)
    assert bench._args(["--items", "conv_fused,norm_compiled"]).items == "conv_fused,norm_compiled"
    with pytest.raises(SystemExit):
        bench._args(["--items", "conv_fused,norm_fused"])
    assert "--items: unknown norm_fused; expected some of conv_eager" in capsys.readouterr().err
    hola = load_script("bench_hola_attention")
    assert hola.parse_args([]).items.split(",") == list(hola.ITEMS)
    with pytest.raises(SystemExit):
        hola.parse_args(["--items", "hola_triton,hola_flex"])
    assert "--items: unknown hola_flex; expected some of gdn_fla" in capsys.readouterr().err
