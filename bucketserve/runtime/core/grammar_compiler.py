"""StructuredOutputsParams -> llguidance grammars and matchers, each spec compiled once.

The gateway validates with `validate_structured_outputs` (in its executor: it compiles); a
worker's `GrammarCompiler` also holds the model's token table and hands out matchers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from bucketserve.runtime.core.structured_outputs import StructuredOutputsParams
from bucketserve.runtime.io.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled specs kept per compiler (an LRU)
_MAX_MESSAGE = 400  # characters of the engine's error text in a ValueError
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}

Key = tuple[str, str, bool]


class GrammarCompiler:
    """Compiles specs to llguidance grammars, caching each by `StructuredOutputsParams.key`.

    Without a tokenizer it validates only (the gateway's); with one (a worker's) it also
    builds the token table once, on first use (about half a second for a 50k vocabulary),
    and keeps one compiled matcher per spec, which `matcher` copies for each sequence.
    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's).
    Thread-safe.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        vocab_size: int | None = None,
        eos_token_ids: Collection[int] = (),
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[Key, str] = OrderedDict()
        self._errors: dict[Key, str] = {}  # specs that do not compile -> why
        self._matchers: OrderedDict[Key, llguidance.LLMatcher] = OrderedDict()
        self.num_compiled = 0  # cache misses, for tests and stats

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The model's token table as llguidance reads it (built once)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise RuntimeError("this GrammarCompiler has no tokenizer (validation only)")
                eos = self.eos_token_ids or None  # None: the tokenizer's own
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._ll_tokenizer

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of `params`; ValueError naming the field if it does not
        compile (with a tokenizer, checked against the model's tokens too)."""
        key = params.key
        with self._lock:
            if key in self._errors:
                raise ValueError(self._errors[key])
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar, error = _compile(params)
        if error is None:
            tokenizer = self.ll_tokenizer if self.tokenizer is not None else None
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, tokenizer, limits=_limits()
            )
            error = _message(params, messages[0]) if failed else None
        with self._lock:
            self.num_compiled += 1
            if error is not None:
                self._errors[key] = error
                _trim(self._errors, self.cache_size)
                raise ValueError(error)
            self._grammars[key] = grammar
            _trim(self._grammars, self.cache_size)
        return grammar

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the field and the problem if `params` cannot compile."""
        self.grammar(params)

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (a copy of the spec's compiled one); ValueError
        as `grammar` if the spec does not compile."""
        key = params.key
        with self._lock:
            template = self._matchers.get(key)
            if template is not None:
                self._matchers.move_to_end(key)
        if template is None:
            grammar = self.grammar(params)
            template = llguidance.LLMatcher(
                self.ll_tokenizer, grammar, log_level=0, limits=_limits()
            )
            with self._lock:
                self._matchers[key] = template
                _trim(self._matchers, self.cache_size)
        return template.deep_copy()


def _compile(params: StructuredOutputsParams) -> tuple[str, str | None]:
    """(grammar, None), or ("", the error message)."""
    kind, text, compact, whitespace = params.key
    try:
        if kind in ("json", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": not compact}
            if whitespace is not None:
                options["whitespace_pattern"] = whitespace
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options), None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text), None
        if kind == "choice":
            return llguidance.grammar_from("choice", text), None
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text)), None
    except Exception as exc:  # the converters raise ValueError, AssertionError, ...
        return "", _message(params, str(exc) or type(exc).__name__)


def _message(params: StructuredOutputsParams, error: str) -> str:
    text = " ".join(error.split())
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 3] + "..."
    return f"structured_outputs.{params.kind}: invalid {_WHAT[params.kind]}: {text}"


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(verbose_errors=False)


def _trim(cache: dict, size: int) -> None:
    while len(cache) > size:
        cache.pop(next(iter(cache)))


_default = GrammarCompiler()


def validate_structured_outputs(
    params: StructuredOutputsParams | None, compiler: GrammarCompiler | None = None
) -> None:
    """The edge's check: ValueError ("structured_outputs.json: invalid JSON schema: ...")
    if `params` cannot compile; nothing for None. Compiles (a cache hit costs microseconds):
    call it off the event loop."""
    if params is not None:
        (compiler or _default).validate(params)
