"""Write the PTX that Triton compiles for sm_90a from a kernel of the 340M compile plan (or a variant of it), to
compare two versions of hola_titan/kernels/hola_triton_attn.py: the "same PTX" checks of docs/LOG.md (2026-12-03,
tenth session). No GPU needed; run with Triton 3.6 first on the path, from the repository root:

    PYTHONPATH=<triton 3.6> python docs/results/kernel_resources_triton36_2026-12-03/ptx_dump.py \\
        _cache_bwd_dq_kernel _cache_bwd_dq_oc_kernel out.ptx oc_ptr=do_ptr DELTA_ONLY=False

Arguments: the plan's kernel, the function to compile (the same name for the kernel itself), the output file, then
NAME=BASE aliases for arguments the plan's kernel lacks and NAME=True/False constexprs. Compare two dumps with
debug lines removed (``.loc``, ``.file``, comments, ``$L__tmp`` labels and the debug sections after ``.section``).
"""

import sys

sys.path.insert(0, "scripts")

import kernel_resources as kr  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hola_titan.kernels.precompile import jit_function  # noqa: E402

PLAN_FILE = kr.ROOT / "hola_titan/kernels/configs/NVIDIA_H200__fla-0.6.0__triton-3.6.0.json"

base, func, out = sys.argv[1:4]
pairs = dict(a.split("=") for a in sys.argv[4:])
constants = {k: v == "True" for k, v in pairs.items() if v in ("True", "False")}
aliases = {k: v for k, v in pairs.items() if k not in constants}
spec = kr._find_spec(PLAN_FILE, "hola/d256/h4/bfloat16/packed", base)
if func != base:
    spec = kr.variant_spec(spec, func, constants, aliases)
consts = {tuple(p): (v["constexpr"] if isinstance(v, dict) and "constexpr" in v else v)
          for p, v in zip(spec["constant_keys"], spec["constant_vals"])}
attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
kernel = triton.compile(ASTSource(jit_function(spec["name"]), dict(spec["signature"]), consts, attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=spec["options"]["num_warps"], num_stages=spec["options"]["num_stages"]))
open(out, "w").write(kernel.asm["ptx"])
