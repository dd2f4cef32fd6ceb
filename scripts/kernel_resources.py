"""What a Triton kernel costs the GPU in registers, spills and shared memory, compiled here (no GPU needed).

Register spills and shared-memory size decide much of what a launch configuration can reach, and reading them
costs no device time. Triton compiles for any target given explicitly and its package carries NVIDIA's tools, so
this script compiles a kernel for sm_90a (H100/H200) on any machine with Triton's NVIDIA backend installed,
CPU-only ones included, and reports per configuration: registers per thread, the stack frame and local memory per
thread (bytes; spilled registers go there), shared memory, the count of ``wgmma`` instructions in the PTX
(Hopper's warpgroup matrix instructions) and of ``mma.sync`` ones (the Ampere path Triton falls back to, e.g. for
tiles of fewer than 64 rows: every warp then reads its operands from shared memory itself), and the compile time.

The kernel and its exact argument types come from a compile plan of ``hola_titan/kernels/runtime/configs/``
(``hola_titan/kernels/runtime/precompile.py``: what a real run compiled); constexprs, warps and stages can be
overridden, so a sweep over tiles is one command::

    python scripts/kernel_resources.py --plan hola/d128/h2/bfloat16/packed --kernel _cache_fwd_kernel \\
        --sweep BM=64,128 BN=32,64 --warps 4,8 --stages 2,3 --json /tmp/fwd.json
    python scripts/kernel_resources.py --plan hola/d256/h4/bfloat16/packed --kernel _cache_bwd_dq_gluon_kernel

(At head dim 256 on an H200 the plans list the Gluon cache kernels, which run there; the Triton cache kernels'
specialisations are in the plans of other head dims: ``--sweep D=256`` on a head-dim-128 plan compiles them at 256.)
``--arch 80`` compiles for an A100 (sm_80) instead (docs/training.md, "GPUs: what runs where")::

    python scripts/kernel_resources.py --plan hola/d128/h2/bfloat16/packed --kernel _cache_fwd_kernel \\
        --sweep D=256 BM=64 BN=32 --warps 4 --stages 2 --arch 80

Numbers are for the Triton installed here; the H200 machines run Triton 3.6 (``pip install triton==3.6.0`` in a
separate environment reproduces them). Timing still needs the GPU (``scripts/bench_hola_attention.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=Path, default=None,
                        help="configurations file with plans "
                             "(default: the H200 file under hola_titan/kernels/runtime/configs/)")
    parser.add_argument("--plan", required=True, help="plan key, e.g. hola/d256/h4/bfloat16/packed")
    parser.add_argument("--kernel", required=True, help="kernel function name (the last part of its full name)")
    parser.add_argument("--function", default=None,
                        help="compile this function of the kernel's module instead, with the plan's argument types "
                             "by name (a variant whose arguments are the kernel's plus constexprs given in --sweep)")
    parser.add_argument("--alias", nargs="*", default=[], metavar="NEW=BASE",
                        help="with --function: its argument NEW takes the type and attributes of the kernel's "
                             "argument BASE (e.g. ka_ptr=k_ptr for a continuing call's prefix rows; or dh0=g for "
                             "an optional pointer the plan's launch passed as None)")
    parser.add_argument("--sweep", nargs="*", default=[], metavar="NAME=V1,V2",
                        help="constexpr values to try (the plan's value otherwise)")
    parser.add_argument("--warps", default=None, help="comma-separated num_warps (the plan's otherwise)")
    parser.add_argument("--stages", default=None, help="comma-separated num_stages (the plan's otherwise)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser.parse_args(argv)


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(text, text)


def _find_spec(path: Path, plan: str, kernel: str) -> dict:
    data = json.loads(path.read_text())
    plans = data.get("plans", {})
    if plan not in plans:
        raise SystemExit(f"error: --plan: {path} has no plan {plan!r}; it has {', '.join(sorted(plans))}")
    for text in plans[plan]:
        spec = json.loads(text)
        if spec["name"].rsplit(".", 1)[-1] == kernel:
            return spec
    names = sorted({json.loads(t)["name"].rsplit(".", 1)[-1] for t in plans[plan]})
    raise SystemExit(f"error: --kernel: plan {plan} has no kernel {kernel!r}; it has {', '.join(names)}")


def variant_spec(spec: dict, function: str, constants: dict, aliases: dict | None = None) -> dict:
    """``spec`` re-addressed to ``function`` (a jit function of the same module): its arguments take the plan
    kernel's types, constants and attributes by name; an extra argument named in ``aliases`` (``{new: base}``)
    takes those of the kernel's argument ``base`` (a second source of the same kind, e.g. the prefix rows of a
    continuing call); any other extra argument must be a constexpr in ``constants``."""
    from hola_titan.kernels.runtime.precompile import jit_function

    aliases = aliases or {}
    base = jit_function(spec["name"]).arg_names
    name = spec["name"].rsplit(".", 1)[0] + "." + function
    names = jit_function(name).arg_names
    # An optional pointer the plan's launch passed as None is a constexpr None there; aliased, it becomes a real
    # argument (e.g. fla's state kernels with an initial state, which a training plan never launches).
    absent = {base[key[0]] for key, val in zip(spec["constant_keys"], spec["constant_vals"])
              if len(key) == 1 and val is None}
    bad = [f"{new}={old}" for new, old in aliases.items()
           if new not in names or (new in spec["signature"] and new not in absent) or old not in spec["signature"]
           or old in absent]
    if bad:
        raise SystemExit(f"error: --alias {' '.join(bad)}: the first must be an argument of {function} that the "
                         f"plan's kernel lacks (or passed as None), the second an argument the plan's kernel was given")
    missing = [n for n in names if n not in spec["signature"] and n not in constants and n not in aliases]
    if missing:
        raise SystemExit(f"error: --function {function}: arguments {', '.join(missing)} are not in the plan's "
                         f"kernel; give the constexprs with --sweep NAME=VALUE, other arguments with --alias")

    def moved(keys, vals):
        out_keys, out_vals = [], []
        for key, val in zip(keys, vals):
            arg = base[key[0]]
            for target in [arg] * (arg in names and arg not in aliases) + [new for new, old in aliases.items()
                                                                            if old == arg]:
                out_keys.append([names.index(target), *key[1:]])
                out_vals.append(val)
        return out_keys, out_vals

    const_keys, const_vals = moved(spec["constant_keys"], spec["constant_vals"])
    for arg, value in constants.items():
        if arg in names and arg not in spec["signature"]:
            const_keys.append([names.index(arg)])
            const_vals.append(value)
    attrs_keys, attrs_vals = moved(spec["attrs_keys"], spec["attrs_vals"])
    types = {n: spec["signature"].get(aliases.get(n, n), "constexpr") for n in names}
    return {**spec, "name": name, "signature": types,
            "constant_keys": const_keys, "constant_vals": const_vals, "attrs_keys": attrs_keys,
            "attrs_vals": attrs_vals}


def target_name(arch: int) -> str:
    """What Triton compiles for at compute capability ``arch``: sm_90a (Hopper's architecture-specific features,
    warpgroup MMA among them) from 90 on, plain sm_80 before."""
    return f"sm_{arch}" + ("a" if arch >= 90 else "")


def compile_resources(spec: dict, *, constants: dict, num_warps: int, num_stages: int, arch: int) -> dict:
    """Compile one specialisation of ``spec`` for ``arch`` and read its resources from ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hola_titan.kernels.runtime.precompile import jit_function

    fn = jit_function(spec["name"])
    names = fn.arg_names  # constant_keys index the kernel's arguments
    consts = {}
    for path, value in zip(spec["constant_keys"], spec["constant_vals"]):
        value = value["constexpr"] if isinstance(value, dict) and "constexpr" in value else value
        consts[tuple(path)] = constants.get(names[path[0]], value) if len(path) == 1 else value
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (the cache read's at D 256): its own front end
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    src = ASTSource(fn, dict(spec["signature"]), consts, attrs)
    began = time.perf_counter()
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    seconds = time.perf_counter() - began
    ptx = kernel.asm["ptx"]
    # The binary Triton made, read by the cuobjdump its package carries (the ptxas Triton used may not be the one
    # in its package folder).
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(kernel.asm["cubin"])
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", "k.cubin"], cwd=tmp, capture_output=True,
                                text=True, check=True).stdout

    def number(name):
        found = re.search(rf"\b{name}:(\d+)", report)
        return int(found.group(1)) if found else None

    # LOCAL: bytes of local memory per thread, where spilled registers go; STACK: the stack frame.
    return {"registers": number("REG"), "local_bytes": number("LOCAL"), "stack_bytes": number("STACK"),
            "shared_bytes": kernel.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
            "mma_sync": ptx.count("mma.sync"),
            "compile_s": round(seconds, 2)}


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kernel_resources_"))
    # The H200 file by name (no import of torch before the arguments are known to be good).
    path = args.configs or (ROOT / "hola_titan" / "kernels" / "runtime" / "configs"
                            / "NVIDIA_H200__fla-0.6.0__triton-3.6.0.json")
    spec = _find_spec(path, args.plan, args.kernel)
    sweep = {}
    for item in args.sweep:
        name, _, values = item.partition("=")
        sweep[name] = [_value(v) for v in values.split(",")]
    if args.function:
        sys.path.insert(0, str(ROOT))
        aliases = dict(item.partition("=")[::2] for item in args.alias)
        spec = variant_spec(spec, args.function, {n: v[0] for n, v in sweep.items()}, aliases)
    for name in sweep:
        if name not in spec["signature"] or spec["signature"][name] != "constexpr":
            raise SystemExit(f"error: --sweep: {name!r} is not a constexpr argument of "
                             f"{args.function or args.kernel}")
    warps = [int(w) for w in args.warps.split(",")] if args.warps else [spec["options"]["num_warps"]]
    stages = [int(s) for s in args.stages.split(",")] if args.stages else [spec["options"]["num_stages"]]
    rows = []
    names = list(sweep)
    header = f"{' '.join(f'{n:>6}' for n in names)} {'warps':>5} {'stages':>6} {'regs':>5} {'stack':>6} {'local':>6} " \
             f"{'smem KiB':>8} {'wgmma':>5} {'mma.sync':>8} {'compile s':>9}"
    print(f"{args.function or args.kernel} from plan {args.plan}" + (f" ({args.kernel}'s)" if args.function else "")
          + f", {target_name(args.arch)}")
    print(header)
    for values in itertools.product(*(sweep[n] for n in names)):
        for num_warps, num_stages in itertools.product(warps, stages):
            constants = dict(zip(names, values))
            row = {**constants, "num_warps": num_warps, "num_stages": num_stages}
            try:
                row.update(compile_resources(spec, constants=constants, num_warps=num_warps, num_stages=num_stages,
                                             arch=args.arch))
                print(f"{' '.join(f'{v!s:>6}' for v in values)} {num_warps:>5} {num_stages:>6} "
                      f"{row['registers']!s:>5} {row['stack_bytes']!s:>6} {row['local_bytes']!s:>6} "
                      f"{row['shared_bytes'] / 1024:>8.1f} "
                      f"{row['wgmma']:>5} {row['mma_sync']:>8} {row['compile_s']:>9.1f}", flush=True)
            except Exception as error:  # noqa: BLE001 (one configuration that does not compile is a row, not the end)
                row["error"] = str(error).strip().splitlines()[-1][:200] if str(error).strip() else repr(error)
                print(f"{' '.join(f'{v!s:>6}' for v in values)} {num_warps:>5} {num_stages:>6} error: "
                      f"{row['error']}", flush=True)
            rows.append(row)
    if args.json:
        import triton
        args.json.write_text(json.dumps({"plan": args.plan, "kernel": args.kernel, "arch": args.arch,
                                         "triton": triton.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
