"""Issues 10 and 30: the small_* configs, replicate_small.py (plan, a --quick piece, merging), and
build_small_corpus.py's splitting."""

from __future__ import annotations

import hashlib
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import load_script
from hola_titan.config import parse_config, validate

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "train_configs").glob("small_*.toml"))


corpus = load_script("build_small_corpus")
replicate = load_script("replicate_small")


RECIPES = [(task, flavour) for task in ("mqar", "text") for flavour in ("hola", "hola_recency", "gdn")]


def test_the_replication_uses_the_small_text_and_mqar_recipes():
    assert {p.stem for p in CONFIGS} == {f"small_{f}_text" for f in ("hola", "gdn", "hola_recency")}
    assert set(replicate.TASKS) == {"mqar", "text"} and replicate.FLAVOURS == ("hola", "hola_recency", "gdn")
    assert all((REPO / replicate.TASKS[t].config.format(flavour=f)).is_file() for t, f in RECIPES)


@pytest.mark.parametrize("task,flavour", RECIPES, ids=lambda v: v)
def test_config_parses_and_validates(task, flavour):
    config = parse_config(["--job.config_file", str(REPO / replicate.TASKS[task].config.format(flavour=flavour))])
    validate(config, world_size=1)
    assert config.model.flavour == flavour and config.checkpoint.enable
    assert config.training.seq_len == {"mqar": 256, "text": 1024}[task]
    assert config.data.dataset.startswith("mqar:") == (task == "mqar")


@pytest.mark.parametrize("task", ["mqar", "text"])
def test_configs_differ_only_in_flavour(task):
    """The comparison of replicate_small.py holds everything but the token mixer fixed."""
    def normalised(flavour):
        config = parse_config(["--job.config_file", str(REPO / replicate.TASKS[task].config.format(flavour=flavour))])
        config.model.flavour = "x"
        config.job.dump_folder = config.job.description = config.job.config_file = ""
        return config

    assert normalised("hola") == normalised("gdn") == normalised("hola_recency")


