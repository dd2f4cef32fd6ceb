"""A small wrapper around a Hugging Face ``tokenizers`` tokenizer, and :func:`load_tokenizer`.

The wrapper encodes plain text without adding any special token (no BOS, no EOS: the packer appends the EOS after
each document itself) and encodes text that happens to spell a special token (``"<|endoftext|>"``) as ordinary
text, so that the only EOS ids in a packed stream are the document separators.

``path`` forms accepted by :func:`load_tokenizer`:

* ``"bundled"``: ``hola_titan/assets/tokenizer`` (byte-level BPE, 8192 entries, ``<|endoftext|>`` = 0,
  ``<|pad|>`` = 1, trained on the bundled corpus by ``scripts/build_bundled_data.py``);
* a folder holding ``tokenizer.json`` (e.g. a downloaded HF model folder such as the Mistral 32k tokenizer);
* a ``tokenizer.json`` file.

The EOS and pad tokens come from ``tokenizer_config.json`` / ``special_tokens_map.json`` beside ``tokenizer.json``
when present, otherwise from a list of common names (``<|endoftext|>``, ``</s>``, ...). A tokenizer without a pad
token pads with its EOS id.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

BUNDLED = "bundled"
"""The ``path`` / ``dataset`` value that selects what ships with the package."""

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
BUNDLED_TOKENIZER_DIR = ASSETS_DIR / "tokenizer"

_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


class Tokenizer:
    """Text <-> token ids, with the ids the data pipeline needs (``eos_id``, ``pad_id``, ``vocab_size``).

    Args:
        backend: a ``tokenizers.Tokenizer``; the wrapper keeps its own copy.
        eos_token: end-of-document token, also the document separator in packed rows.
        pad_token: padding token; None pads with ``eos_token``.
        name: where the tokenizer came from, for messages.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token: str, pad_token: str | None = None,
                 name: str = "") -> None:
        self._serialized = backend.to_str()
        self._backend = tokenizers.Tokenizer.from_str(self._serialized)
        # Text that spells a special token stays text; see the module docstring.
        self._backend.encode_special_tokens = True
        self.name = name
        self.eos_token = eos_token
        self.pad_token = pad_token if pad_token is not None else eos_token
        eos_id = self._backend.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer {name!r}: EOS token {eos_token!r} is not in the vocabulary")
        pad_id = self._backend.token_to_id(self.pad_token)
        if pad_id is None:
            raise ValueError(f"tokenizer {name!r}: pad token {self.pad_token!r} is not in the vocabulary")
        self.eos_id: int = eos_id
        self.pad_id: int = pad_id
        added = [int(i) for i in self._backend.get_added_tokens_decoder()]
        self.vocab_size: int = max([self._backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
        self._fingerprint: str | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with no special tokens added."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text (in parallel threads inside ``tokenizers``)."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are written out (``<|endoftext|>``), not dropped."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer definition and its EOS/pad choice; equal fingerprints encode identically."""
        if self._fingerprint is None:
            digest = hashlib.sha256(self._serialized.encode("utf-8"))
            digest.update(f"\0{self.eos_token}\0{self.pad_token}".encode())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``folder``.

        The folder loads back with :func:`load_tokenizer` and with ``transformers.AutoTokenizer.from_pretrained``.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(self._serialized, encoding="utf-8")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        special = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
        return out

    def __repr__(self) -> str:
        return (f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"pad_id={self.pad_id})")


def _token_content(value: Any) -> str | None:
    """A special token as written in ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    return data if isinstance(data, dict) else {}


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load ``"bundled"``, a folder with ``tokenizer.json``, or a ``tokenizer.json`` file (module docstring).

    Raises:
        FileNotFoundError: ``path`` does not exist, or the folder has no ``tokenizer.json``.
        ValueError: the file is not a ``tokenizers`` JSON file, or no EOS token can be identified.
    """
    name = os.fspath(path)
    if name == BUNDLED:
        file = BUNDLED_TOKENIZER_DIR / "tokenizer.json"
    else:
        given = Path(name).expanduser()
        if given.is_dir():
            file = given / "tokenizer.json"
            if not file.is_file():
                raise FileNotFoundError(f"tokenizer path {name!r}: the folder has no tokenizer.json")
        elif given.is_file():
            file = given
        else:
            raise FileNotFoundError(f"tokenizer path {name!r} does not exist (expected 'bundled', a folder with "
                                    "tokenizer.json, or a tokenizer.json file)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"tokenizer path {name!r}: {file} is not a Hugging Face tokenizer.json ({error})") from error

    config = {**_read_json(file.parent / "special_tokens_map.json"),
              **_read_json(file.parent / "tokenizer_config.json")}
    vocab = backend.get_vocab(with_added_tokens=True)
    eos = _token_content(config.get("eos_token"))
    if eos is None or eos not in vocab:
        eos = next((t for t in _EOS_NAMES if t in vocab), None)
    if eos is None:
        raise ValueError(f"tokenizer path {name!r}: cannot tell which token is EOS; add a tokenizer_config.json "
                         f"with an eos_token beside {file.name} (looked for {', '.join(_EOS_NAMES)})")
    pad = _token_content(config.get("pad_token"))
    if pad is None or pad not in vocab:
        pad = next((t for t in _PAD_NAMES if t in vocab), None)
    return Tokenizer(backend, eos_token=eos, pad_token=pad, name=name)
