"""Bounds for chat templates a server client sends (--trust-request-chat-template).

Jinja's sandbox stops templates from reaching Python internals, but not from asking for a lot of memory
or time: `{{ 'x' * 10**9 }}`, `{% set s = s ~ s %}` in a loop, `'x'.center(10**9)`, nested loops. A
request's template is rendered by `BoundedSandbox`, which checks the size of what each operator, call and
filter would make before making it (where one call can amplify its input) and after, caps the rendered
text, and stops at a deadline checked on every line the compiled template runs.
The operator's templates (--chat-template, the tokenizer's, offline LLM.chat) keep the plain sandbox.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

MAX_TEMPLATE_CHARS = 256 * 1024  # a request's template source
MAX_OUTPUT_CHARS = 4 * 1024 * 1024  # rendered text, and any one value made while rendering
MAX_INT_ARG = 100_000  # an int passed to a call or filter (widths, counts; the sandbox's range cap)
MAX_RENDER_SECONDS = 5.0

_state = threading.local()  # the render deadline of this thread, if it renders a request template


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A request's chat template went past a size or time limit."""


def _weight(value: Any, budget: int = MAX_OUTPUT_CHARS) -> int:
    """Characters / items in `value` and what it holds, counted only until past `budget`."""
    total, stack = 0, [value]
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
    return total


def _depth(value: Any, budget: int = MAX_OUTPUT_CHARS) -> int:
    """How deeply lists and dicts nest in `value` (visiting at most `budget` items)."""
    deepest, stack, seen = 0, [(value, 0)], 0
    while stack and seen <= budget:
        item, depth = stack.pop()
        seen += 1
        deepest = max(deepest, depth)
        if isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
    return deepest


def _refuse_over(size: int, what: str) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(f"the chat template would make {what} of more than {MAX_OUTPUT_CHARS} characters")


def check_deadline() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateLimitError(f"the chat template took longer than {MAX_RENDER_SECONDS} s to render")


def _check_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARG:
            raise TemplateLimitError(f"the chat template passes {value}, over the limit {MAX_INT_ARG}, to a call")


_NUMBER = re.compile(r"\d+")


