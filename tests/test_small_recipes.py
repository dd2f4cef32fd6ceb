"""Issue 10 recipes: the small_* configs, replicate_small.py --dry-run, and build_small_corpus.py's splitting."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hola_titan.config import parse_config, validate

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "train_configs").glob("small_*.toml"))


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


corpus = _load_script("build_small_corpus")


def test_six_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert names == {f"small_{f}_{t}" for f in ("hola", "gdn", "hola_recency") for t in ("text", "recall")}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_and_validates(path):
    config = parse_config(["--job.config_file", str(path)])
    validate(config, world_size=1)
    assert config.training.seq_len in (512, 1024)
    task = path.stem.rsplit("_", 1)[1]
    assert config.data.dataset.startswith("mqar:") == (task == "recall")


@pytest.mark.parametrize("task", ["text", "recall"])
def test_configs_differ_only_in_flavour(task):
    def normalised(flavour):
        config = parse_config(["--job.config_file", str(REPO / "train_configs" / f"small_{flavour}_{task}.toml")])
        config.model.flavour = "x"
        config.job.dump_folder = config.job.description = config.job.config_file = ""
        return config

    assert normalised("hola") == normalised("gdn") == normalised("hola_recency")


def test_dry_run_lists_the_commands():
    result = subprocess.run([sys.executable, "scripts/replicate_small.py", "--dry-run", "--gpus", "0,1"],
                            cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    lines = result.stdout.splitlines()
    trains = [ln for ln in lines if "-m hola_titan.train" in ln]
    # recall sweep: 3 flavours x 3 lrs; text: 3 flavours x 2 lrs; recall seeds: 3 flavours x 1 more seed
    assert len(trains) == 9 + 6 + 3
    for flavour in ("hola", "gdn", "hola_recency"):
        for lr in ("0.0003", "0.001", "0.003"):
            assert any(f"small_{flavour}_recall.toml" in ln and f"--optimizer.lr {lr} " in ln for ln in trains)
        assert any(f"small_{flavour}_text.toml" in ln and "--data.dataset data/small_corpus/train.jsonl" in ln
                   for ln in trains)
    assert any("--optimizer.lr BEST_LR --training.seed 1" in ln for ln in trains)
    assert sum("scripts/convert_to_safetensors.py" in ln for ln in lines) == 18
    mqar = [ln for ln in lines if "-m hola_titan.eval mqar" in ln]
    assert len(mqar) == 12 + 8 and all("--pairs 4,8,16,32,64,128 --seq-lens 512,1024" in ln for ln in mqar)
    # The 8 recall runs of the HOLA flavours are also evaluated with the cache off, and inspected.
    off = [ln for ln in mqar if "--cache off" in ln]
    assert len(off) == 8 and not any("recall_gdn" in ln for ln in off)
    inspected = [ln for ln in lines if "-m hola_titan.eval cache" in ln]
    assert len(inspected) == 8 and all("--pairs 16 --seq-len 512" in ln for ln in inspected)
    niah = [ln for ln in lines if "-m hola_titan.eval niah" in ln]
    assert len(niah) == 6 and all("--tasks s_niah_1,s_niah_2 --lengths 1024,2048,4096,8192" in ln for ln in niah)
    ppl = [ln for ln in lines if "-m hola_titan.eval ppl" in ln]
    assert len(ppl) == 6 and all("--data data/small_corpus/validation.jsonl" in ln for ln in ppl)
    assert lines[-1].startswith("# estimate:")


def test_dry_run_per_flavour_lr():
    result = subprocess.run([sys.executable, "scripts/replicate_small.py", "--dry-run", "--only", "recall",
                             "--flavours", "gdn", "--lr", "gdn=1e-4:1e-2", "--seeds", "0"],
                            cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    trains = [ln for ln in result.stdout.splitlines() if "-m hola_titan.train" in ln]
    assert [ln.split("--optimizer.lr ")[1].split()[0] for ln in trains] == ["0.0001", "0.01"]


def test_quick_run_resumes_from_carried_results_and_keeps_a_time_budget(tmp_path):
    """A run whose evaluations exist is done even without its checkpoint (results carried to another machine);
    past --time-budget-min nothing new starts and the run says what is left."""
    def replicate(*extra):
        return subprocess.run([sys.executable, "scripts/replicate_small.py", "--quick", "--only", "recall",
                               "--mqar-lrs", "1e-3", "--seeds", "0", "--out", str(tmp_path), *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    first = replicate("--flavours", "gdn")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert (tmp_path / "metrics" / "recall_gdn_lr0.001_s0.jsonl").is_file()
    evaluated = tmp_path / "eval" / "mqar" / "mqar_recall_gdn_lr0.001_s0.json"
    assert evaluated.is_file()
    shutil.rmtree(tmp_path / "runs")
    shutil.rmtree(tmp_path / "exports")
    again = replicate("--flavours", "gdn")
    assert again.returncode == 0 and "skip (evaluated): recall_gdn_lr0.001_s0" in again.stdout
    assert not (tmp_path / "runs").exists(), "a carried-over run was trained again"
    budget = replicate("--flavours", "gdn,hola", "--time-budget-min", "0")
    assert budget.returncode == 0, budget.stderr[-2000:]
    assert "deferred (time budget): train recall_hola_lr0.001_s0" in budget.stdout
    assert "incomplete: 5 commands deferred" in budget.stdout  # train, export, mqar, mqar cache off, cache
    assert not (tmp_path / "runs" / "recall_hola_lr0.001_s0").exists()


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
    bundled = _load_script("build_bundled_data")
    assert all(bundled.is_validation(d.id) == corpus.is_validation(d.id) for d in docs)


def test_write_jsonl_round_trips(tmp_path):
    docs = [corpus.Document("a/1", "a", "line one\n« two »")]
    digest = corpus.write_jsonl(tmp_path / "train.jsonl", docs)
    assert len(digest) == 64
    assert '"text": "line one\\n« two »"' in (tmp_path / "train.jsonl").read_text(encoding="utf-8")
