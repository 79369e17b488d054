"""Tokenizer (tokenizer.json via the `tokenizers` library) and the chat template.

The chat template is Jinja source from the checkpoint (chat_template.jinja or
tokenizer_config.json) or an operator override. It is rendered in an immutable sandbox:
templates come from model files, which are not trusted to run code.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer


class ChatTemplateError(ValueError):
    """The messages could not be rendered with the model's chat template."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # HF's templates expect unescaped JSON (jinja's default tojson escapes < > & ')
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


class Tokenizer:
    """Encode/decode plus the special tokens and chat template of one checkpoint."""

    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json (needed to encode prompts)")
        self._tok = RustTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = chat_template or self._template_from(model_dir, config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _template_from(model_dir: Path, config: dict) -> str | None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.exists():
            return jinja_file.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as it would be decoded on its own (for logprob entries)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template; pass one with chat_template=... (--chat-template)"
            )
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise ChatTemplateError(f"each message needs a 'role' (got {message!r})")
        try:
            return _compile(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc

