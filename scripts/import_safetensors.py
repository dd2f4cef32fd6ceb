"""Turn a safetensors folder (written by ``hola_titan.export`` or ``convert_to_safetensors.py``) into a model-only
DCP checkpoint, the form training reads as ``--checkpoint.initial_load_path``.

Usage::

    python scripts/import_safetensors.py exports/run-1000 checkpoints/run-1000-dcp
    ./run_train.sh --checkpoint.initial_load_path checkpoints/run-1000-dcp ...   # with or without --checkpoint.enable

The weights are checked against the folder's ``config.json`` (names and shapes) and stored as float32 (the
trainer's master weights) unless ``--dtype`` says otherwise. ``initial_load_path`` also accepts the safetensors
folder directly; the DCP form is what a large model wants, because each rank then reads only its own shards.

The export's files are checked against its ``manifest.json`` first (a changed, truncated or missing file is refused
by name; an export without a manifest loads with a warning). OUT is written whole or not at all: a hidden sibling
folder renamed into place when the checkpoint is complete. An OUT that exists and is not empty is refused, named,
unless ``--overwrite``, and even then its old content is removed only after the new checkpoint is in place; a full
disk or a file-size limit leaves it as it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hola_titan.checkpoint import write_model_only
from hola_titan.export import load_pretrained
from hola_titan.staging import check_destination, staged_folder

WHAT = "model-only checkpoint"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a safetensors folder with config.json")
    parser.add_argument("out", type=Path, help="output DCP checkpoint folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="stored weight dtype")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing non-empty OUT (only once the new checkpoint is complete)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    hint = "choose another output folder, or pass --overwrite to replace it"
    try:
        # Before the export is read, so a refused OUT costs nothing.
        check_destination(args.out, replaceable=lambda _: args.overwrite, what=WHAT, hint=hint)
        model, _ = load_pretrained(args.folder, dtype=args.dtype)
        with staged_folder(args.out, replaceable=lambda _: args.overwrite, what=WHAT, hint=hint) as tmp:
            write_model_only(model.state_dict(), tmp)
    except (OSError, ValueError) as error:  # FolderWriteError and the export's errors are ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (model only, {model.args.flavour} {model.args.size}, {args.dtype}); use it as "
          f"--checkpoint.initial_load_path {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