def _main(capsys, *argv) -> tuple[int, str, str]:
    rc = replicate.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _planned_runs(out: str) -> dict[int, list[str]]:
    """``{piece: [run line, ...]}`` from --plan's listing."""
    pieces: dict[int, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("piece "):
            current = pieces.setdefault(int(line.split()[1].rstrip(":")), [])
        elif line.startswith("  mqar_") or line.startswith("  text_"):
            current.append(line.split()[0])
    return pieces


def test_plan_lists_pieces_that_fit_a_lent_gpu(capsys):
    rc, out, _ = _main(capsys, "--plan")
    assert rc == 0
    headers = [ln for ln in out.splitlines() if ln.startswith("piece ")]
    minutes = [float(re.search(r"about ([0-9.]+) min", h).group(1)) for h in headers]
    assert len(headers) == 4 and all(0 < m <= replicate.PIECE_LIMIT_MIN for m in minutes), headers
    runs = _planned_runs(out)
    flavours = ("hola", "hola_recency", "gdn")
    assert sorted(runs[0]) == sorted(f"mqar_{f}_lr{lr}_s0" for f in flavours for lr in ("0.001", "0.003", "0.01"))
    assert sorted(runs[1]) == sorted(f"text_{f}_lr0.003_s{s}" for f in flavours for s in (0, 1))
    assert sorted(runs[2] + runs[3]) == sorted(f"mqar_{f}_lrBEST_s{s}" for f in flavours for s in (1, 2, 3, 4))
    assert len(runs[2]) == len(runs[3]) == 6
    assert all("needs the sweep results" in h for h in headers[2:]) and not any("needs" in h for h in headers[:2])
    mqar = [ln for ln in out.splitlines() if "-m hola_titan.eval mqar" in ln]
    assert mqar and all("--pairs 8,16,32,64,128 --seq-lens 256,512 --samples 256" in ln for ln in mqar)
    assert any("--cache off" in ln for ln in mqar)
    assert any("-m hola_titan.eval cache" in ln for ln in out.splitlines())
    niah = [ln for ln in out.splitlines() if "-m hola_titan.eval niah" in ln]
    assert len(niah) == 1 and "--tasks s_niah_1,s_niah_2 --lengths 1024,2048,4096" in niah[0]
    train = [ln for ln in out.splitlines() if "-m hola_titan.train" in ln]
    assert "train_configs/mqar_hola.toml" in train[0] and "--training.steps 1000" in train[0]
    assert "small_hola_text.toml" in train[1] and "--data.dataset data/small_corpus/train.jsonl" in train[1]
    # The text runs keep the 2026-12-03 pieces' block 64, which the configs no longer hold (they hold 256).
    assert "--model.block 64" in train[1] and "--model.block" not in train[0]
    assert out.splitlines()[-1].startswith("total: 4 pieces")


def test_the_mqar_runs_take_another_dataset_and_batch(capsys):
    """--mqar-data and --mqar-batch reach every MQAR run's trainer command (not the text runs'), and the plan's
    estimate takes the larger steps as slower; a dataset the MQAR source refuses is one error line naming it."""
    mix = "mqar:vocab=8192,pairs=4:5/8:1/16:1/32:1/64:1,power_a=0.01"
    rc, out, _ = _main(capsys, "--plan", "--flavours", "gdn", "--mqar-lrs", "1e-3", "--seeds", "0,1",
                       "--mqar-steps", "400", "--mqar-data", mix, "--mqar-batch", "128")
    assert rc == 0
    train = [ln for ln in out.splitlines() if "-m hola_titan.train" in ln]
    mqar = [ln for ln in train if "mqar_gdn.toml" in ln]
    assert mqar and all(f"--data.dataset {mix}" in ln and "--training.local_batch_size 128" in ln for ln in mqar)
    assert not any("--training.local_batch_size" in ln for ln in train if "small_gdn_text.toml" in ln)
    commands = replicate.Commands(steps={"mqar": 400, "text": 10}, corpus=Path("c"), quick=False)
    wide = replicate.Commands(steps={"mqar": 400, "text": 10}, corpus=Path("c"), quick=False, mqar_batch=128)
    run = replicate.Run("mqar", "gdn", 1e-3, 0)
    assert wide.sizes("mqar", "gdn").batch == 128 and commands.sizes("mqar", "gdn").batch == 64
    assert wide.estimate_s(run) - commands.estimate_s(run) == pytest.approx(400 / replicate.MQAR_STEPS_PER_S["gdn"])
    narrow = replicate.Commands(steps={"mqar": 400, "text": 10}, corpus=Path("c"), quick=False, mqar_batch=16)
    assert narrow.estimate_s(run) == pytest.approx(commands.estimate_s(run))  # a smaller step is not taken as faster
    for data, message in [("mqar:pairs=4/4", "a number of pairs of its own"),
                          ("mqar:vocab=8192,pairs=4/128", "too short for 128 pairs"),
                          ("mqar:vocab=4096,pairs=4/8", "must be the recipe's"),
                          ("mqar:vocab=8192,pairs=4/8,power_a=0.5", "must be the recipe's")]:
        rc, _, err = _main(capsys, "--plan", "--mqar-data", data)
        assert rc == 2 and err.startswith("error: --mqar-data:") and message in err, (data, err)
    rc, _, err = _main(capsys, "--plan", "--quick", "--mqar-batch", "8")
    assert rc == 2 and "for full-size runs" in err


def _sweep_json(path: Path, scores: dict[float, dict[str, float]]) -> Path:
    """A finished --quick sweep piece for hola at the lrs of ``scores`` (point -> accuracy)."""
    runs = [{"name": f"mqar_hola_lr{lr:g}_s0", "task": "mqar", "flavour": "hola", "lr": lr, "seed": 0,
             "status": "finished", "steps": 2, "warmup_steps": 1, "seq_len": 64, "batch": 2,
             "stages": [{"name": "train", "command": [], "rc": 0, "seconds": 1.0}],
             "train": {"tokens_per_s": None, "final_loss": None, "final_val_loss": None},
             "results": {"mqar": points}, "files": []} for lr, points in scores.items()]
    data = {"format": replicate.FORMAT, "piece": 0, "kind": "mqar-sweep", "quick": True, "device": "test",
            "runs": runs}
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


QUICK_SEEDS = ["--quick", "--flavours", "hola", "--mqar-lrs", "1e-3,3e-3", "--seeds", "0,1"]
"""A plan of three pieces: the sweep (2 runs), text (2 runs), and piece 2: hola at seed 1 (with eval cache)."""


def test_errors_are_one_line(capsys, tmp_path):
    def error(*argv):
        rc, out, err = _main(capsys, *argv)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
        return err

    assert "--piece 7: the plan has pieces 0-3" in error("--piece", 7, "--out", tmp_path)
    seeds = error("--piece", 2, "--out", tmp_path)
    assert "--piece 2 (MQAR seeds" in seeds and "needs the sweep results" in seeds and "--sweep-results" in seeds
    partial = _sweep_json(tmp_path / "partial.json", {1e-3: {"pairs=8@64": 0.5}})
    assert "no finished sweep run mqar_hola_lr0.003" in error(*QUICK_SEEDS, "--plan", "--sweep-results", partial)
    assert "--sweep-results" in error(*QUICK_SEEDS, "--plan", "--sweep-results", tmp_path / "missing.json")
    assert "--mqar-steps 4000" in error("--plan", "--mqar-steps", 4000)
    assert "finished in both" in error("--merge", partial, partial, "--out", tmp_path / "report")


def test_supervise_stops_what_runs_past_the_deadline():
    children = {name: subprocess.Popen(argv, start_new_session=True)
                for name, argv in (("quick", ["true"]), ("slow", ["sleep", "60"]))}
    start = time.time()
    stopped = replicate.supervise(children, deadline=replicate.Deadline(start + 1.0), poll_s=0.05)
    assert stopped == {"quick": False, "slow": True}
    assert children["slow"].returncode == -signal.SIGKILL and time.time() - start < 10


def test_a_piece_past_its_budget_records_its_runs_as_stopped(tmp_path):
    """A budget shorter than the stop margin stops the runs at once; the JSON still comes, naming them."""
    result = subprocess.run([sys.executable, "scripts/replicate_small.py", "--quick", "--piece", "0", "--flavours",
                             "gdn", "--mqar-lrs", "1e-3", "--out", str(tmp_path), "--time-budget-min", "0.1"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    data = json.loads((tmp_path / "piece-0.json").read_text(encoding="utf-8"))
    assert data["stopped_by"] == "time budget" and [r["status"] for r in data["runs"]] == ["stopped"]
    assert "stopped: mqar_gdn_lr0.001_s0" in result.stdout


def test_quick_piece_end_to_end_and_merge(capsys, tmp_path):
    """A seed piece trains at the sweep's best lr, exports and evaluates on the CPU, writes its JSON and the cache
    PNGs; merged with the sweep, the tables give mean [min, max] over the two seeds."""
    best = {"pairs=8@64": 0.9, "pairs=16@64": 0.7, "pairs=8@128": 0.8, "pairs=16@128": 0.6}
    sweep = _sweep_json(tmp_path / "sweep.json", {1e-3: dict.fromkeys(best, 0.2), 3e-3: best})
    out = tmp_path / "results"
    result = subprocess.run([sys.executable, "scripts/replicate_small.py", *QUICK_SEEDS, "--piece", "2",
                             "--sweep-results", str(sweep), "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "piece-2.json").read_text(encoding="utf-8"))
    assert data["best_lr"] == {"hola": 0.003} and data["device"] == "cpu" and data["versions"]["torch"]
    (run,) = data["runs"]
    assert run["name"] == "mqar_hola_lr0.003_s1" and run["status"] == "finished" and run["lr"] == 0.003
    assert [s["name"] for s in run["stages"]] == ["train", "export", "mqar", "mqar-cache-off", "cache"]
    assert all(s["rc"] == 0 and s["seconds"] > 0 for s in run["stages"])
    assert "--optimizer.lr 0.003 --training.seed 1 --training.steps 2" in " ".join(run["stages"][0]["command"])
    assert run["train"]["final_step"] == 2 and math.isfinite(run["train"]["final_loss"])
    accuracy = run["results"]["mqar"]
    assert set(accuracy) == set(best) and all(0 <= v <= 1 for v in accuracy.values())
    assert set(run["results"]["mqar-cache-off"]) == set(best)
    assert run["files"] and all((out / f).is_file() for f in run["files"])

    report = tmp_path / "report"
    rc, _, _ = _main(capsys, "--merge", sweep, out / "piece-2.json", "--out", report)
    assert rc == 0
    text = (report / "RESULTS.md").read_text(encoding="utf-8")
    pair = [best["pairs=8@64"], accuracy["pairs=8@64"]]
    cell = f"{sum(pair) / 2:.3f} [{min(pair):.3f}, {max(pair):.3f}]"
    assert f"| hola | 0.003 (best) | on | 2 | {cell} |" in text, text
    assert "| hola | 0.001 | on | 1 | 0.200 | 0.200 |" in text
    assert "| hola | 0.003 | 0.750 | best |" in text  # the sweep table: mean over the points
    assert (report / "mqar.png").is_file() and all((report / f).is_file() for f in run["files"])
    assert "## Which orderings hold beyond the seed spread" in text and "| MQAR 8 pairs @ 64 |" in text
    commands = text.split("## Commands", 1)[1]
    assert "--piece 2" in commands and "--out <out>" in commands and "<work>/mqar_hola_lr0.003_s1/train" in commands
    assert str(out) not in commands  # the piece's --out folder and temporary folder are named, not spelled


def test_orderings_beyond_the_spread():
    """A pair is ordered only when the worst seed of one beats the best seed of the other; lower is better for
    perplexity."""
    row = replicate._ordering("m", {"hola": [0.9, 0.8], "hola_recency": [0.7, 0.85], "gdn": [0.1, 0.2]}, True)
    assert row == "| m | hola > gdn, hola_recency > gdn | hola ~ hola_recency |"
    row = replicate._ordering("ppl", {"hola": [56.9, 55.9], "hola_recency": [55.4, 53.3], "gdn": [52.3, 51.1]},
                              False)
    assert row == "| ppl | hola_recency > hola, gdn > hola, gdn > hola_recency | - |"
    runs = [{"task": "text", "flavour": f, "lr": lr, "seed": seed, "results": {"ppl": {"perplexity": p}}}
            for f, lr, seed, p in [("hola", 1e-3, 0, 50.0), ("hola", 1e-3, 1, 51.0), ("hola", 3e-3, 0, 40.0),
                                   ("hola", 3e-3, 1, 41.0), ("gdn", 3e-3, 0, 45.0), ("gdn", 3e-3, 1, 46.0)]]
    text = "\n".join(replicate.ordering_lines(runs, {}))
    # Both of hola's rates are compared, each named with its rate.
    assert "| text: validation perplexity (lower is better) | hola lr 0.003 > hola lr 0.001, gdn > hola lr 0.001, " \
           "hola lr 0.003 > gdn | - |" in text, text


def _b64(number: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    digits = ""
    while True:
        digits = alphabet[number % 64] + digits
        number //= 64
        if number == 0:
            return digits


def test_dictd_entries_split_and_share():
    entries = ["00database header\n", "Apple \\Ap\"ple\\, n.\n   A fruit.  \n", "Bee, n.\n   An insect.\n"]
    data = "".join(entries).encode()
    offsets = [0, len(entries[0].encode()), len((entries[0] + entries[1]).encode())]
    index = "\n".join([f"00databaseinfo\t{_b64(offsets[0])}\t{_b64(len(entries[0]))}",
                       f"Apple\t{_b64(offsets[1])}\t{_b64(len(entries[1]))}",
                       f"Apples\t{_b64(offsets[1])}\t{_b64(len(entries[1]))}",  # shares Apple's entry
                       f"Bee\t{_b64(offsets[2])}\t{_b64(len(entries[2]))}"])
    docs = corpus.dictd_entries(index, data, prefix="d", source="dict")
    assert [d.id for d in docs] == ["d/Apple", "d/Bee"]
    assert docs[0].text == 'Apple \\Ap"ple\\, n.\n   A fruit.'


def test_sword_chapters_and_osis_text():
    block = ('<div type="book" osisID="Ps" sID="g1"/>Intro <chapter n="1" osisID="Ps.1" sID="Ps.1"/>'
             '<title>Psalm 1</title>Blessed <hi type="italic">is</hi> the man<note n="a">a note</note>'
             '<lb/>second &amp; line<chapter eID="Ps.1"/><chapter n="2" osisID="Ps.2" sID="Ps.2"/>Why  do'
             '<chapter eID="Ps.2"/>')
    chapters = corpus.split_chapters(block)
    assert [c for c, _ in chapters] == ["Ps.1", "Ps.2"]
    assert corpus.osis_to_text(chapters[0][1], drop_notes=True) == "Intro Psalm 1\nBlessed is the man\nsecond & line"
    assert "a note" in corpus.osis_to_text(chapters[0][1], drop_notes=False)
    assert corpus.osis_to_text(chapters[1][1], drop_notes=True) == "Why do"
    assert corpus.split_chapters("no markers") == [("", "no markers")]


def test_split_by_hash_is_stable_and_matches_bundled_rule():
    docs = corpus.unique_ids([corpus.Document(f"src/{i}", "src", f"text {i}") for i in range(2000)]
                             + [corpus.Document("src/0", "src", "again")])
    assert docs[-1].id == "src/0 (2)"
    splits = corpus.split_documents(docs)
    held = {d.id for d in splits["validation"]}
    assert 10 < len(held) < 80  # about 2 %
    assert len(splits["train"]) + len(held) == len(docs)
    assert held == {d.id for d in docs if corpus.is_validation(d.id)}
    bundled = load_script("build_bundled_data")
    assert all(bundled.is_validation(d.id) == corpus.is_validation(d.id) for d in docs)
    # Validation in sha256(id) order (its first batches are all that training scores), train in source order.
    hashes = [hashlib.sha256(d.id.encode()).digest() for d in splits["validation"]]
    assert hashes == sorted(hashes) and hashes != [hashlib.sha256(d.id.encode()).digest() for d in docs
                                                   if corpus.is_validation(d.id)]
    assert splits["train"] == [d for d in docs if not corpus.is_validation(d.id)]


def test_write_jsonl_round_trips(tmp_path):
    docs = [corpus.Document("a/1", "a", "line one\n« two »")]
    digest = corpus.write_jsonl(tmp_path / "train.jsonl", docs)
    assert len(digest) == 64
    assert '"text": "line one\\n« two »"' in (tmp_path / "train.jsonl").read_text(encoding="utf-8")
