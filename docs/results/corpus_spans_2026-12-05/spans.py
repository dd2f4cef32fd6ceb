"""How much of a corpus the HOLA cache can see: the share of tokens whose query has a persistent cache.

A query at position p of its segment (a document, cut where a training row of ``seq_len`` tokens ends) sees the
persistent cache only from the second block on (p >= C, blocks aligned to the segment's start); before that the
layer is GDN plus causal attention inside the block. This counts, token-weighted, the share at p >= C and at longer
reaches, per source and for the whole split, with the training stream's order (seed 0, documents followed by EOS,
rows of ``seq_len``) and the held-out split read one document at a time (as ``hola_titan.eval ppl`` does, up to
``seq_len`` tokens per window).

    python docs/results/corpus_spans_2026-12-05/spans.py data/corpus_100m [--seq-len 4096 --block 256]
"""
import argparse
import collections
import gzip
import json
from pathlib import Path

import numpy as np

from hola_titan.data.token_stream import epoch_permutation
from hola_titan.data.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parent
REACH = (256, 512, 1024, 2048)


def read(split: Path) -> tuple[list[str], list[str]]:
    texts, sources = [], []
    for path in sorted(split.glob("*.jsonl*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            for line in handle:
                doc = json.loads(line)
                texts.append(doc["text"])
                sources.append(doc["source"])
    return texts, sources


def lengths_of(texts: list[str]) -> np.ndarray:
    tokenizer = load_tokenizer("bundled")
    return np.array([len(ids) + 1 for i in range(0, len(texts), 4096)  # + EOS
                     for ids in tokenizer.encode_batch(texts[i:i + 4096])], dtype=np.int64)


def positions(lengths: np.ndarray, seq_len: int, *, stream: bool) -> list[np.ndarray]:
    """Per document: each token's position in its segment (its document, restarted at every row boundary)."""
    out, start = [], 0
    for n in lengths:
        pos = np.arange(n, dtype=np.int64)
        if stream:  # rows of seq_len cut the stream; a document crossing a row boundary starts again there
            absolute = start + pos
            first_cut = ((start // seq_len) + 1) * seq_len
            cut = absolute >= first_cut
            pos = np.where(cut, (absolute - first_cut) % seq_len, pos)
            start += n
        else:  # one document at a time, windows of seq_len
            pos = pos % seq_len
        out.append(pos)
    return out


def table(lengths: np.ndarray, sources: list[str], pos: list[np.ndarray]) -> dict:
    per = collections.defaultdict(lambda: np.zeros(len(REACH) + 2))
    for n, src, p in zip(lengths, sources, pos):
        row = [n, 1] + [(p >= r).sum() for r in REACH]
        per[src] += row
        per["(all)"] += row
    return {src: {"tokens": int(v[0]), "documents": int(v[1]), "mean_length": float(v[0] / v[1]),
                  **{f"share_at_{r}": float(v[2 + i] / v[0]) for i, r in enumerate(REACH)}}
            for src, v in sorted(per.items(), key=lambda kv: -kv[1][0])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("corpus", type=Path)
    p.add_argument("--seq-len", type=int, default=4096)
    args = p.parse_args()
    result = {}
    for split, stream in (("train", True), ("heldout", False)):
        texts, sources = read(args.corpus / split)
        lengths = lengths_of(texts)
        keep = np.flatnonzero(lengths > 1)
        order = keep[epoch_permutation(len(keep), seed=0, epoch=0)] if stream else keep
        lens = lengths[order]
        result[split] = table(lens, [sources[i] for i in order], positions(lens, args.seq_len, stream=stream))
        print(f"\n{split}: source | tokens | docs | mean length | " + " | ".join(f"p>={r}" for r in REACH))
        for src, row in result[split].items():
            print(f"{src} | {row['tokens']:,} | {row['documents']:,} | {row['mean_length']:.0f} | "
                  + " | ".join(f"{row[f'share_at_{r}']:.2f}" for r in REACH))
    (HERE / "spans.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
