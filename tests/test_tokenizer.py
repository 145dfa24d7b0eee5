"""Tokenizers built from GGUF metadata and from Hugging Face files, checked against recorded token ids."""

from __future__ import annotations

import json
import lzma
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from basert.convert.tokenizer_source import (
    TokenizerSourceError,
    tokenizer_object_from_hf,
    tokenizer_object_from_path,
)
from basert.tokenizer import BYTE_LEVEL_CHARS, Tokenizer, TokenizerError

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB_DIR = FIXTURES / "tokenizers"
QWEN35_GGUF_XZ = VOCAB_DIR / "ggml-vocab-qwen35.gguf.xz"
SMOLLM2_REFERENCE = FIXTURES / "smollm2" / "reference.json"


def vocab_cases(vocab: str = "qwen35") -> list[tuple[str, list[int]]]:
    """The llama.cpp test-tokenizer-0 vectors: texts end with a separator line, one id line per text."""
    # Bytes, not read_text(): universal newlines would turn a "\r" in a text into "\n".
    inp = (VOCAB_DIR / f"ggml-vocab-{vocab}.gguf.inp").read_bytes().decode("utf-8")
    out = (VOCAB_DIR / f"ggml-vocab-{vocab}.gguf.out").read_bytes().decode("utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""
    lines = out.split("\n")
    assert lines[-1] == ""
    pairs = zip(texts[:-1], lines[:-1], strict=True)
    return [(text, [int(i) for i in line.split()]) for text, line in pairs]


VOCAB_CASES = vocab_cases()
SPM_CASES = vocab_cases("llama-spm")
SMOLLM2_PROMPTS = {
    prompt["name"]: prompt for prompt in json.loads(SMOLLM2_REFERENCE.read_text(encoding="utf-8"))["prompts"]
}


@pytest.fixture(scope="session")
def qwen35_object(qwen35_tokenizer_object: dict) -> dict:
    return qwen35_tokenizer_object


@pytest.fixture(scope="session")
def qwen35(qwen35_tokenizer: Tokenizer) -> Tokenizer:
    return qwen35_tokenizer


@pytest.fixture(scope="session")
def smollm2_object(smollm2_tokenizer_object: dict) -> dict:
    return smollm2_tokenizer_object


@pytest.fixture(scope="session")
def smollm2(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


def test_vocab_vectors_parse_into_fifty_cases() -> None:
    assert len(VOCAB_CASES) == 50
    assert VOCAB_CASES[0] == ("ied 4 ½ months", [1122, 220, 19, 220, 26062, 3951])
    assert VOCAB_CASES[2] == ("", [])


@pytest.mark.parametrize(
    ("text", "expected"), VOCAB_CASES, ids=[f"case{i:02d}" for i in range(len(VOCAB_CASES))]
)
def test_qwen35_gguf_matches_llama_cpp_vectors(qwen35: Tokenizer, text: str, expected: list[int]) -> None:
    assert qwen35.encode(text) == expected


def test_gguf_object_holds_every_tokenizer_key(qwen35_object: dict) -> None:
    assert set(qwen35_object) == {
        "tokenizer_type",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.chat_template",
    }
    assert qwen35_object["tokenizer_type"] == "gguf"
    assert qwen35_object["tokenizer.ggml.model"] == "gpt2"
    assert qwen35_object["tokenizer.ggml.pre"] == "qwen35"
    assert len(qwen35_object["tokenizer.ggml.tokens"]) == 151936
    assert qwen35_object["tokenizer.ggml.tokens"][:3] == ["!", '"', "#"]
    assert qwen35_object["tokenizer.ggml.merges"][:3] == ["Ġ Ġ", "ĠĠ ĠĠ", "i n"]
    assert len(qwen35_object["tokenizer.ggml.merges"]) == 151387
    assert Counter(qwen35_object["tokenizer.ggml.token_type"]) == {1: 151643, 4: 290, 3: 3}
    assert qwen35_object["tokenizer.ggml.bos_token_id"] == 151643
    assert qwen35_object["tokenizer.chat_template"].startswith("{% for message in messages %}")


@pytest.mark.slow
def test_the_converted_header_keeps_the_gguf_tokenizer_object(qwen35_vocab_gguf: Path, qwen35_object: dict) -> None:
    """The object the other checks read from a converted model's header is the GGUF's, parsed anew."""
    parsed = tokenizer_object_from_path(qwen35_vocab_gguf)
    assert parsed == qwen35_object
    assert json.loads(json.dumps(parsed)) == parsed


def test_gguf_object_survives_json(qwen35_object: dict, qwen35: Tokenizer) -> None:
    loaded = json.loads(json.dumps(qwen35_object))
    assert loaded == qwen35_object
    rebuilt = Tokenizer.from_object(loaded)
    for text, expected in VOCAB_CASES:
        assert rebuilt.encode(text) == expected


def test_smollm2_object_flags(smollm2_object: dict) -> None:
    assert smollm2_object["tokenizer.ggml.pre"] == "smollm"
    assert smollm2_object["tokenizer.ggml.add_bos_token"] is False
    assert smollm2_object["tokenizer.ggml.unknown_token_id"] == 0
    assert json.loads(json.dumps(smollm2_object)) == smollm2_object


def test_qwen35_keeps_combining_marks_with_their_letter(qwen35: Tokenizer) -> None:
    # The Qwen3.5 regex has [\p{L}\p{M}]+, so Thai vowel marks stay in the word (Qwen2's would cut there).
    ids = qwen35.encode("กินข้าว")
    assert ids == [129454, 131661]
    assert [qwen35.decode([i]) for i in ids] == ["กิน", "ข้าว"]


def test_qwen35_special_tokens(qwen35: Tokenizer) -> None:
    ids = qwen35.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids == [151644, 872, 198, 6023, 151645]
    assert qwen35.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert qwen35.decode(ids, skip_special=True) == "user\nhi"
    assert qwen35.special_ids == {151643, 151644, 151645}
    assert qwen35.eos_id == 151643
    assert qwen35.eos_ids == {151643, 151645}
    assert qwen35.bos_token == "<|endoftext|>"
    assert qwen35.eos_token == "<|endoftext|>"
    # User-defined tokens are matched in text too, but are not special.
    assert qwen35.encode("a[PAD151650]") == [64, 151650]
    assert qwen35.decode([64, 151650], skip_special=True) == "a[PAD151650]"
    assert qwen35.encode("hi", add_special=True) == [6023]
    assert qwen35.vocab_size == 151936
    assert qwen35.chat_template is not None and "<|im_start|>" in qwen35.chat_template


def test_qwen35_special_text_as_plain_text(qwen35: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = qwen35.encode(text, parse_special=False)
    assert ids == [27, 91, 318, 4906, 91, 29, 872, 198, 6023, 27, 91, 318, 6213, 91, 29]
    assert qwen35.decode(ids) == text
    # Only control tokens turn plain: user-defined tokens still match, as with llama.cpp's parse_special=false.
    assert qwen35.encode("a[PAD151650]", parse_special=False) == [64, 151650]
    for case_text, expected in VOCAB_CASES:
        assert qwen35.encode(case_text, parse_special=False) == expected


def test_smollm2_special_text_as_plain_text(smollm2: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    assert smollm2.encode(text) == [1, 4093, 198, 6004, 2]
    assert smollm2.encode(text, parse_special=False) == [
        44, 108, 306, 79, 3738, 108, 46, 4093, 198, 6004, 44, 108, 306, 79, 486, 108, 46
    ]
    assert smollm2.encode("<filename>a.py", parse_special=False) == [44, 5805, 46, 81, 30, 1306]


def test_add_special_with_special_text_as_plain_text(smollm2_object: dict) -> None:
    tok = Tokenizer.from_object({**smollm2_object, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("<|im_end|>", add_special=True, parse_special=False) == [1, 44, 108, 306, 79, 486, 108, 46]


def test_special_pattern_matches_special_text_only(qwen35: Tokenizer, smollm2: Tokenizer) -> None:
    assert qwen35.special_pattern.findall("<|im_start|>a<|endoftext|>[PAD151650]<think><|im_end") == [
        "<|im_start|>",
        "<|endoftext|>",
    ]
    assert len(set(smollm2.special_pattern.findall("".join(smollm2.decode([i]) for i in range(17))))) == 17
    assert Tokenizer.from_object(byte_vocab_object("gpt2")).special_pattern.search("<|im_start|>") is None


def test_qwen35_pieces_and_bytes(qwen35: Tokenizer) -> None:
    assert qwen35.id_to_piece(1879) == "Ġworld"
    assert qwen35.token_to_id("Ġworld") == 1879
    assert qwen35.token_to_id("no such piece") is None
    assert qwen35.token_bytes(1879) == b" world"
    assert qwen35.token_bytes(151644) == b"<|im_start|>"
    assert qwen35.token_bytes(43459) == b"\xe6\xa1"
    assert qwen35.token_bytes(151936) == b""
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        qwen35.id_to_piece(151936)
    for text, expected in VOCAB_CASES:
        assert b"".join(qwen35.token_bytes(i) for i in expected) == text.encode("utf-8")


def test_to_hf_json_loads_back(qwen35: Tokenizer) -> None:
    hf = HFTokenizer.from_str(qwen35.to_hf_json())
    for text, expected in VOCAB_CASES:
        assert hf.encode(text, add_special_tokens=False).ids == expected


@pytest.mark.parametrize("name", sorted(SMOLLM2_PROMPTS))
def test_smollm2_matches_reference_ids(smollm2: Tokenizer, name: str) -> None:
    prompt = SMOLLM2_PROMPTS[name]
    assert smollm2.encode(prompt["text"]) == prompt["input_ids"]
    assert smollm2.decode(prompt["greedy"]) == prompt["greedy_text"]


def test_smollm2_chat_prompt_uses_control_tokens(smollm2: Tokenizer) -> None:
    ids = SMOLLM2_PROMPTS["chat"]["input_ids"]
    assert ids[0] == 1
    assert ids.count(1) == 3
    assert ids.count(2) == 2


def test_smollm2_special_ids(smollm2: Tokenizer) -> None:
    assert smollm2.bos_id == 1
    assert smollm2.eos_id == 2
    assert smollm2.eos_ids == {0, 2}
    assert smollm2.special_ids == frozenset(range(17))
    assert smollm2.bos_token == "<|im_start|>"
    assert smollm2.eos_token == "<|im_end|>"
    # The GGUF says add_bos_token=False.
    assert smollm2.encode("The capital", add_special=True) == smollm2.encode("The capital")


def test_smollm2_splits_digits_before_the_gpt2_regex(smollm2: Tokenizer) -> None:
    # llama.cpp's smollm pre (and the model's own Digits split) isolates each digit first, so the
    # spaces before a digit stay one "ĠĠ" piece; GPT-2's regex alone would give Ġ, Ġ, 2.
    assert smollm2.encode("  2") == [256, 34]
    assert smollm2.encode("\n\n3") == [1116, 35]
    assert smollm2.encode(" 2024") == [216, 34, 32, 34, 36]


def test_add_bos_token_adds_bos_only_with_add_special(smollm2_object: dict, smollm2: Tokenizer) -> None:
    tok = Tokenizer.from_object({**smollm2_object, "tokenizer.ggml.add_bos_token": True})
    plain = smollm2.encode("The capital")
    assert tok.encode("The capital") == plain
    assert tok.encode("The capital", add_special=True) == [1, *plain]


def byte_vocab_object(pre: str) -> dict:
    """A GGUF tokenizer object with only the 256 byte tokens, so pieces show the pre-tokenizer."""
    return {
        "tokenizer_type": "gguf",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": list(BYTE_LEVEL_CHARS),
        "tokenizer.ggml.token_type": [1] * 256,
        "tokenizer.ggml.merges": [],
    }


def pre_pieces(tok: Tokenizer, text: str) -> list[str]:
    pre = HFTokenizer.from_str(tok.to_hf_json()).pre_tokenizer
    pieces = pre.pre_tokenize_str(text)
    return [bytes(BYTE_LEVEL_CHARS[c] for c in piece).decode("utf-8") for piece, _ in pieces]


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["I", "'", "M", " 12345", "!", "\n", "\n", "x"]),
        ("default", ["I", "'", "M", " 12345", "!", "\n", "\n", "x"]),
        ("llama-bpe", ["I", "'M", " ", "123", "45", "!\n\n", "x"]),
        ("llama3", ["I", "'M", " ", "123", "45", "!\n\n", "x"]),
        ("qwen2", ["I", "'M", " ", "1", "2", "3", "4", "5", "!\n\n", "x"]),
        ("qwen35", ["I", "'M", " ", "1", "2", "3", "4", "5", "!\n\n", "x"]),
        ("smollm", ["I", "'", "M", " ", "1", "2", "3", "4", "5", "!", "\n", "\n", "x"]),
    ],
)
def test_pre_tokenizer_regex_per_pre_name(pre: str, pieces: list[str]) -> None:
    assert pre_pieces(Tokenizer.from_object(byte_vocab_object(pre)), "I'M 12345!\n\nx") == pieces


def test_llama3_adds_bos_unless_the_gguf_says_otherwise() -> None:
    # llama.cpp's default for Llama 3 vocabularies is to add BOS; other BPE vocabularies do not.
    a = list(BYTE_LEVEL_CHARS).index("a")
    llama3 = {**byte_vocab_object("llama-bpe"), "tokenizer.ggml.bos_token_id": 0}
    assert Tokenizer.from_object(llama3).encode("a", add_special=True) == [0, a]
    assert Tokenizer.from_object(llama3).encode("a") == [a]
    explicit = {**llama3, "tokenizer.ggml.add_bos_token": False}
    assert Tokenizer.from_object(explicit).encode("a", add_special=True) == [a]
    gpt2 = {**byte_vocab_object("gpt2"), "tokenizer.ggml.bos_token_id": 0}
    assert Tokenizer.from_object(gpt2).encode("a", add_special=True) == [a]


def test_gguf_eot_and_eom_ids_end_generation() -> None:
    obj = {
        **byte_vocab_object("gpt2"),
        "tokenizer.ggml.eos_token_id": 5,
        "tokenizer.ggml.eot_token_id": 7,
        "tokenizer.ggml.eom_token_id": 9,
    }
    tok = Tokenizer.from_object(obj)
    assert tok.eos_id == 5
    assert tok.eos_ids == {5, 7, 9}
    assert tok.special_ids == frozenset()


def test_unknown_pre_falls_back_to_gpt2_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="unknown GGUF pre-tokenizer 'mystery'"):
        tok = Tokenizer.from_object(byte_vocab_object("mystery"))
    assert pre_pieces(tok, "I'M 12345!") == ["I", "'", "M", " 12345", "!"]


def test_other_gguf_tokenizer_models_are_refused() -> None:
    with pytest.raises(TokenizerError, match="GGUF tokenizer model 'rwkv' is not supported"):
        Tokenizer.from_object({**byte_vocab_object("default"), "tokenizer.ggml.model": "rwkv"})


def test_unknown_tokenizer_type_is_refused() -> None:
    with pytest.raises(TokenizerError, match="unknown tokenizer_type 'sentencepiece'"):
        Tokenizer.from_object({"tokenizer_type": "sentencepiece"})


HF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HF_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "桜の花が咲いた",
    "def add(a, b):\n    return a + b\n",
] * 20


def train_hf_tokenizer() -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=HF_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(HF_CORPUS, trainer)
    return hf


def write_hf_dir(directory: Path, hf: HFTokenizer, config: dict) -> Path:
    directory.mkdir(exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def test_hf_directory_round_trip(tmp_path: Path) -> None:
    hf = train_hf_tokenizer()
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": "{{ messages[0]['content'] }}"}
    model_dir = write_hf_dir(tmp_path / "model", hf, config)
    obj = tokenizer_object_from_path(model_dir)
    assert set(obj) == {
        "tokenizer_type",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.chat_template",
    }
    assert obj["tokenizer_type"] == "hf"
    assert obj["tokenizer_config.json"] == config
    assert obj["tokenizer.chat_template"] == "{{ messages[0]['content'] }}"
    assert tokenizer_object_from_path(model_dir / "tokenizer.json") == obj

    tok = Tokenizer.from_object(json.loads(json.dumps(obj)))
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert tok.eos_id == 2
    assert tok.eos_ids == {0, 2}
    assert tok.bos_id is None
    assert tok.special_ids == {0, 1, 2}
    for text in ["The lazy fox.", "桜の花", "return a + b\n", "unseen words ❄️"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    chat_ids = tok.encode("<|im_start|>The fox<|im_end|>")
    assert (chat_ids[0], chat_ids[-1]) == (1, 2)
    assert tok.decode(chat_ids, skip_special=True) == "The fox"
    assert tok.encode("hi", add_special=True) == tok.encode("hi")


def test_hf_special_text_as_plain_text(tmp_path: Path) -> None:
    hf = train_hf_tokenizer()
    tok = Tokenizer.from_object(tokenizer_object_from_hf(write_hf_dir(tmp_path / "model", hf, {})))
    text = "<|im_start|>The fox<|im_end|>"
    hf.encode_special_tokens = True
    ids = tok.encode(text, parse_special=False)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert not tok.special_ids & set(ids)
    assert tok.decode(ids) == text


def test_hf_bos_from_post_processor_and_config(tmp_path: Path) -> None:
    hf = train_hf_tokenizer()
    hf.add_special_tokens([AddedToken("<s>", special=True)])
    bos = hf.token_to_id("<s>")
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    probed_dir = write_hf_dir(tmp_path / "a", hf, {"bos_token": "<s>"})
    probed = Tokenizer.from_object(tokenizer_object_from_hf(probed_dir))
    plain = probed.encode("The fox")
    assert plain[0] != bos
    assert probed.encode("The fox", add_special=True) == [bos, *plain]
    assert probed.bos_token == "<s>"
    config = {"bos_token": {"content": "<s>"}, "add_bos_token": False}
    disabled = Tokenizer.from_object(tokenizer_object_from_hf(write_hf_dir(tmp_path / "b", hf, config)))
    assert disabled.bos_id == bos
    assert disabled.encode("The fox", add_special=True) == plain


def test_hf_chat_template_sources(tmp_path: Path) -> None:
    hf = train_hf_tokenizer()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert tokenizer_object_from_hf(write_hf_dir(tmp_path / "a", hf, {"chat_template": named}))[
        "tokenizer.chat_template"
    ] == "D"
    jinja_dir = write_hf_dir(tmp_path / "b", hf, {})
    (jinja_dir / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert tokenizer_object_from_hf(jinja_dir)["tokenizer.chat_template"] == "J"
    json_dir = write_hf_dir(tmp_path / "c", hf, {})
    (json_dir / "chat_template.json").write_text(json.dumps({"chat_template": "K"}), encoding="utf-8")
    assert tokenizer_object_from_hf(json_dir)["tokenizer.chat_template"] == "K"
    bare = write_hf_dir(tmp_path / "d", hf, {})
    (bare / "tokenizer_config.json").unlink()
    obj = tokenizer_object_from_hf(bare)
    assert obj["tokenizer_config.json"] == {}
    assert "tokenizer.chat_template" not in obj
    assert Tokenizer.from_object(obj).chat_template is None


def test_missing_tokenizer_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerSourceError, match=f"no tokenizer.json in {tmp_path}"):
        tokenizer_object_from_hf(tmp_path)
    with pytest.raises(TokenizerSourceError, match="is not a .gguf file"):
        tokenizer_object_from_path(tmp_path / "weights.bin")


def test_hf_sentencepiece_style_token_bytes(tmp_path: Path) -> None:
    pieces = ["<unk>", "<0xE6>", "<0xA1>", "<0x9C>", "▁", "h", "e", "l", "o"]
    pieces += ["▁h", "▁he", "ll", "▁hell", "▁hello"]
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o")]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = Tokenizer.from_object(tokenizer_object_from_hf(write_hf_dir(tmp_path / "spm", hf, {})))
    ids = tok.encode("hello 桜")
    assert ids == [13, 4, 1, 2, 3]
    assert [tok.token_bytes(i) for i in ids] == [b" hello", b" ", b"\xe6", b"\xa1", b"\x9c"]
    # decode drops the space Metaspace put before the first word; the bytes keep it for streaming.
    assert tok.decode(ids) == "hello 桜"


@pytest.fixture(scope="session")
def llama_spm_object(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tokenizer object of llama.cpp's SentencePiece (Llama 1/2) vocab-only GGUF."""
    path = tmp_path_factory.mktemp("vocab") / "ggml-vocab-llama-spm.gguf"
    path.write_bytes(lzma.decompress((VOCAB_DIR / "ggml-vocab-llama-spm.gguf.xz").read_bytes()))
    return tokenizer_object_from_path(path)


@pytest.fixture(scope="session")
def llama_spm(llama_spm_object: dict) -> Tokenizer:
    return Tokenizer.from_object(llama_spm_object)


@pytest.mark.parametrize(("text", "expected"), SPM_CASES, ids=[f"case{i:02d}" for i in range(len(SPM_CASES))])
def test_sentencepiece_gguf_matches_llama_cpp_vectors(llama_spm: Tokenizer, text: str, expected: list[int]) -> None:
    assert llama_spm.encode(text) == expected
    # The leading space the vocabulary adds is taken off again; bytes of split characters join up.
    assert llama_spm.decode(expected) == text


def test_sentencepiece_pieces_bytes_and_specials(llama_spm_object: dict, llama_spm: Tokenizer) -> None:
    assert len(SPM_CASES) == 46
    assert llama_spm_object["tokenizer.ggml.model"] == "llama"
    assert (llama_spm.vocab_size, llama_spm.bos_id, llama_spm.eos_id) == (32000, 1, 2)
    assert llama_spm.encode("Hello world", add_special=True) == [1, 15043, 3186]
    assert llama_spm.encode("<s>Hello") == [1, 15043]  # control tokens are matched whole
    assert llama_spm.encode("<s>Hello", parse_special=False)[:2] != [1, 15043]
    assert llama_spm.id_to_piece(15043) == "\u2581Hello"
    assert llama_spm.token_bytes(15043) == b" Hello"
    assert llama_spm.token_bytes(3 + 0xF0) == b"\xf0"  # <0xF0>, a byte-fallback piece
    assert llama_spm.eos_ids == frozenset({2})
    # The 🦙 of "this is 🦙.cpp" has no piece: its four UTF-8 bytes come out as byte pieces.
    assert llama_spm.encode("🦙") == [29871, 243, 162, 169, 156]


def test_sentencepiece_without_space_prefix(llama_spm_object: dict) -> None:
    plain = Tokenizer.from_object({**llama_spm_object, "tokenizer.ggml.add_space_prefix": False})
    assert plain.encode("Hello world") == [10994, 3186]
    assert plain.decode([10994, 3186]) == "Hello world"
    with pytest.raises(TokenizerError, match="32000 pieces but 3 scores"):
        Tokenizer.from_object({**llama_spm_object, "tokenizer.ggml.scores": [0.0, 0.0, 0.0]})
