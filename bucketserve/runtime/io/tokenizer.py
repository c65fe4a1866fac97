"""Text <-> token ids and chat prompts for a Hugging Face model directory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

NO_CHAT_TEMPLATE = (
    "this model has no chat template (its tokenizer_config.json names none, as a base "
    "model's), so chat messages cannot become a prompt: send a plain prompt "
    "(/v1/completions), or give a template: `bucketserve serve --chat-template FILE` "
    "(model.chat_template in the config file), LLM(..., chat_template=FILE) offline"
)


class Tokenizer:
    """`tokenizers.Tokenizer` plus the chat template, behaving like transformers' AutoTokenizer.

    `vocab_size` counts every id the tokenizer can produce, added tokens included.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """`chat_template` (a file or the template itself) replaces the model's own."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)"
            )
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if chat_template is not None:
            template = load_chat_template(chat_template)
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        special = {name: _token_text(config.get(name)) for name in names}
        return cls(tokenizers.Tokenizer.from_file(str(path)), template, special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids are trusted: the edge (gateway admission, `LLMEngine.add_request`) checked
        those a user sent; the rest the model sampled."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template,
        or with `chat_template` (a file or the template itself) instead."""
        _check_messages(messages)
        if chat_template is not None:
            template = _jinja_env().from_string(load_chat_template(chat_template))
        elif self._template is None:
            if not self.chat_template:
                raise ValueError(NO_CHAT_TEMPLATE)
            template = self._template = _jinja_env().from_string(self.chat_template)
        else:
            template = self._template
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("eos_token"))

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("pad_token"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        added = self.backend.get_added_tokens_decoder()
        return sorted(i for i, token in added.items() if token.special)


def load_chat_template(template: str) -> str:
    """A Jinja chat template from a file, or given as itself (vLLM's --chat-template)."""
    path = Path(template).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(
        f"chat template {template!r} is neither a file nor a Jinja template "
        "(one with {{ ... }} or {% ... %})"
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value


def _check_messages(messages: Any) -> None:
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
    )
    if not ok:
        raise ValueError("messages must be a list of {'role': str, 'content': ...} dicts")


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
