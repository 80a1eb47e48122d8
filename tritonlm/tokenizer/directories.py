"""Tokenizer directories: which files define one (GPT-2's vocab.json + merges.txt with special_tokens.json, or a
Hugging Face tokenizer.json), and loading it."""

from __future__ import annotations

import json
from pathlib import Path

from .._base import TrainError
from .encoder import Tokenizer

#: The special tokens ``tritonlm train`` trains a tokenizer with (documents end with it).
SPECIAL_TOKENS = ["<|endoftext|>"]


def find_tokenizer_files(location) -> tuple[Path, ...]:
    """The files that define a tokenizer directory: a Hugging Face ``tokenizer.json``, else ``vocab.json`` and
    ``merges.txt`` (or GPT-2's ``*vocab.json``/``*merges.txt``)."""
    loc = Path(location)
    if loc.is_file() and loc.name == HF_TOKENIZER_FILE:  # a tokenizer.json named directly
        return (loc,)
    if not loc.is_dir():
        raise TrainError(f"tokenizer not found: {loc} (a directory, or its tokenizer.json)")
    if (loc / HF_TOKENIZER_FILE).is_file():
        return (loc / HF_TOKENIZER_FILE,)
    vocab = sorted(loc.glob("*vocab.json"))
    merges = sorted(loc.glob("*merges.txt"))
    if len(vocab) != 1 or len(merges) != 1:
        raise TrainError(f"{loc} must hold a tokenizer.json, or exactly one *vocab.json and one *merges.txt")
    return vocab[0], merges[0]


def tokenizer_dir(location) -> Path:
    """The tokenizer directory of ``--tokenizer``: the directory itself, or the one holding a tokenizer.json
    named directly (so checkpoints and resumes record a directory)."""
    loc = Path(location)
    find_tokenizer_files(loc)  # a one-line error now when there is no tokenizer there
    return loc.parent if loc.is_file() else loc


SPECIAL_TOKENS_FILE = "special_tokens.json"
HF_TOKENIZER_FILE = "tokenizer.json"


def read_special_tokens(location) -> list[str]:
    """The special tokens a tokenizer directory was trained with (``special_tokens.json``, written beside
    vocab.json by ``tritonlm train`` / ``tritonlm tokenize``); ``<|endoftext|>`` for directories without one
    (GPT-2's own files)."""
    path = Path(location) / SPECIAL_TOKENS_FILE
    if not path.exists():
        return list(SPECIAL_TOKENS)
    try:
        tokens = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TrainError(f"{path}: not a JSON list of special tokens ({type(e).__name__})") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise TrainError(f"{path}: must be a JSON list of non-empty strings")
    return tokens


def load_tokenizer(location) -> Tokenizer:
    """The tokenizer of a directory (or a tokenizer.json named directly): a Hugging Face tokenizer.json, or
    vocab.json + merges.txt with the directory's special tokens."""
    files = find_tokenizer_files(location)
    if files[0].name == HF_TOKENIZER_FILE:
        try:
            return Tokenizer.from_hf(files[0])
        except ValueError as e:
            raise TrainError(str(e)) from None
    vocab, merges = files
    specials = read_special_tokens(location)
    try:
        return Tokenizer.from_files(vocab, merges, specials)
    except (ValueError, KeyError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise TrainError(f"tokenizer {vocab} / {merges} is not a GPT-2 vocab.json + merges.txt pair: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
