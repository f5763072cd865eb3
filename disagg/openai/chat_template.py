"""A checkpoint's chat template, rendered as `transformers`' `apply_chat_template` renders it.

The template comes from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (a string,
or a list of named templates of which "default" is used), as transformers looks for it. It runs in
jinja2's immutable sandbox with transformers' settings (`trim_blocks`, `lstrip_blocks`, the loop-controls
extension) and helpers (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), with the
special tokens of `tokenizer_config.json` as variables (`bos_token`, `eos_token`, ...).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]

    @classmethod
    def load(cls, tokenizer_dir: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none (then chat is refused, as transformers >= 4.43
        refuses it)."""
        tokenizer_dir = Path(tokenizer_dir)
        config_path = tokenizer_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        jinja_file = tokenizer_dir / "chat_template.jinja"
        if jinja_file.is_file():
            source = jinja_file.read_text()
        if not source:
            return None
        tokens = {k: _token_text(config.get(k)) for k in _SPECIAL}
        return cls(source, {k: v for k, v in tokens.items() if v is not None})

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            template = _environment().from_string(self.source)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from exc
