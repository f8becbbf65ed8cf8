"""Conversations -> token ids and which of them are trained (the assistant's).

A record is ``{"messages": [{"role": ..., "content": ...}, ...]}`` or
``{"prompt": ..., "completion": ...}`` (strings: a user turn and an assistant turn; or lists
of messages). Roles: system, user, assistant, tool.

Rendering: with a Hugging Face tokenizer folder whose ``chat_template`` (tokenizer_config.json,
or chat_template.jinja beside it) exists, the template is rendered as transformers renders it
(a sandboxed jinja2 environment that trims blocks, with ``tojson``, ``raise_exception`` and
``strftime_now``; the tokenizer's special tokens as ``bos_token`` etc.) and the text encoded
without added tokens: the ids ``apply_chat_template`` gives. An assistant turn's span is what
rendering the conversation through that turn adds to rendering it up to the turn with the
generation prompt; its tokens are trained. Other tokenizers (sentencepiece) use the built-in
template: BOS, then per message ``<|role|>\\n`` + content + EOS; an assistant's content and
EOS are trained.

Bad records are refused with a reason (``BadRecord.reason``), counted by the loader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from titanlite.data.tokenizer import HF_TOKENIZER_CONFIG, Tokenizer
from titanlite.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
REASONS = ("not_a_conversation", "unknown_role", "no_assistant_turn", "too_long", "template")
"""Why a record is left out: no messages (or prompt/completion) of role and text, a role
outside ROLES, no assistant turn, no trained token left after truncation (see the loader),
a template that renders an earlier turn differently once a later one follows."""


class BadRecord(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Example:
    ids: list[int]
    trained: list[bool]
    """Per token: whether it is a target of the loss (an assistant's)."""


def messages_of(record: Any) -> list[dict[str, str]]:
    """The messages of a record; BadRecord when it is not a usable conversation."""
    if not isinstance(record, dict):
        raise BadRecord("not_a_conversation")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        messages = prompt + completion if isinstance(prompt, list) else None
    else:
        raise BadRecord("not_a_conversation")
    ok = isinstance(messages, list) and messages
    if not ok or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        raise BadRecord("not_a_conversation")
    if any(m.get("role") not in ROLES for m in messages):
        raise BadRecord("unknown_role")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def chat_template_of(tokenizer: Tokenizer) -> str | None:
    """The tokenizer folder's chat template (chat_template.jinja, else tokenizer_config.json's
    ``chat_template``; of named templates, "default"), or None."""
    if tokenizer.kind != "huggingface":
        return None
    folder = Path(tokenizer.path).parent
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    config = folder / HF_TOKENIZER_CONFIG
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _refuse(message: str) -> None:
    raise BadRecord("template") from ValueError(message)


class TemplateRenderer:
    """A Hugging Face tokenizer's own chat template (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, template: str) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _refuse
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise UserError(f"tokenizer {str(tokenizer.path)!r}: bad chat_template ({e})") from None
        self.tokenizer = tokenizer
        self.special = {f"{kind}_token": name for kind, name in tokenizer.special_tokens.items()}

    def text(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The rendered conversation (as ``apply_chat_template(..., tokenize=False)``)."""
        return self.template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special
        )

    def render(self, messages: list[dict[str, str]]) -> Example:
        full = self.text(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.text(messages[:i], add_generation_prompt=True)
            through = self.text(messages[: i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise BadRecord("template")
            spans.append((len(before), len(through)))
        ids, offsets = self.tokenizer.encode_spans(full)
        trained = [any(a <= start < b for a, b in spans) for start, _ in offsets]
        return Example(list(ids), trained)


class BuiltinRenderer:
    """The built-in template, for tokenizers without one (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: list[dict[str, str]]) -> Example:
        tok = self.tokenizer
        ids = [tok.bos_id] if tok.bos_id >= 0 else []
        trained = [False] * len(ids)
        eos = [tok.eos_id] if tok.eos_id >= 0 else []
        for m in messages:
            header = tok.encode(f"<|{m['role']}|>\n", bos=False, eos=False)
            body = tok.encode(m["content"], bos=False, eos=False) + eos
            ids += header + body
            trained += [False] * len(header) + [m["role"] == "assistant"] * len(body)
        return Example(ids, trained)


def renderer(tokenizer: Tokenizer) -> TemplateRenderer | BuiltinRenderer:
    """The tokenizer's own template when it has one, else the built-in one."""
    template = chat_template_of(tokenizer)
    return TemplateRenderer(tokenizer, template) if template else BuiltinRenderer(tokenizer)
