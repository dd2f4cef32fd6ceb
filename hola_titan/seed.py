"""Write a seed checkpoint: ``python -m hola_titan.seed --job.config_file FILE [--section.key value ...]``.

Initialises the model of the config exactly as the trainer does (same seed, same values at every layout) and
saves its weights as ``<dump_folder>/<checkpoint.folder>/step-0`` (model only), so that every layout and every
restart of a fresh run starts from the same weights. Holds the run folder's lock while it writes.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from hola_titan.checkpoint import create_seed_checkpoint
    from hola_titan.config import ConfigError, parse_config, write_resolved
    from hola_titan.metrics import setup_logging
    from hola_titan.runfolder import RunFolderError, RunFolderLock

    argv = sys.argv[1:] if argv is None else argv
    setup_logging(0)
    try:
        config = parse_config(argv)
        lock = RunFolderLock(config.job.dump_folder).acquire()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunFolderError as error:
        print(f"error: job.dump_folder: {error}", file=sys.stderr)
        return 2
    try:
        write_resolved(config, config.job.dump_folder)
        print(create_seed_checkpoint(config))
    except (ConfigError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
