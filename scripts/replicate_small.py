"""Issues 10 and 30: the small-scale replication (HOLA vs HOLA+recency vs GDN) in pieces that fit lent GPUs.

A lent H200 runs one command for at most 10 minutes, and nothing (no checkpoint) survives from one command to the
next. So the set is cut into **pieces** of at most 8 minutes: a piece starts its runs side by side on one GPU (nine
MQAR runs, six text runs); every run trains, exports and is evaluated inside the piece, in a temporary folder that
is removed at the end; the piece writes one small JSON, ``<out>/piece-K.json`` (each run's commands, seed, lr,
steps, status, wall times and evaluation summaries; the device and versions), and its logs and cache PNGs in
``<out>/piece-K/``. JSONs from several machines merge into one report.

Usage::

    python scripts/replicate_small.py --plan                               # the pieces, their runs and minutes
    python scripts/replicate_small.py --piece 0 --out results              # one piece (one GPU, <= 8 minutes)
    python scripts/replicate_small.py --piece 1 --corpus data/small_corpus_gz --out results    # the text piece
    python scripts/replicate_small.py --plan --sweep-results results/piece-0.json    # the seed pieces' lrs
    python scripts/replicate_small.py --piece 2 --sweep-results results/piece-0.json --out results
    python scripts/replicate_small.py --merge results/piece-*.json --out report       # RESULTS.md and plots
    python scripts/replicate_small.py --quick --piece 0 --flavours gdn --out /tmp/q  # tiny steps on the CPU

The pieces of the default set, in order:

0. **MQAR lr sweep**: ``train_configs/mqar_<flavour>.toml`` (debug width, 64 rows of 256 tokens, 4-64 pairs) for
   hola, hola_recency and gdn at each lr of ``--mqar-lrs`` (three), the first of ``--seeds``: nine runs.
1. **Text**: ``train_configs/small_<flavour>_text.toml`` (``small`` width, 16 rows of 1024 tokens) on the offline
   corpus of ``scripts/build_small_corpus.py`` (``--corpus``), the three flavours at each of ``--text-seeds`` (two)
   with one lr and the same steps and schedule: six runs. Validation perplexity, and S-NIAH-1/2 at 1x, 2x and 4x
   the training length.
2, 3. **MQAR seeds**: the other ``--seeds`` (1-4) at each flavour's best lr, the highest mean accuracy of the
   sweep runs in ``--sweep-results`` (the sweep's run at that lr is seed 0); six runs a piece. The runs of the
   second seed also run ``eval cache`` for hola and hola_recency (what the cache holds: PNGs in ``piece-K/``).

Every MQAR run is evaluated at 8, 16, 32, 64 and 128 pairs at lengths 256 and 512 (128 pairs fit only 512), in
float32 as trained, and the HOLA flavours also with the cache switched off at test time (``--cache off``). A run's
stages are the commands one would type (``python -m hola_titan.train ...``, ``scripts/convert_to_safetensors.py``,
``python -m hola_titan.eval ...``); they run one after another in one interpreter per run
(``scripts/run_in_one_process.py``), which saves importing torch four or five times per run.

``--time-budget-min`` (default 9) stops the runs still going 15 s before the budget (so does SIGTERM or Ctrl-C to
the piece), then writes the JSON with each run's status (finished, stopped, failed) and the stages it finished. A
stopped run is not resumed: its checkpoint went with the temporary folder, so its piece is run again whole.

The minutes of ``--plan`` come from the throughput constants below: the measured ones cite docs/LOG.md, the rest
say they are estimates. Each piece JSON records its runs' measured times, which replace them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORMAT = "replicate_small piece 1"
"""The ``format`` of a piece JSON; --merge and --sweep-results refuse other files."""
FLAVOURS = ("hola", "hola_recency", "gdn")


def _evict_by_flavour() -> dict[str, str]:
    """The flavour registry's eviction per recurrent flavour (``none``: no cache to switch off or inspect). Read by
    path: importing ``hola_titan`` imports torch and the kernels, seconds that --plan and --merge do not need."""
    spec = importlib.util.spec_from_file_location("_hola_titan_flavours", REPO / "hola_titan/models/flavours.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return {name: entry.evict for name, entry in module.FLAVOURS.items() if entry.recurrent}


HAS_CACHE = {flavour: evict != "none" for flavour, evict in _evict_by_flavour().items()}

# ---------------------------------------------------------------------------------------------------------------
# Sizes of the pieces: what one may take and how long its runs take on one H200 (docs/LOG.md, 2026-12-02, "CPU:
# the small replication in pieces (issue 30)"). Each piece JSON records the measured times that correct them.
# ---------------------------------------------------------------------------------------------------------------

PIECE_LIMIT_MIN = 8.0
"""Longest planned piece: a lent GPU runs a command for at most 10 minutes; the rest is margin."""
DEFAULT_TIME_BUDGET_MIN = 9.0
STOP_MARGIN_S = 15.0
"""Runs are stopped this long before the time budget, so that the JSON is written inside it."""
MQAR_RUNS_PER_PIECE = 9
"""Nine MQAR processes started side by side on one 16-core H200 (first steps all within 44.3 s; docs/LOG.md,
2026-12-02); each uses a few percent of the GPU (issue 30)."""
MQAR_STEPS_PER_S = {"hola": 3.5, "hola_recency": 3.5, "gdn": 9.2}
"""Steps per second of one MQAR run (64 x 256 tokens a step) with eight others beside it on one H200, measured in
piece 0 of the sweep: at 1,000 steps (2026-12-02; docs/results/replicate_small_h200_2026-12-02b/)
HOLA and HOLA+recency 58k tokens/s each, GDN 150-155k, the nine runs trained, exported and evaluated in 5.3
minutes; in the first, 2,500-step attempt (docs/results/replicate_small_h200_2026-12-02/) HOLA and
HOLA+recency 45k tokens/s each while three GDN runs trained beside them (64k once those had finished), GDN 150k.
The six HOLA runs together made about 23 steps/s whether three or six shared the GPU (the issue's three side by
side: 7.6 steps/s each): the GPU, shared by processes in turn, is the limit, so more runs a piece do not add
steps. The slowest flavour sets a piece's length."""
MQAR_STEPS = 1000
"""Steps of an MQAR run: what a HOLA run makes in a piece at the rate above (2,500 would have taken 15 minutes
there; at step 1,000 of that sweep the lr 1e-2 HOLA run was at validation loss 4.40 from 9.04)."""
MQAR_STARTUP_S = 30.0
"""Imports, build and first step of nine MQAR runs side by side on a fresh H200: all within 26.2 s with the compile
plans (`first_step.py --procs 9`, 2026-12-02); in piece 0 the runs logged step 1 22-23 s after the
piece started."""
TEXT_RUNS_PER_PIECE = 6
TEXT_PIN = ("--model.block", "64")
"""Keys every text run gets after its config: the pieces of 2026-12-03 trained at block 64, the text configs' value
then; the configs now hold the paper's 256, and this keeps new pieces paired with the old (and --quick's 128-token
rows longer than a block)."""
TEXT_STEPS_PER_S = {"hola": 2.5, "hola_recency": 2.5, "gdn": 2.5}
"""Estimate, not measured: one ``small`` text run (16 x 1024 tokens a step, bf16) of six sharing one H200, from
the 340M rate (116k tokens/s alone, docs/LOG.md 2026-12-01) scaled by FLOPs per token and halved for host overhead."""
TEXT_STARTUP_S = 60.0
"""Estimate: the compiled 340M run's first step took 37.4 s alone (docs/LOG.md 2026-12-02); six start together."""
EXPORT_S = 10.0
"""Estimate: the converter on a debug or small checkpoint."""
EVAL_S = {"mqar": 20.0, "mqar-cache-off": 20.0, "cache": 15.0, "ppl": 30.0, "niah": 90.0}
"""Estimates per evaluation of one run, including its model load: 10 MQAR points of 256 rows; a cache inspection;
the validation split; 120 S-NIAH prompts of up to 4096 tokens with the compiled decoder's setup."""

