"""Text side of a request's output: incremental detokenization, stop strings, the reasoning split,
logprob entries, and the RequestOutputs handed to the user (whole, or as stream deltas).

The processor owns each request's text state (by request id), from `start` until its finished output
is made. Streamed text never includes a tail that could still turn out to be the start of a stop
string or a reasoning tag, so the deltas of a request always join to exactly its final text.

Incremental detokenization (`IncrementalDetokenizer`) turns a growing list of output ids into text deltas,
with the same scheme as vLLM's prefix/read offsets: each call decodes only a short window of ids that starts
where the previous delta's context began (at first: the last few prompt ids, so spacing and word
joins come out as in a full decode), and emits the part of the window's text beyond that context.
A window whose text ends in U+FFFD is an unfinished multi-byte character (a byte-fallback or
byte-level token sequence cut short), so nothing is emitted until more ids complete it; `flush()`
releases whatever is still held when the sequence ends. Work per call is proportional to the new
ids plus the held-back ones, not to the output length.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from fastdeploy.engine.request import Request
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.outputs import CompletionOutput, Logprob, RequestOutput
from fastdeploy.reasoning.parsers import THINK_END, ReasoningParser
from fastdeploy.step_types import TopLogprobs
from fastdeploy.tool_parsers.calls import call_deltas, call_dict
from fastdeploy.tool_parsers.parsers import ParsedCall, ToolParser

# Prompt ids kept as left context for the first delta (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one sequence; `"".join(deltas) + flush()` equals decoding all output ids."""

    __slots__ = ("_tokenizer", "_skip", "_keep", "_ids", "_read", "_parts", "_text")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 keep: Mapping[int, str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Special tokens written out even when skipping special tokens (a tool parser's markers): id -> text.
        self._keep = dict(keep or {}) if skip_special_tokens else {}
        # Window of ids still needed: context ids [0, _read) followed by ids whose text is not out yet.
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if len(prompt_token_ids) else []
        self._ids: list[int] = [int(i) for i in context]
        self._read = len(self._ids)
        self._parts: list[str] = []
        self._text: str | None = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._parts)
        return self._text

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        if len(new_token_ids) == 0:
            return ""
        self._ids.extend(int(i) for i in new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Release text held back for an unfinished character (it decodes with U+FFFD); call at the end."""
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        if not self._keep or not any(i in self._keep for i in ids):
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip)
        parts, run = [], []
        for i in ids:
            if i in self._keep:
                parts += [self._tokenizer.decode(run, skip_special_tokens=True), self._keep[i]]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self._tokenizer.decode(run, skip_special_tokens=True)

    def _emit(self, final: bool) -> str:
        decode = self._decode
        ids = self._ids
        context = decode(ids[:self._read])
        window = decode(ids)
        if len(window) <= len(context) or (window.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new yet (a skipped special token) or a character still incomplete
        delta = window[len(context):]
        # The ids just emitted become the next window's context; older ids are no longer needed.
        del ids[:self._read]
        self._read = len(ids)
        self._parts.append(delta)
        self._text = None
        return delta


FORCED_THINK_END = "\n" + THINK_END + "\n\n"  # what ends a thinking part cut by reasoning_max_tokens


@dataclass(slots=True)
class TextState:
    """One request's output as text, and what earlier stream deltas carried."""

    index: int  # position of the prompt in the caller's batch
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    reasoning: bool  # the reasoning parser applies to this output
    tool_parser: ToolParser | None  # parses this output's tool calls (None: no tool-call parsing)
    call_ids: list[str] = field(default_factory=list)  # ids of the tool calls found so far
    text: str = ""  # output text so far, cut at a matched stop string
    num_reasoning_tokens: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # position 0 has none
    draft_logprobs: list[dict[int, Logprob] | None] | None = None  # per output token: an accepted MTP draft's
    sent_tokens: int = 0
    sent_text: int = 0
    sent_reasoning: int = 0
    sent_calls: int = 0


@dataclass(slots=True)
class TokenEvents:
    """What a new token's text means for the scheduler."""

    stop_string: str | None = None  # matched: finish the request with it
    forced_tokens: list[int] = field(default_factory=list)  # to emit next (end of a cut thinking part)
    thinking_over: bool = False  # the output's thinking part has ended (a waiting grammar may start)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, reasoning_parser: ReasoningParser | None,
                 tool_parser: ToolParser | None = None):
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.states: dict[str, TextState] = {}

    def start(self, request: Request, prompt: str | None, index: int, enable_thinking: bool,
              tool_calls: bool | ToolParser = False) -> bool:
        """Start the request's text state; whether its output begins with a thinking part (the reasoning
        parser applies). tool_calls: parse tool calls out of this output (a chat given tools) with the tool
        parser, if there is one, or with the parser given (calls forced by tool_choice)."""
        parser = self.reasoning_parser
        tool_parser = tool_calls if isinstance(tool_calls, ToolParser) else self.tool_parser if tool_calls else None
        state = self.states[request.request_id] = TextState(
            index=index, prompt=prompt,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                               request.params.skip_special_tokens, self._markers(tool_parser)),
            reasoning=parser is not None and parser.starts_in_reasoning(prompt, enable_thinking),
            tool_parser=tool_parser,
            prompt_logprobs=[None] if request.wants_prompt_logprobs else None)
        return state.reasoning

    def _markers(self, tool_parser: ToolParser | None) -> dict[int, str]:
        """The tool parser's markers that are single tokens of this tokenizer, by id."""
        ids = {m: self.tokenizer.encode(m, add_special_tokens=False) for m in getattr(tool_parser, "MARKERS", ())}
        return {i[0]: m for m, i in ids.items() if len(i) == 1}

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def on_token(self, request: Request, token: int) -> TokenEvents:
        """Decode the request's new token: a completed stop string cuts the text; after
        reasoning_max_tokens thinking tokens the end of thinking is forced."""
        state = self.states[request.request_id]
        events = TokenEvents()
        if request.params.detokenize:
            new_text = state.detokenizer.add_tokens([token])
            if request.is_finished:
                new_text += state.detokenizer.flush()
            state.text += new_text
            events.stop_string = self._match_stop(request, state, new_text)
        limit = request.params.reasoning_max_tokens
        if (limit is not None and state.reasoning and not request.is_finished and events.stop_string is None
                and THINK_END not in state.text):
            state.num_reasoning_tokens += 1
            if state.num_reasoning_tokens == limit and not request.forced_tokens:
                events.forced_tokens = self.tokenizer.encode(FORCED_THINK_END, add_special_tokens=False)
        events.thinking_over = state.reasoning and THINK_END in state.text
        return events

    @staticmethod
    def _match_stop(request: Request, state: TextState, new_text: str) -> str | None:
        stops = request.params.stop_strings
        if not stops or not new_text:
            return None
        # Only a match ending in the new text is new; it may start in the old text.
        longest = max(len(s) for s in stops)
        search_from = max(len(state.text) - len(new_text) - longest + 1, 0)
        hits = [(state.text.find(s, search_from), s) for s in stops]
        hits = [(pos, s) for pos, s in hits if pos != -1]
        if not hits:
            return None
        pos, stop = min(hits)
        state.text = state.text[:pos + len(stop) if request.params.include_stop_str_in_output else pos]
        return stop

    def add_logprobs(self, request: Request, token: int, top: TopLogprobs) -> None:
        state = self.states[request.request_id]
        if state.logprobs is None:
            state.logprobs = []
        state.logprobs.append(self.logprob_entry(token, top))

    def add_draft_logprobs(self, request: Request, position: int, token: int, top: TopLogprobs) -> None:
        """The MTP layer's logprobs for output token `position`, an accepted draft."""
        state = self.states[request.request_id]
        entries = state.draft_logprobs = state.draft_logprobs or []
        entries += [None] * (position - len(entries))
        entries.append(self.logprob_entry(token, top))

    def add_prompt_logprobs(self, request: Request, position: int, top: TopLogprobs) -> None:
        """Logprobs of prompt token position + 1; a position seen before a preemption is not added twice."""
        entries = self.states[request.request_id].prompt_logprobs
        if len(entries) == position + 1:
            entries.append(self.logprob_entry(request.prompt_token_ids[position + 1], top))

    def _visible_text(self, request: Request, state: TextState) -> str:
        """Text that can no longer change: while running, hold back a possible stop-string start."""
        stops = request.params.stop_strings
        if request.is_finished or not stops or request.params.include_stop_str_in_output:
            return state.text
        return state.text[:max(len(state.text) - (max(len(s) for s in stops) - 1), 0)]

    def _split(self, request: Request, state: TextState) -> tuple[str | None, str, list[ParsedCall]]:
        """(reasoning, text, tool calls): the calls are parsed from the content, never from the reasoning."""
        text = self._visible_text(request, state)
        final, parse_calls = request.is_finished, state.tool_parser is not None
        if not state.reasoning:
            reasoning = None if self.reasoning_parser is None else ""
        else:
            reasoning, text = self.reasoning_parser.split(text, final=final, keep_tool_calls=parse_calls)
        if not parse_calls:
            return reasoning, text, []
        split = state.tool_parser.split(text, final)
        state.call_ids += [state.tool_parser.new_call_id() for _ in range(len(split.calls) - len(state.call_ids))]
        return reasoning, split.text, split.calls

    def make_output(self, request: Request, delta: bool = False) -> RequestOutput:
        """The request's output so far; with delta=True only what was not sent before. The finished
        output is the last: the request's text state is released with it."""
        state = self.states[request.request_id]
        reasoning, text, calls = self._split(request, state)
        tool_calls = [call_dict(c, i) for c, i in zip(calls, state.call_ids)] if calls else None
        token_ids = request.output_token_ids
        logprobs, prompt_logprobs, drafts = state.logprobs, state.prompt_logprobs, state.draft_logprobs
        if drafts is not None:
            drafts = drafts + [None] * (len(token_ids) - len(drafts))
        last = logprobs[-1].get(token_ids[-1]) if logprobs and token_ids else None
        last_logprob = None if last is None else last.logprob
        if delta:
            sent_tokens = state.sent_tokens
            prompt_logprobs = prompt_logprobs if sent_tokens == 0 else None  # sent with the first delta
            token_ids, logprobs = token_ids[sent_tokens:], logprobs[sent_tokens:] if logprobs else logprobs
            drafts = drafts[sent_tokens:] if drafts else drafts
            new_text, new_reasoning = text[state.sent_text:], reasoning
            if reasoning is not None:
                new_reasoning = reasoning[state.sent_reasoning:]
                state.sent_reasoning = len(reasoning)
            tool_calls = [d for n in range(state.sent_calls, len(calls))
                          for d in call_deltas(calls[n], state.call_ids[n], n)] or None
            state.sent_tokens, state.sent_text, state.sent_calls = request.num_output_tokens, len(text), len(calls)
            text, reasoning = new_text, new_reasoning
        if request.is_finished:
            self.release(request.request_id)
        completion = CompletionOutput(
            index=state.index, send_idx=max(request.num_output_tokens - 1, 0), token_ids=token_ids, text=text,
            reasoning_content=reasoning, logprob=last_logprob, logprobs=logprobs, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, tool_calls=tool_calls, draft_logprobs=drafts)
        return RequestOutput(
            request_id=request.request_id, prompt=state.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=completion, finished=request.is_finished, metrics=replace(request.metrics),  # a snapshot
            num_cached_tokens=request.num_cached_tokens, error_code=request.error_code,
            error_msg=request.error_msg, prompt_logprobs=prompt_logprobs)

    def failed_output(self, request: Request) -> RequestOutput:
        """The final output of a request whose text side failed (error_code 500): no text; its state dropped."""
        state = self.states.pop(request.request_id, None)
        completion = CompletionOutput(index=state.index if state else 0, send_idx=max(request.num_output_tokens - 1, 0),
                                      token_ids=[], text="", finish_reason=request.finish_reason)
        return RequestOutput(
            request_id=request.request_id, prompt=state.prompt if state else None,
            prompt_token_ids=request.prompt_token_ids, outputs=completion, finished=True,
            metrics=replace(request.metrics), num_cached_tokens=request.num_cached_tokens,
            error_code=request.error_code, error_msg=request.error_msg)

    def logprob_entry(self, token: int, top: TopLogprobs) -> dict[int, Logprob]:
        """{token_id: Logprob} for the top-k plus the chosen token (ranks are 1-based)."""
        entry = {int(t): Logprob(float(lp), i + 1, self.decode_one(int(t)))
                 for i, (t, lp) in enumerate(zip(top.token_ids, top.logprobs))}
        if token not in entry:
            entry[token] = Logprob(top.target_logprob, top.target_rank, self.decode_one(token))
        return entry

    def decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def bad_word_sequences(self, words: Sequence[str]) -> list[tuple[int, ...]]:
        """Token sequences to ban: each word alone and after a space (as it appears mid-text)."""
        sequences = set()
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    sequences.add(tuple(ids))
        return sorted(sequences)
