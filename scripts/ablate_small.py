"""Ablations of the HOLA layer's open choices at small scale: many training runs side by side on one GPU, resumable
across commands, merged into loss-against-tokens plots (one PNG per family) and a table with the seed spread.

Why: HOLA loses to GDN at small scale with the choices this project first made where the paper is silent (the state
read's scale, the gate's init, the optimizer settings of the cache's parameters, ...). Each variant below changes
one of them through its config key; the runs share everything else, the recipe (``--recipe``): ``small``
(``train_configs/small_hola_text.toml``: the ``small`` width, 16 x 1,024 tokens a step, AdamW lr 3e-3, on the offline
corpus of ``build_small_corpus.py``) or ``46M`` (``train_configs/<flavour>_46M.toml``: the paper's ablation size,
16 x 4,096 tokens a step, on the 120M-token corpus of ``build_corpus.py``; with ``--variants
gdn,hola,hola_recency,transformer`` it is the comparison of the four flavours) or ``micro``
(``train_configs/micro_text.toml``: the debug width on the same corpus, 8 x 512 tokens a step, a CPU proxy that
gives a hypothesis its first test on two cores in under an hour).

Usage::

    python scripts/ablate_small.py --plan                                   # the variants, families, estimate
    python scripts/ablate_small.py --run --work W --out OUT --budget-min 8  # train (or resume) until the budget
    python scripts/ablate_small.py --merge OUT [OUT ...] --report DIR       # plots, table and JSON

``--run`` starts every selected run that has not reached ``--steps`` (``--variants``, ``--seeds``), each in its own
process with its run folder under ``--work``; a run resumes from its last checkpoint. Before the budget ends it
sends SIGTERM, on which the trainer saves a checkpoint and exits, so the next ``--run`` on the same machine (with the
same ``--work``) goes on where this one stopped. It copies every run's ``metrics.jsonl`` and the end of its log to
``--out`` with ``status.json`` (steps reached, device, versions, the commands), every minute while it runs and
once more at its end (``"final": true``), so a machine lost mid-run leaves a folder that merges. With ``--evaluate
ppl,niah`` each run that reaches ``--steps`` is exported and evaluated, in the order named, as soon as its training
ends (perplexity on the corpus's validation and held-out splits, S-NIAH-1/2 at 1-4x the training length), results under
``--out/eval_*``; the merge tables the perplexities against GDN's of the same seed. ``--merge`` reads any number of
such folders (a resumed run logs the steps after its checkpoint again: the last attempt's record of a step
wins).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORMAT = "ablate_small/1"
LOG_FREQ = 5


@dataclass(frozen=True)
class Recipe:
    """The shared training setup of one screen; ``config`` takes the variant's flavour."""
    config: str
    seq_len: int  # the config's training.seq_len
    tokens_per_step: int  # the config's local_batch_size x seq_len
    steps: int
    warmup: int
    checkpoint_interval: int
    validation_freq: int
    corpus: str
    corpus_layout: str  # "gzip_pair": build_small_corpus.py --gzip; "split_folders": build_corpus.py
    about: str
    tokens_per_s: float
    """The tokens a second ``machine`` trains of this recipe in all, whether one run or several side by side (the
    runs share it): what ``--plan`` estimates with."""
    machine: str = "one GPU"
    base: tuple[str, ...] = ()
    """Trainer overrides every run of the recipe gets before its variant's keys (which win over them)."""


RECIPES = {
    "small": Recipe("train_configs/small_hola_text.toml", 1024, 16 * 1024, 1500, 150, 500, 500, "data/small_corpus_gz",
                    "gzip_pair", "`small` width (31M), 16 x 1,024 tokens a step, block 64, AdamW lr 3e-3 to 0.1x, "
                    "weight decay 0.1",
                    # 16 runs side by side on an H200, 2026-12-05: GDN 555 steps and HOLA 500 in 7.1 minutes.
                    16 * 530 * 16 * 1024 / (7.1 * 60),
                    # Every screen of this recipe since 2026-12-05 ran at block 64, the configs' value then; the
                    # configs now hold the paper's 256, which measured better (docs/LOG.md, 2026-12-08). Pinned here
                    # so that a variant keeps meaning what it meant and new runs pair with the old (hola_c256 is the
                    # configs' setting).
                    base=("--model.block", "64")),
    # The paper's ablation size: the four train_configs/<flavour>_46M.toml differ only in the flavour.
    "46M": Recipe("train_configs/{flavour}_46M.toml", 4096, 16 * 4096, 1600, 100, 200, 200, "data/corpus_100m",
                  "split_folders", "46M (12 layers, d_model 512, heads of 256), 16 x 4,096 tokens a step, AdamW lr "
                  "1e-3 to 0.1x, weight decay 0.01, on build_corpus.py's 120M-token corpus",
                  # One H100, 2026-12-06: GDN and HOLA side by side 161k + 144k tokens/s, HOLA alone 330k; three runs
                  # (with one norm per path) 107k + 99k + 78k.
                  300_000.0),
    # The CPU proxy: the debug width at the small recipe's block and window, so a hypothesis gets a first test in
    # minutes while no GPU is lent (train_configs/micro_text.toml).
    "micro": Recipe("train_configs/micro_text.toml", 512, 8 * 512, 1000, 100, 250, 250, "data/corpus_100m",
                    "split_folders", "the debug width (1.6M parameters, d_model 128, 2 layers, 2 heads of 64), 8 x 512 "
                    "tokens a step, block 64, window 64, AdamW lr 3e-3 to 0.1x, weight decay 0.01, on "
                    "build_corpus.py's 120M-token corpus",
                    # Two CPU cores, 2026-12-07: GDN and HOLA side by side, 1,000 steps each in 22 minutes.
                    2 * 1000 * 8 * 512 / (22 * 60), "2 CPU cores"),
}
STOP_GRACE_S = 90.0  # what a stopped run gets to save its checkpoint before it is killed
STATUS_EVERY_S = 60.0  # how often --run rewrites --out while it runs (what a lost machine leaves behind)


@dataclass(frozen=True)
class Variant:
    flavour: str
    families: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    about: str = ""


