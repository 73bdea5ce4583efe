"""Chat templates: finding them and rendering them with Jinja the way transformers does.

Rendering follows `transformers.utils.chat_template_utils`: an immutable sandboxed Jinja
environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a pass-through
`{% generation %}` tag, a `tojson` filter that keeps non-ASCII text, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`. The template sees `messages`, `tools`,
`documents`, `add_generation_prompt`, the tokenizer's named special tokens (`bos_token`, ...) and
any extra keyword (e.g. `enable_thinking`); extra keywords win over special tokens.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fastdeploy.input.chat_template_limits import BoundedSandbox, check_source, render_bounded

logger = logging.getLogger(__name__)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
ContentFormat = Literal["string", "openai"]
# Names under which a message's reasoning may arrive; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class RequestTemplate(str):
    """Template source sent by a server client: only ever Jinja text (never a path to read), rendered by
    the bounded sandbox (chat_template_limits.py)."""

    __slots__ = ()


def resolve_chat_template(value: str | os.PathLike[str]) -> str:
    """Return template text for `value`, which is Jinja source or the path of a file holding it (a
    RequestTemplate is returned as it is: a client's text is never taken for a path)."""
    if isinstance(value, RequestTemplate):
        check_source(value)
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"chat_template must be a Jinja string or a file path, got {type(value).__name__}")
    try:
        path = Path(value)
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # e.g. a long template string is not a valid file name
        pass
    if isinstance(value, str) and any(ch in value for ch in "{}\n"):
        return value
    raise ValueError(f"chat_template {str(value)!r} is neither an existing file nor a Jinja template")


def load_chat_template(directory: str | os.PathLike[str],
                       tokenizer_config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The tokenizer's own template(s): chat_template.jinja wins over tokenizer_config.json."""
    file = Path(directory) / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {item["name"]: item["template"] for item in template}
    return template


def select_chat_template(template: str | Mapping[str, str] | None, tools: Any = None) -> str:
    """Pick one template from a tokenizer's template or named templates (transformers' rules)."""
    if template is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template= (a Jinja string or file)")
    if isinstance(template, str):
        return template
    if tools and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ValueError(f"the tokenizer has several chat templates and none is 'default': {sorted(template)}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text in some templates; render it as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=2)
def _environment(bounded: bool = False) -> ImmutableSandboxedEnvironment:
    """The one place environments are built; `bounded` for a request's template (size and time limits)."""
    env = (BoundedSandbox if bounded else ImmutableSandboxedEnvironment)(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_DictFactory(), namespace=_Namespace)
    return env


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str, bounded: bool = False) -> jinja2.Template:
    """Compile (and cache) a template; syntax errors become ValueError."""
    try:
        return _environment(bounded).from_string(str(source))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template is not valid Jinja (line {exc.lineno}): {exc.message}") from None


@functools.lru_cache(maxsize=64)
def detect_content_format(source: str) -> ContentFormat:
    """'openai' if the template loops over or type-checks message content (parts lists), else 'string'.

    Like vLLM, a template that only concatenates `message['content']` gets list contents flattened
    into one string before rendering.
    """
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for node in tree.find_all((jinja2.nodes.For, jinja2.nodes.Test)):
        target = node.iter if isinstance(node, jinja2.nodes.For) else node.node
        if isinstance(node, jinja2.nodes.Test) and node.name not in ("string", "mapping", "iterable", "sequence"):
            continue
        if _mentions_content(target):
            return "openai"
    return "string"


def _mentions_content(node: jinja2.nodes.Node) -> bool:
    for sub in [node, *node.find_all((jinja2.nodes.Name, jinja2.nodes.Getattr, jinja2.nodes.Const))]:
        label = getattr(sub, "name", None) or getattr(sub, "attr", None) or getattr(sub, "value", None)
        if isinstance(label, str) and "content" in label:
            return True
    return False


def _plain(value: Any) -> Any:
    """Copy `value` as plain JSON-like data; other objects (images, arrays) become inert "<Type>" strings."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy floats) are cut back to the base type and lose their methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return bool(value) if isinstance(value, bool) else int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value] if isinstance(value, list) else tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _flatten_content(content: Any, index: int) -> Any:
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text":
            texts.append(part.get("text", ""))
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"messages[{index}]['content'] has a {kind!r} part, which this chat template cannot show")
    return "\n".join(texts)


def prepare_messages(messages: Sequence[Mapping[str, Any]], content_format: ContentFormat) -> list[dict[str, Any]]:
    """Validate and copy a conversation the way transformers does before rendering."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must hold at least one message")
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        # Keys set to None are dropped: templates handle a missing key but may print "None".
        msg = {k: _plain(v) for k, v in message.items() if v is not None}
        if content_format == "string" and "content" in msg:
            msg["content"] = _flatten_content(msg["content"], i)
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        prepared.append(msg)
    return prepared


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    tools: Sequence[Any] | None = None,
    documents: Sequence[Any] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with the Jinja template `source`; template errors become ValueError.
    continue_final_message: the text ends inside the last message, right after its content, so the model
    continues that message (transformers' semantics; not together with add_generation_prompt)."""
    if continue_final_message not in (True, False, "content"):
        raise NotImplementedError(f"continue_final_message={continue_final_message!r}: only True/False "
                                  "(continue the last message's content) are supported")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the first ends "
                         "the prompt inside the last message, the second opens a new assistant message")
    bounded = isinstance(source, RequestTemplate)
    template = compile_chat_template(str(source), bounded)
    chat = prepare_messages(messages, detect_content_format(source))
    final = _tag_final_message(chat, source) if continue_final_message else None
    variables = {**(special_tokens or {}), **{k: _plain(v) for k, v in kwargs.items()}}
    fixed = {"messages": chat, "tools": _plain(tools), "documents": _plain(documents),
             "add_generation_prompt": add_generation_prompt}
    if fixed.keys() & kwargs.keys():
        raise ValueError(f"chat template keywords may not set {sorted(fixed.keys() & kwargs.keys())}")
    variables.update(fixed)
    try:
        text = render_bounded(template, variables) if bounded else template.render(**variables)
    except jinja2.TemplateError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, AttributeError, KeyError, IndexError, ArithmeticError, RecursionError, MemoryError) as exc:
        raise ValueError(f"chat template failed on these messages: {exc}") from None
    return text if final is None else _cut_at_tag(text, final)


# Appended to the last message's content to find where it ends in the rendered text (as transformers does).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Mark the end of the last message's content (its last text part); return the content marked."""
    content = chat[-1].get("content")
    if content is None:
        raise ValueError("continue_final_message is set but the last message has no content to continue")
    if "content" not in source:
        raise ValueError("continue_final_message is set but the chat template never reads a message's content")
    if isinstance(content, str):
        chat[-1]["content"] = content + _CONTINUE_TAG
        return content
    for i in reversed(range(len(content))):
        part = content[i]
        if isinstance(part, dict) and "text" in part:
            content[i] = {**part, "text": part["text"] + _CONTINUE_TAG}
            return part["text"]
    raise ValueError("continue_final_message is set but the last message has no text part to continue")


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set but the chat template drops (part of) the last message, "
                         "so the prompt cannot end inside it")
    at = text.rindex(tag)
    # A template that trims the content also trimmed the tag's space: cut the whitespace before it too.
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
