"""Export a model as a Hugging Face style folder and load it back, with no distributed setup.

Folder written by :func:`save_pretrained` (loaded by :func:`load_pretrained`, and by
``transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` in any environment where
hola-titan is installed, or without the flag after ``import hola_titan.hf_model``)::

    config.json                       model_type "hola_titan", every ModelArgs field, token ids, dtype, auto_map
    modeling_hola_titan.py            what trust_remote_code loads: the classes of the installed hola_titan
    model.safetensors                 all weights, when they fit in ``max_shard_bytes``; otherwise
    model-00001-of-0000N.safetensors  shards, in module order, and
    model.safetensors.index.json      {"metadata": {"total_size": bytes}, "weight_map": {key: shard file}}
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                      a stock PreTrainedTokenizerFast (no tokenizer code); AutoTokenizer still
                                      takes trust_remote_code=True or the import above: transformers 5 resolves
                                      config.json's model class before it reads these files
    manifest.json                     {"format": "hola_titan export", "hash": "sha256", "files": {name: {"size",
                                      "sha256"}}}: every file above, written last

Writing is all or nothing (:mod:`hola_titan.staging`): the files go into a hidden sibling folder that is renamed
into place when complete, so a full disk or a killed process leaves an earlier export in ``folder`` as it was. An
existing ``folder`` is replaced only when it is empty or an export (its ``config.json`` says ``hola_titan``, or it
holds an export manifest); anything else (a run folder, say) is refused by name. Files a user added to an export
(a README, say) are carried into the new one.

Reading verifies (:func:`verify_export`): :func:`load_pretrained`, ``HolaTitanForCausalLM.from_pretrained`` on a
local folder and ``checkpoint.initial_load_path`` check every file the manifest lists, its size and sha256, and
refuse a folder where one differs, naming the file. A folder without a manifest (exported before manifests existed,
or copied without it) loads with a one-line warning that its bytes cannot be verified. Files not in the manifest
(a README) are not checked.

Key names (stable; tests pin them). They are the fully qualified names of :class:`HolaTitanLM` itself, with no
prefix and no wrapper names (``_checkpoint_wrapped_module.``, ``_orig_mod.``, FSDP), for block index ``i``::

    tok_embeddings.weight                        [vocab, dim]
    layers.{i}.attention_norm.weight             [dim]
    layers.{i}.attn.{q,k,v}_proj.weight          [H*D, dim]
    layers.{i}.attn.o_proj.weight                [dim, H*D]
    layers.{i}.ffn_norm.weight                   [dim]
    layers.{i}.feed_forward.{w1,w3}.weight       [mlp_hidden, dim]   (SwiGLU gate and up)
    layers.{i}.feed_forward.w2.weight            [dim, mlp_hidden]   (down)
    norm.weight                                  [dim]
    output.weight                                [vocab, dim]        only when tie_embeddings is false
  recurrent flavours (hola, hola_recency, gdn) add
    layers.{i}.attn.{q,k,v}_conv.weight          [H*D, 1, conv_size]
    layers.{i}.attn.{a,b}_proj.weight            [H, dim]
    layers.{i}.attn.A_log, layers.{i}.attn.dt_bias   [H]
    layers.{i}.attn.o_norm.weight                [D]
    layers.{i}.attn.g_proj.weight                [H*D, dim]          only when use_gate
  HOLA flavours (hola, hola_recency) add
    layers.{i}.attn.gamma_q, layers.{i}.attn.gamma_k   [D]
    layers.{i}.attn.sink, layers.{i}.attn.gate         [H]

A tied output head is ``tok_embeddings.weight`` and is stored once. ``config.json`` holds every
:class:`~hola_titan.models.args.ModelArgs` field under its own name (``flavour``, ``size``, ``vocab_size``, ``dim``,
..., ``window``, ``block``), so the exact model is rebuilt without the size table, plus ``model_type``,
``architectures``, ``auto_map`` (:data:`AUTO_MAP`), ``hola_titan_format`` (:data:`FORMAT_VERSION`), ``dtype``,
``tie_word_embeddings`` and the tokenizer's ``eos_token_id`` / ``pad_token_id``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hola_titan.data.tokenizer import Tokenizer, load_tokenizer
from hola_titan.fqn import strip_wrappers
from hola_titan.models.args import ModelArgs
from hola_titan.models.model import HolaTitanLM
# FolderWriteError is what the writers below raise; callers import it from here.
from hola_titan.manifests import file_records, first_mismatch
from hola_titan.staging import FolderWriteError, _umask, check_destination, staged_folder  # noqa: F401

logger = logging.getLogger("hola_titan")

FORMAT_VERSION = 1
"""Version of the folder layout and key names above; :func:`load_pretrained` refuses newer versions."""
MODEL_TYPE = "hola_titan"
ARCHITECTURE = "HolaTitanForCausalLM"
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
REMOTE_CODE_FILE = "modeling_hola_titan.py"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "hola_titan export"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
# transformers' standard switch for a model type it does not know: config.json names the classes by
# "module.Class", the module being a file of the folder (trust_remote_code=True runs it).
AUTO_MAP = {"AutoConfig": "modeling_hola_titan.HolaTitanConfig",
            "AutoModelForCausalLM": "modeling_hola_titan.HolaTitanForCausalLM"}
_REMOTE_CODE = '''"""Opens this folder with transformers' trust_remote_code=True. The model code is the installed
hola-titan package's (pip install hola-titan): this file only names its classes, so it runs nothing else."""