VARIANTS = {
    "gdn": Variant("gdn", ("state_read", "mixing", "eviction", "span", "cache_scalars", "flavours", "gate", "sink",
                           "span_defaults", "mixing_lr", "span_256"),
                   (),
                   "Gated DeltaNet, no cache"),
    "hola": Variant("hola", ("state_read", "mixing", "flavours", "gate", "sink", "span_defaults", "mixing_lr",
                             "span_256"), (),
                    "the first defaults: s = D^-1/2, gate init -4, cache params decayed"),
    "hola_s1": Variant("hola", ("state_read", "eviction", "span", "cache_scalars"),
                       ("--model.state_read_scale", "one"), "the state read as the paper writes it: q^T S (s = 1)"),
    "hola_after_norm": Variant("hola", ("mixing",), ("--model.cache_mix", "after_norm"),
                               "s = D^-1/2, the cache read added after the output norm: o_norm(o_state) + l o_cache"),
    "hola_per_path": Variant("hola", ("mixing", "mixing_lr"), ("--model.cache_mix", "per_path_norm"),
                             "s = D^-1/2, one norm per path: o_norm(o_state) + l o_norm(o_cache)"),
    "hola_recency_s1": Variant("hola_recency", ("eviction",), ("--model.state_read_scale", "one"),
                               "HOLA+recency with s = 1"),
    "hola_s1_nodecay": Variant("hola", ("cache_scalars",), ("--model.state_read_scale", "one",
                                                           "--optimizer.decay_cache_scalars", "false"),
                               "s = 1, no weight decay on gamma_q, gamma_k, sink, gate"),
    "hola_s1_w0": Variant("hola", ("span",), ("--model.state_read_scale", "one", "--model.window", "0"),
                          "s = 1, window 0: the causal block and the sink only (no cache entries)"),
    "hola_s1_c256": Variant("hola", ("span",), ("--model.state_read_scale", "one", "--model.block", "256"),
                            "s = 1, block 256 (the paper's C) instead of 64"),
    "hola_gate_m2": Variant("hola", ("gate",), ("--model.gate_init", "-2"),
                            "gate init -2 (lambda 0.12 at init against 0.018): the cache read weighted more from the "
                            "start"),
    "hola_gate_m6": Variant("hola", ("gate",), ("--model.gate_init", "-6"),
                            "gate init -6 (lambda 0.0025): nearer GDN at init"),
    "hola_cache_lr10": Variant("hola", ("gate",), ("--optimizer.cache_lr_multiplier", "10"),
                               "the cache's own scalars (gamma_q, gamma_k, sink, gate) at 10x the learning rate, so "
                               "the gate can move more than about one logit in a run"),
    "hola_nosink": Variant("hola", ("sink",), ("--model.cache_sink", "false"),
                           "no null sink: the read is a softmax over the cache entries and the block's tokens alone"),
    # The span and the cache scalars' decay again, now against the defaults (s = D^-1/2) rather than s = 1, which
    # the first screen measured and set aside (docs/LOG.md, 2026-12-05).
    "hola_w0": Variant("hola", ("span_defaults",), ("--model.window", "0"),
                       "window 0: the causal block and the sink only (no cache entries from earlier blocks)"),
    "hola_c256": Variant("hola", ("span_defaults", "span_256"), ("--model.block", "256"),
                         "block 256 (the paper's C) against the small recipe's 64 (the 46M recipe's block is "
                         "256 already: there it is the defaults)"),
    "hola_nodecay": Variant("hola", ("span_defaults",), ("--optimizer.decay_cache_scalars", "false"),
                            "no weight decay on gamma_q, gamma_k, sink, gate"),
    "hola_recency": Variant("hola_recency", ("flavours", "span_defaults"), (),
                            "HOLA+recency with the defaults"),
    "transformer": Variant("transformer", ("flavours",), (), "Transformer++ (softmax attention, no recurrence)"),
    # After the evening screen of 2026-12-07 (docs/LOG.md): window 0 beats the defaults, and with persistent entries
    # the recurrent state learns less. Two ways to keep the entries without that: start near GDN and let the cache
    # earn its weight (one norm per path stayed GDN at the base rate, its gate moving about one logit a run), and the
    # in-block attention at the 46M recipe's block 256, with and without persistent entries.
    "hola_per_path_lr10": Variant("hola", ("mixing_lr",), ("--model.cache_mix", "per_path_norm",
                                                          "--optimizer.cache_lr_multiplier", "10"),
                                  "one norm per path (near GDN at init), the cache's own scalars at 10x the learning "
                                  "rate so the gate can grow"),
    "hola_c256_w0": Variant("hola", ("span_256",), ("--model.block", "256", "--model.window", "0"),
                            "block 256, window 0: the 46M recipe's in-block span, no persistent entries"),
    # After the small screen of 2026-12-08: at block 256 the persistent entries pay (HOLA below window 0 in both
    # seeds), so the paper's ordering HOLA < HOLA+recency < GDN is asked at the paper's block too.
    "hola_recency_c256": Variant("hola_recency", ("span_256",), ("--model.block", "256"),
                                 "HOLA+recency at block 256: the last 64 tokens before each block as its entries"),
}
DEFAULT_SEEDS = (0, 1)
# The first screen (16 runs fit one GPU side by side); the others are run by name with --variants.
FIRST_SCREEN = ("gdn", "hola", "hola_s1", "hola_after_norm", "hola_per_path", "hola_recency_s1", "hola_s1_w0",
                "hola_s1_c256")
# The second screen (2 seeds each: 14 runs, what one lease of one GPU trains to 1,500 steps): the gate, the sink,
# the span and the cache scalars' decay against the defaults that the first screen and the 46M runs kept. Block 256
# is the 46M recipe's own, and HOLA+recency has its 46M runs, so neither takes a place here.
SECOND_SCREEN = ("gdn", "hola", "hola_gate_m2", "hola_cache_lr10", "hola_nosink", "hola_w0", "hola_nodecay")
# The third (12 runs): what the second left unrun (no sink), block 256 with and without persistent entries, and one
# norm per path with a gate free to grow; GDN and HOLA again (their runs repeat bit for bit, so this costs pairing
# nothing and checks it).
THIRD_SCREEN = ("gdn", "hola", "hola_nosink", "hola_c256", "hola_c256_w0", "hola_per_path_lr10")
SCREENS = {"first_screen": FIRST_SCREEN, "second_screen": SECOND_SCREEN, "third_screen": THIRD_SCREEN}
FAMILY_TITLES = {
    "state_read": "The state read's scale (before the output norm it sets the state's weight against the cache)",
    "mixing": "Where the cache read joins the state read: before the output norm, after it, one norm per path",
    "eviction": "Eviction: score (HOLA) against recency, with the paper's state read",
    "span": "What the cache read spans: window 0 (in-block only), block 64 against 256",
    "cache_scalars": "Weight decay on the cache's own parameters",
    "flavours": "The four flavours of one recipe",
    "gate": "The gate: its init, and the learning rate of the cache's own scalars",
    "sink": "The null sink: with it (the paper's) and without",
    "span_defaults": "With the defaults: window 0 (no entries from earlier blocks), block 256, no decay of the cache's "
                     "scalars, recency eviction",
    "mixing_lr": "One norm per path (near GDN at init) at the base and at 10x the cache scalars' learning rate",
    "span_256": "Block 256 (the 46M recipe's and the paper's C) with and without persistent entries, score and "
                "recency",
}


def run_name(variant: str, seed: int) -> str:
    return f"{variant}_s{seed}"


def corpus_files(recipe: Recipe, corpus: Path) -> tuple[Path, Path]:
    """The training and validation datasets of ``corpus`` in the recipe's layout. A corpus of split folders is
    named by its root: the trainer reads its ``train`` and ``validation`` folders by split, and nothing is held out
    of the training documents (naming ``corpus/train`` itself would hold every 100th document out, unused)."""
    if recipe.corpus_layout == "gzip_pair":
        return corpus / "train.jsonl.gz", corpus / "validation.jsonl.gz"
    return corpus, corpus


# ppl: the validation split and the held-out sources; ppl_heldout: the held-out sources alone (the number that
# decides, for a lease too short for the validation split's thousands of documents); ppl_cache_off: the held-out
# sources (the validation split where a corpus has none) scored again with every cache gate at zero, HOLA flavours
# only (the cache-off ablation: what the state path predicts alone); ppl_window: the same split as ppl_cache_off
# scored in windows of the training length (lm-eval's rolling windows, the context of the papers' "Wiki. ppl": no
# target sees more than training showed; the default gives every target its whole document, which can be 100x the
# training length); cache_ages: how old the entries a HOLA flavour's cache holds are over the longest documents of
# that split, and where its read's softmax mass goes (entries of earlier blocks, in-block tokens, sink: window 0 has
# only the latter) (``hola_titan.eval cache --data``, up to 16x the training length); niah: S-NIAH-1/2.
EVALS = ("ppl", "ppl_heldout", "ppl_cache_off", "ppl_window", "cache_ages", "niah")
CACHE_AGE_LENGTH_FACTOR = 16
"""``cache_ages`` reads up to this many training lengths of each of the 4 longest documents."""
CACHE_OFF = "_cache_off"
"""The suffix of the split name under which the merge keeps the cache-off scores (``eval_heldout_cache_off``)."""
WINDOW = "_window"
"""The suffix of the split name under which the merge keeps the scores in windows of the training length."""
CACHE_OFF_LABEL = "-cache-off"
"""What ``hola_titan.eval`` appends to a result's label (and file name) with ``--cache off``."""
EVAL_CHUNK = 16384
"""``hola_titan.eval ppl --chunk``: short documents packed into rows of up to this many tokens, longer ones read
through the decoding cache in calls of this many. Every target still sees its whole document (the result is the
same function as at any chunk); 8x fewer calls than the default 2,048, which on the 46M runs of 2026-12-05 let the
validation split (6,793 documents) run past its time limit."""
NIAH_TASKS = "s_niah_1,s_niah_2"
NIAH_LENGTH_FACTORS = (1, 2, 4)  # x training.seq_len


def eval_splits(recipe: Recipe, corpus: Path) -> dict[str, Path]:
    """The corpus's held-out texts that ``--evaluate ppl`` scores: the validation split, and the held-out sources
    (whole sources never trained on, the Wikitext-like split of build_corpus.py) where the corpus has them."""
    if recipe.corpus_layout == "gzip_pair":
        return {"validation": corpus / "validation.jsonl.gz"}
    # The held-out sources first: the number that decides (the paper's gain is on Wikitext-like text), and the
    # quicker of the two (288 long documents against 6,793 short ones).
    return {split: corpus / split for split in ("heldout", "validation") if (corpus / split).exists()}


def single_split(recipe: Recipe, corpus: Path) -> tuple[str, Path]:
    """The split that the evaluations of one split (cache off, windows, cache ages) score: the held-out sources,
    else the validation split."""
    splits = eval_splits(recipe, corpus)
    split = "heldout" if "heldout" in splits else "validation"
    return split, splits[split]


