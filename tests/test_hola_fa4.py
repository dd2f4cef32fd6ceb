"""The ``fa4`` backend (the cache read as one FlashAttention-4 varlen call) on a CPU: its layout and its dispatch.

FlashAttention-4's kernels need an sm_90 GPU (``test_kernels_fa4_gpu.py``). Here the call is replaced by
:func:`~hola_titan.kernels.hola.fa4.varlen_attention_torch`, the same function in PyTorch, which is itself
checked against a query-by-query loop over the documented semantics. What is tested: that the varlen layout
(queries in place, per-head gathered keys, ``cu_seqlens`` and ``seqused_k``) reads exactly the spec's visible
set, forward and every gradient against the reference given the backend's own selection (packed documents,
length-1 documents, ragged last blocks, a window larger than a block, no window, recency), and that the backend
is refused, naming why, wherever it cannot run.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_fp32_close, fresh_leaves as fresh, hola_inputs as make_inputs, token_abs_terms
from hola_titan.config import ConfigError, parse_config, validate
from hola_titan.kernels.hola import fa4
from hola_titan.kernels.dispatch import call_path, explain_backend, resolve_backend
from hola_titan.kernels.hola.fa4 import (LAYOUTS, VarlenLayout, hola_attention_fa4, merge_by_lse, split_layouts,
                                         varlen_attention_torch, varlen_layout)
from hola_titan.kernels.hola.reference import hola_attention_reference
from hola_titan.kernels.hola.selection import check_selection
from hola_titan.kernels.runtime.documents import build_block_table

NAMES = ("q", "k", "v", "g", "beta", "gamma_q", "gamma_k", "sink", "gate")
SHARED = ("gamma_q", "gamma_k", "sink", "gate")
CPU = torch.device("cpu")

# (batch, seq_len, cu_seqlens, heads, dim, block, window, evict)
CASES = [
    (2, 37, None, 2, 16, 16, 4, "score"),
    (1, 60, [0, 1, 23, 24, 60], 2, 16, 12, 20, "score"),
    (1, 40, [0, 3, 40], 2, 32, 16, 8, "recency"),
    (1, 33, None, 2, 16, 16, 0, "score"),
]


def _id(c):
    return f"B{c[0]}-T{c[1]}-{'varlen' if c[2] else 'rows'}-H{c[3]}-D{c[4]}-C{c[5]}-W{c[6]}-{c[7]}"


def weight_of(o):
    return torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(o.dtype)


def grads_of(o, state, x):
    loss = (o * weight_of(o)).sum() + state.sum()
    return torch.autograd.grad(loss, [x[n] for n in NAMES], retain_graph=True)


def reference_given(x, sel, **kw):
    return hola_attention_reference(*[x[n] for n in NAMES], initial_state=None, output_final_state=True,
                                    initial_cache=None, output_final_cache=False, selected=sel, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_fa4_backend_matches_the_reference_given_its_selection(case, layout):
    """Forward, final state and every gradient, with the varlen attention in PyTorch: the layout is the read."""
    b, t, cu, h, d, block, window, evict = case
    x = make_inputs(b, t, h, d, seed=t + window)
    kw = dict(window=window, block=block, evict=evict, cu_seqlens=torch.tensor(cu) if cu else None)
    o, state, _, aux = hola_attention_fa4(*[x[n] for n in NAMES], output_final_state=True, return_aux=True,
                                          attend=varlen_attention_torch, layout=layout, **kw)
    if evict == "score" and window:
        check_selection(aux["m"].reshape(b * t, h), aux["sel"], aux["table"], window)
    grads = grads_of(o, state, x)
    xr, x64 = fresh(x), fresh(x, torch.float64)
    o_r, state_r, _ = reference_given(xr, aux["sel"], **kw)
    grads_r = grads_of(o_r, state_r, xr)
    o_64, state_64, _ = reference_given(x64, aux["sel"], **kw)
    grads_64 = grads_of(o_64, state_64, x64)
    terms = dict(zip(SHARED, token_abs_terms(o_64, weight_of(o_64), [x64[n] for n in SHARED])))
    assert_fp32_close(o, o_r, o_64, "o")
    assert_fp32_close(state, state_r, state_64, "final_state")
    for name, gr, gr_r, gr_64 in zip(NAMES, grads, grads_r, grads_64):
        assert_fp32_close(gr, gr_r, gr_64, f"d{name}", abs_terms=terms.get(name))


def test_the_layout_reads_exactly_the_visible_set():
    """Block by block and head by head: the used key slots are the valid cache entries, then the block's own tokens
    in order; the unused slots read the zero row; the queries are the blocks' tokens in place."""
    cu = [0, 1, 23, 24, 60]
    block, window, h, num_tokens = 12, 20, 3, 60
    table = build_block_table(1, num_tokens, torch.tensor(cu), block, CPU)
    gen = torch.Generator().manual_seed(0)
    sel = torch.full((table.num_blocks, h, window), -1, dtype=torch.int32)
    for b in range(table.num_blocks):  # valid entries scattered among empty slots, a different set per head
        if int(table.blk_len[b]) == 0:
            continue  # a padding row of the table: no queries, no cache
        start, doc = int(table.blk_start[b]), int(table.blk_doc_start[b])
        n = min(window, start - doc)
        for head in range(h):
            slots = torch.randperm(window, generator=gen)[:n]
            sel[b, head, slots] = (doc + torch.randperm(start - doc, generator=gen)[:n]).to(torch.int32)
    lay = varlen_layout(sel, table, num_tokens=num_tokens, window=window, block=block)
    slots = window + block
    assert lay.key_rows.shape == (table.num_blocks * slots, h) and lay.max_q == block and lay.max_k == slots
    assert torch.equal(lay.cu_k, torch.arange(table.num_blocks + 1, dtype=torch.int32) * slots)
    real = table.blk_len > 0
    assert torch.equal(lay.cu_q[:-1][real], table.blk_start[real]) and int(lay.cu_q[-1]) == num_tokens
    for b in range(table.num_blocks):
        start, length = int(table.blk_start[b]), int(table.blk_len[b])
        used = int(lay.used_k[b])
        for head in range(h):
            cached = sel[b, head][sel[b, head] >= 0]
            rows = lay.key_rows[b * slots:(b + 1) * slots, head]
            assert used == len(cached) + length
            assert torch.equal(rows[:len(cached)], cached.long())  # in the selection's order
            assert torch.equal(rows[len(cached):used], torch.arange(start, start + length))
            assert (rows[used:] == num_tokens).all()
    # The split layout: the blocks' own rows in place (causal), and the entries alone in W slots (no mask).
    own, entries = split_layouts(sel, table, num_tokens=num_tokens, window=window, block=block)
    assert own.key_rows is None and own.causal and torch.equal(own.cu_k, lay.cu_q) and own.used_k is None
    assert not entries.causal and torch.equal(entries.cu_k, torch.arange(table.num_blocks + 1,
                                                                         dtype=torch.int32) * window)
    for b in range(table.num_blocks):
        for head in range(h):
            cached = sel[b, head][sel[b, head] >= 0]
            rows = entries.key_rows[b * window:(b + 1) * window, head]
            assert int(entries.used_k[b]) == len(cached) and torch.equal(rows[:len(cached)], cached.long())
            assert (rows[len(cached):] == num_tokens).all()


