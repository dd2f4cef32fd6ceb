"""Which orderings of variants hold beyond the spread of their seeds, as table rows for the scripts' merges.

Standard library only: ``scripts/replicate_small.py`` and ``scripts/ablate_small.py`` read this file by path in
their ``--merge`` modes, which would otherwise import torch (seconds) for nothing.
"""

from __future__ import annotations

LEGEND = ("`a > b`: every seed of a is better than every seed of b (the worst seed of a beats the best seed of b); "
          "`a ~ b`: the seeds overlap, no ordering beyond the spread.")
HEADER = ["| metric | ordered beyond the spread | within the spread |", "|---|---|---|"]


def ordering_row(label: str, values: dict[str, list[float]], higher_is_better: bool) -> str:
    """One table row over every pair of the variants in ``values`` (in their order) that has at least one value:
    ``a > b`` where a's worst value beats b's best, ``a ~ b`` otherwise. Callers pass only variants with two or
    more seeds: with one seed, "beyond the spread" means nothing."""
    names = [n for n in values if values[n]]
    ordered, within = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            va, vb = values[a], values[b]
            if higher_is_better:
                a_wins, b_wins = min(va) > max(vb), min(vb) > max(va)
            else:
                a_wins, b_wins = max(va) < min(vb), max(vb) < min(va)
            if a_wins or b_wins:
                ordered.append(f"{a} > {b}" if a_wins else f"{b} > {a}")
            else:
                within.append(f"{a} ~ {b}")
    return f"| {label} | {', '.join(ordered) or '-'} | {', '.join(within) or '-'} |"


PAIRED_LEGEND = ("Paired by seed (runs of one seed read the same batches and are scored on the same validation "
                 "batches): `a > b` where a is better than b in every seed both ran (two or more, named in brackets), "
                 "`a ~ b` where the seeds disagree.")
PAIRED_HEADER = ["| metric | better in every seed | seeds disagree |", "|---|---|---|"]


def paired_row(label: str, values: dict[str, dict[int, float]], higher_is_better: bool) -> str:
    """One table row over every pair of variants with two or more seeds in common: ``a > b`` where a beats b in
    each of those seeds (ties count against), ``a ~ b`` otherwise. Pairs with fewer common seeds are left out."""
    names = list(values)
    ordered, within = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            common = sorted(set(values[a]) & set(values[b]))
            if len(common) < 2:
                continue
            sign = 1.0 if higher_is_better else -1.0
            a_wins = all(sign * (values[a][s] - values[b][s]) > 0 for s in common)
            b_wins = all(sign * (values[b][s] - values[a][s]) > 0 for s in common)
            seeds = f" ({', '.join(map(str, common))})"
            if a_wins or b_wins:
                ordered.append((f"{a} > {b}" if a_wins else f"{b} > {a}") + seeds)
            else:
                within.append(f"{a} ~ {b}{seeds}")
    return f"| {label} | {', '.join(ordered) or '-'} | {', '.join(within) or '-'} |"
