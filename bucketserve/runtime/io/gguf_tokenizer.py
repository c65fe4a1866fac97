"""A GGUF's vocabulary as a `tokenizers.Tokenizer` that encodes as transformers does when it
loads the same file: byte-level BPE (`gpt2`) or Gemma's SentencePiece BPE (`llama`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import (
    AddedToken,
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
        elif self.kind != "llama" or self.arch not in GEMMA_ARCHITECTURES:
            raise ValueError(
                f"GGUF tokenizer {self.kind!r} of architecture {self.arch!r} is not supported; "
                f"only byte-level BPE ('gpt2') and Gemma's SentencePiece ('llama' in "
                f"{GEMMA_ARCHITECTURES})"
            )

    def build(self) -> Tokenizer:
        self.check()
        tok = self._byte_level() if self.kind == "gpt2" else self._gemma()
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
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {DIGIT_SPLIT_PRE + GPT2_PRE}"
        )

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
                merges=_merges_in_vocab_order(vocab),
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


def _merges_in_vocab_order(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a token into two vocabulary pieces, tokens in id order
    and, within one token, the longer left piece first."""
    merges = []
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges
