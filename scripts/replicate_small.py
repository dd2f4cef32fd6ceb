"""Issue 10: the small-scale replication, HOLA vs GDN vs HOLA+recency, in one command.

Usage::

    python scripts/build_small_corpus.py data/small_corpus            # once, CPU only (about a minute)
    python scripts/replicate_small.py --gpus 0,1,2,3,4,5,6,7          # the whole set on 8 GPUs
    python scripts/replicate_small.py --dry-run                       # print the commands and an estimate
    python scripts/replicate_small.py --quick --out /tmp/small_quick  # tiny steps on the CPU (smoke test)

What it runs, in order (every step skips work whose output already exists, so a cut-short run resumes):

1. **Recall, lr sweep**: ``train_configs/small_<flavour>_recall.toml`` (MQAR, 4-64 pairs, seq_len 512) for every
   flavour and every lr of ``--mqar-lrs`` (or ``--lr FLAVOUR=LR:LR``) at the first seed; export each checkpoint
   with ``scripts/convert_to_safetensors.py``; ``python -m hola_titan.eval mqar`` at 4 .. 128 pairs (past the
   state capacity) and 1x/2x the training length; for the HOLA flavours also with the cache switched off at test
   time (``--cache off``) and ``python -m hola_titan.eval cache`` (what each layer's cache holds).
2. **Recall, seeds**: the other ``--seeds`` at each flavour's best lr (highest mean MQAR accuracy in step 1), so
   every point of the final curve has >= 2 seeds.
3. **Text**: ``train_configs/small_<flavour>_text.toml`` on ``data/small_corpus`` for every flavour and every lr
   of ``--text-lrs`` (or ``--lr``), then S-NIAH-1/2 at 1x/2x/4x/8x the training length and validation perplexity.
4. **Report**: ``<out>/RESULTS.md`` (tables) and ``<out>/mqar.png``, ``<out>/niah.png``, ``<out>/ppl.png``.

Resuming across machines: a run counts as done once its evaluation JSONs exist (its training and export are
skipped then, even without the checkpoint), so carrying ``<out>/eval`` (and ``<out>/metrics``, a copy of every
finished run's ``metrics.jsonl``) to the next machine continues the set there. ``--time-budget-min M`` starts no
new command after M minutes (the running ones finish) and says what is left, for machines lent for a limited time.

Jobs of a step run side by side: ``--gpus`` lists the GPUs and ``--jobs-per-gpu`` how many share one (the MQAR
recipes ran three to an H200 in docs/LOG.md); each job sees one GPU through ``CUDA_VISIBLE_DEVICES``. Logs go to
``<out>/logs``, runs to ``<out>/runs``, exports to ``<out>/exports``, eval JSONs to ``<out>/eval``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue

REPO = Path(__file__).resolve().parents[1]
FLAVOURS = ("hola", "gdn", "hola_recency")
MQAR_PAIRS = (4, 8, 16, 32, 64, 128)
NIAH_TASKS = "s_niah_1,s_niah_2"
NIAH_FACTORS = (1, 2, 4, 8)
TOKENS_PER_GPU_SECOND = 190_000
"""Training throughput of the debug width on one H200 (reference backend, three runs sharing it; docs/LOG.md)."""


@dataclass
class Command:
    name: str
    argv: list[str]
    output: Path
    """Exists once the command has done its work (then it is skipped)."""
    gpu: bool = True
    tokens: int = 0
    """Training tokens, for the estimate."""
    env: dict[str, str] = field(default_factory=dict)
    keep: tuple[Path, Path] | None = None
    """(source, destination) copied after the command succeeds: results worth carrying to another machine."""

    def shell(self) -> str:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())
        return prefix + " ".join(shlex.quote(a) for a in self.argv)


@dataclass(frozen=True)
class Run:
    task: str
    """``recall`` or ``text``."""
    flavour: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.task}_{self.flavour}_lr{self.lr:g}_s{self.seed}"


# ---------------------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------------------


def parse_floats(text: str) -> list[float]:
    return [float(v) for v in text.replace(":", ",").split(",") if v.strip()]


def parse_lr_overrides(items: list[str]) -> dict[str, list[float]]:
    """``["gdn=3e-4:1e-3"]`` -> ``{"gdn": [3e-4, 1e-3]}``."""
    out = {}
    for item in items:
        flavour, eq, values = item.partition("=")
        if not eq or flavour not in FLAVOURS or not parse_floats(values):
            raise SystemExit(f"error: --lr expects FLAVOUR=LR[:LR...] with FLAVOUR in {FLAVOURS}, got {item!r}")
        out[flavour] = parse_floats(values)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/small_replication"), help="results folder")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and a GPU-time estimate")
    parser.add_argument("--quick", action="store_true", help="tiny steps and evals on the CPU (smoke test)")
    parser.add_argument("--only", choices=("recall", "text"), default=None, help="run one half only")
    parser.add_argument("--flavours", default=",".join(FLAVOURS), help="comma-separated flavours")
    parser.add_argument("--seeds", default="0,1", help="training seeds; the first one runs the lr sweep")
    parser.add_argument("--mqar-lrs", default="3e-4,1e-3,3e-3", help="recall lr sweep (every flavour)")
    parser.add_argument("--text-lrs", default="1e-3,3e-3", help="text lr sweep (every flavour)")
    parser.add_argument("--lr", action="append", default=[], metavar="FLAVOUR=LR[:LR...]",
                        help="lrs of one flavour for both sweeps (repeatable), e.g. --lr gdn=3e-4:1e-3:3e-3:1e-2")
    parser.add_argument("--size", default=None, help="--model.size override (text: small, recall: debug)")
    parser.add_argument("--corpus", type=Path, default=Path("data/small_corpus"),
                        help="folder with train.jsonl and validation.jsonl (scripts/build_small_corpus.py)")
    parser.add_argument("--gpus", default="0", help="GPU indices to spread jobs over")
    parser.add_argument("--jobs-per-gpu", type=int, default=3, help="jobs sharing one GPU")
    parser.add_argument("--python", default=sys.executable, help="Python of the project's environment")
    parser.add_argument("--time-budget-min", type=float, default=None,
                        help="start no new command after this many minutes; run again to continue")
    return parser


# ---------------------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------------------


class Planner:
    """Builds the train, export and eval commands of a :class:`Run` (quick or full)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = args.out
        self.py = args.python

    def corpus_file(self, split: str) -> Path:
        """``<corpus>/<split>.jsonl``, or the ``.jsonl.gz`` that ``build_small_corpus.py --gzip`` writes."""
        plain = self.args.corpus / f"{split}.jsonl"
        compressed = plain.with_name(plain.name + ".gz")
        return compressed if compressed.is_file() and not plain.is_file() else plain

    def config(self, run: Run) -> Path:
        return Path("train_configs") / f"small_{run.flavour}_{run.task}.toml"

    def steps_seq_batch(self, run: Run) -> tuple[int, int, int]:
        if self.args.quick:
            return 4, 128, 2
        text = (REPO / self.config(run)).read_text(encoding="utf-8")
        values = {}
        for key in ("steps", "seq_len", "local_batch_size"):
            line = next(ln for ln in text.splitlines() if ln.split("=")[0].strip() == key)
            values[key] = int(line.split("=")[1].split("#")[0])
        return values["steps"], values["seq_len"], values["local_batch_size"]

    def train(self, run: Run) -> Command:
        steps, seq_len, batch = self.steps_seq_batch(run)
        dump = self.out / "runs" / run.name
        argv = [self.py, "-m", "hola_titan.train", "--job.config_file", str(self.config(run)),
                "--job.dump_folder", str(dump), "--optimizer.lr", f"{run.lr:g}", "--training.seed", str(run.seed)]
        if self.args.size:
            argv += ["--model.size", self.args.size]
        if run.task == "text" and self.args.quick:
            argv += ["--data.dataset", "bundled"]  # the smoke test needs no built corpus
        elif run.task == "text":
            argv += ["--data.dataset", str(self.corpus_file("train")),
                     "--validation.dataset", str(self.corpus_file("validation"))]
        if self.args.quick:
            argv += ["--training.steps", str(steps), "--training.seq_len", str(seq_len),
                     "--training.local_batch_size", str(batch), "--training.device", "cpu",
                     "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1",
                     "--checkpoint.interval", str(steps), "--metrics.log_freq", "1", "--validation.enable", "false"]
            if run.task == "recall":
                argv += ["--data.dataset", "mqar:vocab=8192,pairs=4-16,power_a=0.01"]
        return Command(f"train {run.name}", argv, dump / "checkpoint" / f"step-{steps}" / ".metadata",
                       tokens=steps * seq_len * batch,
                       keep=(dump / "metrics.jsonl", self.out / "metrics" / f"{run.name}.jsonl"))

    def export_dir(self, run: Run) -> Path:
        return self.out / "exports" / run.name

    def export(self, run: Run) -> Command:
        steps, _, _ = self.steps_seq_batch(run)
        checkpoint = self.out / "runs" / run.name / "checkpoint" / f"step-{steps}"
        argv = [self.py, "scripts/convert_to_safetensors.py", str(checkpoint), str(self.export_dir(run))]
        return Command(f"export {run.name}", argv, self.export_dir(run) / "config.json", gpu=False)

    def _eval(self, name: str, run: Run, extra: list[str], *, suffix: str = "") -> Command:
        out = self.out / "eval" / name
        argv = [self.py, "-m", "hola_titan.eval", name, "--checkpoint", str(self.export_dir(run)),
                "--out", str(out), "--no-progress"]
        if self.args.quick:
            argv += ["--device", "cpu", "--threads", "1"]
        return Command(f"eval {name}{suffix} {run.name}", argv + extra, out / f"{name}_{run.name}{suffix}.json")

    def evals(self, run: Run) -> list[Command]:
        _, seq_len, _ = self.steps_seq_batch(run)
        if run.task == "recall":
            pairs = [p for p in MQAR_PAIRS if 4 * p <= seq_len] if self.args.quick else list(MQAR_PAIRS)
            samples = "8" if self.args.quick else "256"
            mqar = ["--pairs", ",".join(map(str, pairs)), "--seq-lens", f"{seq_len},{2 * seq_len}",
                    "--samples", samples]
            commands = [self._eval("mqar", run, mqar)]
            if run.flavour != "gdn":  # how much of the recall the cache carries, and what it holds
                commands.append(self._eval("mqar", run, mqar + ["--cache", "off"], suffix="-cache-off"))
                commands.append(self._eval("cache", run, ["--pairs", str(min(16, seq_len // 4)),
                                                          "--seq-len", str(seq_len)]))
            return commands
        lengths = ",".join(str(f * seq_len) for f in NIAH_FACTORS)
        if self.args.quick:
            niah = ["--tasks", NIAH_TASKS, "--lengths", f"{seq_len},{2 * seq_len}", "--depths", "50",
                    "--samples", "1"]
            ppl = ["--data", "bundled", "--max-documents", "4"]
        else:
            niah = ["--tasks", NIAH_TASKS, "--lengths", lengths, "--samples", "4"]
            ppl = ["--data", str(self.corpus_file("validation"))]
        return [self._eval("niah", run, niah), self._eval("ppl", run, ppl)]


def lrs_for(flavour: str, task: str, args: argparse.Namespace) -> list[float]:
    overrides = parse_lr_overrides(args.lr)
    if flavour in overrides:
        return overrides[flavour]
    return parse_floats(args.mqar_lrs if task == "recall" else args.text_lrs)


def sweep_runs(args: argparse.Namespace) -> dict[str, list[Run]]:
    """The runs of step 1 (recall sweep at the first seed) and step 3 (text), by task."""
    flavours = [f.strip() for f in args.flavours.split(",") if f.strip()]
    for flavour in flavours:
        if flavour not in FLAVOURS:
            raise SystemExit(f"error: unknown flavour {flavour!r}; expected some of {FLAVOURS}")
    seed = int(args.seeds.split(",")[0])
    tasks = [args.only] if args.only else ["recall", "text"]
    return {task: [Run(task, f, lr, seed) for f in flavours for lr in lrs_for(f, task, args)] for task in tasks}


def seed_runs(best_lr: dict[str, float], args: argparse.Namespace) -> list[Run]:
    """Step 2: the remaining seeds at each flavour's best recall lr."""
    seeds = [int(s) for s in args.seeds.split(",")[1:] if s.strip()]
    return [Run("recall", f, lr, s) for f, lr in best_lr.items() for s in seeds]


def pipeline(planner: Planner, runs: list[Run]) -> list[list[Command]]:
    """Stages that run one after the other; commands within a stage run side by side. Runs whose evaluations
    all exist are done (see the module docstring) and left out."""
    todo = []
    for run in runs:
        if all(c.output.exists() for c in planner.evals(run)):
            print(f"skip (evaluated): {run.name}")
        else:
            todo.append(run)
    return [[planner.train(r) for r in todo], [planner.export(r) for r in todo],
            [c for r in todo for c in planner.evals(r)]]


# ---------------------------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------------------------


START = time.time()
DEFERRED: list[Command] = []


def run_stage(commands: list[Command], args: argparse.Namespace) -> list[Command]:
    """Run the commands whose outputs are missing, side by side over the GPU slots; return the failed ones.
    Past ``--time-budget-min`` a command is not started but deferred (listed at the end)."""
    todo = [c for c in commands if not c.output.exists()]
    for c in commands:
        if c.output.exists():
            print(f"skip (done): {c.name}")
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    slots: Queue[str | None] = Queue()
    for _ in range(max(1, args.jobs_per_gpu)):
        for gpu in gpus if not args.quick else [None]:
            slots.put(gpu)
    failed = []
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def work(command: Command) -> None:
        gpu = slots.get()
        if args.time_budget_min is not None and time.time() - START > 60 * args.time_budget_min:
            slots.put(gpu)
            DEFERRED.append(command)
            print(f"deferred (time budget): {command.name}", flush=True)
            return
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if gpu is not None and command.gpu:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        log = logs / (command.name.replace(" ", "_") + ".log")
        start = time.time()
        print(f"start: {command.name} (gpu {gpu}) -> {log}", flush=True)
        try:
            with open(log, "w", encoding="utf-8") as handle:
                handle.write(command.shell() + "\n")
                handle.flush()
                rc = subprocess.run(command.argv, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
        finally:
            slots.put(gpu)
        print(f"{'done' if rc == 0 else f'FAILED (rc {rc})'}: {command.name} in {time.time() - start:.0f} s",
              flush=True)
        if rc != 0:
            failed.append(command)
        elif command.keep is not None and command.keep[0].is_file():
            command.keep[1].parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(*command.keep)

    with ThreadPoolExecutor(max_workers=max(1, slots.qsize())) as pool:
        list(pool.map(work, todo))
    return failed


def read_result(command: Command) -> dict | None:
    if not command.output.is_file():
        return None
    return json.loads(command.output.read_text(encoding="utf-8"))


def mean_summary(result: dict | None) -> float:
    if not result or not result["summary"]:
        return float("nan")
    values = list(result["summary"].values())
    return sum(values) / len(values)


def best_lrs(planner: Planner, runs: list[Run]) -> dict[str, float]:
    """Per flavour, the recall lr whose MQAR accuracy (mean over every point) is highest."""
    best: dict[str, tuple[float, float]] = {}
    for run in runs:
        score = mean_summary(read_result(planner.evals(run)[0]))
        score = -1.0 if math.isnan(score) else score
        if run.flavour not in best or score > best[run.flavour][1]:
            best[run.flavour] = (run.lr, score)
    return {f: lr for f, (lr, _) in best.items()}


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def write_report(planner: Planner, recall: list[Run], text: list[Run], best_lr: dict[str, float]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = planner.out
    lines = ["# Issue 10: small-scale replication (HOLA vs GDN vs HOLA+recency)", "",
             "Written by `scripts/replicate_small.py`"
             + (" --quick (smoke test: the numbers mean nothing)." if planner.args.quick else "."),
             ""]
    if recall:
        groups: dict[tuple[str, float], list[dict]] = {}
        for run in recall:
            result = read_result(planner.evals(run)[0])
            if result:
                groups.setdefault((run.flavour, run.lr), []).append(result["summary"])
        points = sorted({k for rows in groups.values() for row in rows for k in row},
                        key=lambda k: (int(k.split("@")[1]), int(k.split("=")[1].split("@")[0])))
        lines += ["## MQAR accuracy (mean over seeds; [min, max] where more than one seed)", "",
                  "| flavour | lr | seeds | " + " | ".join(points) + " |",
                  "|---|---|---|" + "---|" * len(points)]
        for (flavour, lr), rows in sorted(groups.items()):
            cells = []
            for point in points:
                values = [r[point] for r in rows if point in r]
                cell = f"{sum(values) / len(values):.3f}" if values else "-"
                if len(values) > 1:
                    cell += f" [{min(values):.3f}, {max(values):.3f}]"
                cells.append(cell)
            mark = " (best)" if best_lr.get(flavour) == lr else ""
            lines.append(f"| {flavour} | {lr:g}{mark} | {len(rows)} | " + " | ".join(cells) + " |")
        lines.append("")
        seq_lens = sorted({int(p.split("@")[1]) for p in points})
        if seq_lens:
            fig, axes = plt.subplots(1, len(seq_lens), figsize=(5 * len(seq_lens), 4), squeeze=False)
            for ax, seq_len in zip(axes[0], seq_lens):
                for flavour, lr in best_lr.items():
                    rows = groups.get((flavour, lr), [])
                    xs = [int(p.split("=")[1].split("@")[0]) for p in points if p.endswith(f"@{seq_len}")]
                    keys = [p for p in points if p.endswith(f"@{seq_len}")]
                    means = [sum(r.get(k, float("nan")) for r in rows) / max(len(rows), 1) for k in keys]
                    lows = [m - min(r.get(k, m) for r in rows) if rows else 0 for m, k in zip(means, keys)]
                    highs = [max(r.get(k, m) for r in rows) - m if rows else 0 for m, k in zip(means, keys)]
                    ax.errorbar(xs, means, yerr=[lows, highs], marker="o", capsize=3, label=f"{flavour} lr {lr:g}")
                ax.set_xscale("log", base=2)
                ax.set_xlabel("key-value pairs")
                ax.set_ylabel("accuracy")
                ax.set_title(f"MQAR at seq_len {seq_len}")
                ax.legend()
            fig.tight_layout()
            fig.savefig(out / "mqar.png", dpi=110)
            plt.close(fig)
    if text:
        niah_rows, columns = [], []
        for run in text:
            niah, ppl = (read_result(c) for c in planner.evals(run))
            summary = dict(niah["summary"]) if niah else {}
            columns += [k for k in summary if k not in columns]
            niah_rows.append((run, summary, ppl["summary"]["perplexity"] if ppl else float("nan")))
        lines += ["## Text: validation perplexity and S-NIAH accuracy (task@length)", "",
                  "| flavour | lr | seed | val ppl | " + " | ".join(columns) + " |",
                  "|---|---|---|---|" + "---|" * len(columns)]
        for run, summary, ppl in niah_rows:
            cells = [f"{summary[c]:.2f}" if c in summary else "-" for c in columns]
            lines.append(f"| {run.flavour} | {run.lr:g} | {run.seed} | {ppl:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
        fig, ax = plt.subplots(figsize=(6, 4))
        for run, summary, _ in niah_rows:
            for task in NIAH_TASKS.split(","):
                keys = [k for k in columns if k.startswith(task + "@")]
                if keys:
                    ax.plot([int(k.split("@")[1]) for k in keys], [summary.get(k, float("nan")) for k in keys],
                            marker="o", label=f"{run.flavour} lr {run.lr:g} {task}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("accuracy")
        ax.set_title("S-NIAH")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "niah.png", dpi=110)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([f"{r.flavour}\nlr {r.lr:g}" for r, _, _ in niah_rows], [p for _, _, p in niah_rows])
        ax.set_ylabel("validation perplexity")
        fig.tight_layout()
        fig.savefig(out / "ppl.png", dpi=110)
        plt.close(fig)
    path = out / "RESULTS.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def dry_run(planner: Planner, runs: dict[str, list[Run]], args: argparse.Namespace) -> None:
    recall = runs.get("recall", [])
    seeds = seed_runs({f: 0.0 for f in dict.fromkeys(r.flavour for r in recall)}, args) if recall else []
    tokens = 0
    for title, stage_runs in (("recall lr sweep", recall), ("text", runs.get("text", []))):
        if not stage_runs:
            continue
        print(f"# {title}")
        for stage in pipeline(planner, stage_runs):
            for command in stage:
                tokens += command.tokens
                print(command.shell())
    if seeds:
        print("# recall seeds: after the sweep, at each flavour's best lr (BEST_LR), e.g.")
        for stage in pipeline(planner, seeds):
            for command in stage:
                tokens += command.tokens
                print(command.shell().replace("--optimizer.lr 0", "--optimizer.lr BEST_LR")
                      .replace("lr0_", "lrBEST_LR_"))
    gpu_minutes = tokens / TOKENS_PER_GPU_SECOND / 60
    gpus = len([g for g in args.gpus.split(",") if g.strip()])
    print(f"# estimate: {tokens / 1e9:.2f} G training tokens, about {gpu_minutes:.0f} GPU-minutes of training at "
          f"{TOKENS_PER_GPU_SECOND:,} tokens/s per H200 (debug width), about {gpu_minutes / gpus:.0f} minutes on "
          f"{gpus} GPU(s), plus exports and evals")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    planner = Planner(args)
    runs = sweep_runs(args)
    if args.dry_run:
        dry_run(planner, runs, args)
        return 0
    if "text" in runs and not args.quick and not planner.corpus_file("train").is_file():
        raise SystemExit(f"error: {args.corpus}/train.jsonl is missing; run scripts/build_small_corpus.py "
                         f"{args.corpus}")
    args.out.mkdir(parents=True, exist_ok=True)
    failed: list[Command] = []
    recall = runs.get("recall", [])
    best_lr: dict[str, float] = {}
    if recall:
        for stage in pipeline(planner, recall):
            failed += run_stage(stage, args)
        if all(c.output.exists() for r in recall for c in planner.evals(r)):
            best_lr = best_lrs(planner, recall)
            print(f"best recall lr per flavour: {best_lr}")
            more = seed_runs(best_lr, args)
            for stage in pipeline(planner, more):
                failed += run_stage(stage, args)
            recall = recall + more
        else:  # the best lr needs the whole sweep
            print("recall seeds: waiting for the whole lr sweep (failed or deferred runs above)")
    text = runs.get("text", [])
    for stage in pipeline(planner, text):
        failed += run_stage(stage, args)
    report = write_report(planner, recall, text, best_lr)
    print(f"wrote {report}")
    for command in failed:
        print(f"failed: {command.name}: {command.shell()}", file=sys.stderr)
    if DEFERRED:
        print(f"incomplete: {len(DEFERRED)} commands deferred by --time-budget-min (and the stages after them); "
              "run the same command again, with <out>/eval and <out>/metrics carried over, to continue")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
