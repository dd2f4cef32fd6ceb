"""``scripts/ablate_small.py``: every variant is a valid trainer command, and the merge pairs each run with GDN's run
of the same seed (the same batches) and reports the differences, from synthetic run folders."""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path

import pytest

from hola_titan.config import parse_config, validate
from hola_titan.data.sources import resolve_source
from helpers import load_script

ablate = load_script("ablate_small")


def _split_corpus(tmp_path: Path) -> Path:
    """An empty corpus of the 46M layout: what --run checks before it starts anything."""
    corpus = tmp_path / "corpus"
    for split in ("train", "validation", "heldout"):
        (corpus / split).mkdir(parents=True)
    return corpus


def _last_step_trainer(pause_s: float):
    """A stand-in for ``train_command``: a process that waits ``pause_s``, then logs the run's last step."""
    def train_command(variant, seed, *, folder, steps, **_):
        code = (f"import json, pathlib, time; time.sleep({pause_s}); pathlib.Path({str(folder / 'metrics.jsonl')!r})"
                f".write_text(json.dumps({{'step': {steps}, 'loss': 1.0}}) + '\\n')")
        return [sys.executable, "-c", code]
    return train_command


@pytest.mark.parametrize("recipe", list(ablate.RECIPES))
@pytest.mark.parametrize("variant", list(ablate.VARIANTS))
def test_every_variant_is_a_valid_config(variant, recipe, tmp_path):
    r = ablate.RECIPES[recipe]
    command = ablate.train_command(variant, 1, recipe=r, folder=tmp_path / "run", corpus=tmp_path / "corpus",
                                   steps=r.steps, warmup=r.warmup, extra=[])
    assert command[1:3] == ["-m", "hola_titan.train"]
    config = parse_config(command[3:])
    validate(config, world_size=1)
    assert config.model.flavour == ablate.VARIANTS[variant].flavour and config.training.seed == 1
    assert config.training.steps == r.steps and config.checkpoint.enable
    # The recipe's step is what the merge turns into tokens.
    assert config.training.local_batch_size * config.training.seq_len == r.tokens_per_step
    assert config.training.seq_len == r.seq_len
    train, validation = ablate.corpus_files(r, tmp_path / "corpus")
    assert config.data.dataset == str(train) and config.validation.dataset == str(validation)
    if recipe == "46M":
        assert config.model.size == "46M" and config.lr_scheduler.warmup_steps == 100
    if recipe == "micro":  # the small screens' block and window, at the debug width
        assert config.model.size == "debug" and config.lr_scheduler.warmup_steps == 100
        if not ablate.VARIANTS[variant].overrides:
            assert (config.model.block, config.model.window) == (64, 64)


def test_the_small_screen_keeps_block_64_while_the_configs_hold_the_paper_s_256(tmp_path):
    """Every small screen since 2026-12-05 ran at block 64; the configs now hold 256 (measured better), and the
    recipe pins 64 so a variant's name keeps its meaning, while a variant's own block wins over the pin."""
    r = ablate.RECIPES["small"]

    def block_of(variant: str) -> int:
        command = ablate.train_command(variant, 0, recipe=r, folder=tmp_path / variant, corpus=tmp_path / "corpus",
                                       steps=r.steps, warmup=r.warmup, extra=[])
        return parse_config(command[3:]).model.block

    assert parse_config(["--job.config_file", r.config]).model.block == 256
    assert block_of("hola") == block_of("hola_w0") == block_of("gdn") == 64
    assert block_of("hola_c256") == block_of("hola_c256_w0") == 256
    assert all(not ablate.RECIPES[name].base for name in ("46M", "micro"))


def test_a_corpus_of_split_folders_is_read_by_split_with_nothing_held_out(tmp_path):
    corpus = tmp_path / "corpus"
    for split in ("train", "validation"):
        (corpus / split).mkdir(parents=True)
        (corpus / split / "part-00000.jsonl").write_text(json.dumps({"text": split}) + "\n")
    r = ablate.RECIPES["46M"]
    config = parse_config(ablate.train_command("hola", 0, recipe=r, folder=tmp_path / "run", corpus=corpus,
                                               steps=r.steps, warmup=r.warmup, extra=[])[3:])
    train = resolve_source(config.data.dataset, split="train", holdout_every=config.data.holdout_every)
    validation = resolve_source(config.validation.dataset, split="validation")
    assert train.files == (corpus / "train" / "part-00000.jsonl",) and train.holdout is None
    assert validation.files == (corpus / "validation" / "part-00000.jsonl",)


def _write_run_folder(folder: Path, offsets: dict[str, float], *, steps: int, seeds=(0, 1),
                      recipe: str | None = None) -> None:
    """Runs whose loss is a shared per-batch curve (the same batches for every variant of a seed) plus the
    variant's offset, and validation rows every 50 steps."""
    folder.mkdir(parents=True)
    runs = {}
    for variant, offset in offsets.items():
        for seed in seeds:
            name = ablate.run_name(variant, seed)
            rows = []
            for step in range(ablate.LOG_FREQ, steps + 1, ablate.LOG_FREQ):
                batch = 3.0 + math.sin(step * 0.7 + seed)  # the batch-to-batch spread the pairing removes
                rows.append({"step": step, "loss": batch + offset + (0.001 * seed if variant != "gdn" else 0.0)})
                if step % 50 == 0:
                    rows.append({"step": step, "val_loss": 3.0 + offset + 0.1 * seed,
                                 **({"cache_gate": [0.01 * seed + step / 1e4, 0.02],
                                     "cache_gamma_qk": [1.0 + step / 100, 2.0 + seed]} if variant != "gdn" else {})})
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{\"step\": 1")
            runs[name] = {"variant": variant, "seed": seed, "step": steps}
    status = {"format": ablate.FORMAT, "device": "cpu", "steps": steps, "warmup_steps": 10, "runs": runs}
    if recipe is not None:  # the first screens' folders name no recipe (small)
        status["recipe"] = recipe
    (folder / "status.json").write_text(json.dumps(status))


