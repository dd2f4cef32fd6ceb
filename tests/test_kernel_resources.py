"""``scripts/kernel_resources.py``: a kernel of a shipped plan compiled for sm_90a on this CPU, its resources read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).resolve().parents[1]


def test_a_planned_kernel_compiles_for_hopper_here_and_reports_its_resources(tmp_path):
    out = tmp_path / "rstd.json"
    result = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d128/h2/float32/plain",
                             "--kernel", "_rstd_kernel", "--sweep", "BR=16,32", "--warps", "4", "--json", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["BR"] for r in rows] == [16, 32] and all("error" not in r for r in rows), rows
    # A row reduction: a few dozen registers, no spills, a little shared memory for the reduction, no matrix
    # instructions of either kind.
    assert all(0 < r["registers"] < 128 and r["stack_bytes"] == 0 and r["wgmma"] == 0 and r["mma_sync"] == 0
               for r in rows), rows
    assert rows[1]["registers"] >= rows[0]["registers"]  # twice the rows per program


def test_an_unknown_kernel_or_constexpr_is_one_line_naming_it():
    bad = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d128/h2/float32/plain",
                          "--kernel", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--kernel: plan hola/d128/h2/float32/plain has no kernel 'nope'" in bad.stderr
    bad = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d128/h2/float32/plain",
                          "--kernel", "_rstd_kernel", "--sweep", "R=1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "--sweep: 'R' is not a constexpr argument of _rstd_kernel" in bad.stderr


def test_a_variant_takes_the_plan_kernel_s_types_by_name():
    """--function: the split forward candidate, addressed through the plan of the plain forward (its arguments are
    the forward's plus SPLIT), gets the forward's types, constants and attributes at its own argument positions."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import kernel_resources

    shipped = ROOT / "hola_titan/kernels/runtime/configs/NVIDIA_H200__fla-0.6.0__triton-3.6.0.json"
    plan = json.loads(shipped.read_text())["plans"]
    spec = kernel_resources._find_spec(shipped,
                                       "hola/d128/h2/bfloat16/packed", "_cache_fwd_kernel")
    assert plan  # the shipped file has plans
    variant = kernel_resources.variant_spec(spec, "_cache_fwd_split_kernel", {"SPLIT": 2})
    assert variant["name"].endswith("hola.triton_kernels._cache_fwd_split_kernel")
    assert list(variant["signature"]) == [*spec["signature"], "SPLIT"] and variant["signature"]["SPLIT"] == "constexpr"
    at = [len(spec["signature"])]  # SPLIT is the variant's last argument
    assert at in variant["constant_keys"] and variant["constant_vals"][variant["constant_keys"].index(at)] == 2
    assert variant["attrs_keys"] == spec["attrs_keys"]  # the same arguments at the same positions
    with pytest.raises(SystemExit, match="give the constexprs with --sweep"):
        kernel_resources.variant_spec(spec, "_cache_fwd_split_kernel", {})


def test_a_continuing_kernel_takes_its_prefix_arguments_types_from_aliases():
    """--alias: the continuing call's forward (the fresh forward's arguments plus the prefix rows and their
    blocks) addressed through the fresh forward's plan: each prefix argument takes the type and the attributes
    (16-byte alignment) of the argument it names; an alias of an argument either kernel lacks is refused."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import kernel_resources

    path = ROOT / "hola_titan/kernels/runtime/configs/NVIDIA_H200__fla-0.6.0__triton-3.6.0.json"
    spec = kernel_resources._find_spec(path, "hola/d128/h2/bfloat16/packed", "_cache_fwd_kernel")
    aliases = {"ka_ptr": "k_ptr", "va_ptr": "v_ptr", "rka_ptr": "rk_ptr", "pre_start_ptr": "blk_start_ptr",
               "pre_len_ptr": "blk_len_ptr"}
    variant = kernel_resources.variant_spec(spec, "_cache_fwd_pre_kernel", {}, aliases)
    names = list(variant["signature"])
    for new, old in aliases.items():
        assert variant["signature"][new] == spec["signature"][old]
        base_attrs = [v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])
                      if k[0] == list(spec["signature"]).index(old)]
        new_attrs = [v for k, v in zip(variant["attrs_keys"], variant["attrs_vals"]) if k[0] == names.index(new)]
        assert base_attrs and new_attrs == base_attrs, new
    with pytest.raises(SystemExit, match="--alias nope=k_ptr"):
        kernel_resources.variant_spec(spec, "_cache_fwd_pre_kernel", {}, {**aliases, "nope": "k_ptr"})
    with pytest.raises(SystemExit, match="other arguments with --alias"):
        kernel_resources.variant_spec(spec, "_cache_fwd_pre_kernel", {}, {})


def test_an_optional_pointer_the_plan_passed_as_none_becomes_an_argument_by_alias():
    """--alias NEW=BASE also serves an argument the plan's launch passed as None (a constexpr None there): fla's
    state-gradient kernel with an initial state, which no training plan launches. The None constant goes, NEW takes
    BASE's type; aliasing an argument the plan passed as a tensor stays refused."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import kernel_resources

    path = ROOT / "hola_titan/kernels/runtime/configs/NVIDIA_H200__fla-0.6.0__triton-3.6.0.json"
    kernel = "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"
    spec = kernel_resources._find_spec(path, "hola/d256/h4/bfloat16/packed", kernel)
    assert spec["signature"]["dh0"] == "constexpr"
    variant = kernel_resources.variant_spec(spec, kernel, {}, {"dh0": "g"})
    names = list(variant["signature"])
    assert variant["signature"]["dh0"] == spec["signature"]["g"] == "*fp32"
    assert [names.index("dh0")] not in variant["constant_keys"]
    assert [names.index("dht")] in variant["constant_keys"]  # not aliased: still None
    with pytest.raises(SystemExit, match="--alias dh=g"):
        kernel_resources.variant_spec(spec, kernel, {}, {"dh": "g"})
    with pytest.raises(SystemExit, match="--alias dh0=dht"):  # a base the plan passed as None has no type
        kernel_resources.variant_spec(spec, kernel, {}, {"dh0": "dht"})


def test_matrix_instructions_follow_the_tile_rows(tmp_path):
    """The Triton dq kernel's query tile decides the matrix instructions: 32 rows compile to Ampere's mma.sync
    only, 64 rows (one warpgroup) to Hopper's wgmma (docs/LOG.md, 2026-12-03: why the Triton backward kernels run on
    mma.sync). From the bf16 plan at D 128: at D 256 the plans list the Gluon kernels, which run there."""
    result = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d128/h2/bfloat16/packed",
                             "--kernel", "_cache_bwd_dq_kernel", "--sweep", "BM=32,64", "--warps", "4", "--json",
                             str(tmp_path / "dq.json")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "dq.json").read_text())["rows"]
    by_rows = {r["BM"]: r for r in rows}
    assert by_rows[32]["wgmma"] == 0 and by_rows[32]["mma_sync"] > 0, rows
    assert by_rows[64]["wgmma"] > 0, rows


