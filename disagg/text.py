"""Token ids <-> text with a Hugging Face `tokenizers` tokenizer, including stateless streaming decode.

A streaming response carries a few already-sent tokens (the prefix) before the new ones. Text is
computed from raw bytes: a table maps every token id to the bytes it stands for, the prefix's trailing
bytes seed a UTF-8 decoder and only characters completed by the new tokens come out. So a multi-byte
character split across responses is emitted whole, exactly once, by a postprocessing model that keeps no
state between calls, and concatenating every response's text equals `tokenizer.decode(ids)`.
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"  # "▁", sentencepiece's word-boundary mark
_MAX_CARRY = 3  # bytes of an incomplete UTF-8 character (a character is at most 4 bytes)


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character standing for each byte in ByteLevel
    vocabularies (printable Latin-1 maps to itself, the rest to U+0100 onwards)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


def _decoder_steps(decoder: dict | None) -> list[dict]:
    if decoder is None:
        raise ValueError("tokenizer has no decoder; only ByteLevel and sentencepiece-style decoders are supported")
    if decoder["type"] == "Sequence":
        return [step for d in decoder["decoders"] for step in _decoder_steps(d)]
    return [decoder]


@dataclass(frozen=True)
class Detokenizer:
    """Token id -> raw bytes, built once from a tokenizer (ids outside the table decode to nothing, like
    `Tokenizer.decode`). `strip_leading_space`: sentencepiece decoders drop the space that the first
    token's "▁" stands for."""

    token_bytes: tuple[bytes, ...] = field(repr=False)
    strip_leading_space: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> Detokenizer:
        steps = _decoder_steps(json.loads(tokenizer.to_str()).get("decoder"))
        kinds = {s["type"] for s in steps}
        unsupported = kinds - {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
        if unsupported:
            raise ValueError(f"unsupported tokenizer decoder(s): {', '.join(sorted(unsupported))}")
        if any(s["type"] == "Replace" and (s["pattern"], s["content"]) != ({"String": _METASPACE}, " ") for s in steps):
            raise ValueError("unsupported tokenizer decoder: a Replace other than \"\u2581\" -> \" \"")
        byte_level = "ByteLevel" in kinds
        unicode_to_byte = _unicode_to_byte()
        strip = any(
            (s["type"] == "Strip" and s["content"] == " " and s["start"] >= 1)
            or (s["type"] == "Metaspace" and s.get("prepend_scheme", "always") != "never"
                and s.get("add_prefix_space", True))  # older tokenizer.json files spell it this way
            for s in steps
        )

        def to_bytes(token: str) -> bytes:
            if byte_level:
                return b"".join(bytes([unicode_to_byte[c]]) if c in unicode_to_byte else c.encode() for c in token)
            match = _BYTE_TOKEN.fullmatch(token)
            if match and "ByteFallback" in kinds:
                return bytes([int(match.group(1), 16)])
            return token.replace(_METASPACE, " ").encode()

        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1  # ids may have holes
        table = []
        for i in range(size):
            token = tokenizer.id_to_token(i)
            table.append(b"" if token is None or (skip_special_tokens and i in special) else to_bytes(token))
        return cls(tuple(table), strip)

    def _bytes(self, ids: Iterable[int]) -> bytes:
        table, n = self.token_bytes, len(self.token_bytes)
        return b"".join(table[i] if 0 <= i < n else b"" for i in ids)

    def _tail(self, ids: Sequence[int]) -> bytes:
        """The last few bytes of `ids` (enough to hold an incomplete character), walking back from the end."""
        tail = b""
        for i in reversed(ids):
            tail = self._bytes([int(i)]) + tail
            if len(tail) >= _MAX_CARRY:
                break
        return tail

    def incremental_text(self, prefix_ids: Sequence[int], new_ids: Sequence[int], final: bool = False) -> str:
        """Text of the complete characters that end within `new_ids`' bytes.

        `prefix_ids` are tokens whose text was already emitted; they must cover at least the last 3 bytes
        before `new_ids` (a character split across responses starts there). Trailing bytes of an
        incomplete character are held back for the next call, or become U+FFFD when `final`.
        """
        carry = self._tail(prefix_ids)
        new = self._bytes(int(i) for i in new_ids)
        if self.strip_leading_space and not carry:  # no byte before these: they start the text
            new = new.removeprefix(b" ")
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(carry)  # already emitted, or waiting for the rest of its character
        return decoder.decode(new, final)

    def text(self, ids: Sequence[int]) -> str:
        """The whole sequence's text, as `tokenizer.decode(ids)` gives it."""
        return self.incremental_text((), ids, final=True)


class IncrementalText:
    """One sequence's text as its tokens arrive, for a model that sees every response of the sequence
    (tensorrt_llm_bls): each `add` gives the complete characters its tokens end and holds back an
    incomplete one (U+FFFD once `final`), decoding only the new tokens' bytes. Equal to
    `Detokenizer.incremental_text` on any split, which re-reads a few earlier tokens because postprocessing
    keeps no state between responses."""

    def __init__(self, detokenizer: Detokenizer):
        self.detokenizer = detokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.started = False  # a token with bytes came: the text's leading space is behind us

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        data = self.detokenizer._bytes(ids)
        if self.detokenizer.strip_leading_space and not self.started:
            data, self.started = data.removeprefix(b" "), bool(data)
        return self.utf8.decode(data, final)


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    pad: int | None


def load_tokenizer(tokenizer_dir: str | Path) -> Tokenizer:
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the tokenizer directory must hold a Hugging Face tokenizer.json")
    return Tokenizer.from_file(str(path))


def _read_json(tokenizer_dir: str | Path, name: str) -> dict:
    path = Path(tokenizer_dir) / name
    return json.loads(path.read_text()) if path.is_file() else {}


def special_ids(tokenizer: Tokenizer, tokenizer_dir: str | Path) -> SpecialIds:
    """BOS/EOS/PAD ids from tokenizer_config.json's token names, else config.json's *_token_id."""
    tok_config, model_config = _read_json(tokenizer_dir, "tokenizer_config.json"), _read_json(tokenizer_dir, "config.json")

    def lookup(kind: str) -> int | None:
        token = tok_config.get(f"{kind}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
        value = model_config.get(f"{kind}_token_id")
        return value[0] if isinstance(value, list) else value

    return SpecialIds(bos=lookup("bos"), eos=lookup("eos"), pad=lookup("pad"))


def encode_prompt(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids as preprocessing hands them to the engines.

    With `add_special_tokens` (the default, as in upstream's preprocessing model) tokenizer.json's own
    post-processor adds what the checkpoint defines: BOS for most Llama checkpoints, nothing for the
    generated tiny one. That equals `AutoTokenizer.from_pretrained(dir)(text).input_ids` of transformers
    >= 5, which takes the post-processor from tokenizer.json whenever there is one (it drops
    tokenizer_config.json's add_bos_token/add_eos_token then). See `special_tokens_note` for the
    checkpoints on which transformers 4.x differs.
    """
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def added_special_tokens(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids tokenizer.json's post-processor puts before and after a single sequence: ((bos,), ()) for
    a Llama tokenizer, ((), ()) for one without a post-processor."""
    enc = tokenizer.encode("a")
    own = [i for i, s in enumerate(enc.sequence_ids) if s is not None]  # None: added by the post-processor
    if not own:
        return tuple(enc.ids), ()
    return tuple(enc.ids[: own[0]]), tuple(enc.ids[own[-1] + 1 :])


_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def special_tokens_note(tokenizer: Tokenizer, tokenizer_dir: str | Path) -> str | None:
    """A warning for the one case where transformers versions disagree on this checkpoint's prompts, else None.

    transformers 4.x loads a Llama checkpoint (tokenizer_class LlamaTokenizer[Fast], or none and
    config.json's model_type "llama") as LlamaTokenizerFast, whose __init__ replaces tokenizer.json's
    post-processor with one built from tokenizer_config.json's add_bos_token (default true) and
    add_eos_token (default false). transformers >= 5 and every other tokenizer class keep tokenizer.json's
    post-processor, as `encode_prompt` does. When the two give different special tokens, say so.
    """
    tok_config, model_config = _read_json(tokenizer_dir, "tokenizer_config.json"), _read_json(tokenizer_dir, "config.json")
    cls = tok_config.get("tokenizer_class")
    if not (cls in _LLAMA_CLASSES or (cls is None and model_config.get("model_type") == "llama")):
        return None
    ids = special_ids(tokenizer, tokenizer_dir)
    want_bos, want_eos = bool(tok_config.get("add_bos_token", True)), bool(tok_config.get("add_eos_token", False))
    rebuilt = ((ids.bos,) if want_bos and ids.bos is not None else (), (ids.eos,) if want_eos and ids.eos is not None else ())
    actual = added_special_tokens(tokenizer)
    if rebuilt == actual:
        return None
    return (
        f"{tokenizer_dir}: tokenizer.json's post-processor adds {list(actual[0])} before and {list(actual[1])} after a "
        f"prompt, but tokenizer_config.json (add_bos_token={want_bos}, add_eos_token={want_eos}) asks for "
        f"{list(rebuilt[0])} and {list(rebuilt[1])}; prompts follow tokenizer.json, as transformers >= 5 does "
        "(transformers 4.x's LlamaTokenizerFast would follow tokenizer_config.json); "
        "set the spec's model.add_special_tokens: false to add none"
    )
