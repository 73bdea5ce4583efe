"""OpenAI's batch file format for `fastdeploy run-batch`: reading one input line into a checked request
(the server's own request models, so a body means the same sampling here as on /v1), and the output lines.

Input line:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
Output line: {"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {...} | null}
As OpenAI's: a request the endpoint refuses is a response with its HTTP status and error body; a line that is
no request at all (not JSON, no custom_id, another method or url) has `response: null` and `error` instead."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

from pydantic import ValidationError

from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from fastdeploy.entrypoints.openai.serving import APIError, new_id, sampling_params
from fastdeploy.tool_parsers import check_tool_choice, check_tools

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS = {CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest}
# A completion prompt as LLM.generate takes it: text, or {"prompt_token_ids": [...]}.
PromptItem = Union[str, dict[str, list[int]]]


@dataclass
class BatchRequest:
    """One accepted input line: its body as the server parses it and the prompts to run."""

    line: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: ChatCompletionRequest | CompletionRequest
    params: SamplingParams
    prompts: list[Any]  # chat: [the messages]; completions: one PromptItem per prompt
    tools: list[dict[str, Any]] | None = None

    @property
    def chat(self) -> bool:
        return self.url == CHAT_URL

    @property
    def choices_per_prompt(self) -> int:
        return self.params.n


@dataclass
class LineFailure(Exception):
    """A line that gives an error line. status None: the line is no request (its own `error`); else the HTTP
    status the endpoint answers it with (`response` carries the error body)."""

    line: int
    custom_id: str | None
    message: str
    status: int | None = None
    param: str | None = None
    code: str = "invalid_request"

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The server's wording for a body its request model refuses: `field: problem; ...`, the first field."""
    problems = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()]
    first = e.errors()[0]["loc"] if e.errors() else ()
    return "; ".join(problems), str(first[0]) if first else None


def _completion_prompts(prompt: Any) -> list[PromptItem]:
    """The prompts of a /v1/completions body as the server reads them: a str, a list of token ids, or a list
    of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or any(len(p) == 0 for p in prompt):
        raise APIError(400, "prompt must be a non-empty string, list of strings or list of token ids", "prompt")
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def _check_chat(body: ChatCompletionRequest, parses_tool_calls: bool) -> list[dict[str, Any]] | None:
    """The body's tools; APIError for what a chat body cannot ask of an offline batch."""
    if not body.messages:
        raise APIError(400, "messages must be a non-empty list of {'role', 'content'} objects", "messages")
    # As the server without --trust-request-chat-template: a batch runs the model's (or --chat-template's).
    for field, value in (("chat_template", body.chat_template),
                         ("chat_template_kwargs.chat_template", (body.chat_template_kwargs or {}).get("chat_template"))):
        if value is not None:
            raise APIError(400, f"{field}: run-batch uses the model's chat template (or --chat-template); a "
                                "request's own template is not accepted", field)
    try:
        tools = check_tools(body.tools)
        choice = check_tool_choice(body.tool_choice, tools)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), "tools" if "tool_choice" not in str(e) else "tool_choice") from None
    if tools and choice != "auto":
        # LLM.chat's offline tool calling is 'auto' (parsed with --tool-call-parser); forcing calls is the server's.
        raise APIError(400, f"tool_choice={body.tool_choice!r}: run-batch supports only 'auto' with tools",
                       "tool_choice")
    if tools and not parses_tool_calls:  # as the server: calls would come back as plain text
        raise APIError(400, "tool_choice='auto' needs run-batch started with --tool-call-parser", "tool_choice")
    return tools


def parse_line(text: str, line: int, model_names: Sequence[str], parses_tool_calls: bool = False) -> BatchRequest:
    """The request of one input line; LineFailure if it gives an error line instead. `model_names`: the names
    a body's model may have, the served name first (as the server: the checkpoint directory's name, or the
    --model argument as typed). parses_tool_calls: the engine has a --tool-call-parser."""
    custom_id = None
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineFailure(line, None, f"not valid JSON ({e.msg})", code="invalid_json_line") from None
    if not isinstance(item, dict):
        raise LineFailure(line, None, f"must be a JSON object, got {type(item).__name__}")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineFailure(line, None, "custom_id must be a non-empty string", code="missing_custom_id")
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineFailure(line, custom_id, f"unknown fields {unknown}; a line holds custom_id, method, url, body")
    if item.get("method") != "POST":
        raise LineFailure(line, custom_id, f"method must be 'POST', got {item.get('method')!r}",
                          code="invalid_method")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise LineFailure(line, custom_id, f"url must be one of {list(ENDPOINTS)}, got {url!r}", code="invalid_url")
    if not isinstance(item.get("body"), dict):
        raise LineFailure(line, custom_id, "body must be a JSON object (the endpoint's request body)")
    try:
        return _request(line, custom_id, url, item["body"], model_names, parses_tool_calls)
    except APIError as e:
        raise LineFailure(line, custom_id, e.message, e.status, e.param) from None


def _request(line: int, custom_id: str, url: str, raw: dict[str, Any], model_names: Sequence[str],
             parses_tool_calls: bool) -> BatchRequest:
    try:
        body = ENDPOINTS[url](**raw)
    except ValidationError as e:
        raise APIError(400, *_validation_message(e)) from None
    if body.model is not None and body.model not in model_names:
        raise APIError(404, f"The model `{body.model}` does not exist; this batch runs `{model_names[0]}`",
                       "model")
    if body.stream:
        raise APIError(400, "stream: a batch's responses are whole; leave stream out or false", "stream")
    params = sampling_params(body.to_sampling_params)  # the server's mapping and its 400s
    if isinstance(body, ChatCompletionRequest):
        tools = _check_chat(body, parses_tool_calls)
        return BatchRequest(line, custom_id, url, body, params, [body.messages], tools)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (it needs the prompt's logprobs)", "echo")
    return BatchRequest(line, custom_id, url, body, params, _completion_prompts(body.prompt))


def response_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": new_id("batch_req"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": new_id("run-batch"), "body": body}, "error": None}


def failure_line(failure: LineFailure) -> dict[str, Any]:
    if failure.status is not None:
        return response_line(failure.custom_id, failure.status,
                             error_body(failure.status, failure.message, failure.param))
    return {"id": new_id("batch_req"), "custom_id": failure.custom_id, "response": None,
            "error": {"code": failure.code, "message": str(failure)}}
