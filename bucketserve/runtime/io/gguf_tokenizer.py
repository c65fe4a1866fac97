"""A GGUF's vocabulary as a `tokenizers.Tokenizer` that encodes as transformers does when it
loads the same file: byte-level BPE (`gpt2`: GPT-2, SmolLM, Llama 3, Qwen) or SentencePiece
BPE (`llama`: Llama 2 and Mistral by the file's scores, Gemma by its token order)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# llama.cpp pre-tokenizers that split every digit, then apply the GPT-2 regex.
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
GPT2_PRE = ("gpt-2", "gpt2", "mpt", "olmo", "jais")


def _words_split(digits: str) -> str:
    """The pre-tokenizer regex of Llama 3 and Qwen 2 (cl100k's): contractions, letters with
    one leading non-letter, `digits`, punctuation runs, newlines, spaces."""
    return (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits
        + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


# llama.cpp pre-tokenizers that split by a regex of their own, then map bytes
REGEX_PRE = {
    "llama-bpe": _words_split(r"\p{N}{1,3}"),  # Llama 3.x
    "llama3": _words_split(r"\p{N}{1,3}"),
    "qwen2": _words_split(r"\p{N}"),  # Qwen 2, 2.5 and 3: one digit a piece
    "deepseek-r1-qwen": _words_split(r"\p{N}"),
}
# Architectures whose SentencePiece vocabulary is Gemma's: no prefix space, byte fallback.
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
SPACE = "\u2581"  # SentencePiece's visible space

Field = Callable[..., Any]


class GGUFTokenizer:
    """Builds the tokenizer from the `tokenizer.ggml.*` metadata; `field(key, default)` reads
    one metadata value (raising when it is absent and no default is given)."""

    def __init__(self, field: Field, arch: str) -> None:
        self.field = field
        self.arch = arch
        self.kind = field("tokenizer.ggml.model")
        self.tokens: list[str] = field("tokenizer.ggml.tokens")
        self.types: list[int] = field("tokenizer.ggml.token_type", None) or [1] * len(
            self.tokens
        )

    def check(self) -> None:
        """Fail before any work on a vocabulary this module cannot rebuild."""
        if self.kind == "gpt2":
            self._pre_tokenizer()
        elif self.kind != "llama":
            raise ValueError(
                f"GGUF tokenizer {self.kind!r} is not supported; only byte-level BPE ('gpt2') "
                "and SentencePiece BPE ('llama')"
            )

    def build(self) -> Tokenizer:
        self.check()
        if self.kind == "gpt2":
            tok = self._byte_level()
        else:
            tok = self._gemma() if self.arch in GEMMA_ARCHITECTURES else self._sentencepiece()
        tok.post_processor = self._post_processor()
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(self.tokens, self.types, strict=True)
                if k == CONTROL
            ]
        )
        vocab = tok.get_vocab()  # a user-defined token the model spells otherwise stays out
        tok.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(self.tokens, self.types, strict=True)
                if k == USER_DEFINED and t in vocab
            ]
        )
        return tok

    def _byte_level(self) -> Tokenizer:
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        vocab = {token: i for i, token in enumerate(self.tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = self._pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        return tok

    def _pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        pre = self.field("tokenizer.ggml.pre", "gpt-2")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in DIGIT_SPLIT_PRE:
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        if pre in GPT2_PRE:
            return byte_level
        if pre in REGEX_PRE:
            return pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])  # fmt: skip
        supported = DIGIT_SPLIT_PRE + GPT2_PRE + tuple(REGEX_PRE)
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {supported}")

    def _gemma(self) -> Tokenizer:
        """BPE with byte fallback over the file's vocabulary, spaces written as "▁".

        The file stores no merges and Gemma's scores do not rank them; a token's position in
        the file does (earlier merges first), as transformers rebuilds them. Tokens made of
        spaces are stored with real spaces and are looked up as runs of "▁".
        """
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in self.tokens]
        vocab = {token: i for i, token in enumerate(tokens)}
        unk_id = self.field("tokenizer.ggml.unknown_token_id", None)
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_merges_by_rank(vocab, {t: -i for t, i in vocab.items()}),
                unk_token=None if unk_id is None else tokens[unk_id],
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        return tok

    def _sentencepiece(self) -> Tokenizer:
        """Llama 2's and Mistral's BPE with byte fallback: merges ranked by the file's
        scores, spaces written as "▁" and, unless the file says otherwise, one before the
        text (SentencePiece's `add_dummy_prefix`)."""
        vocab = {token: i for i, token in enumerate(self.tokens)}
        scores = self.field("tokenizer.ggml.scores")
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_merges_by_rank(vocab, dict(zip(self.tokens, scores, strict=True))),
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        prefix = bool(self.field("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        strip = [decoders.Strip(content=" ", left=1)] if prefix else []
        tok.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
        return tok

    def _post_processor(self) -> processors.PostProcessor:
        bos_id = self.field("tokenizer.ggml.bos_token_id", None)
        if not self.field("tokenizer.ggml.add_bos_token", False) or bos_id is None:
            return processors.ByteLevel(trim_offsets=False)
        bos = self.tokens[bos_id]
        return processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )

    def token(self, key: str) -> str | None:
        i = self.field(f"tokenizer.ggml.{key}", None)
        return None if i is None else self.tokens[i]

    def config(self, model_max_length: int) -> dict[str, Any]:
        """tokenizer_config.json: the special tokens, BOS handling and the chat template."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.token("bos_token_id"),
            "eos_token": self.token("eos_token_id"),
            "unk_token": self.token("unknown_token_id"),
            "pad_token": self.token("padding_token_id"),
            "additional_special_tokens": [
                t for t, k in zip(self.tokens, self.types, strict=True) if k == CONTROL
            ],
            "add_bos_token": bool(self.field("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "chat_template": self.field("tokenizer.chat_template", None),
        }


def _merges_by_rank(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary pieces, the merges of the
    higher-ranked token first and, within one rank, the longer pieces first."""
    merges = [
        (rank[token], len(left), len(right), left, right)
        for token in vocab
        for cut in range(1, len(token))
        if (left := token[:cut]) in vocab and (right := token[cut:]) in vocab
    ]
    merges.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for *_, left, right in merges]