def _loop_attention(q, k, v, sink, lay: VarlenLayout, scale):
    """The FA4 call's documented semantics, one query at a time (float64): ``(out, lse [H, total_q])``."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for s in range(lay.cu_q.shape[0] - 1):
        q0, q1 = int(lay.cu_q[s]), int(lay.cu_q[s + 1])
        k0, nk = int(lay.cu_k[s]), int(lay.used_k[s])
        for i in range(q1 - q0):
            last = i + nk - (q1 - q0) if lay.causal else nk - 1  # causal: aligned to the bottom right
            for head in range(q.shape[1]):
                keys = k[k0:k0 + last + 1, head].double()
                logits = keys @ q[q0 + i, head].double() * scale
                if sink is not None:
                    logits = torch.cat([logits, sink[head].double().view(1)])
                if logits.numel() == 0:
                    continue  # sees nothing: zero output, lse -inf
                lse[head, q0 + i] = torch.logsumexp(logits, 0)
                p = torch.softmax(logits, 0)[:last + 1]
                out[q0 + i, head] = p @ v[k0:k0 + last + 1, head].double()
    return out, lse


def test_the_torch_varlen_attention_is_the_documented_function():
    """Sequences with more keys than queries, as many, a single query, and an empty one; the sink's gradient."""
    gen = torch.Generator().manual_seed(3)
    lens_q, lens_k, slots = [5, 1, 4, 0], [9, 3, 4, 0], 10
    h, d = 2, 8
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    lay = VarlenLayout(key_rows=torch.empty(0), cu_q=cu_q, cu_k=torch.arange(5, dtype=torch.int32) * slots,
                       used_k=torch.tensor(lens_k, dtype=torch.int32), max_q=5, max_k=slots)
    q = torch.randn(int(cu_q[-1]), h, d, generator=gen, requires_grad=True)
    k = torch.randn(4 * slots, h, d, generator=gen)
    v = torch.randn(4 * slots, h, d, generator=gen)
    sink = torch.randn(h, generator=gen, requires_grad=True)
    out, lse = varlen_attention_torch(q, k, v, sink, lay, d ** -0.5)
    out_loop, lse_loop = _loop_attention(q, k, v, sink, lay, d ** -0.5)
    assert torch.allclose(out.double(), out_loop, atol=1e-5) and torch.allclose(lse.double(), lse_loop, atol=1e-5)
    # Without the mask and the sink (the split layout's second call), an empty sequence included.
    plain = VarlenLayout(**{**lay.__dict__, "causal": False})
    out, lse = varlen_attention_torch(q, k, v, None, plain, d ** -0.5)
    out_loop, lse_loop = _loop_attention(q, k, v, None, plain, d ** -0.5)
    assert torch.allclose(out.double(), out_loop, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_loop)) and torch.allclose(
        lse[~torch.isinf(lse)].double(), lse_loop[~torch.isinf(lse_loop)], atol=1e-5)
    # The sink's gradient (what FA4's backward returns as dsink) by central differences.
    out, _ = varlen_attention_torch(q, k, v, sink, lay, d ** -0.5)
    w = torch.randn(out.shape, generator=gen)
    dsink, = torch.autograd.grad((out * w).sum(), [sink])
    eps = 1e-3
    for head in range(h):
        plus, minus = sink.detach().clone(), sink.detach().clone()
        plus[head] += eps
        minus[head] -= eps
        numeric = ((varlen_attention_torch(q.detach(), k, v, plus, lay, d ** -0.5)[0] * w).sum()
                   - (varlen_attention_torch(q.detach(), k, v, minus, lay, d ** -0.5)[0] * w).sum()) / (2 * eps)
        assert math.isclose(float(dsink[head]), float(numeric), rel_tol=1e-2, abs_tol=1e-3)


