"""GuidedDecodingParams: one output constraint of a request (FastDeploy's names), checked on construction.

The spec is turned into llguidance's grammar text (`to_grammar`) and checked by llguidance without a
tokenizer (a fraction of a millisecond), so a bad JSON schema, regex, choice list, grammar or structural
tag is a ValueError here, before any work starts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _json_value(name: str, value: Any) -> Any:
    """A JSON value given as a Python object or as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"guided_decoding.{name} is not valid JSON: {e.msg} at position {e.pos}") from None
    return value


def _structural_tag_grammar(value: Any) -> str:
    """A structural tag (xgrammar's / vLLM's shape: {"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}) as a Lark grammar: free text in which each trigger starts one of its structures, whose content
    must match the schema."""
    spec = _json_value("structural_tag", value)
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not spec["structures"] \
            or not isinstance(spec.get("triggers"), list) or not spec["triggers"]:
        raise ValueError('guided_decoding.structural_tag must be {"structures": [{"begin": str, "schema": {...}, '
                         '"end": str}, ...], "triggers": [str, ...]} with at least one of each')
    triggers = spec["triggers"]
    if not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("guided_decoding.structural_tag triggers must be non-empty strings")
    tags = []
    for item in spec["structures"]:
        if not isinstance(item, dict) or not isinstance(item.get("begin"), str) \
                or not isinstance(item.get("end", ""), str) or "schema" not in item:
            raise ValueError('each guided_decoding.structural_tag structure must be {"begin": str, "schema": '
                             '{...}, "end": str}')
        trigger = next((t for t in triggers if item["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"guided_decoding.structural_tag: begin {item['begin']!r} starts with none of the "
                             f"triggers {triggers}")
        schema = item["schema"] if isinstance(item["schema"], dict) else _json_value("structural_tag", item["schema"])
        tags.append(llguidance.StructTag(trigger=trigger, begin=item["begin"], grammar=schema, end=item.get("end", "")))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)  # tags match as text


@dataclass
class GuidedDecodingParams:
    """Constrain a request's output to exactly one of: a JSON schema (`json`, dict or JSON text), a regular
    expression (`regex`, Rust regex syntax), one of some strings (`choice`), a grammar (`grammar`: Lark, or
    GBNF/EBNF with `::=` as llama.cpp and xgrammar write it), any JSON object (`json_object=True`), or a
    structural tag (`structural_tag`: free text with tagged JSON segments, dict or JSON text)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) is not None]
        if len(set_kinds) != 1:
            raise ValueError(f"GuidedDecodingParams takes exactly one of {list(KINDS)}, got "
                             f"{set_kinds or 'none'}")
        self.grammar_text(whitespace_flexible=True)  # raises ValueError for a bad spec

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    def to_dict(self) -> dict[str, Any]:
        """FastDeploy's request keys (guided_json, guided_regex, ...) of the set field."""
        keys = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                "grammar": "guided_grammar", "json_object": "guided_json_object", "structural_tag": "structural_tag"}
        return {keys[k]: getattr(self, k) for k in KINDS if getattr(self, k) is not None}

    def cache_key(self, whitespace_flexible: bool) -> str:
        """Equal for specs that compile to the same grammar."""
        return json.dumps([self.kind, getattr(self, self.kind), whitespace_flexible], sort_keys=True)

    def grammar_text(self, whitespace_flexible: bool) -> str:
        """llguidance's grammar for this spec; ValueError naming the field when it is not usable."""
        kind = self.kind
        json_options = {"whitespace_flexible": whitespace_flexible}
        if kind == "json":
            schema = _json_value("json", self.json)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"guided_decoding.json must be a JSON schema (object), got {type(schema).__name__}")
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options)
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError(f"guided_decoding.json_object must be True when set, got {self.json_object!r}")
            text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=json_options)
        elif kind == "regex":
            if not isinstance(self.regex, str):
                raise TypeError(f"guided_decoding.regex must be a str, got {type(self.regex).__name__}")
            text = llguidance.LLMatcher.grammar_from_regex(self.regex)
        elif kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"guided_decoding.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            text = llguidance.grammar_from("choice", list(self.choice))
        elif kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("guided_decoding.grammar must be a non-empty Lark or GBNF/EBNF grammar string")
            try:
                text = llguidance.grammar_from("grammar", self.grammar)
            except ValueError as e:
                raise ValueError(f"guided_decoding.grammar is not a valid grammar: {e}") from None
        else:
            text = llguidance.LLMatcher.grammar_from_lark(_structural_tag_grammar(self.structural_tag))
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
        if failed:
            raise ValueError(f"guided_decoding.{kind} is not valid: {messages[0].strip()}")
        return text
