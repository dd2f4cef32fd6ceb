"""Convert a training checkpoint (a DCP ``step-N`` folder) into a safetensors folder for inference and evaluation.

Usage::

    python scripts/convert_to_safetensors.py outputs/run/checkpoint/step-1000 exports/run-1000 [--dtype bfloat16]
    python scripts/convert_to_safetensors.py outputs/run exports/run    # the run's newest complete checkpoint

CHECKPOINT is a step folder (``<dump>/checkpoint/step-N``), a checkpoint folder (``<dump>/checkpoint``) or a run
folder (``<dump>``); for the last two the newest step that verifies against its ``manifest.json`` and is recorded
healthy (the first loss from its weights passed the trainer's checks) is converted, and the script says which and
why newer ones were passed over. ``--allow-unhealthy`` takes the newest step that verifies whatever its health,
with a warning; a step folder named alone that is recorded unhealthy is refused without it. The model
is rebuilt from the config the checkpoint itself records (the run that wrote it; a later run in the same folder
may have rewritten ``<job.dump_folder>/config.toml``, which is compared and a difference in the model is warned
about). ``--config`` overrides it; a checkpoint that records none (a seed checkpoint) takes the run folder's
``config.toml`` (the first parent folder of the step that has one). The weights are read from the checkpoint in one
process without any process group (whatever number of FSDP ranks saved it), and
:func:`hola_titan.export.save_pretrained` writes ``config.json``, ``model.safetensors`` (sharded above
``--max-shard-bytes``) and the tokenizer files. ``--dtype`` defaults to the run's ``checkpoint.export_dtype``.
The output loads with ``hola_titan.export.load_pretrained`` and, after ``import hola_titan.hf_model``, with
``transformers.AutoModelForCausalLM.from_pretrained``.

The checkpoint's files are checked against its ``manifest.json`` before anything is read; one that differs is
refused naming the file, and one without a manifest (written before checksums existed) is refused unless
``--allow-unverified``, as training refuses it unless ``checkpoint.allow_unverified``. OUT is written whole or not
at all (a hidden sibling renamed into place): an earlier export there is replaced only once the new one is
complete, and an OUT that holds anything but an export (a run folder, say) is refused before the checkpoint is read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hola_titan.checkpoint import (HEALTHY, MANIFEST, UNHEALTHY, CheckpointCorruptError, CheckpointError,
                                   list_checkpoints, load_model_state, recorded_config, recorded_health,
                                   resolve_checkpoint, step_folder, verify_manifest)
from hola_titan.config import ConfigError, JobConfig, config_from_text, flat_items, load_toml
from hola_titan.data import load_tokenizer
from hola_titan.export import DEFAULT_MAX_SHARD_BYTES, check_export_destination, save_pretrained
from hola_titan.models.model import HolaTitanLM
from hola_titan.builder import build_model_args


def find_run_config(checkpoint: Path) -> Path:
    """``config.toml`` in the nearest parent of the step folder ``checkpoint`` (the run's dump folder)."""
    for parent in checkpoint.resolve().parents:
        if (parent / "config.toml").is_file():
            return parent / "config.toml"
    raise FileNotFoundError(f"no config.toml in any parent folder of {checkpoint} (the run's dump folder has it); "
                            "pass --config <job.dump_folder>/config.toml")


def _model_config(step: Path, given: Path | None) -> tuple[JobConfig, str]:
    """The config to rebuild the model from, and where it came from (see the module docstring)."""
    if given is not None:
        return load_toml(given), str(given)
    text = recorded_config(step)
    if text is None:
        path = find_run_config(step)
        return load_toml(path), f"{path} (the checkpoint records no config)"
    config = config_from_text(text, source=f"the config recorded in {step}")
    try:
        folder_path = find_run_config(step)
    except FileNotFoundError:
        return config, f"the config recorded in {step}"
    recorded, folder = flat_items(config), flat_items(load_toml(folder_path))
    differ = sorted(k for k in recorded if k.startswith("model.") and recorded[k] != folder.get(k))
    if differ:
        print(f"warning: {folder_path} differs from the config recorded in {step} in "
              + ", ".join(f"{k} ({folder.get(k)!r} there, {recorded[k]!r} in the checkpoint)" for k in differ)
              + "; converting with the checkpoint's (a later run rewrote the folder's file?)", file=sys.stderr)
    return config, f"the config recorded in {step}"


def choose_step(path: Path, *, allow_unhealthy: bool, allow_unverified: bool = False) -> tuple[Path, str | None]:
    """The step folder to convert for ``path`` and what to say about the choice (None: nothing to say).

    A step folder is taken as named, refused when recorded unhealthy (unless ``allow_unhealthy``). For a checkpoint
    or run folder: the newest step that verifies and is recorded healthy, or with ``allow_unhealthy`` the newest that
    verifies; the steps passed over are named with why. With ``allow_unverified`` the newest step without a manifest
    (written before manifests) is taken when no newer one verifies, with a warning: neither its bytes nor its health
    can be checked. Raises :class:`CheckpointError` in one line."""
    newest, how = resolve_checkpoint(path)
    if how is None:
        health, why = recorded_health(newest)
        if health == UNHEALTHY and not allow_unhealthy:
            raise CheckpointError(f"{newest} is recorded unhealthy ({why}); convert an earlier step, or pass "
                                  "--allow-unhealthy to convert it anyway")
        return newest, None if health == HEALTHY else f"warning: {newest} is recorded {health}" + (
            f" ({why})" if why else "")
    folder, passed = newest.parent, []
    # resolve_checkpoint's words for the folder ("the run folder X"), said of the step chosen here.
    of = how.split(" checkpoint of ", 1)[1]
    for step in reversed(list_checkpoints(folder)):
        candidate = step_folder(folder, step)
        try:
            if verify_manifest(candidate) is None:
                if allow_unverified:
                    said = "; ".join([f"step {step}, the newest complete checkpoint of {of}", *passed])
                    return candidate, f"{said}\nwarning: {candidate} has no manifest.json: neither its bytes nor " \
                        "its health can be checked; converted as --allow-unverified asks"
                passed.append(f"{candidate.name} passed over: no manifest.json, its bytes cannot be verified")
                continue
        except CheckpointCorruptError as error:
            passed.append(f"{candidate.name} passed over: does not verify ({error})")
            continue
        health, why = recorded_health(candidate)
        if health == HEALTHY:
            return candidate, "; ".join([f"step {step}, the newest complete checkpoint of {of} that verifies and is "
                                     "recorded healthy", *passed])
        if allow_unhealthy:
            said = "; ".join([f"step {step}, the newest complete checkpoint of {of} that verifies", *passed])
            return candidate, f"{said}\nwarning: {candidate} is recorded {health} ({why}); converted as " \
                "--allow-unhealthy asks"
        passed.append(f"{candidate.name} passed over: {health} ({why})")
    raise CheckpointError(f"{path} has no checkpoint that verifies and is recorded healthy: {'; '.join(passed)}; "
                          "pass --allow-unhealthy to convert the newest that verifies")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step folder <dump>/checkpoint/step-N, a checkpoint folder "
                        "<dump>/checkpoint or a run folder <dump> (the newest complete step of the last two)")
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--config", type=Path, default=None, help="the run's resolved config.toml")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path (default: model.tokenizer_path of the run)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="weight dtype (default: checkpoint.export_dtype of the run)")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest safetensors file; above it the weights are sharded with an index")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="convert a checkpoint that has no manifest.json (its bytes cannot be verified)")
    parser.add_argument("--allow-unhealthy", action="store_true",
                        help="convert the newest step that verifies even when it is recorded unhealthy or unjudged "
                        "(with a warning); also a step folder named alone that is recorded unhealthy")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_export_destination(args.out)
        step, how = choose_step(args.checkpoint, allow_unhealthy=args.allow_unhealthy,
                                allow_unverified=args.allow_unverified)
        if how is not None:
            said, _, warning = how.partition("\n")
            if said.startswith("warning: "):
                said, warning = "", said
            if said:
                print(f"converting {step}: {said}")
            if warning:
                print(warning, file=sys.stderr)
        config, config_source = _model_config(step, args.config)
        tokenizer = load_tokenizer(args.tokenizer or config.model.tokenizer_path)
        model_args = build_model_args(config, tokenizer.vocab_size)
        with torch.device("meta"):
            model = HolaTitanLM(model_args)
        model.to_empty(device="cpu")
        # A step chosen from a folder was checked against its manifest by choose_step just now.
        verified = how is not None and (step / MANIFEST).is_file()
        load_model_state(step, model, progress=True, allow_unverified=args.allow_unverified, verified=verified)
        dtype = args.dtype or config.checkpoint.export_dtype
        save_pretrained(model, tokenizer, args.out, dtype=dtype, max_shard_bytes=args.max_shard_bytes, progress=True)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({model_args.flavour} {model_args.size}, {dtype}) from {step} "
          f"using {config_source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