def test_the_merge_reports_the_paired_differences(tmp_path):
    offsets = {"gdn": 0.0, "hola": -0.05, "hola_s1": 0.02, "hola_after_norm": -0.01}
    _write_run_folder(tmp_path / "out", offsets, steps=200)
    assert ablate.main(["--merge", str(tmp_path / "out"), "--report", str(tmp_path / "report"), "--span", "100",
                        "--window", "20"]) == 0
    result = json.loads((tmp_path / "report" / "ablations.json").read_text())
    for variant, offset in offsets.items():
        if variant == "gdn":
            continue
        cells = result["variants"][variant]["paired_train_loss_minus_gdn"]
        assert set(cells) == {"1-100", "101-200"}
        for cell in cells.values():  # the per-batch spread cancels; the seeds differ by 0.001
            assert cell == pytest.approx([offset, offset + 0.001], abs=1e-9)
        assert result["variants"][variant]["val_loss_minus_gdn_by_step"]["200"] == pytest.approx([offset] * 2)
    text = (tmp_path / "report" / "ablations.md").read_text()
    assert "| hola | `(defaults)` | -0.049 [-0.050, -0.049] |" in text
    # The cache gates: hola at step 200, layer 0 0.02 / 0.03 (seeds), layer 1 0.02: mean 0.0225, range 0.02-0.025.
    assert "| hola | 0.015 [0.01, 0.02] | 0.0175 [0.015, 0.02] | 0.02 [0.02, 0.02] | 0.0225 [0.02, 0.025] |" in text
    assert result["variants"]["hola"]["cache_gate_by_step"]["200"] == [[0.02, 0.02], [0.03, 0.02]]
    assert "| gdn |" not in text.split("sigmoid(gate)` (init", 1)[1].split("\n\n")[1]
    # gamma_q * gamma_k: layer 0 1 + step / 100 (both seeds), layer 1 2.0 / 3.0 (seeds 0 / 1, mean 2.5).
    gammas = text.split("`gamma_q * gamma_k` averaged", 1)[1].split("\n\n")[1]
    assert "| hola | 2 [1.5, 2.5] | 2.25 [2, 2.5] | 2.5 [2.5, 2.5] | 2.75 [2.5, 3] |" in gammas
    assert "| gdn |" not in gammas
    assert result["variants"]["hola"]["cache_gamma_qk_by_step"]["200"] == [[3.0, 2.0], [3.0, 3.0]]
    assert (tmp_path / "report" / "ablation_state_read.png").is_file()  # gdn, hola, hola_s1
    assert not (tmp_path / "report" / "ablation_span.png").exists()  # only hola_s1 of its members ran


