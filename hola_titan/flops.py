"""Training FLOPs per token of each flavour, counted from its own operations, and the matmul ceiling for MFU.

Per token, forward (backward is twice the forward, so training is 3x):

- dense: ``2 * P_mm`` where ``P_mm`` counts the weights used in matmuls: every projection and MLP weight of
  every block plus the output head (``V * dim``, also when tied to the embedding). Embedding lookups,
  norms, convolutions and gates are not matmuls and are left out.
- state path (recurrent flavours), per head, in the chunked form with chunk ``c = 64``:
  ``6 D^2`` (``W S``, ``q S`` and the state update ``K^T E``) ``+ 8 c D`` (``K K^T``, the two triangular solves,
  ``Q K^T`` and its product with ``E``).
- cache read (HOLA flavours), per head: ``4 D n_vis`` (``q k^T`` and ``p v``), where ``n_vis`` is the average
  number of visible keys over the positions of a row of length T holding one document:
  ``n_vis(t) = min(W, C * floor(t / C)) + (t mod C) + 1`` (the sink is not a key).
- Transformer++ attention, per head: ``4 D n_vis`` with the causal ``n_vis(t) = t + 1``.

MFU divides ``flops_per_token * tokens_per_second`` by the datasheet dense bf16 peak of the GPU (989.5 TFLOP/s for
the H100 and H200: the convention torchtitan and the papers use), see :func:`mfu_peak`. The dense matmul rate
measured on the running device is reported beside it (``mfu_measured``); it is measured afresh by every process
and never stored, so a rate taken while other jobs shared the GPU cannot leak into a later run's numbers. On a CPU
or an unknown GPU, the measured rate is the only denominator, and the run says so.
"""

from __future__ import annotations

import time

import torch

from hola_titan.models.args import ModelArgs

STATE_CHUNK = 64

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, without sparsity).
DATASHEET_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "A800": 312.0, "L40S": 362.05, "B200": 2250.0}


def matmul_params(args: ModelArgs) -> int:
    """Weights used in matmuls per token: block projections, MLP and the output head."""
    dim, h, d = args.dim, args.n_heads, args.head_dim
    if args.is_recurrent:
        mixer = 4 * dim * h * d + 2 * dim * h + (dim * h * d if args.use_gate else 0)
    else:
        mixer = 4 * dim * h * d
    mlp = 3 * dim * args.mlp_hidden
    return args.n_layers * (mixer + mlp) + args.vocab_size * dim


def mean_visible_keys(seq_len: int, *, window: int | None, block: int | None) -> float:
    """Average keys a query reads over a row of ``seq_len`` tokens (``window=None``: causal attention)."""
    t = torch.arange(seq_len, dtype=torch.float64)
    if window is None:
        return float((t + 1).mean())
    done = torch.div(t, block, rounding_mode="floor") * block
    return float((torch.clamp(done, max=window) + (t - done) + 1).mean())


def flops_per_token(args: ModelArgs, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward), by part, and their ``total``."""
    h, d, layers = args.n_heads, args.head_dim, args.n_layers
    parts = {"dense": 3 * 2.0 * matmul_params(args)}
    if args.is_recurrent:
        parts["state"] = 3.0 * layers * h * (6 * d * d + 8 * STATE_CHUNK * d)
        if args.evict != "none":
            n_vis = mean_visible_keys(seq_len, window=args.window, block=args.block)
            parts["cache"] = 3.0 * layers * h * 4 * d * n_vis
    else:
        parts["attention"] = 3.0 * layers * h * 4 * d * mean_visible_keys(seq_len, window=None, block=None)
    parts["total"] = sum(parts.values())
    return parts


def datasheet_tflops(device: torch.device) -> float | None:
    """Dense bf16 datasheet peak of a known GPU, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in DATASHEET_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def measured_matmul_tflops(device: torch.device) -> float:
    """Dense matmul rate of ``device`` in TFLOP/s (bf16 8192^3 on GPU, float32 1024^3 on CPU), measured now on
    random operands (zeros run faster than real data); nothing is cached between processes."""
    if device.type == "cuda":
        dtype, size, reps = torch.bfloat16, 8192, 10
    else:
        dtype, size, reps = torch.float32, 1024, 5
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * size**3 * reps / (time.perf_counter() - start) / 1e12


def mfu_peak(device: torch.device, measured_tflops: float) -> tuple[float, str]:
    """The MFU denominator in TFLOP/s and where it comes from: the datasheet bf16 dense peak of a known GPU, else
    the measured matmul rate (CPU, unknown GPU)."""
    sheet = datasheet_tflops(device)
    if sheet is not None:
        return sheet, f"datasheet bf16 dense peak of {torch.cuda.get_device_name(device)}"
    return measured_tflops, f"measured matmul rate on {device.type} (no datasheet peak known)"