def test_a_gluon_kernel_of_a_plan_compiles_through_gluon(tmp_path):
    """The D = 256 plans list the Gluon cache kernels; the script compiles them with Gluon's front end (warpgroup
    MMA only)."""
    pytest.importorskip("triton.experimental.gluon")
    result = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", "hola/d256/h4/bfloat16/packed",
                             "--kernel", "_cache_bwd_dq_gluon_kernel", "--json", str(tmp_path / "dq.json")], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = json.loads((tmp_path / "dq.json").read_text())["rows"]
    assert row["wgmma"] > 0 and row["mma_sync"] == 0, row


def test_the_head_dim_256_cache_launches_fit_an_a100(tmp_path):
    """The Triton cache kernels' launches at head dim 256 (``CONFIGS``: what an A100 runs, the Gluon kernels being
    sm_90's) compiled for sm_80: plain sm_80 code (``mma.sync``, no ``wgmma``) within the 163 KiB of shared memory an
    A100 block may take, so no launch raises Triton's OutOfResources there (docs/training.md, "GPUs: what runs
    where")."""
    sys.path.insert(0, str(ROOT))
    from hola_titan.kernels.hola.triton_kernels import CONFIGS

    for kind, kernel in (("fwd", "_cache_fwd_kernel"), ("dq", "_cache_bwd_dq_kernel"),
                         ("dkdv", "_cache_bwd_dkdv_kernel")):
        cfg = CONFIGS[kind][256]
        plan = "hola/d128/h2/bfloat16/packed"  # the Triton kernels' argument types; D set to 256 below
        out = tmp_path / f"{kind}.json"
        result = subprocess.run([sys.executable, "scripts/kernel_resources.py", "--plan", plan, "--kernel", kernel,
                                 "--sweep", "D=256", f"BM={cfg['BM']}", f"BN={cfg['BN']}",
                                 "--warps", str(cfg["num_warps"]), "--stages", str(cfg["num_stages"]), "--arch", "80",
                                 "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.splitlines()[0].endswith(", sm_80"), result.stdout
        [row] = json.loads(out.read_text())["rows"]
        assert "error" not in row, row
        assert 0 < row["shared_bytes"] <= 163 * 1024 and row["wgmma"] == 0 and row["mma_sync"] > 0, (kind, row)
