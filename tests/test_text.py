"""Incremental detokenization, stateless (postprocessing) and stateful (tensorrt_llm_bls): any split of a
token sequence decodes to exactly `decode(ids)`."""
from __future__ import annotations

import itertools
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from disagg.text import Detokenizer, IncrementalText, load_tokenizer, special_ids

TEXTS = [
    "café naïve façade",
    "東京タワー",
    "emoji 🙂🚀 mixed with text",
    "Unicode: über 東京 пример λ → ∞ ✓ 🙂",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return load_tokenizer(tiny_checkpoint)


@pytest.fixture(scope="module")
def detok(tokenizer) -> Detokenizer:
    return Detokenizer.from_tokenizer(tokenizer)


def streamed(detok: Detokenizer, ids: list[int], cuts: list[int], window: int | None = 3) -> list[str]:
    """Texts of responses ending at each cut; each carries `window` earlier tokens (None: all). The same
    split through IncrementalText must give the same texts."""
    out, prev = [], 0
    for k, cut in enumerate([*cuts, len(ids)]):
        start = 0 if window is None else max(0, prev - window)
        out.append(detok.incremental_text(ids[start:prev], ids[prev:cut], final=k == len(cuts)))
        prev = cut
    text = IncrementalText(detok)
    assert [text.add(ids[a:b], final=b == len(ids) and k == len(cuts)) for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(ids)]))] == out
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_every_two_and_three_way_split_matches_decode(tokenizer, detok, text):
    ids = [0, *tokenizer.encode(text).ids]  # with BOS: special tokens are skipped like decode() does
    expected = tokenizer.decode(ids)
    assert expected == text
    for cuts in itertools.chain(
        ([c] for c in range(len(ids) + 1)), itertools.combinations(range(len(ids) + 1), 2)
    ):
        assert "".join(streamed(detok, ids, list(cuts))) == expected, cuts
    assert "".join(streamed(detok, ids, list(range(len(ids))), window=None)) == expected


def test_one_token_per_response_emits_each_character_once_and_whole(tokenizer, detok):
    ids = tokenizer.encode("東").ids
    assert len(ids) > 1  # the character spans tokens: the test is about holding its bytes back
    chunks = streamed(detok, ids, list(range(1, len(ids))))
    assert chunks == [""] * (len(ids) - 1) + ["東"]


def test_random_ids_with_invalid_utf8_match_decode(tokenizer, detok):
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    for _ in range(2000):
        ids = [rng.randrange(vocab + 4) for _ in range(rng.randrange(12))]  # a few ids past the vocabulary
        cuts = sorted(rng.sample(range(len(ids) + 1), min(3, len(ids) + 1)))
        assert "".join(streamed(detok, ids, cuts)) == tokenizer.decode(ids), ids


def test_incomplete_bytes_become_replacement_only_when_final(tokenizer, detok):
    ids = tokenizer.encode("東").ids[:1]
    assert detok.incremental_text([], ids, final=False) == ""
    assert detok.incremental_text([], ids, final=True) == "\ufffd"
    assert detok.incremental_text(ids, [], final=True) == "\ufffd"  # flushed by an empty final response


def test_special_tokens_kept_when_not_skipped(tokenizer):
    keep = Detokenizer.from_tokenizer(tokenizer, skip_special_tokens=False)
    ids = [0, *tokenizer.encode("hi").ids, 1]
    assert keep.text(ids) == tokenizer.decode(ids, skip_special_tokens=False) == "<s>hi</s>"


def test_special_ids_come_from_tokenizer_config(tokenizer, tiny_checkpoint):
    ids = special_ids(tokenizer, tiny_checkpoint)
    assert (ids.bos, ids.eos, ids.pad) == (0, 1, None)


def _sentencepiece_tokenizer(decoder) -> Tokenizer:
    """Llama-2 style: "▁" word marks, <0xNN> byte fallback for characters outside the vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzü", "▁t", "he", "▁the"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoder
    return tok


@pytest.mark.parametrize(
    "decoder",
    [
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]),
        decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="always"), decoders.ByteFallback()]),
    ],
    ids=["replace-bytefallback-strip", "metaspace"],
)
def test_sentencepiece_style_tokenizers(decoder):
    tok = _sentencepiece_tokenizer(decoder)
    detok = Detokenizer.from_tokenizer(tok)
    ids = tok.encode("the café über 東京 🙂 the end").ids
    expected = tok.decode(ids)
    assert "<0x" in "".join(tok.id_to_token(i) for i in ids)  # byte fallback is exercised
    for cut in range(len(ids) + 1):
        assert "".join(streamed(detok, ids, [cut])) == expected
    assert "".join(streamed(detok, ids, list(range(len(ids))))) == expected


def test_unsupported_decoder_is_refused():
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="unsupported tokenizer decoder.*WordPiece"):
        Detokenizer.from_tokenizer(tok)
