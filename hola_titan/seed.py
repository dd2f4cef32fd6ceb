"""Write a seed checkpoint: ``python -m hola_titan.seed --job.config_file FILE [--section.key value ...]``.

Initialises the model of the config exactly as the trainer does (same seed, same values at every layout) and
saves its weights as ``<dump_folder>/<checkpoint.folder>/step-0`` (model only), so that every layout and every
restart of a fresh run starts from the same weights. Holds the run folder's lock while it writes; a checkpoint
folder that already holds checkpoints (a seed's step-0 included) is refused, naming them, and left as it is.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from hola_titan.checkpoint import CheckpointError, create_seed_checkpoint
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
        path = create_seed_checkpoint(config)
        # The folder's record after the checkpoint: a refused seed leaves the config of the run that is there.
        write_resolved(config, config.job.dump_folder)
        print(path)
    except (ConfigError, FileNotFoundError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
