"""Text to token ids and back, built with the `tokenizers` library from a `.base` tokenizer object."""

from __future__ import annotations

import array
import itertools
import json
import re
import threading
import warnings

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from basert.errors import InvalidRequestError

# llama.cpp token types (`tokenizer.ggml.token_type`).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPM_SPACE = "\u2581"

# Pre-tokenizer regexes exactly as llama.cpp's `llama-vocab.cpp` lists them per `tokenizer.ggml.pre`;
# several regexes are applied one after another, each splitting the pieces of the one before.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "qwen2": (QWEN2_REGEX,),
    "deepseek-r1-qwen": (QWEN2_REGEX,),
    "stablelm2": (QWEN2_REGEX,),
    "qwen35": (QWEN35_REGEX,),
    "llama3": (LLAMA3_REGEX,),
    "llama-v3": (LLAMA3_REGEX,),
    "llama-bpe": (LLAMA3_REGEX,),
    # StarCoder-family vocabularies (SmolLM2 among them) split every digit off first.
    "smollm": (r"\p{N}", GPT2_REGEX),
    "starcoder": (r"\p{N}", GPT2_REGEX),
    "refact": (r"\p{N}", GPT2_REGEX),
    "codeshell": (r"\p{N}", GPT2_REGEX),
}
# Pre names that use ByteLevel's own GPT-2 regex.
GPT2_PRE_NAMES = frozenset({"gpt2", "default"})
# llama.cpp matches Llama 3 words against the whole vocabulary before merging (`ignore_merges`).
IGNORE_MERGES_PRE_NAMES = frozenset({"llama3", "llama-v3", "llama-bpe"})
# Tokens that end a turn although the model's EOS id is another token: by GGUF key, and by text.
GGUF_TURN_END_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")
BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerError(InvalidRequestError, ValueError):
    """A tokenizer object that cannot be turned into a working tokenizer."""


def _byte_level_table() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte back to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


BYTE_LEVEL_CHARS = _byte_level_table()


class Tokenizer:
    """A model's tokenizer: encode, decode, and the raw bytes of every token."""

    __slots__ = (
        "_hf",
        "_encoding",
        "_token_bytes",
        "_add_bos",
        "vocab_size",
        "bos_id",
        "eos_id",
        "eos_ids",
        "special_ids",
        "special_pattern",
        "chat_template",
    )

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        turn_end_ids: tuple[int, ...],
        add_bos: bool,
        chat_template: str | None,
        byte_level: bool,
    ) -> None:
        self._hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self._add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template
        added = hf.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, token in added.items() if token.special)
        # encode() switches the tokenizer between reading special-token text as special tokens and as plain text
        # (a second tokenizer for the plain reading would double the memory a vocabulary of 150k pieces takes);
        # the lock keeps one encoding's switch from another's.
        self._encoding = threading.Lock()
        # Longest first, so that of two special texts starting at one place the longer wins, as in `tokenizers`;
        # with no special tokens the pattern matches nothing.
        texts = sorted((added[i].content for i in self.special_ids), key=len, reverse=True)
        self.special_pattern: re.Pattern[str] = re.compile("|".join(map(re.escape, texts)) or "(?!)")
        eos_ids = set(turn_end_ids)
        if eos_id is not None:
            eos_ids.add(eos_id)
        for content in END_OF_TURN_TOKENS:
            token_id = hf.token_to_id(content)
            if token_id in self.special_ids:
                eos_ids.add(token_id)
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        self._token_bytes = _token_bytes_table(hf, self.vocab_size, added, byte_level)

    @classmethod
    def from_object(cls, obj: dict) -> Tokenizer:
        """Build the tokenizer a `.base` tokenizer object describes (`tokenizer_type` gguf or hf)."""
        kind = obj.get("tokenizer_type")
        if kind == "gguf":
            return _from_gguf(obj)
        if kind == "hf":
            return _from_hf(obj)
        raise TokenizerError(f"unknown tokenizer_type {kind!r} (expected 'gguf' or 'hf')")

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, for chat templates."""
        return None if self.bos_id is None else self._text_of(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        """The EOS token's text, for chat templates."""
        return None if self.eos_id is None else self._text_of(self.eos_id)

    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token text in it counts as one token each unless `parse_special` is false."""
        with self._encoding:
            self._hf.encode_special_tokens = not parse_special
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special and self._add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for; ids the vocabulary lacks stand for none, as in `decode`."""
        return self._token_bytes.get(token_id)

    def id_to_piece(self, token_id: int) -> str:
        """The token's string as the vocabulary spells it (byte-level form for BPE tokens)."""
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return piece

    def token_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self._hf.token_to_id(piece)

    def to_hf_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (what grammar libraries load)."""
        return self._hf.to_str()

    def _text_of(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class TokenBytes:
    """Every token's bytes in one buffer, with the offset where each starts: a tuple of 150k bytes objects would
    take 7 MiB, this a seventh of that."""

    __slots__ = ("_buffer", "_offsets")

    def __init__(self, pieces: list[bytes]):
        self._buffer = b"".join(pieces)
        self._offsets = array.array("q", itertools.accumulate(map(len, pieces), initial=0))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, token_id: int) -> bytes:
        """The token's bytes; none for an id outside the table."""
        if not 0 <= token_id < len(self):
            return b""
        return self._buffer[self._offsets[token_id]: self._offsets[token_id + 1]]


