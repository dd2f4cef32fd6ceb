"""The evaluation command line: ``scripts/eval.py`` runs every eval on exported debug models on the CPU, and
mistakes end with one ``error:`` line and exit status 2.

Models are randomly initialised debug models exported with ``hola_titan.export.save_pretrained``: the tests check
the plumbing (files, keys, exit codes), not what an untrained model scores.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hola_titan.data import load_tokenizer
from hola_titan.eval.cli import main
from hola_titan.export import save_pretrained, write_export_manifest
from hola_titan.models.args import model_args, replace
from hola_titan.models.model import build_model

REPO = Path(__file__).resolve().parents[1]
FAST = ["--device", "cpu", "--threads", "1", "--no-progress"]


# One pytest-xdist worker runs the module: its module-scoped fixtures are made once.
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.xdist_group("test_eval_cli")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """Debug HOLA, GDN and Transformer++ (trained length 128) folders with the bundled tokenizer."""
    tokenizer = load_tokenizer("bundled")
    root = tmp_path_factory.mktemp("exported")
    folders = {}
    for flavour in ("hola", "gdn", "transformer"):
        args = replace(model_args(flavour, "debug", vocab_size=tokenizer.vocab_size), max_seq_len=128)
        torch.manual_seed(0)
        folders[flavour] = save_pretrained(build_model(args, device="cpu"), tokenizer, root / f"debug_{flavour}")
    return folders


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(REPO / "scripts" / "eval.py"), *args, *FAST], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)


def test_scripts_eval_runs_every_eval_on_debug_models(exported, tmp_path):
    out = tmp_path / "eval"
    hola, gdn = str(exported["hola"]), str(exported["gdn"])
    commands = {
        "ppl": ["ppl", "--compare", hola, gdn, "--max-tokens", "400", "--chunk", "128"],
        "generate": ["generate", "--checkpoint", hola, "--prompt", "The sky", "--max-new-tokens", "4",
                     "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--memory-lengths", "64,192",
                     "--memory-new-tokens", "2"],
        "niah": ["niah", "--checkpoint", gdn, "--tasks", "all", "--lengths", "320", "--depths", "0,100",
                 "--samples", "1", "--batch-size", "2", "--prefill-chunk", "128"],
        "mqar": ["mqar", "--compare", hola, gdn, "--pairs", "2,4,16", "--seq-lens", "32", "--samples", "4"],
    }
    for name, command in commands.items():
        done = run_script(*command, "--out", str(out))
        assert done.returncode == 0, f"{name}: {done.stderr}"
    for label in ("debug_hola", "debug_gdn"):
        for name in ("ppl", "mqar"):
            assert _is_png(out / f"{name}_{label}.png")
            result = json.loads((out / f"{name}_{label}.json").read_text())
            assert result["eval"] == name and result["model"]["flavour"] == label.removeprefix("debug_")
    ppl = json.loads((out / "ppl_debug_hola.json").read_text())
    assert ppl["summary"]["tokens"] > 0 and ppl["summary"]["bits_per_byte"] > 0
    # Which paths ran: the kernels' launch configurations (none on a CPU) and the recurrent layers' backend.
    assert ppl["paths"]["kernel_configs"]["source"] == "off"
    assert ppl["paths"]["kernel_configs"]["why"] == "no tuned configurations on cpu"
    assert ppl["paths"]["attention_backend"] == "reference (auto: no CUDA device)"
    compare = json.loads((out / "mqar_compare.json").read_text())
    assert [row["label"] for row in compare["rows"]] == ["debug_hola", "debug_gdn"]
    assert "pairs=4@32" in compare["metrics"] and "pairs=16@32" not in compare["metrics"]  # 16 pairs do not fit
    assert (out / "mqar_compare.md").read_text().startswith("| checkpoint | flavour |")
    assert (out / "ppl_compare.md").is_file() and (out / "mqar_compare.png").is_file()
    generated = json.loads((out / "generate_debug_hola.json").read_text())
    memory = generated["details"]["memory"]
    assert [row["context_len"] for row in memory] == [64, 192]
    assert generated["details"]["cache_bytes_constant"] and memory[0]["cache_bytes_after_decode"] > 0
    niah = json.loads((out / "niah_debug_gdn.json").read_text())
    assert set(niah["details"]["tasks"]) == {"s_niah_1", "s_niah_2", "s_niah_3", "mk_niah", "mv_niah", "mq_niah"}
    assert set(niah["summary"]) == {f"{task}@320" for task in niah["details"]["tasks"]}
    assert niah["details"]["tasks"]["s_niah_1"]["accuracy_by_depth_length"].keys() == {"0", "100"}
    assert _is_png(out / "niah_debug_gdn.png")


def _is_png(path) -> bool:
    """A whole PNG: the signature, an IHDR of a non-empty image, and the closing IEND chunk."""
    data = path.read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return (data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and width > 50 and height > 50
            and data[-8:-4] == b"IEND")


def test_compare_reads_earlier_result_files(exported, tmp_path, capsys):
    out = str(tmp_path)
    assert main(["mqar", "--checkpoint", str(exported["hola"]), "--pairs", "2", "--seq-lens", "16", "--samples", "2",
                 "--out", out, *FAST]) == 0
    first = str(tmp_path / "mqar_debug_hola.json")
    assert main(["mqar", "--compare", first, str(exported["gdn"]), "--pairs", "2", "--seq-lens", "16",
                 "--samples", "2", "--out", out, *FAST]) == 0
    table = json.loads((tmp_path / "mqar_compare.json").read_text())
    assert [row["label"] for row in table["rows"]] == ["debug_hola", "debug_gdn"]
    assert "| debug_hola | hola |" in capsys.readouterr().out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["perplexity", "--checkpoint", "x"], "invalid choice: 'perplexity'"),
    (["niah"], "one of the arguments --checkpoint --compare is required"),
    (["niah", "--checkpoint", "init:hola", "--tasks", "s_niah_1,needle_9"], "unknown NIAH task 'needle_9'"),
    (["niah", "--checkpoint", "init:hola", "--lengths", "4q"], "length '4q'"),
    (["niah", "--checkpoint", "init:hola", "--depths", "120"], "depth '120'"),
])
def test_usage_mistakes_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in one_error_line(capsys)


def test_a_kernel_configs_file_that_does_not_exist_is_a_one_line_error(tmp_path, capsys):
    """Refused before any model is loaded or evaluated, on any device."""
    assert main(["ppl", "--checkpoint", "init:gdn", "--kernel-configs", str(tmp_path / "none.json"), "--out",
                 str(tmp_path / "out"), *FAST]) == 2
    err = one_error_line(capsys)
    assert "--kernel-configs" in err and "no such file" in err
    assert not list((tmp_path / "out").glob("*.json"))


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main(["ppl", "--checkpoint", str(tmp_path / "no_such_model"), *FAST]) == 2
    assert "does not exist" in one_error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["ppl", "--checkpoint", str(tmp_path / "empty"), *FAST]) == 2
    assert "not an exported model folder" in one_error_line(capsys)
    assert main(["mqar", "--checkpoint", "init:mamba", *FAST]) == 2
    assert "init:<flavour>" in one_error_line(capsys)


def test_an_export_whose_config_was_edited_is_a_one_line_error(exported, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(exported["hola"], tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    config["dim"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    write_export_manifest(folder)  # checksums that agree: the shapes, not the bytes, are what is wrong
    assert main(["ppl", "--checkpoint", str(folder), *FAST]) == 2
    line = one_error_line(capsys)
    assert "do not have the shapes" in line and "config.json" in line and "tok_embeddings.weight" in line


def test_bad_task_exits_non_zero_from_the_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "hola_titan.eval", "niah", "--checkpoint", "init:gdn",
                           "--tasks", "haystack_9"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "unknown NIAH task 'haystack_9'" in done.stderr


def test_niah_length_too_short_for_the_prompt_is_a_one_line_error(exported, tmp_path, capsys):
    argv = ["niah", "--checkpoint", str(exported["gdn"]), "--tasks", "mq_niah", "--lengths", "64", "--depths", "50",
            "--samples", "1", "--out", str(tmp_path), *FAST]
    assert main(argv) == 2
    assert "too short for mq_niah" in one_error_line(capsys)


def test_transformer_beyond_its_training_length_warns_and_runs(exported, tmp_path, capsys):
    argv = ["niah", "--checkpoint", str(exported["transformer"]), "--tasks", "s_niah_1", "--lengths", "300",
            "--depths", "50", "--samples", "1", "--out", str(tmp_path), *FAST]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: debug_transformer: NIAH length 300 is beyond the Transformer++ training length 128" in err
    assert json.loads((tmp_path / "niah_debug_transformer.json").read_text())["summary"].keys() == {"s_niah_1@300"}


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_that_cannot_be_a_folder_is_one_line_before_the_eval_runs(where, tmp_path, capsys):
    taken = tmp_path / "results.txt"
    taken.write_text("a file the user keeps\n")
    out = taken if where == "a file" else taken / "res"
    assert main(["mqar", "--checkpoint", "init:gdn", "--pairs", "2", "--seq-lens", "16", "--samples", "2",
                 "--out", str(out), *FAST]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {out}: {taken} is a file, not a folder") and "--out" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]
    assert taken.read_text() == "a file the user keeps\n"


def test_an_out_under_a_file_from_the_module_entry_point_is_one_line(tmp_path):
    taken = tmp_path / "results.txt"
    taken.write_text("")
    done = subprocess.run([sys.executable, "-m", "hola_titan.eval", "ppl", "--checkpoint", "init:gdn", "--out",
                           str(taken / "res"), "--max-tokens", "64", *FAST], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: {taken / 'res'}: {taken} is a file, not a folder"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]


def test_a_full_disk_writing_the_comparison_is_one_line_and_leaves_the_earlier_one(exported, tmp_path, capsys,
                                                                                    monkeypatch):
    """The disk fills while ``mqar_compare.md`` is written: one line naming it and the cause, exit 2, and the
    comparison of the run before is as it was, with no temporary file beside it."""
    argv = ["mqar", "--compare", str(exported["hola"]), str(exported["gdn"]), "--pairs", "2", "--seq-lens", "16",
            "--samples", "2", "--out", str(tmp_path), *FAST]
    assert main(argv) == 0
    compare = tmp_path / "mqar_compare.md"
    before = compare.read_bytes()
    capsys.readouterr()
    real = Path.write_bytes

    def fills_up(self, data):
        if not self.name.startswith(f".{compare.name}."):
            return real(self, data)
        real(self, data[: len(data) // 2])  # part of it reaches the disk, then it is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_bytes", fills_up)
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {compare}: cannot be written: no space left on the device"), line
    monkeypatch.undo()
    assert compare.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