from hola_titan.hf_model import HolaTitanConfig, HolaTitanForCausalLM

__all__ = ["HolaTitanConfig", "HolaTitanForCausalLM"]
'''
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.float32``, ``"bfloat16"`` etc. as a ``torch.dtype``; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def clean_fqn(name: str) -> str:
    """A parameter name without the prefixes that activation checkpointing, compile and FSDP1 insert."""
    return strip_wrappers(name)


def _native(model: nn.Module) -> nn.Module:
    """The ``HolaTitanLM`` behind a ``transformers`` wrapper (``hola_titan.hf_model``), or ``model`` itself."""
    return getattr(model, "hola_lm", model)


def export_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights of ``model`` on the CPU under the documented key names.

    ``model`` may be FSDP2-sharded (DTensor parameters): every rank must then call this, because the shards are
    gathered; every rank gets the full dict. A plain model needs no process group.
    """
    model = _native(model)
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[clean_fqn(name)] = tensor.detach().to("cpu")
    return out


def config_dict(args: ModelArgs, tokenizer: Tokenizer | None, *, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` contents of ``args`` (module docstring)."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "hola_titan_format": FORMAT_VERSION,
        **dataclasses.asdict(args),
        "tie_word_embeddings": args.tie_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": tokenizer.eos_id if tokenizer is not None else None,
        "pad_token_id": tokenizer.pad_id if tokenizer is not None else None,
        "bos_token_id": None,
    }


def args_from_config(config: dict[str, Any], *, source: str = "config.json") -> ModelArgs:
    """Rebuild :class:`ModelArgs` from a ``config.json`` dict; fields a newer ModelArgs added take defaults.

    Raises:
        ValueError: not a hola_titan config, a newer format, or a required field is missing.
    """
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{source}: model_type is {config.get('model_type')!r}, expected {MODEL_TYPE!r}")
    version = config.get("hola_titan_format", 1)
    if version > FORMAT_VERSION:
        raise ValueError(f"{source}: hola_titan_format {version} is newer than this code reads ({FORMAT_VERSION})")
    values = {}
    for f in dataclasses.fields(ModelArgs):
        if f.name in config:
            values[f.name] = config[f.name]
        elif f.default is dataclasses.MISSING:
            raise ValueError(f"{source}: missing model field {f.name!r}")
    return ModelArgs(**values)


def _shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split ``state`` in order into groups of at most ``max_shard_bytes`` (a larger tensor is a group alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


class ExportCorruptError(ValueError):
    """An export folder whose files are not what its manifest (or the safetensors format) says; names the file."""


def is_export(folder: Path) -> bool:
    """Whether ``folder`` holds an export this module wrote (its ``config.json`` says ``hola_titan``, or it has an
    export manifest): the only non-empty folders a re-export may replace."""
    for name, key, value in (("config.json", "model_type", MODEL_TYPE), (MANIFEST_FILE, "format", MANIFEST_FORMAT)):
        try:
            if json.loads((folder / name).read_text(encoding="utf-8")).get(key) == value:
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _written_by_export(name: str) -> bool:
    """Names an export writes; a re-export replaces them (an old shard layout included) and carries the rest."""
    return (name in ("config.json", REMOTE_CODE_FILE, INDEX_FILE, MANIFEST_FILE, *TOKENIZER_FILES)
            or _SHARD_RE.match(name) is not None)


def check_export_destination(folder: str | os.PathLike[str]) -> None:
    """Raise :class:`~hola_titan.staging.FolderWriteError` when ``folder`` exists and may not be replaced by an
    export (neither empty nor an export); callers check before the slow part (loading a checkpoint)."""
    check_destination(Path(folder), replaceable=is_export, what="safetensors export")


def write_export_manifest(folder: str | os.PathLike[str]) -> Path:
    """Write ``<folder>/manifest.json``: size and sha256 of every file in ``folder`` (module docstring)."""
    folder = Path(folder)
    files = file_records(folder, hash_name="sha256", key="sha256", skip=lambda name: name == MANIFEST_FILE)
    record = {"format": MANIFEST_FORMAT, "hash": "sha256", "files": files}
    (folder / MANIFEST_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return folder / MANIFEST_FILE


def verify_export(folder: str | os.PathLike[str]) -> dict | None:
    """Check every file ``manifest.json`` lists: present, its size, its sha256.

    Returns ``{"files", "bytes"}`` when all match; None, with a one-line warning, for a folder without a manifest.
    Raises :class:`ExportCorruptError` naming the first file that is missing, of another size or whose checksum
    differs, or an unreadable manifest.
    """
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        if not (folder / "config.json").is_file():
            return None  # not an export at all: the caller's reading of config.json says so
        logger.warning("export: %s has no %s (exported before exports carried checksums, or copied without it): its "
                       "bytes cannot be verified; export it again to add one", folder, MANIFEST_FILE)
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("hash") != "sha256":
            raise ValueError(f"not an export manifest (format {manifest.get('format')!r}, hash "
                             f"{manifest.get('hash')!r})")
        files = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ExportCorruptError(f"{path}: unreadable ({error})") from None
    wrong = first_mismatch(folder, files, hash_name="sha256")
    if wrong is not None:
        raise ExportCorruptError(f"{folder / wrong.name}: {wrong.describe(MANIFEST_FILE, 'the export', 'sha256')}")
    total = sum(size for size, _ in files.values())
    return {"files": len(files), "bytes": total}


def write_safetensors(state: dict[str, torch.Tensor], folder: str | os.PathLike[str], *,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False) -> list[Path]:
    """Write ``state`` as ``model.safetensors``, or as shards plus ``model.safetensors.index.json``, with
    ``manifest.json``, as a folder of its own, all or nothing (module docstring; an earlier export in ``folder`` is
    replaced whole, so no stale shard is left behind). Returns the written weight files.

    Raises:
        FolderWriteError: ``folder`` holds something else, or writing failed (a full disk, a file-size limit).
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: must be > 0, got {max_shard_bytes}")
    out = Path(folder)
    with staged_folder(out, replaceable=is_export, what="safetensors export",
                       carry=lambda name: not _written_by_export(name)) as tmp:
        names = _write_weights(state, tmp, max_shard_bytes=max_shard_bytes, progress=progress)
        write_export_manifest(tmp)
    return [out / name for name in names]


def _write_weights(state: dict[str, torch.Tensor], out: Path, *, max_shard_bytes: int,
                   progress: bool) -> list[str]:
    """The weight files of ``state`` in the (new, empty) folder ``out``; returns their names."""
    from safetensors.torch import save_file

    shards = _shards(state, max_shard_bytes)
    names = ([SAFETENSORS_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(t.numel() * t.element_size() for t in state.values())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing safetensors")
    weight_map = {}
    try:
        for name, shard in zip(names, shards):
            # "format": "pt" is what transformers expects of PyTorch safetensors files.
            save_file({k: v.contiguous() for k, v in shard.items()}, str(out / name), metadata={"format": "pt"})
            # safetensors creates its files with mode 0600 whatever the umask; give them the mode open() gives the
            # other files of the folder (0666 less the umask), so whoever can read config.json can read the weights.
            os.chmod(out / name, 0o666 & ~_umask())
            weight_map.update({key: name for key in shard})
            if bar is not None:
                bar.update(sum(t.numel() * t.element_size() for t in shard.values()))
    finally:
        if bar is not None:
            bar.close()  # also on a failed write: the error line then starts a line of its own
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return names


def save_pretrained(model: nn.Module, tokenizer: Tokenizer | None, folder: str | os.PathLike[str], *,
                    dtype: torch.dtype | str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    progress: bool = False) -> Path:
    """Write ``model`` (a ``HolaTitanLM``, possibly FSDP-sharded) and ``tokenizer`` as a folder (module docstring).

    Args:
        model: the model; its ``args`` go into ``config.json``. With FSDP every rank must call this (the shards
            are gathered); only rank 0 writes.
        tokenizer: written beside the weights (None: weights and config only).
        folder: output folder, created if needed; an earlier export there is replaced only once the new one is
            complete, and a folder that is not an export is refused (module docstring).
        dtype: cast floating-point weights to this dtype (``torch.bfloat16`` or ``"bfloat16"``); None keeps them.
        max_shard_bytes: largest weight file; above it the weights are sharded with an index.
        progress: show a tqdm progress bar while writing.

    Returns:
        The folder.

    Raises:
        FolderWriteError: ``folder`` holds something else, or writing failed; ``folder`` is as it was.
    """
    import torch.distributed as dist

    target = resolve_dtype(dtype)
    args = _native(model).args
    state = export_state_dict(model)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return Path(folder)
    if target is not None:
        state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    stored = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    out = Path(folder)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: must be > 0, got {max_shard_bytes}")
    with staged_folder(out, replaceable=is_export, what="safetensors export",
                       carry=lambda name: not _written_by_export(name)) as tmp:
        _write_weights(state, tmp, max_shard_bytes=max_shard_bytes, progress=progress)
        config = config_dict(args, tokenizer, dtype=stored)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / REMOTE_CODE_FILE).write_text(_REMOTE_CODE, encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(tmp)
        write_export_manifest(tmp)  # last: it covers every file above
    return out


def read_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of an exported folder as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not an exported hola_titan folder)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # invalid UTF-8 or JSON
        raise ExportCorruptError(f"{path}: not a JSON file ({error})") from None
    if not isinstance(config, dict):
        raise ExportCorruptError(f"{path}: holds a {type(config).__name__}, not a JSON object")
    return config


def read_safetensors(folder: str | os.PathLike[str], *, device: torch.device | str = "cpu",
                     progress: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``; the bytes
    are not verified here (:func:`verify_export` does that). A file that is not whole safetensors raises
    :class:`ExportCorruptError` naming it."""
    from safetensors.torch import load_file

    out = Path(folder)
    if (out / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((out / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
            files = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ExportCorruptError(f"{out / INDEX_FILE}: unreadable ({type(error).__name__}: {error})") from None
    elif (out / SAFETENSORS_FILE).is_file():
        files, weight_map = [SAFETENSORS_FILE], None
    else:
        raise FileNotFoundError(f"{folder}: neither {SAFETENSORS_FILE} nor {INDEX_FILE}")
    if progress:
        from tqdm import tqdm

        files = tqdm(files, desc="reading safetensors", unit="file")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            part = load_file(str(out / name), device=str(device))
        except FileNotFoundError:
            raise ExportCorruptError(f"{out / name}: missing (listed in {INDEX_FILE})") from None
        except OSError as error:
            raise ExportCorruptError(f"{out / name}: cannot be read ({error.strerror})") from None
        except Exception as error:  # noqa: BLE001  (safetensors' SafetensorError: a truncated or damaged file)
            raise ExportCorruptError(f"{out / name}: not a readable safetensors file ({error})") from None
        if weight_map is not None:
            wrong = [k for k in part if weight_map.get(k) != name]
            if wrong:
                raise ValueError(f"{out / name}: holds {wrong[:3]} which {INDEX_FILE} does not map to it")
        state.update(part)
    if weight_map is not None and set(weight_map) != set(state):
        missing = sorted(set(weight_map) - set(state))
        raise ValueError(f"{folder}: {INDEX_FILE} lists keys no shard holds: {missing[:5]}")
    return state


def check_keys(expected: set[str], found: set[str], *, source: str) -> None:
    """Raise ``ValueError`` naming missing and unexpected weight names."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the model in config.json: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")


def load_pretrained(folder: str | os.PathLike[str], *, device: torch.device | str = "cpu",
                    dtype: torch.dtype | str | None = None, backend: str = "auto",
                    ) -> tuple[HolaTitanLM, Tokenizer | None]:
    """Load an exported folder as ``(HolaTitanLM in eval mode, Tokenizer or None)``; no process group needed.

    Args:
        folder: a folder written by :func:`save_pretrained` or ``scripts/convert_to_safetensors.py``.
        device: where the weights go.
        dtype: cast floating-point weights to this dtype; None keeps the stored dtype.
        backend: the token-mixer implementation (``HolaTitanLM(backend=...)``).

    Raises:
        FileNotFoundError: no config or weights. ExportCorruptError: a file differs from the manifest or is not
        readable, naming it. ValueError: a config or weight-name mismatch, naming the keys.
    """
    target = resolve_dtype(dtype)
    verify_export(folder)
    args = args_from_config(read_config(folder), source=f"{folder}/config.json")
    state = read_safetensors(folder, device=device)
    with torch.device("meta"):
        model = HolaTitanLM(args, backend=backend)
    check_keys(set(model.state_dict()), set(state), source=str(folder))
    # Shapes before load_state_dict, whose RuntimeError lists every mismatch with no word on which file to fix.
    wrong = [f"{name} {tuple(state[name].shape)} (config: {tuple(t.shape)})" for name, t in model.state_dict().items()
             if tuple(state[name].shape) != tuple(t.shape)]
    if wrong:
        raise ValueError(f"{folder}: the weights do not have the shapes {folder}/config.json describes (was it edited, "
                         f"or written for another model?): {len(wrong)} tensor(s), e.g. {'; '.join(wrong[:3])}")
    if target is not None:
        state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise ValueError(f"{folder}: tensors not loaded: {leftover[:5]}")
    tokenizer = load_tokenizer(folder) if (Path(folder) / "tokenizer.json").is_file() else None
    return model.eval(), tokenizer
