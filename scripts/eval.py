#!/usr/bin/env python
"""Evaluate checkpoints: ``python scripts/eval.py EVAL --checkpoint FOLDER [options]``.

The same command line as ``python -m hola_titan.eval`` (see docs/evaluation.md): ``ppl``,
``generate``, ``niah`` and ``mqar``, each with ``--compare A B ...`` for a table across checkpoints.
"""

import sys
from pathlib import Path

# Runs from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hola_titan.eval.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