def eval_commands(name: str, *, recipe: Recipe, folder: Path, corpus: Path, out: Path, steps: int,
                  seq_len: int, evals: list[str], has_cache: bool = True) -> list[tuple[list[str], Path]]:
    """What ``--evaluate`` still has to run for a finished run: ``(command, file it writes)``, the export first and
    then the evaluations in the order ``evals`` names them (a budget that ends early cuts the last named, so name
    first what matters most), those whose file exists left out (a later ``--run`` picks up what a budget cut
    short). The export folder is named after the run, which the evaluations take as their label. ``has_cache``:
    the run's flavour reads a cache (the cache-off ablation and ``cache_ages`` apply to it)."""
    export = folder / name
    evaluate = [sys.executable, "-m", "hola_titan.eval"]
    by_eval: dict[str, list[tuple[list[str], Path]]] = {}
    if "ppl" in evals or "ppl_heldout" in evals:
        splits = eval_splits(recipe, corpus)
        if "ppl" not in evals:
            splits = {split: data for split, data in splits.items() if split == "heldout"}  # run() checked it
        by_eval["ppl"] = [
            ([*evaluate, "ppl", "--checkpoint", str(export), "--data", str(data), "--out", str(out / f"eval_{split}"),
              "--no-progress", "--chunk", str(EVAL_CHUNK)], out / f"eval_{split}" / f"ppl_{name}.json")
            for split, data in splits.items()]
    if "ppl_cache_off" in evals and has_cache:
        split, data = single_split(recipe, corpus)
        folder_off = out / f"eval_{split}{CACHE_OFF}"
        by_eval["ppl_cache_off"] = [([*evaluate, "ppl", "--checkpoint", str(export), "--data", str(data), "--out",
                                      str(folder_off), "--no-progress", "--chunk", str(EVAL_CHUNK), "--cache", "off"],
                                     folder_off / f"ppl_{name}{CACHE_OFF_LABEL}.json")]
    if "ppl_window" in evals:
        split, data = single_split(recipe, corpus)
        folder_win = out / f"eval_{split}{WINDOW}"
        by_eval["ppl_window"] = [([*evaluate, "ppl", "--checkpoint", str(export), "--data", str(data), "--out",
                                   str(folder_win), "--no-progress", "--chunk", str(EVAL_CHUNK), "--window",
                                   str(seq_len)], folder_win / f"ppl_{name}.json")]
    if "cache_ages" in evals and has_cache:
        split, data = single_split(recipe, corpus)
        by_eval["cache_ages"] = [([*evaluate, "cache", "--checkpoint", str(export), "--data", str(data), "--out",
                                   str(out / "eval_cache"), "--no-progress", "--max-documents", "4", "--max-tokens",
                                   str(CACHE_AGE_LENGTH_FACTOR * seq_len)], out / "eval_cache" / f"cache_{name}.json")]
    if "niah" in evals:
        lengths = ",".join(str(f * seq_len) for f in NIAH_LENGTH_FACTORS)
        by_eval["niah"] = [([*evaluate, "niah", "--checkpoint", str(export), "--out", str(out / "eval_niah"),
                             "--no-progress", "--tasks", NIAH_TASKS, "--lengths", lengths, "--samples", "4"],
                            out / "eval_niah" / f"niah_{name}.json")]
    todo = [([sys.executable, "scripts/convert_to_safetensors.py", str(folder / "checkpoint" / f"step-{steps}"),
              str(export)], export / "model.safetensors")]
    # ppl and ppl_heldout are one block (the held-out split alone when ppl is not named), at the first one named.
    order = dict.fromkeys("ppl" if e in ("ppl", "ppl_heldout") else e for e in evals)
    todo += [item for e in order for item in by_eval.get(e, [])]
    return [(command, target) for command, target in todo if not target.exists()]


def corpus_needs(recipe: Recipe, corpus: Path) -> tuple[Path, ...]:
    """What ``--run`` checks before it starts anything."""
    if recipe.corpus_layout == "gzip_pair":
        return corpus_files(recipe, corpus)
    return corpus / "train", corpus / "validation"


def corpus_identity(recipe: Recipe, corpus: Path) -> dict:
    """Which build of the corpus the runs read: the sha256 of each file of its splits, and a short id over them.
    Runs of one seed read the same batches only on the same build: ``build_corpus.py`` follows the Debian packages
    of the day, and a point release that changes 1% of the documents reorders every batch."""
    roots = [*dict.fromkeys(corpus_needs(recipe, corpus)),
             *([corpus / "heldout"] if (corpus / "heldout").is_dir() else [])]
    files = {}
    for root in roots:
        for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
            # The splits' data only: not PROVENANCE.md (it records the build's timings) nor a dot folder (a
            # download cache), which would give two byte-identical builds two ids.
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts):
                files[os.path.relpath(f, corpus)] = _by_path("manifests").digest_file(f, "sha256")
    return {"id": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12], "files": files}


def train_command(variant: str, seed: int, *, recipe: Recipe, folder: Path, corpus: Path, steps: int, warmup: int,
                  extra: list[str]) -> list[str]:
    v = VARIANTS[variant]
    train, validation = corpus_files(recipe, corpus)
    return [sys.executable, "-m", "hola_titan.train", "--job.config_file", recipe.config.format(flavour=v.flavour),
            "--job.dump_folder", str(folder), "--model.flavour", v.flavour, "--training.seed", str(seed),
            "--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup),
            "--checkpoint.interval", str(recipe.checkpoint_interval), "--checkpoint.keep_latest_k", "2",
            "--metrics.log_freq", str(LOG_FREQ), "--validation.freq", str(recipe.validation_freq),
            "--data.dataset", str(train), "--validation.dataset", str(validation), *recipe.base, *v.overrides,
            *extra]


def pinned_device(recipe: Recipe, variant: str, extra: list[str]) -> str:
    """``training.device`` as :func:`train_command` gives it to the runs: ``extra``'s, else the recipe's config's
    (the configs of one recipe differ only in the flavour)."""
    for i, arg in enumerate(extra):
        if arg == "--training.device" and i + 1 < len(extra):
            return extra[i + 1]
        if arg.startswith("--training.device="):
            return arg.split("=", 1)[1]
    with open(REPO / recipe.config.format(flavour=VARIANTS[variant].flavour), "rb") as f:
        return tomllib.load(f).get("training", {}).get("device", "auto")


