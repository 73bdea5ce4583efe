"""Runs the accepted lines of a batch file on one LLM, all together on the engine's continuous batching.

Lines are grouped by what one LLM.chat / LLM.generate call shares (chat: the template keywords and tools;
completions: nothing; the sampling parameters go per prompt). Each group is one whole (not streamed) call on
its own thread, all at once: the engine serialises steps and every step advances every submitted request,
whichever thread submitted it, so all groups run in the same batch (a uniform file is a single call)."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jinja2

from fastdeploy.cli.batch_lines import BatchRequest, LineFailure
from fastdeploy.entrypoints.llm import LLM
from fastdeploy.entrypoints.openai.serving import Choice
from fastdeploy.outputs import RequestOutput

# Groups run at once; more wait for a thread. Far above what a batch file normally has (one or two: chat and
# completions), it only bounds the threads of a file mixing many template keyword sets.
MAX_CONCURRENT_GROUPS = 32


@dataclass
class LineResult:
    """One line's outputs, gathered as the server gathers a whole response."""

    request: BatchRequest
    choices: list[Choice]
    prompt_token_ids: list[list[int]]  # per prompt
    error: tuple[int, str] | None = None  # (HTTP status, message) of a request the engine refused or failed

    @classmethod
    def of(cls, request: BatchRequest) -> LineResult:
        count = len(request.prompts) * request.choices_per_prompt
        return cls(request, [Choice() for _ in range(count)], [[] for _ in request.prompts])


@dataclass
class _Group:
    members: list[LineResult] = field(default_factory=list)


def _key(request: BatchRequest) -> str:
    if request.chat:
        return json.dumps(["chat", request.body.chat_template_kwargs, request.tools], sort_keys=True, default=str)
    return "completion"


class BatchEngine:
    def __init__(self, llm: LLM, on_line_done: Callable[[LineResult | LineFailure], None] | None = None):
        self.llm = llm
        self.on_line_done = on_line_done or (lambda _: None)

    def run(self, requests: Sequence[BatchRequest]) -> list[LineResult | LineFailure]:
        """Each request's result, in the given order."""
        results = [LineResult.of(r) for r in requests]
        groups: dict[str, _Group] = {}
        for result in results:
            groups.setdefault(_key(result.request), _Group()).members.append(result)
        failures: dict[int, LineFailure] = {}  # by id() of the line's LineResult
        if groups:
            with ThreadPoolExecutor(min(len(groups), MAX_CONCURRENT_GROUPS), thread_name_prefix="run-batch") as pool:
                for done in [pool.submit(self._run_group, group, failures) for group in groups.values()]:
                    done.result()  # an engine failure is the whole run's: raised here
        return [failures.get(id(r), r) for r in results]

    def _call(self, group: _Group) -> list[RequestOutput]:
        first = group.members[0].request
        prompts = [p for m in group.members for p in m.request.prompts]
        params = [m.request.params for m in group.members for _ in m.request.prompts]
        if first.chat:
            return self.llm.chat(prompts, params, chat_template_kwargs=first.body.chat_template_kwargs,
                                 tools=first.tools)
        return self.llm.generate(prompts, params)

    def _run_group(self, group: _Group, failures: dict[int, LineFailure]) -> None:
        """The group's call. A prompt that cannot be rendered or tokenized fails the call before anything is
        submitted: then each line gets its own call, so only the bad one fails."""
        try:
            outputs = self._call(group)
        except (ValueError, TypeError, NotImplementedError, jinja2.TemplateError) as e:
            if len(group.members) > 1:
                for member in group.members:
                    self._run_group(_Group([member]), failures)
                return
            request = group.members[0].request
            failures[id(group.members[0])] = failure = LineFailure(
                request.line, request.custom_id, str(e), 400, "messages" if request.chat else "prompt")
            self.on_line_done(failure)
            return
        # The call returns n outputs per prompt, prompt by prompt (a best_of prompt's n best): the lines' choices.
        slots = [(m, k) for m in group.members for k in range(len(m.choices))]
        for (result, k), output in zip(slots, outputs, strict=True):
            result.choices[k].add(output)
            result.prompt_token_ids[k // result.request.choices_per_prompt] = list(output.prompt_token_ids)
            if output.error_code != 200 and result.error is None:
                result.error = (output.error_code, output.error_msg or "internal error")
        for member in group.members:
            self.on_line_done(member)