def test_merging_two_key_sets_by_their_lse_is_the_read_over_both():
    """The split layout's merge: the softmax over the union (with the sink on one side), a side with no keys
    weighing nothing."""
    gen = torch.Generator().manual_seed(5)
    n, h, d, ka, kb = 6, 2, 8, 5, 3
    q = torch.randn(n, h, d, generator=gen)
    keys, vals = torch.randn(ka + kb, h, d, generator=gen), torch.randn(ka + kb, h, d, generator=gen)
    sink = torch.randn(h, generator=gen)

    def full(kset, vset, with_sink):  # every query sees every key of the set
        cu = torch.tensor([0, n], dtype=torch.int32)
        lay = VarlenLayout(key_rows=None, cu_q=cu, cu_k=torch.tensor([0, kset.shape[0]], dtype=torch.int32),
                           used_k=None, max_q=n, max_k=max(kset.shape[0], 1), causal=False)
        return varlen_attention_torch(q, kset, vset, sink if with_sink else None, lay, d ** -0.5)

    o_a, lse_a = full(keys[:ka], vals[:ka], True)
    o_b, lse_b = full(keys[ka:], vals[ka:], False)
    o_all, _ = full(keys, vals, True)
    assert torch.allclose(merge_by_lse(o_a, lse_a, o_b, lse_b), o_all, atol=1e-6)
    empty = torch.full_like(lse_b, float("-inf"))
    assert torch.allclose(merge_by_lse(o_a, lse_a, torch.zeros_like(o_b), empty), o_a, atol=1e-7)


def test_fa4_is_refused_naming_why_wherever_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="'fa4' cannot run here: the FlashAttention-4 read needs a CUDA device"):
        resolve_backend("fa4", CPU)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        explain_backend("fa4", CPU, head_dim=64)
    # Never auto's choice.
    assert explain_backend("auto", CPU, head_dim=64)[0] == "reference"
    # What the package itself lacks, as the paths line and the refusal say it.
    monkeypatch.setattr(fa4, "fa4_version", lambda: None)
    fa4._import_problem.cache_clear()
    assert "not installed (pip install 'hola-titan[fa4]')" in fa4._import_problem()
    monkeypatch.setattr(fa4, "fa4_version", lambda: "4.0.0b1")
    fa4._import_problem.cache_clear()
    assert f"4.0.0b1 is installed; the adapter is written against {fa4.FA4_VERSION}" in \
        fa4._import_problem()
    fa4._import_problem.cache_clear()
    # A call continuing from a cache takes the reference, and says so.
    q = torch.zeros(1, 4, 2, 16)
    path, why = call_path("fa4", "fa4", q, decoding=False, initial_cache=object())
    assert path == "reference" and "fa4 starts from an empty cache" in why


def test_the_config_takes_fa4_and_refuses_triton_only_settings_with_it():
    config = parse_config(["--model.flavour", "hola", "--model.attention_backend", "fa4"])
    assert config.model.attention_backend == "fa4"
    validate(config, world_size=1)
    refused = parse_config(["--model.flavour", "hola", "--model.attention_backend", "fa4",
                            "--model.save_cache_output", "true"])
    with pytest.raises(ConfigError, match="model.save_cache_output.*needs the Triton attention backend"):
        validate(refused, world_size=1)


def test_a_run_asking_for_fa4_where_it_cannot_run_stops_at_start_naming_the_key(tmp_path, capsys):
    """Through the trainer's entry point: one error line naming model.attention_backend and why, exit 2, and no
    run folder record written (nothing trained, nothing to resume)."""
    from pathlib import Path

    from hola_titan.train import main

    debug = str(Path(__file__).resolve().parents[1] / "train_configs" / "debug_model.toml")
    code = main(["--job.config_file", debug, "--job.dump_folder", str(tmp_path / "run"), "--model.attention_backend",
                 "fa4", "--training.steps", "1", "--checkpoint.enable", "false"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "model.attention_backend" in lines[0] and "needs a CUDA device" in lines[0], lines[0]
    assert not (tmp_path / "run" / "config.toml").exists()
