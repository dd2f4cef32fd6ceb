"""Checks a launch before ``torchrun`` starts: ``python -m hola_titan.preflight [--no-folder-check] [--section.key
value ...]``.

``run_train.sh`` runs it once, in one process, with ``WORLD_SIZE`` set to the processes the launch will start, so
that a mistake ends in one line and exit status 2 instead of a worker's error inside torchrun's failure report.
It checks what can be checked without building the model: the config and its cross-field rules at that world
size, the parallel degrees, the tokenizer, the training (and validation) data source (a Hugging Face hub dataset:
that the hub answers for it or ``datasets``' cache holds it, asked once, without retries), that
``checkpoint.initial_load_path`` names a checkpoint when it will be loaded, that the run folder and the checkpoint
folder can be folders (no file in the way, no symbolic link loop, no name too long) and checkpoints can be written
(a read-only folder is found here, not at the first save), and that no other run holds the run folder. A dry run
(``--dry-run``) needs only the config.
"""

from __future__ import annotations

import os
import sys


def preflight(argv: list[str], *, folder_check: bool = True) -> None:
    """Raise ``ConfigError``, ``DataError`` or ``FileNotFoundError`` with one line; return when the launch looks
    sound. ``folder_check``: also check that no other run holds the run folder (the launching node of a
    multi-node run; on the others the run's own rank 0 may already hold it)."""
    from hola_titan.config import ConfigError, check_run_folders, parse_config, resolve_degrees, validate

    config = parse_config(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    validate(config, world_size=world_size)
    resolve_degrees(config.parallelism, config.training, world_size=world_size)
    if config.dry_run:
        return
    from hola_titan.data import load_tokenizer
    from hola_titan.data.sources import check_hub_source, resolve_source
    from hola_titan.data.synthetic import is_synthetic
    from hola_titan.runfolder import RunFolderError, RunFolderLock

    # On every node (each writes its shards of every checkpoint), before anything else reads the folders.
    check_run_folders(config)
    load_tokenizer(config.model.tokenizer_path)
    ckpt = config.checkpoint
    if ckpt.initial_load_path:
        from pathlib import Path

        from hola_titan.checkpoint import CheckpointError, list_checkpoints, resolve_checkpoint

        # Used unless the run resumes from checkpoints of its own folder.
        if not (ckpt.enable and list_checkpoints(Path(config.job.dump_folder) / ckpt.folder)):
            try:
                resolve_checkpoint(ckpt.initial_load_path, safetensors=True)
            except CheckpointError as err:
                raise ConfigError("checkpoint.initial_load_path", str(err)) from None
    data = config.data
    sources = []
    if not is_synthetic(data.dataset):
        sources.append(("data.dataset", resolve_source(data.dataset, split=data.split, text_field=data.text_field,
                                                       dataset_config=data.dataset_config,
                                                       holdout_every=data.holdout_every)))
        if config.validation.enable and config.validation.dataset in (None, data.dataset):
            resolve_source(data.dataset, split="validation", text_field=data.text_field,
                           dataset_config=data.dataset_config, holdout_every=data.holdout_every)
    other = config.validation.dataset
    if config.validation.enable and other not in (None, data.dataset) and not is_synthetic(other):
        sources.append(("validation.dataset", resolve_source(other, split="validation", text_field=data.text_field,
                                                             dataset_config=data.dataset_config)))
    # A hub name on a node without network: said here in one line, not after every worker's half minute of retries.
    for key, source in sources:
        if source.kind == "hub":
            note = check_hub_source(source, key=key)
            if note:
                print(f"warning: {note}", file=sys.stderr)
    if folder_check:
        try:
            RunFolderLock(config.job.dump_folder).probe()
        except RunFolderError as err:
            raise ConfigError("job.dump_folder", str(err)) from None


def main(argv: list[str] | None = None) -> int:
    from hola_titan.checkpoint import CheckpointError
    from hola_titan.config import ConfigError
    from hola_titan.data.sources import DataError

    argv = sys.argv[1:] if argv is None else list(argv)
    folder_check = "--no-folder-check" not in argv
    argv = [a for a in argv if a != "--no-folder-check"]
    try:
        preflight(argv, folder_check=folder_check)
    except (ConfigError, DataError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
