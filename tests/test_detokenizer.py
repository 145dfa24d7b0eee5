"""Streaming detokenization: whole characters only, never an exception, same text as a full decode."""

from __future__ import annotations

import random

import pytest

from basert.engine.detokenizer import IncrementalDetokenizer
from basert.tokenizer import Tokenizer

TEXTS = [
    "桜の花が咲いた",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 and 🧑🏽‍💻",
    "flags 🇯🇵🇫🇷🇩🇪",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅",
    "Hello, 世界! Ça va? 🦙 x² — naïve café, Việt Nam, กินข้าว, мир",
]


@pytest.fixture(params=["qwen35", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tokenizer")


def byte_token(tokenizer: Tokenizer, value: int) -> int:
    """The id of the token that stands for the single byte `value`."""
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == bytes([value]))


def stream(tokenizer: Tokenizer, ids: list[int], *, skip_special: bool = False) -> list[str]:
    """Every push output, then the flush output."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special=skip_special)
    outputs = [detokenizer.push(i) for i in ids]
    outputs.append(detokenizer.flush())
    assert detokenizer.text == "".join(outputs)
    return outputs


@pytest.mark.parametrize("text", TEXTS, ids=["cjk", "zwj", "flags", "emoji", "mixed"])
def test_streaming_valid_text_gives_whole_characters(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    outputs = stream(tokenizer, ids)
    assert "".join(outputs) == text == tokenizer.decode(ids)
    assert all("\ufffd" not in piece for piece in outputs)
    # A multi-byte character split over tokens shows up as an empty push before the one that completes it.
    assert "" in outputs[:-1]


def test_sakura_no_qwen35(qwen35_tokenizer: Tokenizer) -> None:
    ids = qwen35_tokenizer.encode("桜の")
    assert [qwen35_tokenizer.token_bytes(i) for i in ids] == [b"\xe6\xa1", b"\x9c", b"\xe3\x81\xae"]
    assert stream(qwen35_tokenizer, ids) == ["", "桜", "の", ""]


def test_sakura_no_smollm2(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("桜の")
    assert [smollm2_tokenizer.token_bytes(i) for i in ids] == [b"\xe6", b"\xa1", b"\x9c", b"\xe3\x81\xae"]
    assert stream(smollm2_tokenizer, ids) == ["", "", "桜", "の", ""]


@pytest.mark.parametrize(
    ("byte_values", "outputs"),
    [
        # 0xAD on its own: a continuation byte with no lead is replaced at once.
        ([0xAD], ["\ufffd", ""]),
        # After the lead 0xE6 it is a valid second byte; 0x9C completes U+6B5C.
        ([0xE6, 0xAD, 0x9C], ["", "", "歜", ""]),
        # Lead and 0xAD with nothing after them: replaced only at the end of the stream.
        ([0xE6, 0xAD], ["", "", "\ufffd"]),
        # A stray continuation after a complete character.
        ([0xE6, 0xA1, 0x9C, 0xAD], ["", "", "桜", "\ufffd", ""]),
        # A lead followed by a non-continuation byte: the lead is replaced, the next byte kept.
        ([0xE6, 0x41], ["", "\ufffdA", ""]),
        # 0xED 0xA0 starts a UTF-16 surrogate, which UTF-8 forbids: replaced without waiting.
        ([0xED, 0xA0], ["", "\ufffd\ufffd", ""]),
        ([0xED, 0x9F, 0xBF], ["", "", "\ud7ff", ""]),
    ],
    ids=["alone", "completed", "unfinished", "stray", "broken-lead", "surrogate", "last-before-surrogates"],
)
def test_raw_byte_tokens(tokenizer: Tokenizer, byte_values: list[int], outputs: list[str]) -> None:
    ids = [byte_token(tokenizer, value) for value in byte_values]
    assert stream(tokenizer, ids) == outputs
    assert "".join(outputs) == tokenizer.decode(ids)


def test_special_tokens_kept_or_skipped(qwen35_tokenizer: Tokenizer) -> None:
    ids = qwen35_tokenizer.encode("<|im_start|>assistant\n桜<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    assert "".join(stream(qwen35_tokenizer, ids)) == "<|im_start|>assistant\n桜<|im_end|>"
    skipped = stream(qwen35_tokenizer, ids, skip_special=True)
    assert skipped[0] == "" and skipped[-2] == ""
    assert "".join(skipped) == "assistant\n桜" == qwen35_tokenizer.decode(ids, skip_special=True)


def test_skipped_special_token_inside_a_character(qwen35_tokenizer: Tokenizer) -> None:
    # A skipped token adds no bytes, so the character around it still completes, as in decode.
    ids = [byte_token(qwen35_tokenizer, 0xE6), 151645, byte_token(qwen35_tokenizer, 0xA1), 250]
    assert stream(qwen35_tokenizer, ids, skip_special=True) == ["", "", "", "桜", ""]
    assert qwen35_tokenizer.decode(ids, skip_special=True) == "桜"
    kept = stream(qwen35_tokenizer, ids)
    assert kept == ["", "\ufffd<|im_end|>", "\ufffd", "\ufffd", ""]
    assert "".join(kept) == qwen35_tokenizer.decode(ids)


def test_ids_beyond_the_vocabulary_add_nothing(qwen35_tokenizer: Tokenizer) -> None:
    # Model heads can be wider than the vocabulary; decode ignores such ids and so does the stream.
    ids = [9707, qwen35_tokenizer.vocab_size, qwen35_tokenizer.vocab_size + 77, 1879]
    assert stream(qwen35_tokenizer, ids) == ["Hello", "", "", " world", ""]
    assert qwen35_tokenizer.decode(ids) == "Hello world"


def test_random_ids_never_raise_and_match_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(20240607)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size + 64) for _ in range(rng.randrange(1, 40))]
        skip_special = rng.random() < 0.5
        outputs = stream(tokenizer, ids, skip_special=skip_special)
        assert "".join(outputs) == tokenizer.decode(ids, skip_special=skip_special)


def test_random_byte_tokens_never_raise_and_match_decode(tokenizer: Tokenizer) -> None:
    single_bytes = [i for i in range(tokenizer.vocab_size) if len(tokenizer.token_bytes(i)) == 1]
    assert len(single_bytes) >= 235
    rng = random.Random(7)
    for _ in range(2000):
        ids = [rng.choice(single_bytes) for _ in range(rng.randrange(1, 12))]
        outputs = stream(tokenizer, ids)
        assert "".join(outputs) == tokenizer.decode(ids)
        # Lone surrogates (half characters) would make the UTF-8 encoding raise.
        assert b"".join(piece.encode("utf-8") for piece in outputs).decode("utf-8") == "".join(outputs)