def test_a_later_folder_wins_and_a_foreign_status_is_refused(tmp_path):
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": 0.3}, steps=100)
    _write_run_folder(tmp_path / "b", {"gdn": 0.0, "hola": -0.1}, steps=100)
    curves, _ = ablate.load_curves([tmp_path / "a", tmp_path / "b"])
    hola, gdn = curves["hola_s0"], curves["gdn_s0"]
    assert ablate.paired(hola, gdn, 0, 100) == pytest.approx(-0.1)
    (tmp_path / "b" / "status.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(SystemExit, match="status"):
        ablate.load_curves([tmp_path / "b"])


def test_the_46M_merge_counts_its_tokens_and_refuses_mixed_recipes(tmp_path):
    offsets = {"gdn": 0.0, "hola": -0.1, "hola_recency": -0.05, "transformer": 0.02}
    _write_run_folder(tmp_path / "a", offsets, steps=100, recipe="46M")
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r"), "--span", "50"]) == 0
    result = json.loads((tmp_path / "r" / "ablations.json").read_text())
    assert result["recipe"] == "46M" and result["tokens_per_step"] == 16 * 4096
    assert (tmp_path / "r" / "ablation_flavours.png").is_file()
    assert "recipe 46M" in (tmp_path / "r" / "ablations.md").read_text()
    _write_run_folder(tmp_path / "b", offsets, steps=100)
    with pytest.raises(SystemExit, match="different recipes"):
        ablate.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r2")])


def test_the_run_names_the_missing_corpus(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    assert ablate.main(["--run", "--recipe", "46M", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
                        "--corpus", str(tmp_path / "corpus"), "--budget-min", "3"]) == 2
    assert "build_corpus.py" in capsys.readouterr().err


def test_the_command_line_refuses_what_it_cannot_run(capsys):
    with pytest.raises(SystemExit):
        ablate.main(["--plan", "--variants", "hola,nope"])
    assert "unknown nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ablate.main(["--run", "--out", "x"])
    with pytest.raises(SystemExit):
        ablate.main(["--run", "--work", "w", "--out", "x", "--budget-min", "1"])
    assert ablate.main(["--plan"]) == 0
    assert "16 runs" in capsys.readouterr().out
    assert ablate.main(["--plan", "--recipe", "46M", "--variants", "gdn,hola", "--seeds", "0"]) == 0
    assert "1600 steps of 65,536 tokens" in capsys.readouterr().out


def test_the_evaluations_of_a_finished_run_are_listed_and_what_exists_is_left_out(tmp_path):
    corpus = _split_corpus(tmp_path)
    r = ablate.RECIPES["46M"]
    out, folder = tmp_path / "out", tmp_path / "work" / "hola_s0"
    todo = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=out, steps=r.steps,
                                seq_len=r.seq_len, evals=["ppl", "niah"])
    targets = [t for _, t in todo]
    assert targets == [folder / "hola_s0" / "model.safetensors", out / "eval_heldout" / "ppl_hola_s0.json",
                       out / "eval_validation" / "ppl_hola_s0.json", out / "eval_niah" / "niah_hola_s0.json"]
    assert todo[1][0][-2:] == ["--chunk", str(ablate.EVAL_CHUNK)]
    assert todo[0][0][1:3] == ["scripts/convert_to_safetensors.py", str(folder / "checkpoint" / "step-1600")]
    assert "4096,8192,16384" in todo[-1][0]
    (out / "eval_validation").mkdir(parents=True)
    (out / "eval_validation" / "ppl_hola_s0.json").write_text("{}")
    left = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=out, steps=r.steps,
                                seq_len=r.seq_len, evals=["ppl"])
    assert [t.parent.name for _, t in left] == ["hola_s0", "eval_heldout"]
    # The held-out sources alone: a lease too short for the validation split's thousands of documents.
    only = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=tmp_path / "o2",
                                steps=r.steps, seq_len=r.seq_len, evals=["ppl_heldout"])
    assert [t.parent.name for _, t in only] == ["hola_s0", "eval_heldout"]
    # The cache-off ablation: the held-out sources again with every cache gate at zero, for a flavour with a cache.
    off = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=tmp_path / "o3",
                               steps=r.steps, seq_len=r.seq_len, evals=["ppl_heldout", "ppl_cache_off"])
    assert [t for _, t in off][1:] == [tmp_path / "o3" / "eval_heldout" / "ppl_hola_s0.json",
                                       tmp_path / "o3" / "eval_heldout_cache_off" / "ppl_hola_s0-cache-off.json"]
    assert off[-1][0][-2:] == ["--cache", "off"] and str(corpus / "heldout") in off[-1][0]
    gdn = ablate.eval_commands("gdn_s0", recipe=r, folder=tmp_path / "work" / "gdn_s0", corpus=corpus,
                               out=tmp_path / "o3", steps=r.steps, seq_len=r.seq_len,
                               evals=["ppl_heldout", "ppl_cache_off"], has_cache=False)
    assert [t.parent.name for _, t in gdn] == ["gdn_s0", "eval_heldout"]
    # The small recipe's corpus has no held-out sources: its validation split.
    small = ablate.eval_commands("hola_s0", recipe=ablate.RECIPES["small"], folder=folder, corpus=corpus,
                                 out=tmp_path / "o4", steps=1500, seq_len=1024, evals=["ppl_cache_off"])
    assert [t.parent.name for _, t in small] == ["hola_s0", "eval_validation_cache_off"]
    # In windows of the training length (lm-eval's rolling windows): the held-out sources, else the validation split.
    win = ablate.eval_commands("gdn_s0", recipe=r, folder=tmp_path / "work" / "gdn_s0", corpus=corpus,
                               out=tmp_path / "o5", steps=r.steps, seq_len=r.seq_len, evals=["ppl_window"],
                               has_cache=False)
    assert [t for _, t in win][1:] == [tmp_path / "o5" / "eval_heldout_window" / "ppl_gdn_s0.json"]
    assert win[-1][0][-2:] == ["--window", "4096"] and str(corpus / "heldout") in win[-1][0]
    small = ablate.eval_commands("hola_s0", recipe=ablate.RECIPES["small"], folder=folder, corpus=corpus,
                                 out=tmp_path / "o6", steps=1500, seq_len=1024, evals=["ppl_window"])
    assert [t.parent.name for _, t in small] == ["hola_s0", "eval_validation_window"]
    assert small[-1][0][-2:] == ["--window", "1024"]
    # The cache's ages over the 4 longest held-out documents, up to 16 training lengths: HOLA flavours only.
    ages = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=tmp_path / "o7",
                                steps=r.steps, seq_len=r.seq_len, evals=["cache_ages"])
    assert [t for _, t in ages][1:] == [tmp_path / "o7" / "eval_cache" / "cache_hola_s0.json"]
    assert ages[-1][0][-4:] == ["--max-documents", "4", "--max-tokens", "65536"]
    assert ages[-1][0][3] == "cache" and str(corpus / "heldout") in ages[-1][0]
    assert [t.parent.name for _, t in ablate.eval_commands(
        "gdn_s0", recipe=r, folder=tmp_path / "work" / "gdn_s0", corpus=corpus, out=tmp_path / "o7", steps=r.steps,
        seq_len=r.seq_len, evals=["cache_ages"], has_cache=False)] == ["gdn_s0"]
    # Window 0 keeps no entries of earlier blocks, but its read's shares (in-block tokens, sink) are measured too.
    w0 = ablate.eval_commands("hola_w0_s0", recipe=r, folder=tmp_path / "work" / "hola_w0_s0", corpus=corpus,
                              out=tmp_path / "o7", steps=r.steps, seq_len=r.seq_len,
                              evals=["cache_ages", "ppl_cache_off"])
    assert [t.parent.name for _, t in w0] == ["hola_w0_s0", "eval_cache", "eval_heldout_cache_off"]
    # The evaluations run in the order --evaluate names them (a short budget cuts the last named), the export first.
    order = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=tmp_path / "o8",
                                 steps=r.steps, seq_len=r.seq_len,
                                 evals=["ppl_window", "cache_ages", "ppl_heldout", "ppl_cache_off"])
    assert [t.parent.name for _, t in order] == ["hola_s0", "eval_heldout_window", "eval_cache", "eval_heldout",
                                                 "eval_heldout_cache_off"]
    reverse = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=tmp_path / "o8",
                                   steps=r.steps, seq_len=r.seq_len, evals=["niah", "ppl"])
    assert [t.parent.name for _, t in reverse] == ["hola_s0", "eval_niah", "eval_heldout", "eval_validation"]
    # Named twice, run once; ppl_heldout's place holds when ppl comes later.
    twice = ablate.eval_commands("hola_s0", recipe=r, folder=folder, corpus=corpus, out=tmp_path / "o8",
                                 steps=r.steps, seq_len=r.seq_len, evals=["ppl_heldout", "niah", "ppl", "niah"])
    assert [t.parent.name for _, t in twice] == ["hola_s0", "eval_heldout", "eval_validation", "eval_niah"]


