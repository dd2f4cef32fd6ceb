"""The CUDA graph and compiled decoders (hola_titan/decoding.py) against the model's own steps (marker ``gpu``).

``graph`` replays the kernels the eager step launches, so its tokens and its whole cache equal the eager decode
bit for bit; ``compile`` fuses float32 expressions, so its logits and cache are compared within bf16 rounding on
teacher-forced tokens (greedy tokens of a random model could flip on a near-tie). Heads of 256 as at 340M; window 8
and block 16, so 40 steps cross several top-W merges.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from helpers import flat_cache  # noqa: E402
from hola_titan.decoding import StaticDecoder, resolve_mode  # noqa: E402
from hola_titan.eval.generation import generate  # noqa: E402
from hola_titan.models.args import model_args  # noqa: E402
from hola_titan.models.model import ModelCache, build_model  # noqa: E402

FLAVOURS = ("hola", "hola_recency", "gdn")
DEVICE = torch.device("cuda")


def _model(flavour):
    torch.manual_seed(0)
    args = model_args(flavour, "small", vocab_size=512, window=8, block=16, n_layers=2)
    return build_model(args, device=DEVICE).to(torch.bfloat16).eval()



@pytest.mark.parametrize("flavour", FLAVOURS)
def test_graph_equals_eager_bit_for_bit(flavour):
    model = _model(flavour)
    assert resolve_mode("auto", model, DEVICE) == "compile"
    prompt = torch.randint(0, 512, (3, 37), device=DEVICE)
    eager = generate(model, prompt, max_new_tokens=40, decode="eager")
    graph = generate(model, prompt, max_new_tokens=40, decode="graph")
    assert graph.decode_path["decode"] == "graph" and graph.decode_path["device"].startswith("cuda")
    assert graph.tokens == eager.tokens
    for a, b in zip(flat_cache(eager.cache), flat_cache(graph.cache), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_compiled_step_within_rounding(flavour):
    model = _model(flavour)
    tokens = torch.randint(0, 512, (4, 60), device=DEVICE)
    caches = []
    with torch.inference_mode():
        for _ in range(2):
            cache = ModelCache()
            model(tokens[:, :20], cache=cache)
            caches.append(cache)
        ref = StaticDecoder(model, caches[0], mode="buffers")
        fast = StaticDecoder(model, caches[1], mode="compile")
        fast.logits.fill_(float("nan"))
        worst = 0.0
        for t in range(20, 60):
            want = ref.step(tokens[:, t]).clone()
            got = fast.step(tokens[:, t])
            assert torch.isfinite(got).all()
            worst = max(worst, (got - want).abs().max().item() / want.abs().max().item())
        assert worst < 2e-2, worst
        for a, b in zip(flat_cache(ref.cache()), flat_cache(fast.cache()), strict=True):
            if a.dtype.is_floating_point:
                finite = torch.isfinite(a)
                assert torch.equal(finite, torch.isfinite(b))
                torch.testing.assert_close(b[finite].float(), a[finite].float(), rtol=3e-2, atol=3e-2)
            elif a.dtype == torch.int64 and a.dim() == 1:  # tokens seen
                assert torch.equal(a, b)


def test_graph_left_padded_batch_continues_each_prompt():
    """Each row of a left-padded batch continues its own prompt: fed the tokens that row decodes alone, its logits
    equal the alone run's (batch 3 against batch 1 matmuls: bf16 rounding apart)."""
    model = _model("hola")
    lengths = [5, 33, 17]
    prompts = [torch.randint(0, 512, (n,), device=DEVICE) for n in lengths]
    slots = max(lengths)
    padded = torch.zeros(len(prompts), slots, dtype=torch.int64, device=DEVICE)
    for row, p in enumerate(prompts):
        padded[row, slots - len(p):] = p
    alone = [generate(model, p[None], max_new_tokens=25, decode="eager").tokens[0] for p in prompts]
    forced = torch.tensor(alone, device=DEVICE).T  # [25, B]: step t feeds each row's t-th token
    cache = ModelCache()
    with torch.inference_mode():
        model.prefill(padded, lengths=lengths, cache=cache)
        decoder = StaticDecoder(model, cache, mode="graph")
        batch = [decoder.step(forced[t]).clone() for t in range(24)]
        for row, p in enumerate(prompts):
            solo = ModelCache()
            model(p[None], cache=solo)
            solo_decoder = StaticDecoder(model, solo, mode="buffers")
            for t in range(24):
                want = solo_decoder.step(forced[t, row:row + 1])[0]
                assert (batch[t][row] - want).abs().max().item() <= 2e-2 * want.abs().max().item(), (row, t)
