"""The Gluon cache-read kernels (``hola_titan/kernels/hola/gluon_kernels.py``) on a CPU: which kernels a forward and a
backward take and what a run reports, and the kernels compiled for sm_90a here (Gluon has no interpreter: the GPU suite
checks their results against the reference)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from hola_titan.kernels.hola import gluon_kernels, triton_kernels as attn  # noqa: E402


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device that reports sm_90 (the choice reads only the capability), with a Triton the kernels are
    written for (whatever version is installed here)."""
    import triton
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    return torch.device("cuda")


def test_the_gluon_backward_runs_at_d256_bf16_fresh_calls_on_sm90_only(hopper, monkeypatch):
    if gluon_kernels.GLUON_MISSING:
        pytest.skip(f"this Triton has no Gluon: {gluon_kernels.GLUON_MISSING}")
    assert attn.backward_kernels(256, torch.bfloat16, hopper) == ("gluon", "warpgroup-MMA tiles on sm_90 "
                                                                  "(gluon_kernels.py)")
    assert attn.backward_kernels(256, torch.float16, hopper)[0] == "gluon"
    # Every other case runs the Triton kernels, and says why.
    cases = {(128, torch.bfloat16, hopper, False): "launch table names Triton at head dim 128",
             (256, torch.float32, hopper, False): "bf16/fp16 inputs, not torch.float32",
             (256, torch.bfloat16, hopper, True): "continuing from a cache",
             (256, torch.bfloat16, torch.device("cpu"), False): "need a GPU"}
    for (d, dtype, device, continuing), why in cases.items():
        kernels, reason = attn.backward_kernels(d, dtype, device, continuing=continuing)
        assert kernels == "triton" and why in reason, (d, dtype, device, continuing, reason)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    kernels, reason = attn.backward_kernels(256, torch.bfloat16, hopper)
    assert kernels == "triton" and "this GPU is sm_100" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gluon_kernels, "GLUON_MISSING", "ImportError: no gluon")
    assert attn.backward_kernels(256, torch.bfloat16, hopper) == ("triton", "this Triton has no Gluon (ImportError: "
                                                                  "no gluon)")
    monkeypatch.setattr(gluon_kernels, "GLUON_MISSING", "")
    # Inputs in different dtypes, a head dim the kernels are not written for, a Triton they were not written
    # against, a ROCm build (whose GPUs report capability 9 too).
    assert attn.backward_kernels(256, None, hopper) == ("triton", "q, k and v (and the output gradient) come in "
                                                        "different dtypes")
    monkeypatch.setitem(attn.BACKWARD, 128, "gluon")
    assert "written for head dims (256,), not 128" in attn.backward_kernels(128, torch.bfloat16, hopper)[1]
    import triton
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    kernels, reason = attn.backward_kernels(256, torch.bfloat16, hopper)
    assert kernels == "triton" and reason.endswith("this is 3.10.0") and "3.6" in reason, reason
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "ROCm" in attn.backward_kernels(256, torch.bfloat16, hopper)[1]
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gluon_kernels, "GLUON_MISSING", "ImportError: no gluon")
    monkeypatch.setitem(attn.BACKWARD, 256, "triton")
    assert attn.backward_kernels(256, torch.bfloat16, hopper)[0] == "triton"
    # The forward's choice, by its own table.
    assert attn.forward_kernels(256, torch.bfloat16, hopper)[0] == "triton"  # GLUON_MISSING is still patched
    monkeypatch.setattr(gluon_kernels, "GLUON_MISSING", "")
    assert attn.forward_kernels(256, torch.bfloat16, hopper)[0] == "gluon"
    assert attn.forward_kernels(256, torch.bfloat16, hopper, continuing=True)[0] == "triton"
    monkeypatch.setitem(attn.FORWARD, 256, "triton")
    assert attn.forward_kernels(256, torch.bfloat16, hopper)[0] == "triton"