def test_heldout_perplexity_alone_needs_a_corpus_with_a_heldout_split(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    for split in ("train", "validation"):
        (corpus / split).mkdir(parents=True)
    args = ["--run", "--recipe", "46M", "--variants", "hola", "--seeds", "0", "--work", str(tmp_path / "w"),
            "--out", str(tmp_path / "o"), "--corpus", str(corpus), "--evaluate", "ppl_heldout"]
    assert ablate.main(args) == 2
    assert "--evaluate ppl_heldout" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_run_trains_then_evaluates_each_finished_run_and_the_merge_tables_the_perplexities(tmp_path, monkeypatch):
    """The --run loop with stand-ins: a 'trainer' that logs its last step and 'evaluations' that write their
    files; the GDN stand-in's export fails, so its evaluations do not run."""
    corpus = _split_corpus(tmp_path)

    train_command = _last_step_trainer(pause_s=0.0)

    def eval_commands(name, *, out, **_):
        todo = []
        for split, ppl in (("validation", 10.0), ("heldout", 20.0)):
            target = out / f"eval_{split}" / f"ppl_{name}.json"
            ppl = ppl * (0.9 if name.startswith("hola") else 1.0)
            # Per word on heldout only: validation stands for a result written before word perplexity was.
            words = f", 'word_perplexity': {ppl * 2}" if split == "heldout" else ""
            code = (f"import json, pathlib; p = pathlib.Path({str(target)!r}); p.parent.mkdir(exist_ok=True); "
                    f"p.write_text(json.dumps({{'summary': {{'perplexity': {ppl}, 'loss': 1.0, 'tokens': 5"
                    f"{words}}}}}))")
            todo.append(([sys.executable, "-c", code], target))
        export = [sys.executable, "-c", "raise SystemExit(3)" if name.startswith("gdn") else "pass"]
        return [(export, out / "never"), *todo]

    monkeypatch.setattr(ablate, "train_command", train_command)
    monkeypatch.setattr(ablate, "eval_commands", eval_commands)
    args = ["--run", "--recipe", "46M", "--variants", "gdn,hola", "--seeds", "0", "--work", str(tmp_path / "w"),
            "--out", str(tmp_path / "o"), "--corpus", str(corpus), "--budget-min", "2.5", "--evaluate", "ppl"]
    start = time.monotonic()
    assert ablate.main(args) == 0
    assert time.monotonic() - start < 60  # ends when the work is done, not at the end of the budget
    status = json.loads((tmp_path / "o" / "status.json").read_text())
    assert [e["rc"] for e in status["runs"]["hola_s0"]["evaluations"]] == [0, 0, 0]
    assert [e["rc"] for e in status["runs"]["gdn_s0"]["evaluations"]] == [3]
    assert not (tmp_path / "o" / "eval_validation" / "ppl_gdn_s0.json").exists()
    # GDN's results from another folder (a later --run): the merge pairs them by seed.
    (tmp_path / "o2" / "eval_heldout").mkdir(parents=True)
    (tmp_path / "o2" / "eval_heldout" / "ppl_gdn_s0.json").write_text(
        json.dumps({"summary": {"perplexity": 20.0, "loss": 1.0, "tokens": 5, "word_perplexity": 50.0}}))
    (tmp_path / "o2" / "status.json").write_text(json.dumps({**status, "runs": {}}))
    assert ablate.main(["--merge", str(tmp_path / "o"), str(tmp_path / "o2"), "--report", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "ablations.md").read_text()
    assert "`heldout` split" in text and "| hola | 18.00 | -10.0% | 36.00 | -28.0% |" in text
    assert "| hola | 9.00 | - | - | - |" in text  # validation: no GDN result to pair, no words in either
    result = json.loads((tmp_path / "r" / "ablations.json").read_text())
    assert result["variants"]["hola"]["evaluations"]["validation"]["0"]["perplexity"] == 9.0


def test_run_writes_its_status_while_the_runs_train(tmp_path, monkeypatch):
    """A machine lost mid-run leaves --out as the last snapshot found it: status.json and the metrics must be
    there before the driver ends, not only after. The stand-in trainer logs step 5, waits for the driver's
    status, keeps a copy of it, then logs its last step."""
    corpus = _split_corpus(tmp_path)
    out = tmp_path / "o"

    def train_command(variant, seed, *, folder, steps, **_):
        code = (f"import json, pathlib, shutil, time\n"
                f"m = pathlib.Path({str(folder / 'metrics.jsonl')!r}); s = pathlib.Path({str(out / 'status.json')!r})\n"
                f"m.write_text(json.dumps({{'step': 5, 'loss': 2.0}}) + '\\n')\n"
                f"end = time.time() + 30\n"
                f"while time.time() < end and not (s.exists() and json.loads(s.read_text())['runs']"
                f"['hola_s0']['step'] == 5):\n    time.sleep(0.05)\n"
                f"shutil.copyfile(s, s.with_name('seen_mid_run.json'))\n"
                f"m.write_text(m.read_text() + json.dumps({{'step': {steps}, 'loss': 1.0}}) + '\\n')\n")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(ablate, "train_command", train_command)
    monkeypatch.setattr(ablate, "STATUS_EVERY_S", 0.1)
    args = ["--run", "--recipe", "46M", "--variants", "hola", "--seeds", "0", "--work", str(tmp_path / "w"),
            "--out", str(out), "--corpus", str(corpus), "--budget-min", "2.5"]
    assert ablate.main(args) == 0
    mid = json.loads((out / "seen_mid_run.json").read_text())
    assert mid["final"] is False and mid["runs"]["hola_s0"]["step"] == 5 and mid["runs"]["hola_s0"]["rc"] is None
    final = json.loads((out / "status.json").read_text())
    assert final["final"] is True and final["runs"]["hola_s0"]["step"] == 1600 and final["runs"]["hola_s0"]["rc"] == 0
    assert (out / "hola_s0.jsonl").read_text().count("\n") == 2
    assert not [f.name for f in out.iterdir() if f.name.endswith(".tmp")]  # no temporary file left behind
    # A snapshot's folder merges, and the report says it is one.
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "status.json").write_text(json.dumps(mid))
    (snap / "hola_s0.jsonl").write_text(json.dumps({"step": 5, "loss": 2.0}) + "\n")
    assert ablate.main(["--merge", str(snap), "--report", str(tmp_path / "r")]) == 0
    assert "1 of the 1 folders are snapshots" in (tmp_path / "r" / "ablations.md").read_text()
    assert ablate.main(["--merge", str(out), "--report", str(tmp_path / "r2")]) == 0
    assert "snapshots" not in (tmp_path / "r2" / "ablations.md").read_text()


def test_a_status_snapshot_that_cannot_be_written_does_not_stop_the_driver(tmp_path, monkeypatch, capsys):
    """A full disk mid-run: the snapshot is skipped with a warning; the runs train to the end and the final status
    is written once the disk takes it again."""
    corpus = _split_corpus(tmp_path)

    train_command = _last_step_trainer(pause_s=1.0)

    writes = {"n": 0}
    real_write_bytes = Path.write_bytes

    def full_disk_once(self, *args, **kwargs):  # the status's temporary sibling (staging.write_bytes_atomic)
        if self.name.startswith(".status.json.") and writes["n"] == 0:
            writes["n"] += 1
            raise OSError(28, "No space left on device")
        return real_write_bytes(self, *args, **kwargs)

    monkeypatch.setattr(ablate, "train_command", train_command)
    monkeypatch.setattr(ablate, "STATUS_EVERY_S", 0.1)
    monkeypatch.setattr(Path, "write_bytes", full_disk_once)
    args = ["--run", "--recipe", "46M", "--variants", "hola", "--seeds", "0", "--work", str(tmp_path / "w"),
            "--out", str(tmp_path / "o"), "--corpus", str(corpus), "--budget-min", "2.5"]
    assert ablate.main(args) == 0
    assert writes["n"] == 1 and "status snapshot" in capsys.readouterr().out
    final = json.loads((tmp_path / "o" / "status.json").read_text())
    assert final["final"] is True and final["runs"]["hola_s0"]["step"] == 1600


def test_the_merge_orders_the_variants_beyond_the_seed_spread(tmp_path):
    """The ordering table: a pair is ordered only where every seed of one is below every seed of the other in
    perplexity; a variant with one seed is left out of it."""
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2, "hola_recency": -0.05}, steps=100, recipe="46M")
    _write_run_folder(tmp_path / "b", {"transformer": 0.5}, steps=100, seeds=(0,), recipe="46M")
    heldout = {"gdn": (30.0, 31.0), "hola": (27.0, 31.5), "hola_recency": (28.0, 29.0), "transformer": (20.0,)}
    (tmp_path / "a" / "eval_heldout").mkdir()
    for variant, ppls in heldout.items():
        for seed, ppl in enumerate(ppls):
            (tmp_path / "a" / "eval_heldout" / f"ppl_{ablate.run_name(variant, seed)}.json").write_text(
                json.dumps({"summary": {"perplexity": ppl, "loss": math.log(ppl), "tokens": 5}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "ablations.md").read_text()
    section = text.split("## Which orderings hold beyond the seed spread", 1)[1]
    # validation losses 3.0 + offset + 0.1 seed: hola 2.8/2.9 below both; hola_recency 2.95/3.05 overlaps gdn 3.0/3.1
    assert "| validation perplexity, step 100 | hola > gdn, hola > hola_recency | gdn ~ hola_recency |" in section
    assert "| `heldout` perplexity | hola_recency > gdn | gdn ~ hola, hola ~ hola_recency |" in section
    assert "transformer" not in section.split("Steps reached")[0]
    # A run that logged no validation (here a third GDN seed) leaves the others' validation row in place.
    _write_run_folder(tmp_path / "c", {"gdn": 0.0}, steps=100, seeds=(2,), recipe="46M")
    rows = (tmp_path / "c" / "gdn_s2.jsonl").read_text().splitlines()
    (tmp_path / "c" / "gdn_s2.jsonl").write_text("\n".join(r for r in rows if "val_loss" not in r) + "\n")
    assert ablate.main(["--merge", str(tmp_path / "a"), str(tmp_path / "c"), "--report", str(tmp_path / "r3")]) == 0
    assert "| validation perplexity, step 100 |" in (tmp_path / "r3" / "ablations.md").read_text()
    # Seed by seed (the same batches): hola's heldout 27.0/31.5 against gdn's 30.0/31.0 is below in one seed only.
    paired = section.split("Paired by seed", 1)[1]
    assert "| validation perplexity, step 100 | hola > gdn (0, 1), hola_recency > gdn (0, 1), hola > hola_recency " \
           "(0, 1) | - |" in paired
    assert "| `heldout` perplexity | hola_recency > gdn (0, 1) | gdn ~ hola (0, 1), hola ~ hola_recency (0, 1) |" \
        in paired


def test_the_merge_tables_the_cache_off_ablation_against_the_same_run_with_its_cache(tmp_path):
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2}, steps=100, recipe="46M")
    for split, values in (("heldout", {"gdn": (30.0, 31.0), "hola": (25.0, 28.0)}),
                          ("heldout_cache_off", {"hola": (30.0, 35.0)})):
        (tmp_path / "a" / f"eval_{split}").mkdir()
        for variant, ppls in values.items():
            for seed, ppl in enumerate(ppls):
                name = ablate.run_name(variant, seed) + ("-cache-off" if split.endswith("cache_off") else "")
                (tmp_path / "a" / f"eval_{split}" / f"ppl_{name}.json").write_text(
                    json.dumps({"summary": {"perplexity": ppl, "loss": math.log(ppl), "tokens": 5}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "ablations.md").read_text()
    table = text.split("The cache-off ablation", 1)[1].split("\n\n")[1]
    # hola: 30/25 - 1 = +20%, 35/28 - 1 = +25%; gdn has no cache-off row.
    assert "| hola | 32.50 [30.00, 35.00] | +22.5 [+20.0, +25.0]% |" in table and "| gdn |" not in table
    result = json.loads((tmp_path / "r" / "ablations.json").read_text())
    assert result["variants"]["hola"]["evaluations"]["heldout_cache_off"]["1"]["perplexity"] == 35.0


def test_the_merge_tables_windowed_perplexity_apart_from_whole_documents(tmp_path):
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2}, steps=100, recipe="46M")
    for split, values in (("heldout", {"gdn": (30.0, 31.0), "hola": (33.0, 31.0)}),
                          ("heldout_window", {"gdn": (20.0, 20.0), "hola": (18.0, 19.0)})):
        (tmp_path / "a" / f"eval_{split}").mkdir()
        for variant, ppls in values.items():
            for seed, ppl in enumerate(ppls):
                (tmp_path / "a" / f"eval_{split}" / f"ppl_{ablate.run_name(variant, seed)}.json").write_text(
                    json.dumps({"summary": {"perplexity": ppl, "loss": math.log(ppl), "tokens": 5}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "ablations.md").read_text()
    whole = text.split("`heldout` split after training", 1)[1].split("\n\n")[1]
    windowed = text.split("`heldout` split scored in windows of the training length", 1)[1].split("\n\n")[1]
    # Whole documents: hola 33/30 - 1 = +10%, 31/31 - 1 = 0%; windows: 18/20 - 1 = -10%, 19/20 - 1 = -5%.
    assert "| hola | 32.00 [31.00, 33.00] | +5.0 [+0.0, +10.0]% |" in whole
    assert "| hola | 18.50 [18.00, 19.00] | -7.5 [-10.0, -5.0]% |" in windowed
    assert "| `heldout_window` perplexity | hola > gdn |" in text


def test_the_merge_tables_how_old_the_cache_s_entries_are(tmp_path):
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2}, steps=100, recipe="46M")
    (tmp_path / "a" / "eval_cache").mkdir()
    for seed, (early, age) in enumerate(((0.10, 0.4), (0.30, 0.6))):
        bins = [{"from": 256, "to": 4095, "slots": 10, "mean_relative_age": age, "early_share": early},
                {"from": 4096, "to": 65536, "slots": 10, "mean_relative_age": age, "early_share": 2 * early}]
        layers = {"0": {"early_share": early, "mean_relative_age": age, "bins": bins},
                  "1": {"early_share": early + 0.1, "mean_relative_age": age, "bins": bins}}
        (tmp_path / "a" / "eval_cache" / f"cache_{ablate.run_name('hola', seed)}.json").write_text(json.dumps(
            {"details": {"mode": "text", "layers": layers, "documents": [65536, 9000], "early": 8}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "ablations.md").read_text()
    table = text.split("How old the cache's entries are", 1)[1].split("\n\n")[1]
    # Early share per seed, mean over the layers: 0.15 and 0.35; the last bin's: 0.20 and 0.60.
    assert "| hola | 0.250 [0.150, 0.350] | 0.500 [0.400, 0.600] | 4,096-65,536 | 0.400 [0.200, 0.600] |" in table
    assert "| gdn |" not in table
    result = json.loads((tmp_path / "r" / "ablations.json").read_text())
    assert result["variants"]["hola"]["cache_ages"]["1"]["1"]["early_share"] == pytest.approx(0.4)
    # A run whose cache held nothing (no bins) is left out of the table, not a crash of the merge.
    empty = {"early_share": float("nan"), "mean_relative_age": float("nan"), "bins": []}
    (tmp_path / "a" / "eval_cache" / f"cache_{ablate.run_name('gdn', 0)}.json").write_text(json.dumps(
        {"details": {"mode": "text", "layers": {"0": empty}, "documents": [100], "early": 8}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r2")]) == 0
    assert "| gdn |" not in (tmp_path / "r2" / "ablations.md").read_text().split("How old the cache's entries", 1)[1]


def test_the_merge_tables_where_the_cache_read_s_mass_goes(tmp_path):
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2, "hola_w0": -0.3}, steps=100, recipe="46M")
    (tmp_path / "a" / "eval_cache").mkdir()

    def reads(persistent, ratio):
        bins = [{"from": 256, "to": 4095, "tokens": 9, "persistent": persistent, "block": 0.5, "sink": 0.1,
                 "cache_to_state": ratio},
                {"from": 4096, "to": 65536, "tokens": 9, "persistent": 2 * persistent, "block": 0.4, "sink": 0.1,
                 "cache_to_state": 2 * ratio}]
        layer = {"persistent": persistent, "block": 0.9 - persistent, "sink": 0.1, "cache_to_state": ratio,
                 "bins": bins, "per_head": {}}
        return {"layers": {"0": layer, "1": {**layer, "persistent": persistent + 0.1}}, "documents": [65536, 900],
                "block": 256, "window": 64, "evict": "score"}

    for name, details in ((ablate.run_name("hola", 0), {"mode": "text", "layers": {}, "reads": reads(0.2, 1.5)}),
                          (ablate.run_name("hola", 1), {"mode": "text", "layers": {}, "reads": reads(0.4, 2.5)}),
                          (ablate.run_name("hola_w0", 0), {"mode": "text", "layers": {}, "reads": reads(0.0, 1.0)})):
        (tmp_path / "a" / "eval_cache" / f"cache_{name}.json").write_text(json.dumps({"details": details}))
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "ablations.md").read_text()
    assert "How old the cache's entries are" not in text  # no ages: window 0 and these stand-ins hold none
    table = text.split("Where the cache read's mass goes", 1)[1].split("\n\n")[1]
    # Mass on earlier entries per seed, mean over the layers: 0.25, 0.45; in the last bin (both layers): 0.4, 0.8.
    assert ("| hola | 0.350 [0.250, 0.450] | 0.100 [0.100, 0.100] | 2.000 [1.500, 2.500] | 4,096-65,536 | "
            "0.600 [0.400, 0.800] | 4.000 [3.000, 5.000] |") in table
    assert "| hola_w0 | 0.050 |" in table and "| gdn |" not in table
    result = json.loads((tmp_path / "r" / "ablations.json").read_text())
    assert result["variants"]["hola"]["cache_reads"]["1"]["1"]["persistent"] == pytest.approx(0.5)


def test_the_merge_tables_and_orders_the_niah_accuracies(tmp_path):
    """S-NIAH results (eval_niah/niah_<run>.json): a table per variant, and rows of the ordering tables where higher
    accuracy is better."""
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2}, steps=100, recipe="46M")
    (tmp_path / "a" / "eval_niah").mkdir()
    accuracy = {"gdn": (0.25, 0.5), "hola": (0.75, 1.0)}
    for variant, values in accuracy.items():
        for seed, acc in enumerate(values):
            (tmp_path / "a" / "eval_niah" / f"niah_{ablate.run_name(variant, seed)}.json").write_text(
                json.dumps({"summary": {"s_niah_1@4096": acc, "s_niah_2@4096": 1.0 - acc}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "ablations.md").read_text()
    assert "| hola | 0.88 [0.75, 1.00] | 0.12 [0.00, 0.25] |" in text
    spread, paired = text.split("## Which orderings hold beyond the seed spread", 1)[1].split("Paired by seed", 1)
    assert "| s_niah_1@4096 | hola > gdn | - |" in spread and "| s_niah_2@4096 | gdn > hola | - |" in spread
    assert "| s_niah_1@4096 | hola > gdn (0, 1) | - |" in paired
    result = json.loads((tmp_path / "r" / "ablations.json").read_text())
    assert result["variants"]["hola"]["niah"]["1"] == {"s_niah_1@4096": 1.0, "s_niah_2@4096": 0.0}


def test_the_merge_has_no_ordering_table_with_one_seed(tmp_path):
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2}, steps=100, seeds=(1,), recipe="46M")
    assert ablate.main(["--merge", str(tmp_path / "a"), "--report", str(tmp_path / "r")]) == 0
    assert "Which orderings" not in (tmp_path / "r" / "ablations.md").read_text()


