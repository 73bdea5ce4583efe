"""Text side of a request's output: incremental detokenization, stop strings, the reasoning
split, and the RequestOutputs handed to the user (whole, or as stream deltas).

Streamed text never includes a tail that could still turn out to be the start of a stop string
or a reasoning tag, so the deltas of a request always join to exactly its final text.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastdeploy.engine.request import CompletionOutput, Logprob, Request, RequestOutput
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.output.detokenizer import IncrementalDetokenizer
from fastdeploy.reasoning.parsers import ReasoningParser


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, reasoning_parser: ReasoningParser | None):
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser

    def start(self, request: Request, enable_thinking: bool) -> None:
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     request.params.skip_special_tokens)
        parser = self.reasoning_parser
        request.reasoning = parser is not None and parser.starts_in_reasoning(request.prompt, enable_thinking)

    def on_token(self, request: Request, token: int) -> None:
        """Decode the new token; a completed stop string cuts the text and finishes the request."""
        if not request.params.detokenize:
            return
        new_text = request.detokenizer.add_tokens([token])
        if request.is_finished:
            new_text += request.detokenizer.flush()
        request.text += new_text
        stops = request.params.stop_strings
        if not stops or not new_text:
            return
        # Only a match ending in the new text is new; it may start in the old text.
        longest = max(len(s) for s in stops)
        search_from = max(len(request.text) - len(new_text) - longest + 1, 0)
        hits = [(request.text.find(s, search_from), s) for s in stops]
        hits = [(pos, s) for pos, s in hits if pos != -1]
        if not hits:
            return
        pos, stop = min(hits)
        end = pos + len(stop) if request.params.include_stop_str_in_output else pos
        request.text = request.text[:end]
        request.finish("stop", stop)

    def visible_text(self, request: Request) -> str:
        """Text that can no longer change: while running, hold back a possible stop-string start."""
        text = request.text
        stops = request.params.stop_strings
        if request.is_finished or not stops or request.params.include_stop_str_in_output:
            return text
        return text[:max(len(text) - (max(len(s) for s in stops) - 1), 0)]

    def split(self, request: Request) -> tuple[str | None, str]:
        text = self.visible_text(request)
        if not request.reasoning:
            return (None if self.reasoning_parser is None else ""), text
        return self.reasoning_parser.split(text, final=request.is_finished)

    def make_output(self, request: Request, delta: bool = False) -> RequestOutput:
        """The request's output so far; with delta=True only what was not sent before."""
        reasoning, text = self.split(request)
        token_ids = request.output_token_ids
        logprobs = request.logprobs
        prompt_logprobs = request.prompt_logprobs
        if delta:
            sent_tokens = request.sent_tokens
            prompt_logprobs = prompt_logprobs if sent_tokens == 0 else None  # sent with the first delta
            token_ids, logprobs = token_ids[sent_tokens:], logprobs[sent_tokens:] if logprobs else logprobs
            new_text, new_reasoning = text[request.sent_text:], reasoning
            if reasoning is not None:
                new_reasoning = reasoning[request.sent_reasoning:]
                request.sent_reasoning = len(reasoning)
            request.sent_tokens, request.sent_text = request.num_output_tokens, len(text)
            text, reasoning = new_text, new_reasoning
        completion = CompletionOutput(
            index=request.index, send_idx=max(request.num_output_tokens - 1, 0), token_ids=token_ids, text=text,
            reasoning_content=reasoning, logprobs=logprobs, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=completion, finished=request.is_finished, metrics=request.metrics,
            num_cached_tokens=request.num_cached_tokens, error_code=request.error_code,
            error_msg=request.error_msg, prompt_logprobs=prompt_logprobs)

    def logprob_entry(self, token: int, top_ids: np.ndarray, top_logprobs: np.ndarray, logprob: float,
                      rank: int) -> dict[int, Logprob]:
        """{token_id: Logprob} for the top-k plus the chosen token (ranks are 1-based)."""
        entry = {int(t): Logprob(float(lp), i + 1, self.decode_one(int(t)))
                 for i, (t, lp) in enumerate(zip(top_ids, top_logprobs))}
        if token not in entry:
            entry[token] = Logprob(float(logprob), int(rank), self.decode_one(token))
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