def test_the_paths_line_names_the_kernels_and_where_delta_comes_from(hopper, monkeypatch):
    if gluon_kernels.GLUON_MISSING:
        pytest.skip(f"this Triton has no Gluon: {gluon_kernels.GLUON_MISSING}")
    assert attn.describe_cache_forward(256, torch.bfloat16, hopper) == ("Gluon kernels (gluon_kernels.py: "
                                                                         "warpgroup-MMA tiles on sm_90)")
    line = attn.describe_cache_backward(256, torch.bfloat16, hopper, kept_output=False, deterministic=False)
    assert line == ("Gluon kernels (gluon_kernels.py: warpgroup-MMA tiles on sm_90); delta over the cache's keys "
                    "(output not kept)")
    # The Gluon kernels sum dq without atomic adds, kept output or not.
    line = attn.describe_cache_backward(256, torch.bfloat16, hopper, kept_output=True, deterministic=False)
    assert "atomic" not in line and line.endswith("delta from the kept cache-read output (model.save_cache_output)")
    cpu = attn.describe_cache_backward(256, torch.float32, torch.device("cpu"), kept_output=False,
                                       deterministic=False)
    assert cpu.startswith("Triton kernels (Gluon kernels need a GPU")
    monkeypatch.setitem(attn.BACKWARD, 256, "triton")
    line = attn.describe_cache_backward(256, torch.bfloat16, hopper, kept_output=True, deterministic=False)
    assert line.startswith("Triton kernels (the launch table names Triton at head dim 256); dq summed by the dk/dv "
                           "programs with atomic adds, in no fixed order;"), line
    line = attn.describe_cache_backward(256, torch.bfloat16, hopper, kept_output=True, deterministic=True)
    assert "atomic" not in line


# Constexprs of the kernels as the backward launches them (triton_kernels._cache_attention_bwd_gluon).
_TYPES = {"sel_ptr": "*i32", "blk_start_ptr": "*i32", "blk_len_ptr": "*i32", "dest_ptr": "*i64", "SENTINEL": "i64",
          "H": "i32", "NQT": "i32", "NKT": "i32", "NCT": "i32", "W": "i32", "scale": "fp32"}
_BF16 = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "oc_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "os_ptr", "o_ptr")


def _compile_for_hopper(name: str, types: dict | None = None, **constexprs) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    GluonASTSource = pytest.importorskip("triton.experimental.gluon._runtime").GluonASTSource
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip(f"no cuobjdump in this Triton ({cuobjdump})")
    fn = getattr(gluon_kernels, name)
    names = fn.arg_names
    config = gluon_kernels.FWD_CONFIG if name == "_cache_fwd_gluon_kernel" else gluon_kernels.CONFIG
    constexprs = dict(D=256, **config, **constexprs)
    types = {**_TYPES, **(types or {})}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n in _BF16 else "*fp32")
                 for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")}
    kernel = triton.compile(GluonASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=constexprs["num_warps"]))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(kernel.asm["cubin"])
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", "k.cubin"], cwd=tmp, capture_output=True,
                                text=True, check=True).stdout
    ptx = kernel.asm["ptx"]
    # ptxas again, verbose, on the same PTX: it reports (C7515) when it serialises the warpgroup MMAs (a register of
    # an accumulator touched inside the MMA pipeline), which costs the kernel its overlap without any error.
    from triton.backends.nvidia import compiler as nvidia_compiler
    try:
        ptxas = nvidia_compiler.get_ptxas(90).path  # Triton 3.7+: the tool by architecture
    except TypeError:
        ptxas = nvidia_compiler.get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        verbose = subprocess.run([ptxas, "-v", "-arch=sm_90a", "k.ptx", "-o", "k.cubin"], cwd=tmp, capture_output=True,
                                 text=True, check=True)
    return {"serialised": "C7515" in verbose.stdout + verbose.stderr,
            "registers": int(re.search(r"\bREG:(\d+)", report).group(1)),
            "stack_bytes": int(re.search(r"\bSTACK:(\d+)", report).group(1)), "shared": kernel.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "wgmma_waits": ptx.count("wgmma.wait_group")}


# Warpgroup-MMA instructions per step: S and dP (16 each at K = 256), and 4 per accumulating product (K = 64).
@pytest.mark.parametrize("name,constexprs,products", [("_cache_bwd_dq_gluon_kernel", dict(HAS_OC=False), 40),
                                                      ("_cache_bwd_dq_gluon_kernel", dict(HAS_OC=True), 36),
                                                      ("_cache_bwd_dkdv_gluon_kernel", {}, 40),
                                                      ("_cache_fwd_gluon_kernel", dict(STORE_OC=False), 20),
                                                      ("_cache_fwd_gluon_kernel", dict(STORE_OC=True), 20),
                                                      ("_cache_fwd_gluon_kernel",
                                                       dict(STORE_OC=False, types={"os_ptr": "*fp32"}), 20)],
                         ids=["dq", "dq_kept_output", "dkdv", "fwd", "fwd_kept_output", "fwd_float32_state"])
