"""``python -m hola_titan.eval``: see :mod:`hola_titan.eval.cli`."""

import sys

from hola_titan.eval.cli import main

sys.exit(main())
