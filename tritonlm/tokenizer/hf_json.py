"""Reading a Hugging Face ``tokenizer.json``: its pre-tokenizer pattern, normaliser, post-processor template (the
special ids ``add_special_tokens=True`` puts around a text), and whether it is a SentencePiece-style BPE."""

from __future__ import annotations

from pathlib import Path

from .pretokenize import GPT2_PATTERN


def _hf_pattern(file: Path, pre: dict | None) -> str:
    """The pre-tokenisation regex of a tokenizer.json ``pre_tokenizer``: GPT-2's ``ByteLevel`` (its own regex), or a
    ``Sequence`` of one isolating ``Split`` regex and a regex-free ``ByteLevel`` (Llama 3, Qwen 2)."""
    def bad(why: str):
        return ValueError(f"{file}: pre_tokenizer {why}: only byte-level pre-tokenisers are supported")

    if not pre:
        raise bad("is missing")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in steps if p.get("type") == "ByteLevel"]
    splits = [p for p in steps if p.get("type") == "Split"]
    others = [p.get("type") for p in steps if p.get("type") not in ("ByteLevel", "Split")]
    if others or len(byte_level) != 1 or len(splits) > 1:
        raise bad(f"steps {[p.get('type') for p in steps]}")
    if byte_level[0].get("add_prefix_space"):
        raise bad("ByteLevel.add_prefix_space=true")
    if not splits:
        if not byte_level[0].get("use_regex", True):
            raise bad("ByteLevel without a regex")
        return GPT2_PATTERN
    split = splits[0]
    if byte_level[0].get("use_regex", True):
        raise bad("has both a Split and ByteLevel's own regex")
    regex_text = (split.get("pattern") or {}).get("Regex")
    if regex_text is None or split.get("behavior") != "Isolated" or split.get("invert"):
        raise bad(f"Split {split.get('pattern')} / behavior {split.get('behavior')!r} (needs an isolating Regex)")
    return regex_text


def _hf_normalization(file: Path, norm: dict | None) -> str | None:
    steps = (norm.get("normalizers") if norm.get("type") == "Sequence" else [norm]) if norm else []
    kinds = [n.get("type") for n in steps]
    if not kinds:
        return None
    if kinds == ["NFC"]:
        return "NFC"
    raise ValueError(f"{file}: normalizer {kinds} is not supported (only NFC)")




def _hf_template(file: Path, post) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a tokenizer.json's post-processor puts before and after a single text: TemplateProcessing's
    ``single`` (Llama 3's ``<|begin_of_text|> $A``), Roberta/Bert's cls ... sep, nothing for ByteLevel; a Sequence
    combines its steps. Other post-processors are a ``ValueError`` naming the type."""
    if not post:
        return (), ()
    kind = post.get("type")
    if kind == "Sequence":
        before, after = [], []
        for step in post.get("processors", []):
            b, a = _hf_template(file, step)
            before, after = before + list(b), list(a) + after
        return tuple(before), tuple(after)
    if kind == "ByteLevel":
        return (), ()
    if kind in ("RobertaProcessing", "BertProcessing"):
        return (int(post["cls"][1]),), (int(post["sep"][1]),)
    if kind == "TemplateProcessing":
        specials = post.get("special_tokens", {})
        before, after, seen_text = [], [], False
        for piece in post.get("single", []):
            if "Sequence" in piece:
                seen_text = True
                continue
            name = piece.get("SpecialToken", {}).get("id")
            if name not in specials:
                raise ValueError(f"{file}: post_processor template names an unknown special token {name!r}")
            (after if seen_text else before).extend(int(i) for i in specials[name]["ids"])
        return tuple(before), tuple(after)
    raise ValueError(f"{file}: post_processor type {kind!r} is not supported")


def _sentencepiece_style(spec: dict) -> bool:
    """A tokenizer.json of SentencePiece-style BPE (Llama 2, Mistral 7B, Gemma, Phi-3): byte fallback, a Metaspace
    pre-tokenizer, or spaces replaced by ``▁`` in the normalizer."""
    if (spec.get("model") or {}).get("byte_fallback"):
        return True
    pre = spec.get("pre_tokenizer") or {}
    norm = spec.get("normalizer") or {}
    steps = (pre.get("pretokenizers") or []) + [pre] + (norm.get("normalizers") or []) + [norm]
    return any(s.get("type") in ("Metaspace", "Prepend") or (s.get("type") == "Replace" and s.get("content") == "\u2581")
               for s in steps if s)


