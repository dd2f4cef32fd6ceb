"""The flavour registry (``hola_titan/models/flavours.py``): one entry per flavour, one mixer surface."""

from __future__ import annotations

import typing

import pytest
import torch

from hola_titan.config import Model
from hola_titan.models import flavours
from hola_titan.models.args import model_args
from hola_titan.models.context import BatchContext
from hola_titan.models.model import HolaTitanLM
from hola_titan.kernels.runtime.documents import Documents


def test_the_config_s_choices_are_the_registry_s_names():
    hint = typing.get_type_hints(Model)["flavour"]
    assert tuple(typing.get_args(hint)) == tuple(flavours.FLAVOURS) == ("hola", "hola_recency", "gdn", "transformer")
    with pytest.raises(ValueError, match=r"^model\.flavour: unknown flavour 'swa'; expected one of hola, "):
        model_args("swa", "debug", vocab_size=97)


def test_an_entry_is_checked_when_registered():
    with pytest.raises(ValueError, match="registered already"):
        flavours.register(flavours.Flavour("gdn", "x:Y", recurrent=True, evict="none"))
    with pytest.raises(ValueError, match="recurrent flavour names its evict"):
        flavours.register(flavours.Flavour("new_attention", "x:Y", recurrent=False, evict="score"))
    assert "new_attention" not in flavours.FLAVOURS


@pytest.mark.parametrize("name", list(flavours.FLAVOURS))
def test_every_mixer_has_the_one_surface(name):
    """Each flavour's mixer class is built and called alike (constructor, forward, stream, cache type, TP plan)
    and its model runs packed documents and plain rows; the entry decides what the args report."""
    entry = flavours.get(name)
    args = model_args(name, "debug", vocab_size=97)
    assert args.is_recurrent == entry.recurrent and args.mixer_class() is entry.mixer_class()
    if entry.recurrent:
        assert args.evict == entry.evict
    else:
        with pytest.raises(ValueError, match="has no HOLA layer"):
            _ = args.evict
    for size, (heads, dim) in entry.heads.items():
        sized = model_args(name, size, vocab_size=97)
        assert (sized.n_heads, sized.head_dim) == (heads, dim)
    mixer = args.mixer_class()
    for attribute in ("Cache", "TP_COLWISE", "TP_ROWWISE", "TP_PER_HEAD", "stream"):
        assert hasattr(mixer, attribute), f"{name}: the mixer lacks {attribute}"
    built = mixer(args, backend="reference", kernels="reference", overlap_backward=False)
    for part in (*mixer.TP_COLWISE, *mixer.TP_ROWWISE):
        assert hasattr(built, part), f"{name}: TP plan names {part}, which the mixer lacks"
    for part, params in mixer.TP_PER_HEAD.items():
        assert set(params.values()) <= {"shard", "replicate"}
        assert built.get_submodule(part) is not None
    torch.manual_seed(0)
    model = HolaTitanLM(args, backend="reference")
    model.init_weights()
    tokens = torch.randint(0, 97, (2, 16))
    cu = torch.tensor([0, 5, 16, 32])
    packed = model(tokens, context=BatchContext(documents=Documents.from_host(cu, device="cpu", seq_len=32)))
    alone = torch.cat([model(tokens.reshape(-1)[None, a:b]).reshape(b - a, -1) for a, b in ((0, 5), (5, 16), (16, 32))])
    assert torch.allclose(packed.reshape(32, -1), alone, atol=1e-5), name