def _check_format(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """str.format / `%` / the format filter: widths in the format, and each field at most as long as the
    longest argument's text."""
    if any(int(n) > MAX_INT_ARG for n in _NUMBER.findall(fmt)):
        raise TemplateLimitError(f"the chat template formats with a width over {MAX_INT_ARG}")
    values = [*args, *kwargs.values()]
    _check_args(args, kwargs)
    # a field is at most the longest argument's text, padded to at most the largest int (a nested width)
    widest = (max((4 * _weight(v) + 32 for v in values), default=0)
              + max((abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)
              + MAX_INT_ARG * ("*" in fmt))
    _refuse_over(len(fmt) + (fmt.count("%") + fmt.count("{")) * widest, "a formatted string")


def _size(value: Any) -> int:
    return abs(value) if isinstance(value, int) and not isinstance(value, bool) else _weight(value)


def _precheck(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The calls whose output can be much larger than their input: their output size, before running."""
    if not args:
        return
    first = args[0]
    if name == "replace" and len(args) >= 3 and isinstance(first, str):
        old, new = str(args[1]), str(args[2])
        hits = len(first) + 1 if not old else first.count(old)
        _refuse_over(len(first) + hits * len(new), "a replaced string")
    elif name == "join":
        items = args[1] if isinstance(first, str) and len(args) > 1 else first
        sep = first if isinstance(first, str) and len(args) > 1 else str(args[1] if len(args) > 1 else "")
        count = len(items) if hasattr(items, "__len__") else 0
        _refuse_over(_weight(items) + count * len(sep), "a joined string")
    elif name in ("format", "format_map") and isinstance(first, str):
        _check_format(first, args[1:], kwargs)
    elif name == "tojson":  # each line indented by indent x depth, each item followed by a separator
        indent = kwargs.get("indent", args[2] if len(args) > 2 else None)
        separators = kwargs.get("separators", args[3] if len(args) > 3 else None)
        weight = _weight(first)
        per_item = (_size(indent) if isinstance(indent, (int, str)) else 0) * max(_depth(first), 1) + _weight(
            separators) + 1
        _refuse_over(4 * weight + (weight + 1) * per_item, "a JSON string")
    elif name == "translate" and isinstance(first, str) and len(args) > 1 and isinstance(args[1], dict):
        _refuse_over(len(first) * max([_weight(v) for v in args[1].values()] + [1]), "a translated string")
    elif name in ("indent", "expandtabs") and isinstance(first, str):  # a width per line / per tab
        key = "width" if name == "indent" else "tabsize"
        width = _size(kwargs.get(key, args[1] if len(args) > 1 else 8))
        lines = first.count("\n" if name == "indent" else "\t") + 1
        _refuse_over(len(first) + lines * width, f"a string from {name}")
    elif name == "wordwrap" and isinstance(first, str):  # at most one wrapstring per character
        wrap = kwargs.get("wrapstring", args[3] if len(args) > 3 else None)
        _refuse_over(len(first) * (1 + max(_weight(wrap), 1)), "a wrapped string")


def _call_name(obj: Any) -> str:
    return getattr(obj, "__name__", "")


def _checked_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def run(*args: Any, **kwargs: Any) -> Any:
        check_deadline()
        _check_args(args, kwargs)
        # pass_context / pass_eval_context filters get that first: the checked value comes after it
        plain = args[1:] if args and not isinstance(args[0], (str, list, tuple, dict)) and hasattr(
            f, "jinja_pass_arg") else args
        _precheck(f.__name__.lstrip("_").removeprefix("do_").removeprefix("sync_do_"), plain, kwargs)
        result = f(*args, **kwargs)
        _refuse_over(_weight(result), f"a value from the filter {f.__name__}")
        return result

    return run


class _CheckedFilters(dict):
    """The filter table: every filter, also one added after the environment is made, runs checked."""

    def __init__(self, filters: dict[str, Callable[..., Any]]) -> None:
        super().__init__()
        for name, f in filters.items():
            self[name] = f

    def __setitem__(self, name: str, f: Callable[..., Any]) -> None:
        super().__setitem__(name, _checked_filter(f))


class _BoundedCodeGenerator(CodeGenerator):
    """`~` (string concatenation) is compiled inline by Jinja, past the sandbox's hooks: route its result
    through the environment's size check."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.checked_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with size checks on operators, calls, filters and `~`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "**", "%", "//"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = _CheckedFilters(self.filters)

    @staticmethod
    def checked_concat(text: str) -> str:
        _refuse_over(len(text), "a string")
        return text

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        check_deadline()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    _refuse_over(_weight(seq) * max(times, 0), "a repeated sequence")
        elif operator == "+" and isinstance(left, (str, list, tuple)):
            _refuse_over(_weight(left) + _weight(right), "a joined sequence")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            _refuse_over(int(right * math.log2(abs(left)) / 8), "a number")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right if isinstance(right, tuple) else (right,), {})
        result = super().call_binop(context, operator, left, right)
        _refuse_over(_weight(result), "a value")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            mapping = args[0] if value.__name__ == "format_map" and args else {}
            _check_format(fmt, args if not mapping else tuple(mapping.values()), kwargs)
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(checked, wrapped)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        check_deadline()
        _check_args(args, kwargs)
        bound_to = getattr(__obj, "__self__", None)
        _precheck(_call_name(__obj), (bound_to, *args) if isinstance(bound_to, str) else args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _refuse_over(_weight(result), f"a value from {_call_name(__obj) or 'a call'}")
        return result


def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
    if event == "line":
        check_deadline()
    return _trace_lines


def _trace_calls(frame: Any, event: str, arg: Any) -> Any:
    # Only the template's own compiled code is traced line by line (loops that call nothing).
    if frame.f_code.co_filename == "<template>":
        check_deadline()
        return _trace_lines
    return None


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    previous = sys.gettrace()
    _state.deadline = time.monotonic() + seconds
    sys.settrace(_trace_calls)  # this thread only
    try:
        yield
    finally:
        sys.settrace(previous)
        _state.deadline = None


def check_source(source: str) -> None:
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"the chat template is longer than {MAX_TEMPLATE_CHARS} characters")


def render_bounded(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render a request's template (compiled by a BoundedSandbox) within the size and time limits."""
    parts, size = [], 0
    with _deadline(MAX_RENDER_SECONDS):
        for part in template.generate(**variables):
            size += len(part)
            _refuse_over(size, "a prompt")
            parts.append(part)
    return "".join(parts)