def read_jsonl(path: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` (or its copy) as its history: a resumed run logs the steps after its checkpoint
    again, and the last attempt's record of each step is kept (hola_titan/metrics_records.py); none when absent."""
    if not path.is_file():
        return []
    return _metrics_records().read_metrics(path)


@functools.cache
def _by_path(module: str):
    """``hola_titan.<module>`` (dotted below the package), read by path (once): importing ``hola_titan`` imports
    torch, seconds that --plan and --merge do not need. Only for the package's standard-library modules."""
    spec = importlib.util.spec_from_file_location(f"_hola_titan_{module.replace('.', '_')}",
                                                  REPO / "hola_titan" / f"{module.replace('.', '/')}.py")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # where dataclasses (manifests.py's) look their module up while it executes
    spec.loader.exec_module(loaded)
    return loaded


def _metrics_records():
    return _by_path("metrics_records")


def _seed_orderings():
    return _by_path("seed_orderings")


def last_step(rows: list[dict]) -> int:
    return max((r["step"] for r in rows if "loss" in r), default=0)


# ---------------------------------------------------------------------------------------------------------------
# --run
# ---------------------------------------------------------------------------------------------------------------

def run(args) -> int:
    recipe = RECIPES[args.recipe]
    work, out, corpus = Path(args.work).resolve(), Path(args.out).resolve(), Path(args.corpus).resolve()
    builder = ("scripts/build_small_corpus.py DIR --gzip" if recipe.corpus_layout == "gzip_pair"
               else "scripts/build_corpus.py DIR")
    for path in corpus_needs(recipe, corpus):
        if not path.exists():
            print(f"error: --corpus {corpus}: no {path.name} for --recipe {args.recipe} (python {builder})",
                  file=sys.stderr)
            return 2
    if "ppl_heldout" in args.evaluate and "ppl" not in args.evaluate:
        if "heldout" not in eval_splits(recipe, corpus):
            hint = ("the small recipe's corpus has none: use --evaluate ppl" if recipe.corpus_layout == "gzip_pair"
                    else f"python {builder} writes one")
            print(f"error: --evaluate ppl_heldout: --corpus {corpus} has no held-out split ({hint})", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_min * 60.0 - STOP_GRACE_S
    runs = [(v, s) for v in args.variants for s in args.seeds]
    flavours = _by_path("models.flavours")  # the registry says which flavours read a cache
    has_cache = {run_name(v, s): flavours.get(VARIANTS[v].flavour).evict not in (None, "none") for v, s in runs}
    # Before any trainer starts: a status written mid-run needs them, and an error here loses no training.
    staging = _by_path("staging")  # the atomic writes of the status (standard library only)
    device = _device(pinned_device(recipe, args.variants[0], args.extra))
    versions, corpus_id = _versions(), corpus_identity(recipe, corpus)
    children: dict[str, subprocess.Popen] = {}
    commands, started = {}, time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for variant, seed in runs:
        name = run_name(variant, seed)
        folder = work / name
        if last_step(read_jsonl(folder / "metrics.jsonl")) >= args.steps:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        commands[name] = train_command(variant, seed, recipe=recipe, folder=folder, corpus=corpus, steps=args.steps,
                                       warmup=args.warmup, extra=args.extra)
        log = open(folder / "train.log", "a", encoding="utf-8")
        children[name] = subprocess.Popen(commands[name], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
    print(f"{len(children)} run(s) started, {len(runs) - len(children)} already finished", flush=True)
    # --evaluate: each finished run's export and evaluations, one command at a time per run, started as soon as
    # its training ends (beside the runs still training) and cut at the end of the budget.
    end_of_budget = time.monotonic() + args.budget_min * 60.0 - 5.0
    pending: dict[str, list[tuple[list[str], Path]]] = {}
    evaluating: dict[str, subprocess.Popen] = {}
    eval_log: dict[str, list[dict]] = {}

    def queue_evaluations(name: str) -> None:
        if args.evaluate and name not in pending and \
                last_step(read_jsonl(work / name / "metrics.jsonl")) >= args.steps:
            pending[name] = eval_commands(name, recipe=recipe, folder=work / name, corpus=corpus, out=out,
                                          steps=args.steps, seq_len=recipe.seq_len,
                                          evals=args.evaluate, has_cache=has_cache[name])

    def step_evaluations() -> None:
        for name, todo in pending.items():
            p = evaluating.get(name)
            if p is not None and p.poll() is None:
                continue
            if p is not None:
                eval_log[name][-1]["rc"] = p.returncode
                del evaluating[name]
                if p.returncode != 0:
                    todo.clear()  # the next command needs this one's output; the log says which failed
                    continue
            if todo and time.monotonic() < end_of_budget - 30:
                command, _ = todo.pop(0)
                log = open(work / name / "eval.log", "a", encoding="utf-8")
                evaluating[name] = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)
                eval_log.setdefault(name, []).append({"command": command[1:4], "rc": None})

    def write_status(final: bool) -> dict:
        """``--out``: every run's metrics, the end of its log and ``status.json``. Written at the end and every
        STATUS_EVERY_S before it, so a machine lost mid-run (a lease taken back) leaves a folder that merges as it
        is; ``final`` says whether the driver ended (``rc`` is None for a child still running)."""
        status = {"format": FORMAT, "started": started, "wall_s": time.time() - started, "final": final,
                  "base": list(recipe.base),
                  "budget_min": args.budget_min, "steps": args.steps, "warmup_steps": args.warmup,
                  "tokens_per_step": recipe.tokens_per_step, "recipe": args.recipe, "config": recipe.config,
                  "device": device, "host": platform.node(), "versions": versions,
                  "corpus": corpus_id, "runs": {}}
        for variant, seed in runs:
            name = run_name(variant, seed)
            folder = work / name
            rows = read_jsonl(folder / "metrics.jsonl")
            # Each file renamed into place: a snapshot of the machine never finds half a copy.
            if (folder / "metrics.jsonl").is_file():
                staging.write_bytes_atomic(out / f"{name}.jsonl", (folder / "metrics.jsonl").read_bytes())
            log = folder / "train.log"
            if log.is_file():
                staging.write_text_atomic(out / f"{name}.log",
                                          "\n".join(log.read_text(errors="replace").splitlines()[-40:]) + "\n")
            p = children.get(name)
            status["runs"][name] = {"variant": variant, "seed": seed, "flavour": VARIANTS[variant].flavour,
                                    "overrides": list(VARIANTS[variant].overrides), "step": last_step(rows),
                                    "finished": last_step(rows) >= args.steps,
                                    "rc": None if p is None else p.poll(), "stopped": name in stopped,
                                    "evaluations": eval_log.get(name, []),
                                    "command": [str(c).replace(str(work), "<work>").replace(str(REPO), "<repo>")
                                                for c in commands.get(name, [])]}
        staging.write_text_atomic(out / "status.json", json.dumps(status, indent=1) + "\n")
        return status

    stopped: set[str] = set()
    next_status = 0.0

    def snapshot() -> None:
        """A mid-run status, at most every STATUS_EVERY_S. One that cannot be written (a full disk) is reported and
        skipped: the driver must go on to stop the trainers in time and evaluate them."""
        nonlocal next_status
        if time.monotonic() < next_status:
            return
        next_status = time.monotonic() + STATUS_EVERY_S
        try:
            write_status(final=False)
        except OSError as err:
            print(f"warning: the status snapshot in {out} was not written ({err}); the runs go on", flush=True)
    for variant, seed in runs:
        if run_name(variant, seed) not in children:
            queue_evaluations(run_name(variant, seed))
    while True:
        snapshot()
        for name, p in children.items():
            if p.poll() == 0:
                queue_evaluations(name)
        step_evaluations()
        training = any(p.poll() is None for p in children.values())
        if training and time.monotonic() >= deadline:
            for name, p in children.items():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint, then exits
                    stopped.add(name)
            end = time.monotonic() + STOP_GRACE_S - 5
            while time.monotonic() < end and any(p.poll() is None for p in children.values()):
                step_evaluations()
                snapshot()
                time.sleep(1)
            for p in children.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            continue
        left = bool(evaluating) or any(pending.values())
        if not training and not left:
            break
        if time.monotonic() >= end_of_budget or (not training and not evaluating
                                                  and time.monotonic() >= end_of_budget - 30):
            break  # what is left is evaluated by the next --run
        time.sleep(2)
    for p in evaluating.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # cut by the budget: the next --run evaluates it again
    for p in [*children.values(), *evaluating.values()]:
        p.wait()
    status = write_status(final=True)
    for name, r in status["runs"].items():
        print(f"{name:24s} step {r['step']:5d}{'  finished' if r['finished'] else ''}  rc {r['rc']}")
    failed = [n for n, r in status["runs"].items() if r["rc"] not in (None, 0) and not r["stopped"]]
    return 1 if failed else 0


def _device(pinned: str = "auto") -> str:
    """What the runs train on: "cpu" where their ``training.device`` pins the CPU (:func:`pinned_device`; the
    micro recipe on a GPU machine), else the GPU's name (as torch gives it), read through nvidia-smi where there is
    one: the driver runs beside the trainers, and a CUDA context of its own would take GPU memory from them."""
    if pinned == "cpu":
        return "cpu"
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                               capture_output=True, text=True, timeout=30)
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import torch
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as err:  # noqa: BLE001 - recorded, not fatal
        return f"unknown ({err})"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for dist in ("torch", "triton", "fla-core"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


# ---------------------------------------------------------------------------------------------------------------
# --merge
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Curve:
    variant: str
    seed: int
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    val: dict[int, float] = field(default_factory=dict)
    gates: dict[int, list[float]] = field(default_factory=dict)
    """Per validated step, each cache layer's mean ``sigmoid(gate)`` (the trainer's ``cache_gate``)."""
    gammas: dict[int, list[float]] = field(default_factory=dict)
    """Per validated step, each cache layer's mean ``gamma_q * gamma_k`` (the trainer's ``cache_gamma_qk``)."""
    corpus: str = ""
    """The corpus build it read (``status.json``'s ``corpus`` id; for folders written before it was recorded,
    ``unrecorded: <folder>``: runs of one such folder shared a build, runs of two are not known to)."""


UNRECORDED = "unrecorded: "


def folder_build(folder: Path, status: dict | None = None) -> str:
    """The corpus build a ``--run`` folder's runs read: its ``status.json``'s ``corpus`` id, or ``unrecorded: <folder>``
    for folders written before the build was recorded (runs of one such folder shared a build)."""
    if status is None:
        status = json.loads((folder / "status.json").read_text())
    shown = str(folder)  # as named on the command line; an absolute path only as far as the working folder
    if folder.is_absolute():
        shown = folder.name if os.path.relpath(folder).startswith("..") else os.path.relpath(folder)
    return (status.get("corpus") or {}).get("id") or f"{UNRECORDED}{shown}"


def load_curves(folders: list[Path]) -> tuple[dict[str, Curve], list[dict]]:
    """Every run's training-loss curve and validation losses from the ``--run`` folders (later folders win)."""
    by_run: dict[str, dict[int, float]] = {}
    vals: dict[str, dict[int, float]] = {}
    gates: dict[str, dict[int, list[float]]] = {}
    gammas: dict[str, dict[int, list[float]]] = {}
    meta: dict[str, tuple[str, int, str]] = {}
    statuses = []
    for folder in folders:
        status = json.loads((folder / "status.json").read_text())
        if status.get("format") != FORMAT:
            raise SystemExit(f"error: {folder}/status.json is not an {FORMAT} status")
        statuses.append(status)
        build = folder_build(folder, status)
        for name, r in status["runs"].items():
            if name in meta and _other_build(meta[name][2], build):
                # The same run name on another build of the corpus is another run (other batches): it replaces
                # the earlier one rather than mixing the two runs' rows. (Folders without a record may hold a
                # resumed run's later part, as before builds were recorded: their rows still merge.)
                for rows in (by_run, vals, gates, gammas):
                    rows.pop(name, None)
            meta[name] = (r["variant"], r["seed"], build)
            for row in read_jsonl(folder / f"{name}.jsonl"):
                if "loss" in row:
                    by_run.setdefault(name, {})[row["step"]] = row["loss"]
                if "val_loss" in row:
                    vals.setdefault(name, {})[row["step"]] = row["val_loss"]
                if row.get("cache_gate"):
                    gates.setdefault(name, {})[row["step"]] = row["cache_gate"]
                if row.get("cache_gamma_qk"):
                    gammas.setdefault(name, {})[row["step"]] = row["cache_gamma_qk"]
    curves = {}
    for name, (variant, seed, build) in meta.items():
        points = sorted(by_run.get(name, {}).items())
        curves[name] = Curve(variant, seed, [s for s, _ in points], [v for _, v in points], vals.get(name, {}),
                             gates.get(name, {}), gammas.get(name, {}), build)
    return curves, statuses


def _other_build(a: str, b: str) -> bool:
    """Two recorded builds that differ (a folder without a record may hold a resumed run's later part)."""
    return a != b and not a.startswith(UNRECORDED) and not b.startswith(UNRECORDED)


def load_evaluations(folders: list[Path], curves: dict[str, Curve] | None = None) -> dict[str, dict[str, dict]]:
    """``--evaluate ppl`` results: split -> run name -> {perplexity, loss, tokens} (later folders win). With
    ``curves``, a result counts only from a folder of its run's corpus build (not an earlier run of the name)."""
    found: dict[str, dict[str, dict]] = {}
    for folder in folders:
        build = folder_build(folder)
        for path in sorted(folder.glob("eval_*/ppl_*.json")):
            name = path.stem.removeprefix("ppl_").removesuffix(CACHE_OFF_LABEL)  # the run's name, cache off or on
            if curves is not None and name in curves and _other_build(curves[name].corpus, build):
                continue
            result = json.loads(path.read_text())
            split = path.parent.name.removeprefix("eval_")
            # word_perplexity: results written since 2026-12-07 (None in older ones).
            found.setdefault(split, {})[name] = {k: result["summary"].get(k) for k in
                                                 ("perplexity", "loss", "tokens", "word_perplexity")}
    return found


def load_niah(folders: list[Path], curves: dict[str, Curve] | None = None) -> dict[str, dict[str, float]]:
    """``--evaluate niah`` results: run name -> {``<task>@<length>``: accuracy} (later folders win; ``curves`` as
    for :func:`load_evaluations`)."""
    return {name: dict(result["summary"])
            for name, result in _run_results(folders, curves, "eval_niah", "niah_").items()}


def _run_results(folders: list[Path], curves: dict[str, Curve] | None, sub: str, prefix: str) -> dict[str, dict]:
    """``<folder>/<sub>/<prefix><run>.json`` of every folder: run name -> parsed result (later folders win; with
    ``curves``, a result counts only from a folder of its run's corpus build)."""
    found: dict[str, dict] = {}
    for folder in folders:
        build = folder_build(folder)
        for path in sorted(folder.glob(f"{sub}/{prefix}*.json")):
            name = path.stem.removeprefix(prefix)
            if curves is not None and name in curves and _other_build(curves[name].corpus, build):
                continue
            found[name] = json.loads(path.read_text())
    return found


def load_cache_results(folders: list[Path],
                       curves: dict[str, Curve] | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """``--evaluate cache_ages`` results, each file read once (later folders win; ``curves`` as for
    :func:`load_evaluations`): run name -> the eval's ``details`` where it holds the entries' ages, and run name ->
    ``details["reads"]`` (where the cache read's softmax mass goes; window 0 runs have these alone)."""
    found = {name: result["details"] for name, result in _run_results(folders, curves, "eval_cache", "cache_").items()}
    # A run whose cache held nothing has no bins (and NaN shares): no ages to table.
    ages = {name: d for name, d in found.items()
            if d.get("layers") and all(layer["bins"] for layer in d["layers"].values())}
    return ages, {name: d["reads"] for name, d in found.items() if d.get("reads")}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def cache_age_lines(curves: dict[str, Curve], variants: list[str], ages: dict[str, dict]) -> list[str]:
    """How old the held entries are on the longest held-out documents: per variant, the share from the first 1/8
    of the prefix and the mean relative age, overall and in the last bin of reading positions (each a mean over
    layers, then mean [min, max] over seeds)."""
    if not ages:
        return []
    first = next(iter(ages.values()))
    lines = ["", f"How old the cache's entries are (`hola_titan.eval cache --data`, the {len(first['documents'])} "
             f"longest documents of the split, up to {max(first['documents']):,} tokens): the share of held slots "
             f"from the first 1/{first['early']} of the prefix (a uniform sample of it: {1 / first['early']:.3f}; "
             "recency: 0) and their mean relative age ((r - p) / r for an entry p read at r; uniform: 0.5), mean "
             "over the layers; the last columns for the reading positions of the last bin:", "",
             "| variant | early share | mean relative age | last bin | early share there |", "|---|---|---|---|---|"]
    for v in variants:
        found = [ages[run_name(v, c.seed)] for c in curves.values() if c.variant == v and run_name(v, c.seed) in ages]
        if not found:
            continue
        early = [_mean([layer["early_share"] for layer in d["layers"].values()]) for d in found]
        age = [_mean([layer["mean_relative_age"] for layer in d["layers"].values()]) for d in found]
        late = [_mean([layer["bins"][-1]["early_share"] for layer in d["layers"].values()]) for d in found]
        last = next(iter(found[0]["layers"].values()))["bins"][-1]
        lines.append(f"| {v} | {spread(early, 3)} | {spread(age, 3)} | {last['from']:,}-{last['to']:,} | "
                     f"{spread(late, 3)} |")
    return lines


def cache_read_lines(curves: dict[str, Curve], variants: list[str], reads: dict[str, dict]) -> list[str]:
    """Where each variant's cache read puts its softmax mass on the longest held-out documents (from the second
    block on): the entries of earlier blocks, the sink, and the gated read's size beside the state read; means over
    the layers, then mean [min, max] over seeds; the last columns for the positions of the last bin."""
    if not reads:
        return []
    first = next(iter(reads.values()))
    lines = ["", f"Where the cache read's mass goes (`hola_titan.eval cache --data`, the same documents, up to "
             f"{max(first['documents']):,} tokens, every token from the second block on): the softmax mass on the "
             "entries of earlier blocks and on the sink (the rest is on the in-block tokens), and "
             "`|sigmoid(gate) o_cache| / |o_state|`, the cache read's size beside the state read where they are "
             "summed; means over the layers:", "",
             "| variant | mass on earlier entries | on the sink | cache / state | last bin | earlier entries there | "
             "cache / state there |", "|---|---|---|---|---|---|---|"]
    for v in variants:
        found = [reads[run_name(v, c.seed)] for c in curves.values() if c.variant == v and run_name(v, c.seed) in reads]
        if not found:
            continue

        def over_layers(d: dict, key: str, last: bool = False) -> float:
            return _mean([(layer["bins"][-1] if last else layer)[key] for layer in d["layers"].values()])

        # NaN (cache_to_state of a variant that normalises each read before the sum: not their weight there): "-".
        cols = [[x for x in (over_layers(d, key, last) for d in found) if not math.isnan(x)] for key, last in
                (("persistent", False), ("sink", False), ("cache_to_state", False), ("persistent", True),
                 ("cache_to_state", True))]
        last_bin = next(iter(found[0]["layers"].values()))["bins"][-1]
        lines.append(f"| {v} | {spread(cols[0], 3)} | {spread(cols[1], 3)} | {spread(cols[2], 3)} | "
                     f"{last_bin['from']:,}-{last_bin['to']:,} | {spread(cols[3], 3)} | {spread(cols[4], 3)} |")
    return lines


def smooth(steps: list[int], values: list[float], width: int) -> tuple[list[int], list[float]]:
    """Mean of the logged losses in windows of ``width`` steps (one point per window, at its last step)."""
    out_s, out_v, bucket, end = [], [], [], width
    for s, v in zip(steps, values):
        while s > end:
            if bucket:
                out_s.append(end)
                out_v.append(sum(bucket) / len(bucket))
            bucket, end = [], end + width
        bucket.append(v)
    if bucket:
        out_s.append(end if steps[-1] == end else steps[-1])
        out_v.append(sum(bucket) / len(bucket))
    return out_s, out_v


def spread(values: list[float], digits: int = 2, signed: bool = False) -> str:
    if not values:
        return "-"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if len(values) == 1:
        return f.format(values[0])
    return f"{f.format(sum(values) / len(values))} [{f.format(min(values))}, {f.format(max(values))}]"


def gdn_base(by: dict[tuple[str, int], Curve], curve: Curve) -> Curve | None:
    """GDN's run of ``curve``'s seed on the same corpus build (the same batches), or None: the one base every
    comparison with GDN takes."""
    base = by.get(("gdn", curve.seed))
    return base if base is not None and base.corpus == curve.corpus else None


def paired(curve: Curve, base: Curve, start: int, stop: int) -> float | None:
    """Mean of ``curve``'s loss minus ``base``'s over the steps in (start, stop] that both logged: the runs of one seed
    read the same batches in the same order, so the difference of two losses on one batch is the variants' own
    difference, without the batch-to-batch spread of the loss (1-2 nats here); ``base`` from :func:`gdn_base`, of
    the same corpus build. None when they share too few steps."""
    mine, theirs = dict(zip(curve.steps, curve.loss)), dict(zip(base.steps, base.loss))
    diffs = [mine[s] - theirs[s] for s in mine if start < s <= stop and s in theirs]
    return sum(diffs) / len(diffs) if len(diffs) >= max(1, (stop - start) // (2 * LOG_FREQ)) else None


def merge(args) -> int:
    curves, statuses = load_curves([Path(f) for f in args.merge])
    names = sorted({s.get("recipe", "small") for s in statuses})  # the first screens wrote no recipe: small
    if len(names) != 1:
        raise SystemExit(f"error: --merge: folders of different recipes ({', '.join(names)}); merge each apart")
    recipe = RECIPES[names[0]]
    tokens_per_step = recipe.tokens_per_step
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    variants = [v for v in VARIANTS if any(c.variant == v for c in curves.values())]
    by = {(c.variant, c.seed): c for c in curves.values()}
    seeds = sorted({c.seed for c in curves.values()})
    span = args.span
    last = max((max(c.steps) for c in curves.values() if c.steps), default=0)
    windows = [(a, a + span) for a in range(0, last, span)]
    summary = {}
    for v in variants:
        runs = [by[(v, s)] for s in seeds if (v, s) in by]
        cells = []
        for a, b in windows:
            diffs = [paired(c, base, a, b) for c in runs if (base := gdn_base(by, c)) is not None]
            cells.append([d for d in diffs if d is not None] if all(d is not None for d in diffs) else [])
        val_steps = sorted({s for c in runs for s in c.val})
        summary[v] = {"flavour": VARIANTS[v].flavour, "overrides": list(VARIANTS[v].overrides),
                      "about": VARIANTS[v].about, "seeds": [c.seed for c in runs],
                      "corpus_builds": [c.corpus for c in runs],
                      "steps": [max(c.steps, default=0) for c in runs],
                      "paired_train_loss_minus_gdn": {f"{a + 1}-{b}": cell for (a, b), cell in zip(windows, cells)},
                      "val_loss_by_step": {str(s): [c.val.get(s) for c in runs] for s in val_steps},
                      "val_loss_minus_gdn_by_step": {
                          str(s): [c.val[s] - base.val[s] for c in runs
                                   if (base := gdn_base(by, c)) is not None and s in c.val and s in base.val]
                          for s in val_steps},
                      "cache_gate_by_step": {str(s): [c.gates.get(s) for c in runs]
                                             for s in sorted({t for c in runs for t in c.gates})},
                      "cache_gamma_qk_by_step": {str(s): [c.gammas.get(s) for c in runs]
                                                 for s in sorted({t for c in runs for t in c.gammas})}}
    evals = load_evaluations([Path(f) for f in args.merge], curves)
    niah = load_niah([Path(f) for f in args.merge], curves)
    ages, reads = load_cache_results([Path(f) for f in args.merge], curves)
    for v in variants:
        runs = [by[(v, s)] for s in seeds if (v, s) in by]
        summary[v]["evaluations"] = {
            split: {str(c.seed): results.get(run_name(v, c.seed)) for c in runs} for split, results in evals.items()}
        if niah:
            summary[v]["niah"] = {str(c.seed): niah.get(run_name(v, c.seed)) for c in runs}
        if ages:
            summary[v]["cache_ages"] = {str(c.seed): {name: {k: layer[k] for k in ("early_share", "mean_relative_age")}
                                                      for name, layer in ages[run_name(v, c.seed)]["layers"].items()}
                                        for c in runs if run_name(v, c.seed) in ages}
        if reads:
            summary[v]["cache_reads"] = {str(c.seed): {name: {k: layer[k] for k in ("persistent", "block", "sink",
                                                                                    "cache_to_state")}
                                                       for name, layer in reads[run_name(v, c.seed)]["layers"].items()}
                                         for c in runs if run_name(v, c.seed) in reads}
    devices = sorted({s["device"] for s in statuses})
    lines = [f"# Ablations of the HOLA layer, recipe {names[0]} ({', '.join(devices)})", "",
             f"{recipe.about} (one step: {tokens_per_step / 1e6:.3f}M tokens), a {statuses[0]['steps']}-step cosine "
             f"schedule, warmup {statuses[0]['warmup_steps']}, `{recipe.config}` with each variant's keys; seeds "
             f"{', '.join(map(str, seeds))}.",
             *([] if not any(st.get("base") for st in statuses) else
               ["", "Every run of the recipe also got `" + "`, `".join(sorted({" ".join(st["base"]) for st in statuses
                                                                            if st.get("base")})) +
                "` before its variant's keys (`status.json`'s `base`; folders written before 2026-12-08 record "
                "none and ran at the configs' block 64 of that time)."]),
             *([] if all(st.get("final", True) for st in statuses) else
               ["", f"{sum(not st.get('final', True) for st in statuses)} of the {len(statuses)} folders are snapshots "
                "taken before their driver ended (`\"final\": false` in `status.json`): their runs stop where the "
                "snapshot found them (steps reached: below)."]),
             "", "Runs of one seed on one build of the corpus read the same batches in the same order, so each cell "
             "is the variant's training loss minus GDN's on the same batches, averaged over the window (mean [min, "
             "max] over the seeds whose GDN run read the same build; negative: better than GDN).", "",
             "| variant | keys | " + " | ".join(f"{a + 1}-{b}" for a, b in windows) + " |",
             "|---|---|" + "---|" * len(windows)]
    for v in variants:
        if v == "gdn":
            continue
        s = summary[v]
        lines.append(f"| {v} | `{' '.join(s['overrides']) or '(defaults)'}` | " + " | ".join(
            spread(cell, 3, signed=True) for cell in s["paired_train_loss_minus_gdn"].values()) + " |")
    val_steps = sorted({int(k) for s in summary.values() for k in s["val_loss_by_step"]})
    if val_steps:
        lines += ["", "Validation loss (the same batches for every run of a corpus build), and minus GDN's at the "
                  "same step and seed on the same build:", "",
                  "| variant | " + " | ".join(f"step {s}" for s in val_steps) + " | " +
                  " | ".join(f"minus GDN, step {s}" for s in val_steps) + " |",
                  "|---|" + "---|" * (2 * len(val_steps))]
        for v in variants:
            s = summary[v]
            vals = [[x for x in s["val_loss_by_step"].get(str(t), []) if x is not None] for t in val_steps]
            diffs = [s["val_loss_minus_gdn_by_step"].get(str(t), []) for t in val_steps]
            lines.append(f"| {v} | " + " | ".join(spread(x, 4) for x in vals) + " | " +
                         " | ".join("-" if v == "gdn" else spread(d, 4, signed=True) for d in diffs) + " |")
    for split, results in sorted(evals.items()):
        if split.endswith(CACHE_OFF):
            lines += cache_off_lines(split, results, evals.get(split.removesuffix(CACHE_OFF), {}), curves, variants)
            continue
        how = (f"`{split.removesuffix(WINDOW)}` split scored in windows of the training length (`hola_titan.eval "
               "ppl --window`, as lm-eval's rolling windows: no target sees more context than training gave it"
               if split.endswith(WINDOW) else
               f"`{split}` split after training (`hola_titan.eval ppl`, every target with its whole document")
        lines += ["", f"Perplexity on the corpus's {how}; minus GDN's of the same seed and corpus build, in percent), "
                  "per token and per word (the papers' \"Wiki. ppl\" is per word):", "",
                  "| variant | perplexity | minus GDN | word perplexity | minus GDN |", "|---|---|---|---|---|"]
        for v in variants:
            mine = {c.seed: results.get(run_name(v, c.seed)) for c in curves.values() if c.variant == v}
            cells = []
            for key in ("perplexity", "word_perplexity"):
                ppl = [r[key] for r in mine.values() if r and r.get(key) is not None]
                rel = [100.0 * (r[key] / results[run_name("gdn", seed)][key] - 1.0)
                       for seed, r in mine.items() if r and r.get(key) is not None and run_name("gdn", seed) in results
                       and results[run_name("gdn", seed)].get(key) is not None
                       and gdn_base(by, by[(v, seed)]) is not None]
                cells += [spread(ppl, 2) if ppl else "-",
                          spread(rel, 1, signed=True) + "%" if rel and v != "gdn" else "-"]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += niah_lines(curves, variants, niah)
    lines += cache_age_lines(curves, variants, ages)
    lines += cache_read_lines(curves, variants, reads)
    lines += gate_lines(curves, variants)
    lines += gate_lines(curves, variants, "gammas")
    lines += ordering_lines(curves, variants, evals, niah)
    lines += ["", "Steps reached: " + ", ".join(f"{v} " + "/".join(map(str, summary[v]["steps"])) for v in variants),
              ""]
    plots = plot_families(curves, variants, report, width=args.window, tokens_per_step=tokens_per_step)
    for family, png in plots.items():
        lines += [f"## {FAMILY_TITLES.get(family, family)}", "", f"![{family}]({png})", ""]
    (report / "ablations.md").write_text("\n".join(lines))
    (report / "ablations.json").write_text(json.dumps({"format": FORMAT, "recipe": names[0], "last_step": last,
                                                       "tokens_per_step": tokens_per_step, "variants": summary,
                                                       "runs": [s["runs"] for s in statuses],
                                                       "devices": [s["device"] for s in statuses]}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


def niah_lines(curves: dict[str, Curve], variants: list[str], niah: dict[str, dict[str, float]]) -> list[str]:
    """S-NIAH accuracy per variant and column (task at a length), mean [min, max] over the seeds evaluated."""
    columns = list(dict.fromkeys(k for r in niah.values() for k in r))
    if not columns:
        return []
    lines = ["", "S-NIAH accuracy (`hola_titan.eval niah`, 1-4x the training length; mean [min, max] over seeds):", "",
             "| variant | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for v in variants:
        results = [niah[run_name(v, c.seed)] for c in curves.values() if c.variant == v and run_name(v, c.seed) in niah]
        if results:
            lines.append(f"| {v} | " + " | ".join(spread([r[k] for r in results if k in r], 2) for k in columns) + " |")
    return lines


def cache_off_lines(split: str, off: dict[str, dict], on: dict[str, dict], curves: dict[str, Curve],
                    variants: list[str]) -> list[str]:
    """The cache-off ablation: each run's perplexity on ``split`` with every cache gate at zero, against the same run
    with its cache (``on``: the cache-on scores of that split)."""
    lines = ["", f"The cache-off ablation: perplexity on the `{split.removesuffix(CACHE_OFF)}` split with every "
             "layer's cache gate forced to zero at test time (`hola_titan.eval ppl --cache off`: what the state path "
             "predicts alone), and how much higher than the same run with its cache, in percent:", "",
             "| variant | perplexity, cache off | minus cache on |", "|---|---|---|"]
    for v in variants:
        names = [run_name(v, c.seed) for c in curves.values() if c.variant == v]
        ppl = [off[n]["perplexity"] for n in names if off.get(n)]
        if not ppl:
            continue
        rel = [100.0 * (off[n]["perplexity"] / on[n]["perplexity"] - 1.0) for n in names if off.get(n) and on.get(n)]
        lines.append(f"| {v} | {spread(ppl, 2)} | {spread(rel, 1, signed=True) + '%' if rel else '-'} |")
    return lines


GATE_TITLES = {
    "gates": "The cache read's weight `sigmoid(gate)` (init: `sigmoid(model.gate_init)`)",
    "gammas": "The cache logits' factor per dimension, `gamma_q * gamma_k` averaged over the head dim (init 1)",
}


def gate_lines(curves: dict[str, Curve], variants: list[str], attr: str = "gates") -> list[str]:
    """A per-layer cache scalar at each logged validation (runs that logged it: the trainer writes ``sigmoid(gate)``
    since 2026-12-06, ``gamma_q * gamma_k`` since 2026-12-07): mean over layers and seeds, and its range over the
    layers, per variant. ``attr``: the :class:`Curve` field, ``gates`` or ``gammas``."""
    logged = [c for c in curves.values() if getattr(c, attr)]
    if not logged:
        return []
    steps = sorted({s for c in logged for s in getattr(c, attr)})
    lines = ["", f"{GATE_TITLES[attr]}, mean over the layers and seeds [lowest layer, highest layer]:", "",
             "| variant | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for v in variants:
        runs = [c for c in logged if c.variant == v]
        if not runs:
            continue
        cells = []
        for s in steps:
            layers = [getattr(c, attr)[s] for c in runs if s in getattr(c, attr)]
            if not layers:
                cells.append("-")
                continue
            per_layer = [sum(x) / len(x) for x in zip(*layers)]
            cells.append(f"{sum(per_layer) / len(per_layer):.4g} [{min(per_layer):.4g}, {max(per_layer):.4g}]")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines


def ordering_lines(curves: dict[str, Curve], variants: list[str], evals: dict[str, dict[str, dict]],
                   niah: dict[str, dict[str, float]] | None = None) -> list[str]:
    """Which orderings of the variants hold beyond the spread of their seeds (``a > b``: every seed of a better
    than every seed of b), over the variants with two or more seeds, and which hold seed by seed (a better than b
    in each seed both ran: the same batches): the validation perplexity at the last step that all of their runs
    logged, the perplexity of each evaluated split (lower is better) and each S-NIAH column (higher is better)."""
    seeds = {v: sorted(c.seed for c in curves.values() if c.variant == v) for v in variants}
    many = [v for v in variants if len(seeds[v]) > 1]
    if len(many) < 2:
        return []
    orderings = _seed_orderings()
    runs = {name: c for name, c in curves.items() if c.variant in many}
    key, builds_note = _pairing_keys(runs)
    metrics = []  # (label, variant -> pairing key -> value, higher is better)
    validated = {n: c for n, c in runs.items() if c.val}  # a run that logged no validation does not hide the others'
    common = set.intersection(*(set(c.val) for c in validated.values())) if validated else set()
    if common:
        step = max(common)
        metrics.append((f"validation perplexity, step {step}",
                        {v: {key[n]: math.exp(c.val[step]) for n, c in validated.items() if c.variant == v}
                         for v in many}, False))
    for split, results in sorted(evals.items()):
        metrics.append((f"`{split}` perplexity", {v: {key[n]: results[n]["perplexity"] for n, c in runs.items()
                                                      if c.variant == v and results.get(n)} for v in many}, False))
    niah = niah or {}
    for column in dict.fromkeys(k for r in niah.values() for k in r):
        metrics.append((column, {v: {key[n]: niah[n][column] for n, c in runs.items()
                                     if c.variant == v and column in niah.get(n, {})} for v in many}, True))
    spread_rows, paired_rows = [], []
    for label, values, higher in metrics:
        values = {v: x for v, x in values.items() if len(x) > 1}
        if len(values) < 2:
            continue
        spread_rows.append(orderings.ordering_row(label, {v: list(x.values()) for v, x in values.items()}, higher))
        paired_rows.append(orderings.paired_row(label, values, higher))
    if not spread_rows:
        return []
    return ["", "## Which orderings hold beyond the seed spread", "",
            f"{orderings.LEGEND} Better: lower perplexity, higher S-NIAH accuracy. Variants with two or more seeds (" +
            ", ".join(f"{v}: {', '.join(map(str, seeds[v]))}" for v in many) + "); the runs of one corpus build are "
            "scored on the same validation batches, so their spread is that of training (initialisation and data "
            "order)" + (", and runs of different builds differ by their batches too." if builds_note else ".") +
            builds_note, "",
            *orderings.HEADER, *spread_rows,
            "", orderings.PAIRED_LEGEND + builds_note, "", *orderings.PAIRED_HEADER, *paired_rows]


def _pairing_keys(runs: dict[str, Curve]) -> tuple[dict[str, str], str]:
    """Run name -> the key runs are paired by: the seed, or, where runs of one seed read different builds of the
    corpus (other batches), the seed and a letter per build, so that only runs of one build pair; and a sentence
    naming the builds when there are several."""
    builds = list(dict.fromkeys(c.corpus for c in runs.values()))
    letter = {b: chr(ord("a") + i) if i < 26 else f"[{i}]" for i, b in enumerate(builds)}
    per_seed: dict[int, set[str]] = {}
    for c in runs.values():
        per_seed.setdefault(c.seed, set()).add(c.corpus)
    key = {n: str(c.seed) if len(per_seed[c.seed]) == 1 else f"{c.seed}{letter[c.corpus]}" for n, c in runs.items()}
    if not any(len(b) > 1 for b in per_seed.values()):
        return key, ""
    return key, (" Runs of one seed on different builds of the corpus read other batches and are not paired: "
                 + "; ".join(f"{letter[b]} = {b}" for b in builds) + ".")


def plot_families(curves: dict[str, Curve], variants: list[str], report: Path, *, width: int,
                  tokens_per_step: int) -> dict[str, str]:
    """One PNG per family: the smoothed training loss against tokens (left; thin lines are seeds, thick ones their
    mean) and each seed's loss minus GDN's on the same batches (right; below zero is better than GDN)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mtok(steps):
        return [t * tokens_per_step / 1e6 for t in steps]

    by = {(c.variant, c.seed): c for c in curves.values() if c.steps}
    written = {}
    families = {f: [v for v in variants if f in VARIANTS[v].families] for v in variants for f in VARIANTS[v].families}
    shown: set[str] = set()
    # The fullest families first; a family whose one variant another plot already shows adds nothing.
    for family, members in sorted(families.items(), key=lambda item: (-len(item[1]), item[0])):
        others = [v for v in members if v != "gdn"]
        if not others or (len(others) < 2 and set(others) <= shown):
            continue
        shown.update(others)
        fig, (ax, dax) = plt.subplots(1, 2, figsize=(13, 4.8))
        for i, v in enumerate(members):
            color = f"C{i}"
            runs = [c for (name, _), c in sorted(by.items()) if name == v]
            smoothed = [smooth(c.steps, c.loss, width) for c in runs]
            for s, x in smoothed:
                ax.plot(mtok(s), x, color=color, lw=0.6, alpha=0.4)
            if smoothed:
                n = min(len(s) for s, _ in smoothed)
                ax.plot(mtok(smoothed[0][0][:n]), [sum(x[j] for _, x in smoothed) / len(smoothed) for j in range(n)],
                        color=color, lw=1.8, label=v)
            if v == "gdn":
                continue
            diffs = []
            for c in runs:
                base = gdn_base(by, c)
                if base is None:
                    continue
                points = [(a + width, paired(c, base, a, a + width)) for a in range(0, max(c.steps), width)]
                points = [(s, d) for s, d in points if d is not None]
                dax.plot(mtok([s for s, _ in points]), [d for _, d in points], color=color, lw=0.6, alpha=0.5)
                diffs.append(dict(points))
            if diffs:
                common = sorted(set.intersection(*(set(d) for d in diffs)))
                dax.plot(mtok(common), [sum(d[s] for d in diffs) / len(diffs) for s in common], color=color, lw=1.8,
                         label=v)
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel(f"training loss, mean of {width}-step windows")
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
        ax.legend(fontsize=8)
        dax.axhline(0.0, color="k", lw=0.6)
        dax.set_xlabel("tokens (M)")
        dax.set_ylabel(f"minus GDN's, same batches ({width}-step means)")
        dax.set_ylim(-0.3, 0.2)
        dax.legend(fontsize=8)
        fig.suptitle(FAMILY_TITLES.get(family, family), fontsize=10)
        fig.tight_layout()
        png = f"ablation_{family}.png"
        fig.savefig(report / png, dpi=110)
        plt.close(fig)
        written[family] = png
    return written


# ---------------------------------------------------------------------------------------------------------------
# --plan
# ---------------------------------------------------------------------------------------------------------------

def plan(args) -> int:
    recipe = RECIPES[args.recipe]
    n = len(args.variants) * len(args.seeds)
    tokens = n * args.steps * recipe.tokens_per_step
    print(f"recipe {args.recipe}: {recipe.about}")
    print(f"{n} runs ({len(args.variants)} variants x seeds {', '.join(map(str, args.seeds))}), {args.steps} steps "
          f"of {recipe.tokens_per_step:,} tokens: {tokens / 1e6:.1f}M tokens; at {recipe.tokens_per_s:,.0f} tokens/s "
          f"(what {recipe.machine} trains of this recipe in all, side by side or not), about "
          f"{tokens / recipe.tokens_per_s / 60:.1f} minutes of training on {recipe.machine} (start-up and evaluations "
          f"aside)")
    if recipe.base:
        print(f"every run of the recipe: {' '.join(recipe.base)} (a variant's own keys win over it)")
    for v in args.variants:
        variant = VARIANTS[v]
        print(f"  {v:18s} {variant.flavour:13s} {' '.join(variant.overrides) or '(defaults)':60s} "
              f"families: {', '.join(variant.families)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true", help="print the runs and an estimate")
    mode.add_argument("--run", action="store_true", help="train or resume the runs until --budget-min")
    mode.add_argument("--merge", nargs="+", metavar="OUT", help="--run output folders to merge")
    p.add_argument("--variants", default=",".join(FIRST_SCREEN),
                   help="comma-separated, from: " + ", ".join(VARIANTS) + "; or a screen: " + ", ".join(SCREENS))
    p.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)))
    p.add_argument("--recipe", choices=sorted(RECIPES), default="small",
                   help="the shared setup: small (31M, 16 x 1,024) or 46M (the paper's ablation size, 16 x 4,096)")
    p.add_argument("--steps", type=int, help="default: the recipe's")
    p.add_argument("--warmup", type=int, help="default: the recipe's")
    p.add_argument("--work", help="--run: the runs' folders (kept between commands on one machine)")
    p.add_argument("--out", help="--run: where the metrics, log tails and status.json go")
    p.add_argument("--corpus", help="--run: the recipe's corpus (default: data/small_corpus_gz, from "
                   "build_small_corpus.py --gzip, for small; data/corpus_100m, from build_corpus.py, for 46M)")
    p.add_argument("--budget-min", type=float, default=8.0, help="--run: stop (saving) before this many minutes")
    p.add_argument("--evaluate", default="",
                   help="--run: comma-separated, from: " + ", ".join(EVALS) + "; each finished run is exported and "
                   "evaluated (ppl on the corpus's held-out and validation splits, ppl_heldout on the held-out one "
                   "alone, ppl_cache_off the held-out one with every cache gate at zero, HOLA flavours only; "
                   "ppl_window the held-out one in windows of the training length; cache_ages the age of the "
                   "cache's entries over its longest documents and where its read's softmax mass goes, HOLA flavours "
                   "only; "
                   "S-NIAH-1/2 at 1-4x the training length) as soon as its training ends, in the order named (a "
                   "budget that ends early cuts the last named), results under --out/eval_*")
    p.add_argument("--report", help="--merge: folder for ablations.md, ablations.json and the PNGs")
    p.add_argument("--window", type=int, default=25, help="--merge: steps per point of the plotted curves")
    p.add_argument("--span", type=int, default=100, help="--merge: steps per column of the table of differences")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="--run: more trainer overrides for every run (last on the line)")
    args = p.parse_args(argv)
    args.variants = list(SCREENS.get(args.variants, [v for v in args.variants.split(",") if v]))
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}, or one screen: "
                f"{', '.join(SCREENS)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    args.evaluate = [e for e in args.evaluate.split(",") if e]
    unknown = [e for e in args.evaluate if e not in EVALS]
    if unknown:
        p.error(f"--evaluate: unknown {', '.join(unknown)}; choose from {', '.join(EVALS)}")
    recipe = RECIPES[args.recipe]
    args.steps = recipe.steps if args.steps is None else args.steps
    args.warmup = recipe.warmup if args.warmup is None else args.warmup
    args.corpus = recipe.corpus if args.corpus is None else args.corpus
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.plan:
        return plan(args)
    if args.run:
        if not args.work or not args.out:
            p.error("--run needs --work and --out")
        if args.budget_min * 60.0 <= STOP_GRACE_S + 30:
            p.error(f"--budget-min: at least {(STOP_GRACE_S + 30) / 60:.1f} (runs need time to save when stopped)")
        return run(args)
    if not args.report:
        p.error("--merge needs --report")
    return merge(args)


if __name__ == "__main__":
    sys.exit(main())