def _token_bytes_table(hf: HFTokenizer, vocab_size: int, added: dict[int, AddedToken], byte_level: bool) -> TokenBytes:
    pieces = []
    for token_id in range(vocab_size):
        if token_id in added:
            pieces.append(added[token_id].content.encode("utf-8"))
            continue
        piece = hf.id_to_token(token_id)
        pieces.append(b"" if piece is None else _piece_bytes(piece, byte_level))
    return TokenBytes(pieces)


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    if byte_level:
        try:
            return bytes(BYTE_LEVEL_CHARS[c] for c in piece)
        except KeyError:
            # Same fallback as the ByteLevel decoder: a piece outside the byte alphabet is plain text.
            return piece.encode("utf-8")
    byte = BYTE_FALLBACK_PIECE.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _from_gguf(obj: dict) -> Tokenizer:
    model = obj.get("tokenizer.ggml.model")
    if model == "llama":
        return _from_gguf_spm(obj)
    if model != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and SentencePiece 'llama' "
            "are); convert from the Hugging Face model directory instead"
        )
    tokens: list[str] = obj["tokenizer.ggml.tokens"]
    token_types: list[int] = obj.get("tokenizer.ggml.token_type") or []
    pre = obj.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEXES and pre not in GPT2_PRE_NAMES:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2's", stacklevel=3)
        pre = "gpt2"
    merges = []
    for merge in obj.get("tokenizer.ggml.merges", []):
        # Search from index 1, as llama.cpp does, so that a piece starting with a space stays whole.
        split = merge.find(" ", 1)
        merges.append((merge[:split], merge[split + 1 :]))
    hf = HFTokenizer(
        models.BPE(
            vocab={token: token_id for token_id, token in enumerate(tokens)},
            merges=merges,
            ignore_merges=pre in IGNORE_MERGES_PRE_NAMES,
        )
    )
    hf.pre_tokenizer = _pre_tokenizer(pre)
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens(_added_tokens(tokens, token_types))
    add_bos = obj.get("tokenizer.ggml.add_bos_token", pre in IGNORE_MERGES_PRE_NAMES)
    return Tokenizer(
        hf,
        bos_id=obj.get("tokenizer.ggml.bos_token_id"),
        eos_id=obj.get("tokenizer.ggml.eos_token_id"),
        turn_end_ids=tuple(obj[key] for key in GGUF_TURN_END_KEYS if key in obj),
        add_bos=bool(add_bos),
        chat_template=obj.get("tokenizer.chat_template"),
        byte_level=True,
    )


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[AddedToken]:
    """Control tokens (special) and user-defined ones, matched whole before the model runs, as in llama.cpp."""
    return [
        AddedToken(token, special=token_type == TOKEN_TYPE_CONTROL, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]


def _from_gguf_spm(obj: dict) -> Tokenizer:
    """A SentencePiece vocabulary (`tokenizer.ggml.model` "llama": pieces, scores, token types) as a `tokenizers`
    BPE model: llama.cpp's SPM tokenizer merges, again and again, the adjacent pair whose joined piece is in the
    vocabulary with the highest score. BPE merges by rank, so every split of a normal piece into two pieces of the
    vocabulary is a merge, ranked by the score of the piece it makes (ties in vocabulary order, as transformers'
    SentencePiece converter ranks them). Characters the vocabulary lacks fall back to their `<0xXX>` byte pieces;
    spaces are `▁`, with one in front of the text when `add_space_prefix` (default true)."""
    tokens: list[str] = obj["tokenizer.ggml.tokens"]
    scores: list[float] = obj.get("tokenizer.ggml.scores") or []
    token_types: list[int] = obj.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens)
    if len(scores) != len(tokens) or len(token_types) != len(tokens):
        raise TokenizerError(
            f"SentencePiece vocabulary has {len(tokens)} pieces but {len(scores)} scores and {len(token_types)} "
            "token types"
        )
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    lookup = vocab.get
    ranked: list[tuple[float, str, str]] = []
    for token_id, piece in enumerate(tokens):
        if token_types[token_id] != TOKEN_TYPE_NORMAL or len(piece) < 2:
            continue
        splits = []
        for cut in range(1, len(piece)):
            left = lookup(piece[:cut])
            if left is not None:
                right = lookup(piece[cut:])
                if right is not None:
                    splits.append((left, right, cut))
        score = -scores[token_id]
        ranked.extend((score, piece[:cut], piece[cut:]) for _, _, cut in sorted(splits))
    ranked.sort(key=lambda merge: merge[0])  # stable: equal scores keep vocabulary order
    unknown_id = obj.get("tokenizer.ggml.unknown_token_id")
    hf = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, left, right in ranked],
            unk_token=tokens[unknown_id] if isinstance(unknown_id, int) and 0 <= unknown_id < len(tokens) else None,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    space_prefix = bool(obj.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(SPM_SPACE)] if space_prefix else []
    hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    hf.decoder = decoders.Sequence([
        decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if space_prefix else []),
    ])
    hf.add_tokens(_added_tokens(tokens, token_types))
    return Tokenizer(
        hf,
        bos_id=obj.get("tokenizer.ggml.bos_token_id"),
        eos_id=obj.get("tokenizer.ggml.eos_token_id"),
        turn_end_ids=tuple(obj[key] for key in GGUF_TURN_END_KEYS if key in obj),
        add_bos=bool(obj.get("tokenizer.ggml.add_bos_token", True)),
        chat_template=obj.get("tokenizer.chat_template"),
        byte_level=False,
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in GPT2_PRE_NAMES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    steps = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in PRE_TOKENIZER_REGEXES[pre]]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _from_hf(obj: dict) -> Tokenizer:
    tokenizer_json = obj["tokenizer.json"]
    hf = HFTokenizer.from_str(json.dumps(tokenizer_json))
    config = obj.get("tokenizer_config.json") or {}
    bos_id = _config_token_id(hf, config.get("bos_token"))
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # No explicit flag: the tokenizer's own post-processor decides, as in transformers.
        with_special = hf.encode("", add_special_tokens=True).ids
        add_bos = bos_id is not None and with_special[:1] == [bos_id]
    return Tokenizer(
        hf,
        bos_id=bos_id,
        eos_id=_config_token_id(hf, config.get("eos_token")),
        turn_end_ids=(),
        add_bos=bool(add_bos),
        chat_template=obj.get("tokenizer.chat_template"),
        byte_level="ByteLevel" in json.dumps(tokenizer_json.get("decoder")),
    )


def _config_token_id(hf: HFTokenizer, token: str | dict | None) -> int | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    return hf.token_to_id(token)


# Tokens compared at a time by `common_prefix`: list slices compare far faster than a loop over single tokens.
PREFIX_STRIDE = 16


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (compared a stride of tokens at a time:
    prompts of thousands of tokens are compared on every admission and scheduling step)."""
    n = min(len(a), len(b))
    i = 0
    while i + PREFIX_STRIDE <= n and a[i:i + PREFIX_STRIDE] == b[i:i + PREFIX_STRIDE]:
        i += PREFIX_STRIDE
    while i < n and a[i] == b[i]:
        i += 1
    return i