MQAR_PAIRS = (8, 16, 32, 64, 128)
MQAR_LENGTH_FACTORS = (1, 2)
MQAR_SAMPLES = 256
CACHE_PAIRS = 16
NIAH_TASKS = "s_niah_1,s_niah_2"
NIAH_LENGTH_FACTORS = (1, 2, 4)
QUICK = {"steps": 2, "warmup_steps": 1, "batch": 2, "mqar_seq_len": 64, "text_seq_len": 128,
         "mqar_pairs": (8, 16), "mqar_samples": 4, "cache_pairs": 8}
"""--quick: sizes that run a piece on a 2-core CPU in seconds (the numbers mean nothing)."""


class ReplicateError(Exception):
    """A mistake in the options or the inputs: printed as one line ``error: ...``, exit status 2."""


# ---------------------------------------------------------------------------------------------------------------
# The plan: tasks, runs, pieces
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """What differs between the MQAR and the text runs; the code asks :data:`TASKS` instead of testing the name."""

    name: str
    config: str
    """The recipe, ``{flavour}`` filled in."""
    steps_option: str
    """The option that sets the steps (named in errors)."""
    runs_per_piece: int
    startup_s: float
    steps_per_s: dict[str, float]
    """By flavour."""


TASKS = {"mqar": Task("mqar", "train_configs/mqar_{flavour}.toml", "--mqar-steps", MQAR_RUNS_PER_PIECE,
                      MQAR_STARTUP_S, MQAR_STEPS_PER_S),
         "text": Task("text", "train_configs/small_{flavour}_text.toml", "--text-steps", TEXT_RUNS_PER_PIECE,
                      TEXT_STARTUP_S, TEXT_STEPS_PER_S)}


@dataclass(frozen=True)
class Run:
    task: str
    flavour: str
    lr: float | None
    """None: the best lr of the sweep, not known without the sweep results."""
    seed: int
    inspect_cache: bool = False
    """Also ``eval cache`` (PNGs of what each layer's cache holds)."""

    @property
    def name(self) -> str:
        lr = "BEST" if self.lr is None else f"{self.lr:g}"
        return f"{self.task}_{self.flavour}_lr{lr}_s{self.seed}"


@dataclass(frozen=True)
class Piece:
    index: int
    kind: str
    """``mqar-sweep``, ``text`` or ``mqar-seeds``."""
    runs: tuple[Run, ...]


def runs_count(piece: Piece) -> str:
    return f"{len(piece.runs)} run" + ("s" if len(piece.runs) != 1 else "")


PIECE_TITLES = {"mqar-sweep": "MQAR lr sweep", "text": "text (perplexity, S-NIAH)",
                "mqar-seeds": "MQAR seeds at each flavour's best lr"}


@dataclass(frozen=True)
class Stage:
    name: str
    """``train``, ``export`` or an evaluation: ``mqar``, ``mqar-cache-off``, ``cache``, ``ppl``, ``niah``."""
    argv: tuple[str, ...]
    result: Path | None = None
    """The evaluation's JSON."""


@dataclass(frozen=True)
class Sizes:
    """Steps and shapes of one task's runs, as trained."""

    steps: int
    warmup_steps: int
    seq_len: int
    batch: int


