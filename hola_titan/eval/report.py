"""Result files, plots and comparison tables.

Every evaluation writes ``<out>/<eval>_<label>.json`` holding ``eval``, ``checkpoint``, ``label``, ``model``
(flavour, size, parameters, ...), ``settings``, ``summary`` (flat ``{metric: number}``, what comparisons
tabulate) and ``details``, and ``<out>/<eval>_<label>.png`` (matplotlib, Agg backend). ``--compare`` adds
``<out>/<eval>_compare.{json,md}`` (one row per checkpoint, one column per summary metric) and, for NIAH and
MQAR, ``<out>/<eval>_compare.png`` with a line per checkpoint. Each file is written through a hidden sibling renamed
into place (an interrupted eval leaves the earlier file or the new one, never a torn one); a file that cannot be
written is an :class:`EvalError` naming it and the cause.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot is imported)

from hola_titan.eval.runtime import EvalError  # noqa: E402
from hola_titan.staging import describe_write_error, write_bytes_atomic  # noqa: E402


def write_file(data: bytes | str, path: Path) -> Path:
    """Write ``data`` (``str``: UTF-8) to ``path``, making its folder, through a sibling renamed into place.
    Raises :class:`EvalError` naming ``path`` and the cause (a full disk, a file where a folder should be)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_bytes_atomic(path, data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as error:
        raise EvalError(f"{path}: cannot be written: {describe_write_error(error, path.parent)}") from None


def write_json(data: dict, path: Path) -> Path:
    return write_file(json.dumps(data, indent=2, default=_plain) + "\n", path)


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def read_result(path: Path, *, eval_name: str) -> dict:
    """A result file written earlier, checked to be of ``eval_name``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise EvalError(f"result file {str(path)!r} cannot be read: {error}") from None
    if not isinstance(data, dict) or data.get("eval") != eval_name or "summary" not in data:
        raise EvalError(f"result file {str(path)!r} is not a {eval_name} result")
    return data


# ---------------------------------------------------------------------------------------------------------------
# Plots: one function per evaluation, each taking the result dict
# ---------------------------------------------------------------------------------------------------------------


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    # Rendered in memory, so that the file is written as every other one is (write_file).
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    return write_file(image.getvalue(), path)


def plot_niah(result: dict, path: Path) -> Path:
    """Accuracy vs context length (a line per task) and a depth x length heatmap per task."""
    tasks = result["details"]["tasks"]
    fig, axes = plt.subplots(1, 1 + len(tasks), figsize=(5 + 4 * len(tasks), 4), squeeze=False)
    line = axes[0][0]
    for name, task in tasks.items():
        lengths = list(task["accuracy_by_length"])
        line.plot(range(len(lengths)), list(task["accuracy_by_length"].values()), marker="o", label=name)
        line.set_xticks(range(len(lengths)), lengths)
    line.set(xlabel="context length (tokens)", ylabel="exact-match accuracy", ylim=(-0.05, 1.05),
             title=f"NIAH: {result['label']}")
    line.legend(fontsize=8)
    for ax, (name, task) in zip(axes[0][1:], tasks.items()):
        grid = task["accuracy_by_depth_length"]
        depths = list(grid)
        lengths = list(next(iter(grid.values())))
        values = [[grid[d][length] for length in lengths] for d in depths]
        image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), lengths)
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set(xlabel="context length", ylabel="needle depth", title=name)
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(fig, path)


def plot_mqar(result: dict, path: Path) -> Path:
    """Accuracy vs number of key-value pairs, a line per sequence length."""
    fig, ax = plt.subplots(figsize=(6, 4))
    points = result["details"]["points"]
    for seq_len in sorted({p["seq_len"] for p in points}):
        mine = sorted((p for p in points if p["seq_len"] == seq_len), key=lambda p: p["pairs"])
        ax.plot([p["pairs"] for p in mine], [p["accuracy"] for p in mine], marker="o", label=f"seq_len {seq_len}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.05, 1.05), title=f"MQAR: {result['label']}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_perplexity(result: dict, path: Path) -> Path:
    """Mean loss vs position in the document (log-spaced bins)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = result["details"]["loss_by_position"]
    ax.plot([(b["from"] * max(b["to"], b["from"])) ** 0.5 for b in bins], [b["loss"] for b in bins], marker="o")
    ax.set_xscale("log")
    summary = result["summary"]
    ax.set(xlabel="context tokens before the target", ylabel="mean loss (nats)",
           title=f"{result['label']}: ppl {summary['perplexity']:.2f}, {summary['bits_per_byte']:.3f} bits/byte")
    return _save(fig, path)


def plot_memory(result: dict, path: Path) -> Path:
    """Decoding cache size and peak memory vs context length."""
    rows = result["details"]["memory"]
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows:
        lengths = [r["context_len"] for r in rows]
        ax.plot(lengths, [r["cache_bytes_after_decode"] / 2**20 for r in rows], marker="o",
                label="ModelCache.nbytes()")
        ax.plot(lengths, [r["peak_over_start_bytes"] / 2**20 for r in rows], marker="s",
                label="peak memory over start")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    ax.set(xlabel="context length (tokens)", ylabel="MiB", title=f"decoding memory: {result['label']}")
    return _save(fig, path)


def plot_cache(result: dict, path: Path) -> Path:
    """Selected positions against the reading block, per layer (rows) and head (columns), coloured by token kind;
    also one PNG per layer beside it (``<stem>_layer<L>.png``)."""
    from hola_titan.eval.cache_inspect import KINDS

    details = result["details"]
    text = details.get("mode") == "text"  # text: one colour (no token kinds), the first document's selections
    reads = plot_cache_reads(result, path.with_name(f"{path.stem}_reads.png")) if "reads" in details else None
    if not details["positions"]:  # window 0: no entries of earlier blocks, only the read's shares
        return reads
    kinds = None if text else details["kinds"]
    colours = {"key": "tab:blue", "value": "tab:orange", "query": "tab:green", "answer": "tab:red",
               "filler": "lightgray", "held": "tab:blue"}
    names = list(details["positions"])

    def draw(axes_row, name):
        pos = details["positions"][name]  # [blocks, H, W]
        for head, ax in enumerate(axes_row):
            for kind in ("held",) if text else KINDS:
                xs, ys = [], []
                for b, heads in enumerate(pos):
                    for p in heads[head]:
                        if p >= 0 and (text or KINDS[kinds[p]] == kind):
                            xs.append((b + 1) * details["block"])
                            ys.append(p)
                ax.scatter(xs, ys, s=2 if text else 6, c=colours[kind], label=kind)
            ax.set(xlabel="reading block starts at", ylabel="selected position", title=f"layer {name} head {head}")
        axes_row[0].legend(fontsize=6, markerscale=2)

    heads = len(details["positions"][names[0]][0])
    for name in names:
        fig, axes = plt.subplots(1, heads, figsize=(4 * heads, 3.5), squeeze=False)
        draw(axes[0], name)
        _save(fig, path.with_name(f"{path.stem}_layer{name}.png"))
    fig, axes = plt.subplots(len(names), heads, figsize=(4 * heads, 3.2 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        draw(row, name)
    fig.suptitle(f"cache selections ({details['evict']}, W {details['window']}, C {details['block']}): "
                 f"{result['label']}")
    return _save(fig, path)


def plot_cache_reads(result: dict, path: Path) -> Path:
    """The cache read's softmax mass on the entries of earlier blocks, the in-block tokens and the sink, and the
    gated read's size beside the state read, per layer against the position (``eval cache --data``)."""
    reads = result["details"]["reads"]
    names = list(reads["layers"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in names:
        bins = reads["layers"][name]["bins"]
        mid = [(b["from"] + b["to"]) / 2 for b in bins]
        line, = axes[0].plot(mid, [b["persistent"] for b in bins], marker="o", label=f"layer {name}")
        axes[0].plot(mid, [b["sink"] for b in bins], linestyle=":", color=line.get_color())
        axes[1].plot(mid, [b["cache_to_state"] for b in bins], marker="o", color=line.get_color())
    axes[0].set(xscale="log", xlabel="position", ylabel="mass",
                title="entries of earlier blocks (solid), sink (dotted)")
    axes[1].set(xscale="log", yscale="log", xlabel="position", ylabel="ratio",
                title="|sigmoid(gate) o_cache| / |o_state|")
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"cache reads ({reads['evict']}, W {reads['window']}, C {reads['block']}): {result['label']}")
    return _save(fig, path)


PLOTS = {"cache": plot_cache, "niah": plot_niah, "mqar": plot_mqar, "ppl": plot_perplexity, "generate": plot_memory}


# ---------------------------------------------------------------------------------------------------------------
# Comparison across checkpoints
# ---------------------------------------------------------------------------------------------------------------


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.4e}"
    return str(value)


def comparison(results: list[dict]) -> dict:
    """Rows (one per result) over the union of summary metrics, in first-seen order."""
    metrics: list[str] = []
    for result in results:
        metrics += [m for m in result["summary"] if m not in metrics]
    rows = [{"label": r["label"], "checkpoint": r["checkpoint"], "flavour": r["model"].get("flavour"),
             **{m: r["summary"].get(m) for m in metrics}} for r in results]
    return {"eval": results[0]["eval"], "metrics": metrics, "rows": rows}


def markdown_table(table: dict) -> str:
    head = ["checkpoint", "flavour", *table["metrics"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        lines.append("| " + " | ".join([row["label"], str(row["flavour"])] +
                                       [_cell(row[m]) for m in table["metrics"]]) + " |")
    return "\n".join(lines)


def plot_compare_niah(results: list[dict], path: Path) -> Path:
    """Accuracy vs context length, a panel per task and a line per checkpoint."""
    tasks = list(dict.fromkeys(t for r in results for t in r["details"]["tasks"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
    for ax, name in zip(axes[0], tasks):
        for result in results:
            task = result["details"]["tasks"].get(name)
            if task is None:
                continue
            lengths = list(task["accuracy_by_length"])
            ax.plot(range(len(lengths)), list(task["accuracy_by_length"].values()), marker="o",
                    label=result["label"])
            ax.set_xticks(range(len(lengths)), lengths)
        ax.set(xlabel="context length", ylabel="exact-match accuracy", ylim=(-0.05, 1.05), title=name)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_compare_mqar(results: list[dict], path: Path) -> Path:
    """Accuracy vs number of pairs, a panel per sequence length and a line per checkpoint."""
    seq_lens = sorted({p["seq_len"] for r in results for p in r["details"]["points"]})
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(4.5 * len(seq_lens), 4), squeeze=False)
    for ax, seq_len in zip(axes[0], seq_lens):
        for result in results:
            mine = sorted((p for p in result["details"]["points"] if p["seq_len"] == seq_len),
                          key=lambda p: p["pairs"])
            ax.plot([p["pairs"] for p in mine], [p["accuracy"] for p in mine], marker="o", label=result["label"])
        ax.set_xscale("log", base=2)
        ax.set(xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.05, 1.05), title=f"MQAR, seq_len {seq_len}")
        ax.legend(fontsize=7)
    return _save(fig, path)


COMPARE_PLOTS = {"niah": plot_compare_niah, "mqar": plot_compare_mqar}
