"""Bundled data, tokenizer and the packed, resumable, data-parallel data pipeline.

Public API::

    tokenizer = load_tokenizer("bundled")          # or a folder / tokenizer.json of a HF tokenizer
    data = config.data                             # hola_titan.config.Data: dataset, split, packing, hold-out
    loader = build_dataloader(data=data, tokenizer=tokenizer, seq_len=2048, local_batch_size=8,
                              dp_rank=rank, dp_world_size=world)
    for batch in loader:                           # endless; batch: input_ids, labels, position_ids, cu_seqlens
        ...
    state = loader.state_dict()                    # global rows consumed; resumes at any dp_world_size
    val = build_validation_dataloader(data=data, tokenizer=tokenizer, seq_len=2048, local_batch_size=8)

Layouts: rows, labels and ``cu_seqlens`` in :mod:`hola_titan.data.packing`; the global row order, sharding and
resume in :mod:`hola_titan.data.loader`; accepted ``dataset`` strings in :mod:`hola_titan.data.sources`.
"""

from hola_titan.data.loader import PackedDataLoader, build_dataloader, build_validation_dataloader
from hola_titan.data.packing import IGNORE_INDEX, Batch, document_starts, pack_rows
from hola_titan.data.sources import resolve_source
from hola_titan.data.tokenizer import BUNDLED, Tokenizer, load_tokenizer

__all__ = [
    "BUNDLED",
    "IGNORE_INDEX",
    "Batch",
    "PackedDataLoader",
    "Tokenizer",
    "build_dataloader",
    "build_validation_dataloader",
    "document_starts",
    "load_tokenizer",
    "pack_rows",
    "resolve_source",
]