class Commands:
    """The stages of a run (train, export, evaluations), full size or ``--quick`` (tiny, on the CPU)."""

    python = "python"
    """The commands' interpreter as recorded (the project's environment runs them)."""

    def __init__(self, *, steps: dict[str, int], corpus: Path, quick: bool, mqar_data: str | None = None,
                 mqar_batch: int | None = None):
        self.steps = steps
        self.corpus = corpus
        self.quick = quick
        self.mqar_data = mqar_data
        """``--mqar-data``: the MQAR runs' ``data.dataset`` instead of the recipe's (None: the recipe's)."""
        self.mqar_batch = mqar_batch
        """``--mqar-batch``: the MQAR runs' rows a step instead of the recipe's (None: the recipe's)."""

    def sizes(self, task: str, flavour: str) -> Sizes:
        if self.quick:
            return Sizes(QUICK["steps"], QUICK["warmup_steps"], QUICK[f"{task}_seq_len"], QUICK["batch"])
        recipe = self.recipe(task, flavour)
        steps = self.steps[task]
        # The recipe's warm-up, but at most a tenth of a run shortened to fit a piece.
        warmup = min(recipe["lr_scheduler"]["warmup_steps"], max(1, steps // 10))
        batch = recipe["training"]["local_batch_size"]
        if task == "mqar" and self.mqar_batch is not None:
            batch = self.mqar_batch
        return Sizes(steps, warmup, recipe["training"]["seq_len"], batch)

    @staticmethod
    def recipe(task: str, flavour: str) -> dict:
        """The task's recipe for ``flavour``, as parsed TOML."""
        return tomllib.loads((REPO / TASKS[task].config.format(flavour=flavour)).read_text(encoding="utf-8"))

    def corpus_file(self, split: str) -> Path:
        """``<corpus>/<split>.jsonl``, or the ``.jsonl.gz`` that ``build_small_corpus.py --gzip`` writes."""
        plain = self.corpus / f"{split}.jsonl"
        compressed = plain.with_name(plain.name + ".gz")
        return compressed if compressed.is_file() and not plain.is_file() else plain

    def stages(self, run: Run, folder: Path) -> list[Stage]:
        """The commands of ``run``, writing under ``folder`` (the run's part of the piece's temporary folder)."""
        sizes = self.sizes(run.task, run.flavour)
        lr = "BEST_LR" if run.lr is None else f"{run.lr:g}"
        train = [self.python, "-m", "hola_titan.train", "--job.config_file",
                 TASKS[run.task].config.format(flavour=run.flavour), "--job.dump_folder", str(folder / "train"),
                 "--optimizer.lr", lr, "--training.seed", str(run.seed), "--training.steps", str(sizes.steps),
                 "--lr_scheduler.warmup_steps", str(sizes.warmup_steps), "--checkpoint.interval", str(sizes.steps)]
        if run.task == "text":
            train += TEXT_PIN
        if self.quick:
            train += ["--training.device", "cpu", "--training.seq_len", str(sizes.seq_len),
                      "--training.local_batch_size", str(sizes.batch), "--training.mixed_precision_param", "float32",
                      "--metrics.log_freq", "1", "--validation.enable", "false", "--data.dataset",
                      "mqar:vocab=8192,pairs=4-8,power_a=0.01" if run.task == "mqar" else "bundled"]
        elif run.task == "text":
            train += ["--data.dataset", str(self.corpus_file("train")),
                      "--validation.dataset", str(self.corpus_file("validation"))]
        else:
            if self.mqar_data is not None:
                train += ["--data.dataset", self.mqar_data]
            if self.mqar_batch is not None:
                train += ["--training.local_batch_size", str(self.mqar_batch)]
        # The folder's name is the evaluations' label, so their files name the run.
        export = folder / run.name
        stages = [Stage("train", tuple(train)),
                  Stage("export", (self.python, "scripts/convert_to_safetensors.py",
                                   str(folder / "train" / "checkpoint" / f"step-{sizes.steps}"), str(export)))]
        evals = self._mqar_evals(run, sizes) if run.task == "mqar" else self._text_evals(sizes)
        for name, extra in evals:
            command = name.removesuffix("-cache-off")  # the eval adds the suffix to the label itself
            argv = [self.python, "-m", "hola_titan.eval", command, "--checkpoint", str(export),
                    "--out", str(folder / "eval"), "--no-progress"]
            if self.quick:
                argv += ["--device", "cpu", "--threads", "1"]
            label = run.name + name.removeprefix(command)
            stages.append(Stage(name, tuple(argv + extra), folder / "eval" / f"{command}_{label}.json"))
        return stages

    def _mqar_evals(self, run: Run, sizes: Sizes) -> list[tuple[str, list[str]]]:
        pairs = QUICK["mqar_pairs"] if self.quick else MQAR_PAIRS
        samples = QUICK["mqar_samples"] if self.quick else MQAR_SAMPLES
        lengths = ",".join(str(f * sizes.seq_len) for f in MQAR_LENGTH_FACTORS)
        # float32: as the MQAR recipes train and export (the eval's CUDA default is bfloat16).
        mqar = ["--pairs", ",".join(map(str, pairs)), "--seq-lens", lengths, "--samples", str(samples),
                "--dtype", "float32"]
        evals = [("mqar", mqar)]
        if HAS_CACHE[run.flavour]:
            evals.append(("mqar-cache-off", mqar + ["--cache", "off"]))
        if run.inspect_cache:
            cache_pairs = QUICK["cache_pairs"] if self.quick else CACHE_PAIRS
            evals.append(("cache", ["--pairs", str(cache_pairs), "--seq-len", str(sizes.seq_len),
                                    "--dtype", "float32"]))
        return evals

    def _text_evals(self, sizes: Sizes) -> list[tuple[str, list[str]]]:
        lengths = ",".join(str(f * sizes.seq_len) for f in NIAH_LENGTH_FACTORS)
        if self.quick:
            return [("ppl", ["--data", "bundled", "--max-documents", "2"]),
                    ("niah", ["--tasks", NIAH_TASKS, "--lengths", lengths, "--depths", "50", "--samples", "1"])]
        return [("ppl", ["--data", str(self.corpus_file("validation"))]),
                ("niah", ["--tasks", NIAH_TASKS, "--lengths", lengths, "--samples", "4"])]

    def estimate_s(self, run: Run) -> float:
        """Wall seconds of ``run`` with the piece's other runs beside it (the constants above)."""
        task = TASKS[run.task]
        evals = [s.name for s in self.stages(run, Path("<work>"))[2:]]
        sizes = self.sizes(run.task, run.flavour)
        rate = task.steps_per_s[run.flavour]
        if run.task == "mqar" and self.mqar_batch is not None and not self.quick:
            # The rates were measured at the recipe's rows a step with the GPU shared by the piece's runs: a larger
            # step is taken as proportionally slower (an upper bound), a smaller one as no faster (launch-bound).
            rate *= min(1.0, self.recipe("mqar", run.flavour)["training"]["local_batch_size"] / self.mqar_batch)
        return task.startup_s + sizes.steps / rate + EXPORT_S + sum(EVAL_S[name] for name in evals)


def balanced_chunks(items: list[Run], *, limit: int) -> list[list[Run]]:
    """``items`` in the fewest chunks of at most ``limit``, of sizes differing by at most one."""
    if not items:
        return []
    count = math.ceil(len(items) / limit)
    base, extra = divmod(len(items), count)
    chunks, start = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        chunks.append(items[start:start + size])
        start += size
    return chunks


def build_plan(*, flavours: list[str], seeds: list[int], mqar_lrs: list[float], text_seeds: list[int],
               text_lr: float, best_lr: dict[str, float] | None) -> list[Piece]:
    """The pieces, in order: the sweep, the text runs, then the seeds at the best lr (``None`` lrs without it)."""
    sweep = [Run("mqar", f, lr, seeds[0]) for f in flavours for lr in mqar_lrs]
    text = [Run("text", f, text_lr, s) for s in text_seeds for f in flavours]
    # Seed-major, so each piece holds every flavour; the second seed's runs show what the cache holds.
    more = [Run("mqar", f, None if best_lr is None else best_lr[f], s, inspect_cache=s == seeds[1] and HAS_CACHE[f])
            for s in seeds[1:] for f in flavours]
    pieces: list[Piece] = []
    for kind, runs in (("mqar-sweep", sweep), ("text", text), ("mqar-seeds", more)):
        for chunk in balanced_chunks(runs, limit=TASKS[runs[0].task].runs_per_piece if runs else 1):
            pieces.append(Piece(len(pieces), kind, tuple(chunk)))
    return pieces


def check_piece_sizes(pieces: list[Piece], commands: Commands) -> None:
    if commands.quick:
        return
    for piece in pieces:
        run = max(piece.runs, key=commands.estimate_s)
        minutes = commands.estimate_s(run) / 60
        if minutes > PIECE_LIMIT_MIN:
            option = TASKS[run.task].steps_option
            raise ReplicateError(f"{option} {commands.steps[run.task]}: piece {piece.index} would take about "
                                 f"{minutes:.1f} minutes, over the {PIECE_LIMIT_MIN:g}-minute limit of a piece; "
                                 "use fewer steps")


# ---------------------------------------------------------------------------------------------------------------
# Piece JSONs: reading, and the best lr of the sweep
# ---------------------------------------------------------------------------------------------------------------


def load_pieces(paths: list[Path], *, option: str) -> list[dict]:
    """Piece JSONs, each with ``path``; ``option`` names where they came from in errors."""
    pieces = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ReplicateError(f"{option} {path}: cannot be read ({error})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ReplicateError(f"{option} {path}: not a piece JSON of this script (format {FORMAT!r})")
        data["path"] = str(path)
        pieces.append(data)
    return pieces


def finished_runs(pieces: list[dict], *, option: str) -> list[dict]:
    """The finished runs of ``pieces`` (each with ``piece`` and ``path``); a run finished twice is an error, since
    it would count one seed twice; every run of a task must have the same sizes."""
    runs, seen, sizes = [], {}, {}
    for piece in pieces:
        for run in piece["runs"]:
            if run["status"] != "finished":
                continue
            name = run["name"]
            if name in seen:
                raise ReplicateError(f"{option}: run {name} finished in both {seen[name]} and {piece['path']}; "
                                     "leave one of them out")
            seen[name] = piece["path"]
            shape = (piece["quick"], run["steps"], run["warmup_steps"], run["seq_len"], run["batch"])
            first = sizes.setdefault(run["task"], (shape, piece["path"]))
            if first[0] != shape:
                raise ReplicateError(f"{option}: {run['task']} runs of {first[1]} and {piece['path']} differ in "
                                     f"(quick, steps, warmup, seq_len, batch): {first[0]} and {shape}")
            runs.append(dict(run, piece=piece["piece"], path=piece["path"], kind=piece["kind"]))
    return runs


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def sweep_scores(runs: list[dict]) -> dict[tuple[str, float], float]:
    """``(flavour, lr) -> mean MQAR accuracy (cache on) over every point`` of the sweep runs."""
    return {(r["flavour"], r["lr"]): mean(list(r["results"]["mqar"].values()))
            for r in runs if r["kind"] == "mqar-sweep" and "mqar" in r["results"]}


def best_lrs(scores: dict[tuple[str, float], float]) -> dict[str, float]:
    """Per flavour, the lr with the highest score (the smaller lr on a tie)."""
    best: dict[str, tuple[float, float]] = {}
    for (flavour, lr), score in sorted(scores.items()):
        if flavour not in best or score > best[flavour][1]:
            best[flavour] = (lr, score)
    return {flavour: lr for flavour, (lr, _) in best.items()}


def best_lr_from_sweep(paths: list[Path], *, flavours: list[str], mqar_lrs: list[float],
                       commands: Commands) -> dict[str, float]:
    """The best lr per flavour from the sweep results; every planned sweep run must have finished there, at the
    sizes this plan trains (a best lr from part of the sweep, or from other sizes, would mislead)."""
    pieces = load_pieces(paths, option="--sweep-results")
    for piece in pieces:
        if piece["quick"] != commands.quick:
            raise ReplicateError(f"--sweep-results {piece['path']}: written {'with' if piece['quick'] else 'without'} "
                                 "--quick, unlike this plan")
    runs = finished_runs(pieces, option="--sweep-results")
    scores = sweep_scores(runs)
    missing = [f"mqar_{f}_lr{lr:g}" for f in flavours for lr in mqar_lrs if (f, lr) not in scores]
    if missing:
        raise ReplicateError(f"--sweep-results: no finished sweep run {', '.join(missing)} in "
                             f"{', '.join(map(str, paths))}; run the sweep piece (again) and pass its JSON")
    sizes = commands.sizes("mqar", flavours[0])
    for run in runs:
        if run["kind"] == "mqar-sweep" and run["steps"] != sizes.steps:
            raise ReplicateError(f"--sweep-results {run['path']}: {run['name']} trained {run['steps']} steps, "
                                 f"this plan {sizes.steps} (--mqar-steps)")
    return {f: lr for f, lr in best_lrs(scores).items() if f in flavours}


# ---------------------------------------------------------------------------------------------------------------
# Running a piece
# ---------------------------------------------------------------------------------------------------------------


class Deadline:
    """When the piece stops its runs: the time budget, or at once after SIGTERM or Ctrl-C."""

    def __init__(self, at: float):
        self.at = at
        self.why = "time budget"

    def passed(self) -> bool:
        return time.time() >= self.at

    def now(self, signum: int, frame) -> None:
        self.at = 0.0
        self.why = signal.Signals(signum).name


def supervise(children: dict[str, subprocess.Popen], *, deadline: Deadline, poll_s: float = 0.5) -> dict[str, bool]:
    """Wait for the children (each in its own session); at the deadline kill the process group of each one still
    running. Returns ``{name: True if it was stopped}``."""
    stopped = {name: False for name in children}
    while any(child.poll() is None for child in children.values()):
        if deadline.passed():
            for name, child in children.items():
                if child.poll() is None:
                    # SIGKILL, not SIGTERM: the trainer would spend the time left saving a checkpoint nobody keeps.
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                    stopped[name] = True
            break
        time.sleep(poll_s)
    return stopped


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def training_summary(metrics: list[dict]) -> dict:
    """Final loss, final validation loss and the mean tokens/s after the first logged step (compilation)."""
    losses = [m for m in metrics if m.get("loss") is not None]
    vals = [m for m in metrics if m.get("val_loss") is not None]
    rates = [m["tokens_per_s"] for m in losses[1:] if m.get("tokens_per_s")]
    return {"final_step": losses[-1]["step"] if losses else None,
            "final_loss": losses[-1]["loss"] if losses else None,
            "final_val_loss": vals[-1]["val_loss"] if vals else None,
            "tokens_per_s": mean(rates) if rates else None}


def collect(run: Run, stages: list[Stage], *, folder: Path, stopped: bool, files: Path, commands: Commands) -> dict:
    """The JSON record of one run from its folder: stages ended, evaluation summaries, training metrics; its log
    and cache PNGs are copied into ``files``."""
    status_lines = read_jsonl(folder / "status.jsonl")
    ended = {row["name"]: row for row in status_lines if row["name"] != "environment"}
    environment = next((row for row in status_lines if row["name"] == "environment"), {})
    finished = all(s.name in ended and ended[s.name]["rc"] == 0 for s in stages)
    status = "finished" if finished else "stopped" if stopped else "failed"
    results, copied = {}, []
    files.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        if stage.result is not None and ended.get(stage.name, {}).get("rc") == 0:
            results[stage.name] = json.loads(stage.result.read_text(encoding="utf-8"))["summary"]
        if stage.name == "cache" and stage.name in results:
            for png in sorted(stage.result.parent.glob(f"cache_{run.name}*.png")):
                shutil.copyfile(png, files / png.name)
                copied.append(f"{files.name}/{png.name}")
    shutil.copyfile(folder / "log.txt", files / f"{run.name}.log")
    sizes = commands.sizes(run.task, run.flavour)
    record = {"name": run.name, "task": run.task, "flavour": run.flavour, "lr": run.lr, "seed": run.seed,
              "config": TASKS[run.task].config.format(flavour=run.flavour), "steps": sizes.steps,
              "warmup_steps": sizes.warmup_steps, "seq_len": sizes.seq_len, "batch": sizes.batch,
              "tokens": sizes.steps * sizes.seq_len * sizes.batch, "status": status,
              "stages": [dict(name=s.name, command=list(s.argv), rc=ended.get(s.name, {}).get("rc"),
                              seconds=ended.get(s.name, {}).get("seconds")) for s in stages],
              "train": training_summary(read_jsonl(folder / "train" / "metrics.jsonl")),
              "results": results, "files": copied, "log": f"{files.name}/{run.name}.log",
              "environment": environment}
    if status != "finished":  # the reason, without opening the log
        record["log_tail"] = (folder / "log.txt").read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
    return record


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in ("torch", "triton", "fla-core", "hola-titan"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
        found["git_commit"] = commit.stdout.strip() or None
        found["git_dirty"] = bool(dirty.stdout.strip()) if commit.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):  # a copy of the tree without git (a lent machine)
        found["git_commit"] = found["git_dirty"] = None
    return found


def run_piece(piece: Piece, *, commands: Commands, out: Path, budget_min: float, work_parent: Path | None,
              keep_work: bool, argv: list[str], extra: dict) -> int:
    """Start the piece's runs side by side, stop them at the deadline, write ``<out>/piece-K.json``."""
    start = time.time()
    deadline = Deadline(start + max(0.0, budget_min * 60 - STOP_MARGIN_S))
    previous = {sig: signal.signal(sig, deadline.now) for sig in (signal.SIGTERM, signal.SIGINT)}
    estimate_min = max(commands.estimate_s(r) for r in piece.runs) / 60
    print(f"piece {piece.index}: {PIECE_TITLES[piece.kind]}, {runs_count(piece)} side by side, about "
          f"{estimate_min:.1f} min (budget {budget_min:g} min)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"replicate_piece{piece.index}_", dir=work_parent))
    # The runs share the host's cores; each one's torch threads would otherwise take all of them.
    threads = max(1, (os.cpu_count() or 1) // len(piece.runs))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
    children, stages_of = {}, {}
    try:
        for run in piece.runs:
            folder = work / run.name
            folder.mkdir()
            stages_of[run.name] = stages = commands.stages(run, folder)
            (folder / "stages.json").write_text(json.dumps([{"name": s.name, "argv": list(s.argv)} for s in stages]),
                                                encoding="utf-8")
            with open(folder / "log.txt", "w", encoding="utf-8") as log:
                children[run.name] = subprocess.Popen(
                    [sys.executable, "scripts/run_in_one_process.py", str(folder / "stages.json"),
                     str(folder / "status.jsonl")], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
        stopped = supervise(children, deadline=deadline)
        files = out / f"piece-{piece.index}"
        records = [collect(run, stages_of[run.name], folder=work / run.name, stopped=stopped[run.name], files=files,
                           commands=commands) for run in piece.runs]
    finally:
        for child in children.values():  # an exception above must not leave runs behind on a shared GPU
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    device = next((r["environment"]["device"] for r in records if r["environment"].get("device")), None)
    data = {"format": FORMAT, "piece": piece.index, "kind": piece.kind, "title": PIECE_TITLES[piece.kind],
            "quick": commands.quick, "command": ["python", "scripts/replicate_small.py", *argv],
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)), "wall_s": time.time() - start,
            "time_budget_min": budget_min, "stopped_by": deadline.why if any(stopped.values()) else None,
            "estimate_min": estimate_min, "runs_side_by_side": len(piece.runs), "threads_per_run": threads,
            "device": device, "host": platform.node(), "versions": versions(),
            "work_folder": str(work) + ("" if keep_work else " (removed)"), **extra, "runs": records}
    path = out / f"piece-{piece.index}.json"
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)  # a reader never sees half a file
    counts = {s: sum(r["status"] == s for r in records) for s in ("finished", "stopped", "failed")}
    print(f"wrote {path}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + f" in {data['wall_s'] / 60:.1f} min", flush=True)
    for record in records:
        if record["status"] != "finished":
            print(f"{record['status']}: {record['name']} (log {out / record['log']})", flush=True)
    return 0 if counts["finished"] == len(records) else 1


# ---------------------------------------------------------------------------------------------------------------
# Merging piece JSONs into tables and plots
# ---------------------------------------------------------------------------------------------------------------


CHANCE_SCORE = 0.01
"""A sweep run whose mean MQAR accuracy stays under this learned nothing (chance is about 1 / vocabulary)."""
LEARNED_POINT = "pairs=8@256"
LEARNED_ACCURACY = 0.5


def spread(values: list[float], digits: int = 3) -> str:
    """``mean [min, max]`` over seeds (the value alone for one seed)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def _point(key: str) -> tuple[int, int]:
    """``"pairs=8@256"`` -> ``(256, 8)``."""
    pairs, length = key.removeprefix("pairs=").split("@")
    return int(length), int(pairs)


def group_runs(runs: list[dict], task: str) -> dict[tuple[str, float], list[dict]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for run in sorted(runs, key=lambda r: (FLAVOURS.index(r["flavour"]), r["lr"], r["seed"])):
        if run["task"] == task:
            groups.setdefault((run["flavour"], run["lr"]), []).append(run)
    return groups


def mqar_lines(runs: list[dict], best: dict[str, float]) -> list[str]:
    groups = group_runs(runs, "mqar")
    if not groups:
        return []
    scores = sweep_scores(runs)
    lines = ["## MQAR: learning-rate sweep", "", "Mean accuracy over every point, cache on, one seed per lr.", "",
             "| flavour | lr | mean accuracy | |", "|---|---|---|---|"]
    for (flavour, lr), score in sorted(scores.items(), key=lambda kv: (FLAVOURS.index(kv[0][0]), kv[0][1])):
        lines.append(f"| {flavour} | {lr:g} | {score:.3f} | {'best' if best.get(flavour) == lr else ''} |")
    chance = [f for f in best if scores.get((f, best[f]), 0.0) < CHANCE_SCORE]
    if chance:
        lines += ["", f"At chance at every rate of the sweep (best mean accuracy under {CHANCE_SCORE:g}): "
                  f"{', '.join(chance)}; the seeds of {'that flavour' if len(chance) == 1 else 'those flavours'} "
                  "train at a rate the sweep could not tell from the others."]
    learned = []
    for (flavour, lr), group in groups.items():
        if best.get(flavour) == lr:
            acc = [r["results"]["mqar"].get(LEARNED_POINT) for r in group if "mqar" in r["results"]]
            acc = [a for a in acc if a is not None]
            if acc:
                learned.append(f"{flavour} {sum(a > LEARNED_ACCURACY for a in acc)}/{len(acc)}")
    if learned:
        lines += ["", f"Seeds that learned MQAR (accuracy over {LEARNED_ACCURACY:g} at {LEARNED_POINT}, cache on), "
                  "at the best lr: " + ", ".join(learned) + "."]
    points = sorted({_point(k) for g in groups.values() for r in g for k in r["results"].get("mqar", {})})
    for seq_len in sorted({length for length, _ in points}):
        pairs = [p for length, p in points if length == seq_len]
        lines += ["", f"## MQAR accuracy at length {seq_len}", "",
                  "| flavour | lr | cache | seeds | " + " | ".join(f"{p} pairs" for p in pairs) + " |",
                  "|---|---|---|---|" + "---|" * len(pairs)]
        for (flavour, lr), group in groups.items():
            for result, cache in (("mqar", "on"), ("mqar-cache-off", "off")):
                rows = [r["results"][result] for r in group if result in r["results"]]
                if not rows:
                    continue
                cells = [spread([row[f"pairs={p}@{seq_len}"] for row in rows if f"pairs={p}@{seq_len}" in row])
                         for p in pairs]
                mark = " (best)" if best.get(flavour) == lr else ""
                lines.append(f"| {flavour} | {lr:g}{mark} | {cache} | {len(rows)} | " + " | ".join(cells) + " |")
    return lines + [""]


def text_lines(runs: list[dict]) -> list[str]:
    groups = group_runs(runs, "text")
    if not groups:
        return []
    columns = list(dict.fromkeys(k for g in groups.values() for r in g for k in r["results"].get("niah", {})))
    lines = ["## Text: validation perplexity and S-NIAH accuracy (task@length)", "",
             "| flavour | lr | seeds | val ppl | " + " | ".join(columns) + " |",
             "|---|---|---|---|" + "---|" * len(columns)]
    for (flavour, lr), group in groups.items():
        ppl = [r["results"]["ppl"]["perplexity"] for r in group if "ppl" in r["results"]]
        cells = [spread([r["results"]["niah"][c] for r in group if c in r["results"].get("niah", {})], 2)
                 for c in columns]
        lines.append(f"| {flavour} | {lr:g} | {len(group)} | {spread(ppl, 2)} | " + " | ".join(cells) + " |")
    return lines + [""]


def cache_lines(runs: list[dict]) -> list[str]:
    inspected = [r for r in runs if "cache" in r["results"]]
    if not inspected:
        return []
    lines = ["## What the cache holds", "", "Share of the selected cache slots holding keys, values, queries or "
             "answers of one MQAR row, against those kinds' share of the tokens (`eval cache`).", "",
             "| run | layer | share | base rate | plots |", "|---|---|---|---|---|"]
    for run in inspected:
        summary = run["results"]["cache"]
        plots = " ".join(f"[{Path(f).name}]({f})" for f in run["files"])
        for key in summary:
            if key.startswith("kv_share@"):
                layer = key.split("@", 1)[1]
                lines.append(f"| {run['name']} | {layer} | {summary[key]:.3f} | {summary['kv_base@' + layer]:.3f} | "
                             f"{plots} |")
                plots = ""
    return lines + [""]


def _ordering(label: str, values: dict[str, list[float]], higher_is_better: bool) -> str:
    """One table row: the pairs of flavours that every seed orders the same way (``hola_titan/seed_orderings.py``)."""
    return _seed_orderings().ordering_row(label, values, higher_is_better)


@functools.cache
def _seed_orderings():
    """``hola_titan/seed_orderings.py``, read by path once (importing ``hola_titan`` imports torch)."""
    spec = importlib.util.spec_from_file_location("_hola_titan_seed_orderings", REPO / "hola_titan/seed_orderings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ordering_lines(runs: list[dict], best: dict[str, float]) -> list[str]:
    """Which orderings of the flavours hold beyond the spread of the seeds, metric by metric (flavours with two
    or more seeds only; MQAR at each flavour's best lr with the cache on)."""
    rows = []
    mqar = {f: g for (f, lr), g in group_runs(runs, "mqar").items() if best.get(f) == lr and len(g) > 1}
    keys = sorted({k for g in mqar.values() for r in g for k in r["results"].get("mqar", {})}, key=_point)
    for key in keys:
        values = {f: [r["results"]["mqar"][key] for r in g if key in r["results"].get("mqar", {})]
                  for f, g in mqar.items()}
        length, pairs = _point(key)
        rows.append(_ordering(f"MQAR {pairs} pairs @ {length}", values, True))
    groups = {key: g for key, g in group_runs(runs, "text").items() if len(g) > 1}
    rates = {}
    for flavour, lr in groups:
        rates[flavour] = rates.get(flavour, 0) + 1
    # A flavour trained at several rates is compared at each, named with its rate.
    text = {(f if rates[f] == 1 else f"{f} lr {lr:g}"): g for (f, lr), g in groups.items()}
    if text:
        rows.append(_ordering("text: validation perplexity (lower is better)",
                              {f: [r["results"]["ppl"]["perplexity"] for r in g if "ppl" in r["results"]]
                               for f, g in text.items()}, False))
        columns = list(dict.fromkeys(k for g in text.values() for r in g for k in r["results"].get("niah", {})))
        for column in columns:
            rows.append(_ordering(f"text: {column}", {f: [r["results"]["niah"][column] for r in g
                                                          if column in r["results"].get("niah", {})]
                                                      for f, g in text.items()}, True))
    if not rows:
        return []
    orderings = _seed_orderings()
    return ["## Which orderings hold beyond the seed spread", "",
            f"{orderings.LEGEND} Better: higher accuracy, lower perplexity. Flavours with two or more seeds; MQAR "
            "at each flavour's best lr, cache on, its seed 0 being the sweep run that chose that lr.",
            "", *orderings.HEADER, *rows, ""]


def gpu_lines(pieces: list[dict]) -> list[str]:
    parts = [f"piece {p['piece']} {p['wall_s'] / 60:.1f} min" for p in pieces if p.get("wall_s") is not None]
    if not parts:
        return []
    return ["GPU time (each piece's wall time on its GPU; pieces run side by side in one command share it): "
            + ", ".join(parts) + ".", ""]


def command_lines(pieces: list[dict]) -> list[str]:
    """Each piece's command, and the commands of its first run (its other runs differ in the flavour's config,
    the lr and the seed, as their names say)."""
    lines = ["## Commands", "", "`<out>`: the piece's --out folder; `<work>`: its temporary folder.", ""]
    for piece in pieces:
        command = piece.get("command") or []
        command = list(command) if isinstance(command, list) else str(command).split()
        if "--out" in command[:-1]:
            command[command.index("--out") + 1] = "<out>"
        # The JSON marks a deleted temporary folder "<path> (removed)".
        work = (piece.get("work_folder") or "").split(" (")[0]

        def generic(words: list[str], work=work) -> str:
            text = " ".join(words)
            return text.replace(work, "<work>") if work else text
        first = piece["runs"][0]
        lines += [f"Piece {piece['piece']} ({piece.get('title', piece.get('kind', ''))}):", "", "```",
                  generic(command), f"# {first['name']}:"]
        lines += [generic(stage.get("command") or []) for stage in first.get("stages", [])] + ["```", ""]
    return lines


def runs_lines(pieces: list[dict]) -> list[str]:
    lines = ["## Runs", "", "Training wall time includes start-up; tokens/s is the trainer's mean after its first "
             "logged step, with the piece's other runs beside it.", "",
             "| run | piece | status | device | steps | train s | tokens/s | final loss | final val loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for piece in pieces:
        for run in piece["runs"]:
            train = run["train"]
            seconds = run["stages"][0]["seconds"]
            cells = [run["name"], str(piece["piece"]), run["status"], piece["device"] or "-", str(run["steps"]),
                     f"{seconds:.0f}" if seconds is not None else "-",
                     f"{train['tokens_per_s']:,.0f}" if train["tokens_per_s"] else "-",
                     f"{train['final_loss']:.4f}" if train["final_loss"] is not None else "-",
                     f"{train['final_val_loss']:.4f}" if train["final_val_loss"] is not None else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def plot(runs: list[dict], best: dict[str, float], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def errorbar(ax, xs, values, **style):
        centre = [mean(v) for v in values]
        low = [c - min(v) for c, v in zip(centre, values)]
        high = [max(v) - c for c, v in zip(centre, values)]
        ax.errorbar(xs, centre, yerr=[low, high], marker="o", capsize=3, **style)

    written = []
    mqar = group_runs(runs, "mqar")
    points = sorted({_point(k) for g in mqar.values() for r in g for k in r["results"].get("mqar", {})})
    lengths = sorted({length for length, _ in points})
    if lengths:
        fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4), squeeze=False)
        for ax, seq_len in zip(axes[0], lengths):
            pairs = [p for length, p in points if length == seq_len]
            for flavour, lr in best.items():
                for result, dash in (("mqar", "-"), ("mqar-cache-off", "--")):
                    rows = [r["results"][result] for r in mqar.get((flavour, lr), []) if result in r["results"]]
                    if rows:
                        suffix = ", cache off" if result != "mqar" else ""
                        errorbar(ax, pairs, [[row[f"pairs={p}@{seq_len}"] for row in rows] for p in pairs],
                                 linestyle=dash, color=f"C{FLAVOURS.index(flavour)}",
                                 label=f"{flavour} lr {lr:g}{suffix} ({len(rows)} seeds)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(pairs, [str(p) for p in pairs])
            ax.set(xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.03, 1.03),
                   title=f"MQAR at length {seq_len} (mean, min-max over seeds)")
            ax.legend(fontsize=7)
        written.append(_save(fig, out / "mqar.png"))
    text = group_runs(runs, "text")
    if text:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        labels, values = [], []
        for (flavour, lr), group in text.items():
            labels.append(f"{flavour}\nlr {lr:g}")
            values.append([r["results"]["ppl"]["perplexity"] for r in group if "ppl" in r["results"]] or [math.nan])
        errorbar(left, range(len(labels)), values, linestyle="none")
        left.set_xticks(range(len(labels)), labels)
        left.set(ylabel="validation perplexity", title="Perplexity (mean, min-max over seeds)")
        for (flavour, lr), group in text.items():
            rows = [r["results"]["niah"] for r in group if "niah" in r["results"]]
            for task in NIAH_TASKS.split(","):
                keys = [k for k in (rows[0] if rows else {}) if k.startswith(task + "@")]
                if keys:
                    errorbar(right, range(len(keys)), [[row[k] for row in rows] for k in keys],
                             color=f"C{FLAVOURS.index(flavour)}", linestyle="-" if task.endswith("1") else "--",
                             label=f"{flavour} {task}")
                    right.set_xticks(range(len(keys)), [k.split("@")[1] for k in keys])
        right.set(xlabel="prompt length", ylabel="exact match", ylim=(-0.03, 1.03), title="S-NIAH")
        right.legend(fontsize=7)
        written.append(_save(fig, out / "text.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    return path


def merge(paths: list[Path], out: Path) -> Path:
    """``<out>/RESULTS.md`` and plots from piece JSONs; their cache PNGs are copied beside it."""
    pieces = sorted(load_pieces(paths, option="--merge"), key=lambda p: (p["piece"], p["path"]))
    if len({p["quick"] for p in pieces}) > 1:
        raise ReplicateError("--merge: some files were written with --quick and some without")
    runs = finished_runs(pieces, option="--merge")
    best = best_lrs(sweep_scores(runs))
    out.mkdir(parents=True, exist_ok=True)
    for piece in pieces:
        for run in piece["runs"]:
            for name in run["files"]:
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(piece["path"]).parent / name, out / name)
    unfinished = [r["name"] for p in pieces for r in p["runs"] if r["status"] != "finished"]
    lines = ["# Small-scale replication: HOLA vs HOLA+recency vs GDN", "",
             f"Merged by `scripts/replicate_small.py --merge` from {len(pieces)} piece file(s): "
             + ", ".join(f"`{Path(p['path']).name}` (piece {p['piece']}, {p['device'] or 'device unknown'})"
                         for p in pieces) + f". {len(runs)} runs finished"
             + (f"; not finished (left out): {', '.join(unfinished)}." if unfinished else "."),
             "Cells: mean [min, max] over seeds; a single value where one seed ran.", ""]
    if pieces[0]["quick"]:
        lines += ["**--quick**: tiny runs on the CPU to test the machinery; the numbers mean nothing.", ""]
    lines += gpu_lines(pieces) + ordering_lines(runs, best)
    lines += mqar_lines(runs, best) + text_lines(runs) + cache_lines(runs) + runs_lines(pieces)
    lines += command_lines(pieces)
    written = plot(runs, best, out)
    lines += ["Plots: " + ", ".join(f"[{p.name}]({p.name})" for p in written), ""] if written else []
    path = out / "RESULTS.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def print_plan(pieces: list[Piece], commands: Commands, *, best_lr: dict[str, float] | None) -> None:
    if commands.quick:
        print("--quick: tiny runs on this machine's CPU; the minutes are H200 estimates and mean little here")
    total = 0.0
    for piece in pieces:
        minutes = max(commands.estimate_s(r) for r in piece.runs) / 60
        total += minutes
        needs = (" (needs the sweep results: pass --sweep-results with the JSON of piece "
                 f"{next(p.index for p in pieces if p.kind == 'mqar-sweep')})") if piece.runs[0].lr is None else ""
        print(f"piece {piece.index}: {PIECE_TITLES[piece.kind]}, {runs_count(piece)} side by side on one GPU, "
              f"about {minutes:.1f} min{needs}")
        for run in piece.runs:
            sizes = commands.sizes(run.task, run.flavour)
            evals = ", ".join(s.name for s in commands.stages(run, Path("<work>"))[2:])
            lr = "best" if run.lr is None else f"{run.lr:g}"
            print(f"  {run.name:28} lr {lr:6} seed {run.seed}  {sizes.steps} steps x {sizes.batch} x {sizes.seq_len}"
                  f" tokens  evals: {evals}")
        first = piece.runs[0]
        print(f"  commands of {first.name} (<work>: the piece's temporary folder):")
        for stage in commands.stages(first, Path("<work>") / first.name):
            print("    " + " ".join(stage.argv))
    if best_lr is not None:
        print("best lr from the sweep results: " + ", ".join(f"{f} {lr:g}" for f, lr in best_lr.items()))
    print(f"total: {len(pieces)} pieces, about {total:.0f} minutes of GPU time (at most {PIECE_LIMIT_MIN:g} a "
          "piece; throughput constants in scripts/replicate_small.py)")


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(v) for v in values]


def _flavours(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in FLAVOURS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(FLAVOURS)}, got {text!r}")
    return names


def check_mqar_data(dataset: str, *, flavours: list[str]) -> None:
    """``--mqar-data`` as the MQAR runs would take it: a valid MQAR source whose rows fit each recipe's length and
    vocabulary, with the vocabulary and query placement that the MQAR evaluation scores (the model's vocabulary,
    ``power_a`` 0.01), so that the runs are scored on the task they trained on."""
    from hola_titan.data.synthetic import parse_mqar  # imports torch: only with this option

    try:
        spec = parse_mqar(dataset)
        for flavour in flavours:
            recipe = Commands.recipe("mqar", flavour)
            base = parse_mqar(recipe["data"]["dataset"])
            spec.check(seq_len=recipe["training"]["seq_len"], model_vocab_size=base.vocab_size)
            if (spec.vocab_size, spec.power_a) != (base.vocab_size, base.power_a):
                raise ValueError(f"vocab {spec.vocab_size} and power_a {spec.power_a:g} must be the recipe's "
                                 f"({base.vocab_size}, {base.power_a:g}), which the MQAR evaluation scores")
    except ValueError as error:
        raise ReplicateError(f"--mqar-data: {error}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", action="store_true", help="list the pieces, their runs and estimated minutes")
    what.add_argument("--piece", type=int, metavar="K", help="run piece K (see --plan) and write <out>/piece-K.json")
    what.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="merge piece JSONs into <out>/RESULTS.md")
    parser.add_argument("--out", type=Path, default=None, help="folder of the piece JSONs, or of the merged report")
    parser.add_argument("--sweep-results", type=Path, nargs="+", default=None, metavar="JSON",
                        help="the sweep piece's JSON(s): the seed pieces train at each flavour's best lr from them")
    parser.add_argument("--quick", action="store_true", help="tiny steps and evaluations on the CPU (smoke test)")
    parser.add_argument("--flavours", type=_flavours, default=list(FLAVOURS), help="comma-separated flavours")
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2, 3, 4],
                        help="MQAR seeds: the first runs the lr sweep, the others the seed pieces")
    parser.add_argument("--mqar-lrs", type=_floats, default=[1e-3, 3e-3, 1e-2], help="MQAR lr sweep")
    parser.add_argument("--mqar-steps", type=int, default=MQAR_STEPS,
                        help="steps of an MQAR run (sized to fit a piece)")
    parser.add_argument("--mqar-data", default=None, metavar="DATASET",
                        help="the MQAR runs' data.dataset instead of the recipe's, e.g. "
                             "'mqar:vocab=8192,pairs=4:5/8:1/16:1/32:1/64:1,power_a=0.01' (Zoology's mix)")
    parser.add_argument("--mqar-batch", type=int, default=None, metavar="ROWS",
                        help="the MQAR runs' rows a step instead of the recipe's 64")
    parser.add_argument("--text-seeds", type=_ints, default=[0, 1], help="seeds of the text runs")
    parser.add_argument("--text-lr", type=float, default=3e-3, help="lr of the text runs (the recipes')")
    parser.add_argument("--text-steps", type=int, default=600, help="steps of a text run (sized to fit a piece)")
    parser.add_argument("--corpus", type=Path, default=Path("data/small_corpus"),
                        help="folder with train.jsonl[.gz] and validation.jsonl[.gz] (scripts/build_small_corpus.py)")
    parser.add_argument("--time-budget-min", type=float, default=DEFAULT_TIME_BUDGET_MIN,
                        help="stop the piece's runs and write its JSON before this many minutes")
    parser.add_argument("--work-dir", type=Path, default=None, help="parent of the piece's temporary folder")
    parser.add_argument("--keep-work", action="store_true", help="keep the temporary folder (checkpoints, exports)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = build_parser().parse_args(argv)
    try:
        if options.merge:
            if options.out is None:
                raise ReplicateError("--merge needs --out (the folder for RESULTS.md and the plots)")
            print(f"wrote {merge(options.merge, options.out)}")
            return 0
        for name in ("mqar_steps", "text_steps"):
            if getattr(options, name) < 1:
                raise ReplicateError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
        if options.mqar_batch is not None and options.mqar_batch < 1:
            raise ReplicateError(f"--mqar-batch must be >= 1, got {options.mqar_batch}")
        if options.quick and (options.mqar_data is not None or options.mqar_batch is not None):
            raise ReplicateError("--mqar-data and --mqar-batch are for full-size runs; --quick sets its own tiny task")
        if options.mqar_data is not None:
            check_mqar_data(options.mqar_data, flavours=options.flavours)
        commands = Commands(steps={"mqar": options.mqar_steps, "text": options.text_steps}, corpus=options.corpus,
                            quick=options.quick, mqar_data=options.mqar_data, mqar_batch=options.mqar_batch)
        best = None
        if options.sweep_results:
            best = best_lr_from_sweep(options.sweep_results, flavours=options.flavours, mqar_lrs=options.mqar_lrs,
                                      commands=commands)
        pieces = build_plan(flavours=options.flavours, seeds=options.seeds, mqar_lrs=options.mqar_lrs,
                            text_seeds=options.text_seeds, text_lr=options.text_lr, best_lr=best)
        check_piece_sizes(pieces, commands)
        if options.plan:
            print_plan(pieces, commands, best_lr=best)
            return 0
        if not 0 <= options.piece < len(pieces):
            raise ReplicateError(f"--piece {options.piece}: the plan has pieces 0-{len(pieces) - 1} (see --plan)")
        piece = pieces[options.piece]
        if piece.runs[0].lr is None:
            raise ReplicateError(f"--piece {piece.index} ({PIECE_TITLES[piece.kind]}) needs the sweep results: pass "
                                 "--sweep-results with the JSON of the sweep piece")
        if options.out is None:
            raise ReplicateError("--piece needs --out (the folder for piece-K.json)")
        if piece.kind == "text" and not commands.quick and not commands.corpus_file("train").is_file():
            raise ReplicateError(f"--corpus {options.corpus}: no train.jsonl or train.jsonl.gz; build it with "
                                 f"python scripts/build_small_corpus.py {options.corpus}")
        extra = {"best_lr": best, "sweep_results": [str(p) for p in options.sweep_results]} if best else {}
        return run_piece(piece, commands=commands, out=options.out, budget_min=options.time_budget_min,
                         work_parent=options.work_dir, keep_work=options.keep_work, argv=argv, extra=extra)
    except ReplicateError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