def test_the_gluon_kernels_compile_for_hopper_on_warpgroup_mma(name, constexprs, products):
    """With the installed Triton (Gluon's names move between versions: the module takes both spellings), for
    sm_90a: every product a warpgroup MMA (no mma.sync) that ptxas does not serialise, within the 227 KiB of shared
    memory a block may use, and spilling at most a few registers (ptxas caps every kernel at 255 registers and
    spills the rest: with Triton 3.9 the loops spill nothing, the epilogues 8-104 bytes; with Triton 3.6 the dk/dv
    epilogue 128 bytes)."""
    pytest.importorskip("triton.backends.nvidia")
    if gluon_kernels.GLUON_MISSING:
        pytest.skip(f"this Triton has no Gluon: {gluon_kernels.GLUON_MISSING}")
    got = _compile_for_hopper(name, **constexprs)
    assert got["mma_sync"] == 0 and got["wgmma"] >= products, got
    assert not got["serialised"], f"ptxas serialises {name}'s warpgroup MMAs (C7515): {got}"
    assert got["stack_bytes"] <= 128 and got["shared"] <= 227 * 1024, got


def test_a_launch_that_leaves_the_gluon_kernels_says_so_once(hopper, monkeypatch, caplog):
    """A fresh call on sm_90 whose table names the Gluon kernels but whose inputs send it to the Triton ones (here
    in mixed dtypes) logs why, once per reason; a continuing call (always the Triton kernels, as the paths lines
    say) and a CPU call log nothing."""
    if gluon_kernels.GLUON_MISSING:
        pytest.skip(f"this Triton has no Gluon: {gluon_kernels.GLUON_MISSING}")
    attn._log_fallback.cache_clear()
    with caplog.at_level("WARNING", logger=attn.__name__):
        for _ in range(2):
            assert attn._launch_choice(attn.BACKWARD, "backward", 256, None, hopper, False) == "triton"
        assert attn._launch_choice(attn.BACKWARD, "backward", 256, torch.bfloat16, hopper, True) == "triton"
        assert attn._launch_choice(attn.FORWARD, "forward", 256, None, torch.device("cpu"), False) == "triton"
        assert attn._launch_choice(attn.FORWARD, "forward", 256, torch.bfloat16, hopper, False) == "gluon"
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["cache-read backward: the Triton kernels run, not the Gluon ones: q, k and v (and the "
                        "output gradient) come in different dtypes"], messages
    attn._log_fallback.cache_clear()


def test_model_cache_kernels_triton_takes_the_triton_kernels_and_says_so(hopper):
    """``model.cache_kernels = triton`` (set by the trainer through set_cache_kernels) empties both launch tables:
    every call on the Triton kernels, with that setting as the reason; ``auto`` restores the tables."""
    if gluon_kernels.GLUON_MISSING:
        pytest.skip(f"this Triton has no Gluon: {gluon_kernels.GLUON_MISSING}")
    try:
        attn.set_cache_kernels("triton")
        assert attn.forward_kernels(256, torch.bfloat16, hopper) == ("triton", "model.cache_kernels = triton")
        assert attn.backward_kernels(256, torch.bfloat16, hopper) == ("triton", "model.cache_kernels = triton")
        assert attn.describe_cache_forward(256, torch.bfloat16, hopper) == ("Triton kernels (model.cache_kernels = "
                                                                            "triton)")
        # A head dim the Gluon kernels never take keeps its own reason.
        assert attn.forward_kernels(128, torch.bfloat16, hopper) == ("triton", "the launch table names Triton at "
                                                                     "head dim 128")
    finally:
        attn.set_cache_kernels("auto")
    assert attn.FORWARD == attn.DEFAULT_FORWARD and attn.BACKWARD == attn.DEFAULT_BACKWARD
    assert attn.forward_kernels(256, torch.bfloat16, hopper)[0] == "gluon"
    with pytest.raises(ValueError, match="cache_kernels: expected 'auto' or 'triton', got 'gluon'"):
        attn.set_cache_kernels("gluon")
