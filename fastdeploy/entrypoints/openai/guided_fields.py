"""The request fields that constrain the output — OpenAI's `response_format` and FastDeploy's extras
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `guided_json_object`, `structural_tag` —
turned into one GuidedDecodingParams. A bad spec is a ValueError whose message starts with the field's
name (the server answers 400 naming it)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from fastdeploy.engine.sampling_params import GuidedDecodingParams

# request field -> GuidedDecodingParams field
EXTRAS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "guided_json_object": "json_object", "structural_tag": "structural_tag"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")


def _from_response_format(value: Any) -> tuple[str, Any] | None:
    """(GuidedDecodingParams field, value) of a response_format, None for {"type": "text"}."""
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise ValueError(f"response_format must be an object with type one of {list(RESPONSE_FORMATS)}, got {value!r}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError('response_format json_schema must be {"type": "json_schema", "json_schema": {"name": '
                             '..., "schema": {...}}}')
        # OpenAI allows leaving out the schema: any JSON object then.
        return ("json", spec["schema"]) if "schema" in spec else ("json_object", True)
    return "structural_tag", {k: v for k, v in value.items() if k != "type"}


def guided_decoding_from(body: BaseModel) -> GuidedDecodingParams | None:
    """The constraint the request asks for (at most one of the fields), or None."""
    given = {name: value for name in ("response_format", *EXTRAS) if (value := getattr(body, name, None)) is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"response_format and the guided_* fields are exclusive: use one of {sorted(given)}")
    (name, value), = given.items()
    kind = _from_response_format(value) if name == "response_format" else (EXTRAS[name], value)
    if kind is None:
        return None
    try:
        return GuidedDecodingParams(**{kind[0]: kind[1]})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} is invalid: {e}") from None
