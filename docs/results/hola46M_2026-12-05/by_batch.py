"""HOLA minus GDN's training loss on the same batch, by what the batch holds (the 46M runs of 2026-12-05, seed 0).

Rebuilds the runs' token stream on the CPU (the runs named the corpus's ``train`` folder, so every 100th document
was held out; seed 0 orders the documents of epoch 0), finds each step's sources, and splits the per-step
differences by the sources' shares (least squares) and by how hard the batch was for GDN (terciles of its loss).

    python docs/results/hola46M_2026-12-05/by_batch.py data/corpus_100m/train   # 80 s of tokenising on 16 cores
"""
import json
import sys
from pathlib import Path

import numpy as np

from hola_titan.data.token_stream import epoch_permutation
from hola_titan.data.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parent
TOKENS_PER_STEP, STEPS, HOLDOUT_EVERY, SEED = 16 * 4096, 1600, 100, 0


def step_shares(train: Path) -> tuple[np.ndarray, list[str]]:
    tokenizer = load_tokenizer("bundled")
    texts, sources, index = [], [], 0
    for path in sorted(train.glob("*.jsonl*")):
        opener = __import__("gzip").open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            for line in handle:
                doc = json.loads(line)
                if index % HOLDOUT_EVERY != HOLDOUT_EVERY - 1:
                    texts.append(doc["text"])
                    sources.append(doc["source"])
                index += 1
    lengths = [len(ids) for i in range(0, len(texts), 4096) for ids in tokenizer.encode_batch(texts[i:i + 4096])]
    keep = [i for i, n in enumerate(lengths) if n > 0]
    names = sorted(set(sources))
    order = epoch_permutation(len(keep), seed=SEED, epoch=0)
    doc_len = np.array([lengths[i] + 1 for i in keep], dtype=np.int64)[order]  # + EOS
    doc_src = np.array([names.index(sources[i]) for i in keep])[order]
    ends = np.cumsum(doc_len)
    starts = ends - doc_len
    shares = np.zeros((STEPS, len(names)))
    for s in range(STEPS):
        a, b = s * TOKENS_PER_STEP, (s + 1) * TOKENS_PER_STEP
        for d in range(np.searchsorted(ends, a, side="right"), np.searchsorted(starts, b, side="left")):
            shares[s, doc_src[d]] += min(ends[d], b) - max(starts[d], a)
    return shares / TOKENS_PER_STEP, names


def losses(name: str) -> dict[int, float]:
    out = {}
    for call in ("c2", "c3", "c4"):
        for line in (HERE / call / f"{name}.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in row:
                out[row["step"]] = row["loss"]  # the last call's record of a step wins
    return out


def main() -> None:
    shares, names = step_shares(Path(sys.argv[1]))
    hola, gdn = losses("hola_s0"), losses("gdn_s0")
    steps = np.array(sorted(set(hola) & set(gdn)))
    diff = np.array([hola[s] - gdn[s] for s in steps])
    base = np.array([gdn[s] for s in steps])
    x = shares[steps - 1]
    for lo, hi in ((0, 400), (400, 800), (800, 1200), (1200, 1600)):
        m = (steps > lo) & (steps <= hi)
        keep = [i for i in range(len(names)) if x[m, i].sum() > 2.0]
        coef = np.linalg.lstsq(x[m][:, keep], diff[m], rcond=None)[0]
        q = np.quantile(base[m], [1 / 3, 2 / 3])
        parts = [base[m] <= q[0], (base[m] > q[0]) & (base[m] <= q[1]), base[m] > q[1]]
        print(f"steps {lo + 1}-{hi}: mean {diff[m].mean():+.4f}; corr with GDN's loss "
              f"{np.corrcoef(diff[m], base[m])[0, 1]:+.2f}; by GDN-loss tercile: "
              + ", ".join(f"{base[m][p].mean():.2f} -> {diff[m][p].mean():+.4f}" for p in parts))
        print("  per source (share of tokens):", "; ".join(
            f"{names[i]} {c:+.3f} ({x[m, i].mean():.2f})" for c, i in sorted(zip(coef, keep)) if x[m, i].mean() > 0.02))


if __name__ == "__main__":
    main()
