"""Byte-level BPE: a fast trainer and a GPT-2-compatible encoder, plus Hugging Face tokenizer.json files (byte-level
and SentencePiece-style BPE). A package split by job; every name is re-exported here:

* :mod:`.pretokenize`: GPT-2's, Llama 3's and Qwen 2's pre-tokenisation patterns, the fast ASCII path, special
  tokens split out first, the file chunking the trainer's worker processes share;
* :mod:`.training`: :func:`train_bpe` (incremental merges, exactly the naive algorithm's result);
* :mod:`.gpt2_format`: GPT-2's ``vocab.json`` / ``merges.txt`` byte-to-character map;
* :mod:`.encoder`: :class:`Tokenizer` (``encode``, ``encode_iterable``, ``decode``, ``from_files``, ``from_hf``,
  ``save``);
* :mod:`.hf_json`: what a ``tokenizer.json`` says (pattern, normaliser, post-processor template);
* :mod:`.sentencepiece_bpe`: SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma, Phi-3);
* :mod:`.files`: :func:`encode_file` (a text file to a token array, in parallel) and :func:`first_invalid_utf8`;
* :mod:`.directories`: tokenizer directories (:func:`find_tokenizer_files`, :func:`load_tokenizer`).
"""

from .directories import (
    HF_TOKENIZER_FILE,
    SPECIAL_TOKENS,
    SPECIAL_TOKENS_FILE,
    find_tokenizer_files,
    load_tokenizer,
    read_special_tokens,
    tokenizer_dir,
)
from .encoder import (
    ENCODE_CACHE_ENTRIES,
    LONG_PIECE_BYTES,
    STREAM_BUFFER_CHARS,
    STREAM_CACHE_ENTRIES,
    Tokenizer,
)
from .files import encode_file, first_invalid_utf8
from .pretokenize import (
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    NEWLINE_CUT_PATTERNS,
    PRETOKEN_BLOCK_CHARS,
    QWEN2_PATTERN,
    _pretokens,
    count_pretokens_file,
)
from .sentencepiece_bpe import SentencePieceBPE
from .training import Merges, Vocab, train_bpe

__all__ = ["Tokenizer", "train_bpe", "encode_file", "first_invalid_utf8", "load_tokenizer", "find_tokenizer_files",
           "tokenizer_dir", "read_special_tokens", "count_pretokens_file", "SentencePieceBPE", "GPT2_PATTERN",
           "LLAMA3_PATTERN", "QWEN2_PATTERN", "NEWLINE_CUT_PATTERNS", "PRETOKEN_BLOCK_CHARS", "SPECIAL_TOKENS",
           "SPECIAL_TOKENS_FILE", "HF_TOKENIZER_FILE", "LONG_PIECE_BYTES", "STREAM_BUFFER_CHARS",
           "STREAM_CACHE_ENTRIES", "ENCODE_CACHE_ENTRIES", "Vocab", "Merges", "_pretokens"]
