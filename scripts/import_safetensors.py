"""Turn a safetensors folder (written by ``hola_titan.export`` or ``convert_to_safetensors.py``) into a model-only
DCP checkpoint, the form training reads as ``--checkpoint.initial_load_path``.

Usage::

    python scripts/import_safetensors.py exports/run-1000 checkpoints/run-1000-dcp
    ./run_train.sh --checkpoint.initial_load_path checkpoints/run-1000-dcp ...   # with or without --checkpoint.enable

The weights are checked against the folder's ``config.json`` (names and shapes) and stored as float32 (the
trainer's master weights) unless ``--dtype`` says otherwise. ``initial_load_path`` also accepts the safetensors
folder directly; the DCP form is what a large model wants, because each rank then reads only its own shards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hola_titan.checkpoint import save_model_only
from hola_titan.export import load_pretrained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a safetensors folder with config.json")
    parser.add_argument("out", type=Path, help="output DCP checkpoint folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="stored weight dtype")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model, _ = load_pretrained(args.folder, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    save_model_only(model.state_dict(), args.out)
    print(f"wrote {args.out} (model only, {model.args.flavour} {model.args.size}, {args.dtype}); use it as "
          f"--checkpoint.initial_load_path {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
