"""Probe: does Triton's Hopper warp specialisation (``tl.range(..., warp_specialize=True)``) compile a D = 256
attention loop for sm_90a, and which forms break it? Compiles here, no GPU needed (Triton 3.6.0 in PYTHONPATH:
``pip install --target DIR --no-deps triton==3.6.0``).

A TMA attention loop (tensor descriptors made on the device, 64x32 tiles, 4 warps) is compiled with an optional
causal mask, descriptors based per block (``OFFS``), a short loop before the specialised one (``PRE``: 1 an
``scf.for``, 2 the same loop unrolled with ``tl.static_range``) and a runtime loop bound (``HI``); the first
form also without the specialisation (``WS`` 0: the plain TMA loop). Prints, per
form, whether it compiled, how many ``ttg.warp_specialize`` regions it has, and the registers and stack ptxas gave.
On 2026-12-03 with Triton 3.6.0 a loop before the specialised one (PRE 1) failed in NVGPUWarpSpecialization (an
MLIR dominance assertion); unrolled (PRE 2) it compiled, and so did all four forms together (in one run out of
seven here that last form failed too, not reproduced since). Output: probe_output.txt beside this file.
"""
import pathlib
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def attn(Q, K, V, Out, N_CTX, H, qk_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         MASK: tl.constexpr, OFFS: tl.constexpr, PRE: tl.constexpr, HI: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    i_h = tl.program_id(1)
    if OFFS:
        start = pid * 256
        length = tl.minimum(N_CTX - start, 256)
        base = (start * H + i_h) * D
        q_desc = tl.make_tensor_descriptor(Q + base, shape=[length, D], strides=[H * D, 1], block_shape=[BM, D])
        k_desc = tl.make_tensor_descriptor(K + base, shape=[length, D], strides=[H * D, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(V + base, shape=[length, D], strides=[H * D, 1], block_shape=[BN, D])
    else:
        length = N_CTX
        q_desc = tl.make_tensor_descriptor(Q, shape=[N_CTX, D], strides=[D, 1], block_shape=[BM, D])
        k_desc = tl.make_tensor_descriptor(K, shape=[N_CTX, D], strides=[D, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(V, shape=[N_CTX, D], strides=[D, 1], block_shape=[BN, D])
    q = q_desc.load([0, 0])
    o_m = tl.arange(0, BM)
    m_i = tl.zeros([BM], dtype=tl.float32) + 1.0
    l_i = tl.zeros([BM], dtype=tl.float32) + 1.0
    acc = tl.zeros([BM, D], dtype=tl.float32)
    if PRE == 1:
        for c0 in tl.range(0, 64, BN):
            p = tl.math.exp2(tl.dot(q, k_desc.load([c0, 0]).T) - m_i[:, None])
            l_i += tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), v_desc.load([c0, 0]), acc)
    elif PRE == 2:
        for c0 in tl.static_range(0, 64, BN):
            p = tl.math.exp2(tl.dot(q, k_desc.load([c0, 0]).T) - m_i[:, None])
            l_i += tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), v_desc.load([c0, 0]), acc)
    hi = tl.minimum(BM, length) if HI else length
    for c0 in tl.range(0, hi, BN, warp_specialize=WS):
        qk = tl.dot(q, k_desc.load([c0, 0]).T) * qk_scale
        if MASK:
            o_n = c0 + tl.arange(0, BN)
            qk = tl.where(o_n[None, :] <= o_m[:, None], qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v_desc.load([c0, 0]), acc * alpha[:, None])
        m_i = m_ij
    tl.store(Out + o_m[:, None] * D + tl.arange(0, D)[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


SIG = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "N_CTX": "i32", "H": "i32", "qk_scale": "fp32",
       "D": "constexpr", "BM": "constexpr", "BN": "constexpr", "MASK": "constexpr", "OFFS": "constexpr",
       "PRE": "constexpr", "HI": "constexpr", "WS": "constexpr"}
CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
print("triton", triton.__version__)
for mask, offs, pre, hi, ws in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 0, 0, 0, 1), (0, 1, 0, 0, 1), (0, 0, 0, 1, 1),
                                (0, 0, 1, 0, 1), (0, 0, 2, 0, 1), (1, 1, 2, 1, 1)]:
    consts = {(7,): 256, (8,): 64, (9,): 32, (10,): mask, (11,): offs, (12,): pre, (13,): hi, (14,): ws}
    form = f"MASK={mask} OFFS={offs} PRE={pre} HI={hi} WS={ws}"
    try:
        k = triton.compile(ASTSource(attn, SIG, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4, num_stages=2))
    except Exception as e:  # noqa: BLE001
        print(f"{form}: failed ({type(e).__name__})")
        continue
    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "k.cubin").write_bytes(k.asm["cubin"])
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", "k.cubin"], cwd=tmp, capture_output=True,
                               text=True, check=True).stdout
    resources = " ".join(re.findall(r"(?:REG|STACK):\d+", usage))
    regions = k.asm["ttgir"].count("ttg.warp_specialize(")
    print(f"{form}: compiled, {regions} specialised region(s), {resources}, shared {k.metadata.shared} B")