def test_the_plan_estimates_with_what_one_gpu_trains_of_the_recipe(capsys):
    """Runs side by side share one GPU: the estimate is the runs' tokens over the recipe's tokens a second."""
    assert ablate.main(["--plan", "--recipe", "46M", "--variants", "gdn,hola", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    minutes = 2 * 1600 * 16 * 4096 / ablate.RECIPES["46M"].tokens_per_s / 60
    assert "2 runs" in out and f"about {minutes:.1f} minutes of training on one GPU" in out
    assert minutes == pytest.approx(11.65, abs=0.01)
    # The CPU proxy says so: its rate is two cores', and its estimate is in their minutes.
    assert ablate.main(["--plan", "--recipe", "micro", "--variants", "gdn,hola,hola_w0,hola_recency",
                        "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    minutes = 4 * 1000 * 8 * 512 / ablate.RECIPES["micro"].tokens_per_s / 60
    assert "1000 steps of 4,096 tokens: 16.4M tokens" in out and minutes == pytest.approx(44.0, abs=0.1)
    assert f"about {minutes:.1f} minutes of training on 2 CPU cores" in out
    # A screen by its name: its variants, each with the recipe's seeds.
    assert ablate.main(["--plan", "--variants", "second_screen"]) == 0
    out = capsys.readouterr().out
    assert f"{2 * len(ablate.SECOND_SCREEN)} runs ({len(ablate.SECOND_SCREEN)} variants" in out
    assert all(f"\n  {v} " in out for v in ablate.SECOND_SCREEN)
    assert ablate.main(["--plan", "--variants", "third_screen"]) == 0
    out = capsys.readouterr().out
    assert f"{2 * len(ablate.THIRD_SCREEN)} runs ({len(ablate.THIRD_SCREEN)} variants" in out
    # Every variant of a screen is plotted with GDN in each of its families: no family without its baseline.
    for v in ablate.THIRD_SCREEN:
        families = ablate.VARIANTS[v].families
        assert all(f in ablate.VARIANTS["gdn"].families and f in ablate.FAMILY_TITLES for f in families), v


def test_runs_on_different_builds_of_the_corpus_are_not_paired(tmp_path):
    """A seed's runs read the same batches only on one build of the corpus: the merge pairs a variant with GDN's run
    of its seed only when both folders' ``status.json`` name the same build (or, where none is recorded, both come
    from one folder), and says which builds it saw."""
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2}, steps=100, recipe="46M")
    _write_run_folder(tmp_path / "b", {"hola_recency": -0.05}, steps=100, recipe="46M")
    for folder, build in (("a", "build-one"), ("b", "build-two")):
        status = json.loads((tmp_path / folder / "status.json").read_text())
        (tmp_path / folder / "status.json").write_text(json.dumps({**status, "corpus": {"id": build, "files": {}}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r")]) == 0
    result = json.loads((tmp_path / "r" / "ablations.json").read_text())
    assert result["variants"]["hola"]["paired_train_loss_minus_gdn"]["1-100"] == pytest.approx([-0.2, -0.199])
    assert result["variants"]["hola_recency"]["paired_train_loss_minus_gdn"]["1-100"] == []
    assert result["variants"]["hola_recency"]["val_loss_minus_gdn_by_step"]["100"] == []
    paired = (tmp_path / "r" / "ablations.md").read_text().split("Paired by seed", 1)[1]
    assert "a = build-one; b = build-two" in paired
    table = paired.split("\n\n", 2)[1]  # the paired table, between the legend and "Steps reached"
    assert table.startswith("| metric |") and "hola > gdn (0a, 1a)" in table and "hola_recency" not in table
    # The held-out results: a GDN of build-one is no base for hola_recency on build-two.
    for folder, name, ppl in (("a", "gdn_s0", 30.0), ("a", "gdn_s1", 31.0), ("b", "hola_recency_s0", 27.0),
                              ("b", "hola_recency_s1", 28.0)):
        (tmp_path / folder / "eval_heldout").mkdir(exist_ok=True)
        (tmp_path / folder / "eval_heldout" / f"ppl_{name}.json").write_text(
            json.dumps({"summary": {"perplexity": ppl, "loss": math.log(ppl), "tokens": 5}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r1")]) == 0
    text = (tmp_path / "r1" / "ablations.md").read_text()
    assert "| hola_recency | 27.50 [27.00, 28.00] | - |" in text
    assert "hola_recency > gdn" not in text.split("Paired by seed", 1)[1]
    assert json.loads((tmp_path / "r1" / "ablations.json").read_text())["variants"]["hola_recency"][
        "corpus_builds"] == ["build-two", "build-two"]
    # The same build in both folders: paired again, with plain seeds.
    status = json.loads((tmp_path / "b" / "status.json").read_text())
    (tmp_path / "b" / "status.json").write_text(json.dumps({**status, "corpus": {"id": "build-one", "files": {}}}))
    assert ablate.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r2")]) == 0
    result = json.loads((tmp_path / "r2" / "ablations.json").read_text())
    assert result["variants"]["hola_recency"]["paired_train_loss_minus_gdn"]["1-100"] == pytest.approx([-0.05, -0.049])
    assert "hola_recency > gdn (0, 1)" in (tmp_path / "r2" / "ablations.md").read_text()


def test_the_run_records_which_build_of_the_corpus_it_read(tmp_path):
    """The splits' files alone: not PROVENANCE.md (its timings differ between byte-identical builds) nor a download
    cache in a dot folder."""
    for split in ("train", "validation", "heldout"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "part-00000.jsonl.gz").write_bytes(split.encode())
    first = ablate.corpus_identity(ablate.RECIPES["46M"], tmp_path)
    assert first["files"] == {f"{split}/part-00000.jsonl.gz": hashlib.sha256(split.encode()).hexdigest()
                              for split in ("train", "validation", "heldout")}
    (tmp_path / "PROVENANCE.md").write_text("built in 212 s")
    (tmp_path / ".cache" / "debs").mkdir(parents=True)
    (tmp_path / ".cache" / "debs" / "a.deb").write_bytes(b"deb")
    (tmp_path / "train" / ".partial").write_bytes(b"x")
    assert ablate.corpus_identity(ablate.RECIPES["46M"], tmp_path) == first
    (tmp_path / "validation" / "part-00000.jsonl.gz").write_bytes(b"three")
    assert ablate.corpus_identity(ablate.RECIPES["46M"], tmp_path)["id"] != first["id"]


def test_a_run_name_on_another_build_replaces_the_earlier_run(tmp_path):
    """Two folders holding one run name on two recorded builds: two runs, the later one kept whole; without
    records (folders of one lease, a resumed run's parts) the rows still merge."""
    _write_run_folder(tmp_path / "a", {"gdn": 0.0, "hola": -0.2}, steps=200, recipe="46M")
    _write_run_folder(tmp_path / "b", {"gdn": 0.0, "hola": -0.1}, steps=100, recipe="46M")
    curves, _ = ablate.load_curves([tmp_path / "a", tmp_path / "b"])
    assert max(curves["hola_s0"].steps) == 200  # unrecorded: merged as before
    for folder, build in (("a", "build-one"), ("b", "build-two")):
        status = json.loads((tmp_path / folder / "status.json").read_text())
        (tmp_path / folder / "status.json").write_text(json.dumps({**status, "corpus": {"id": build, "files": {}}}))
    curves, _ = ablate.load_curves([tmp_path / "a", tmp_path / "b"])
    assert max(curves["hola_s0"].steps) == 100 and curves["hola_s0"].corpus == "build-two"
    assert max(curves["hola_s0"].val) == 100


def test_a_recipe_pinned_to_the_cpu_records_the_cpu_as_its_device(monkeypatch):
    """The micro recipe trains on the CPU even on a GPU machine: its status must not name the machine's GPU."""
    micro, small = ablate.RECIPES["micro"], ablate.RECIPES["small"]
    assert ablate.pinned_device(micro, "hola", []) == "cpu" and ablate.pinned_device(small, "gdn", []) == "auto"
    # --extra is appended last to every run's command, so its value is the one the runs take, in either form.
    assert ablate.pinned_device(micro, "hola", ["--training.device", "cuda"]) == "cuda"
    assert ablate.pinned_device(small, "hola", ["--compile.enable", "true", "--training.device=cpu"]) == "cpu"

    def a_gpu_machine(*args, **kwargs):
        return ablate.subprocess.CompletedProcess(args, 0, stdout="NVIDIA H100 80GB HBM3\n", stderr="")

    monkeypatch.setattr(ablate.subprocess, "run", a_gpu_machine)
    assert ablate._device("cpu") == "cpu" and ablate._device("auto") == "NVIDIA H100 80GB HBM3"
