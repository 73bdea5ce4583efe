"""The offline-inference facade: LLM(model, ...).generate(...) / .chat(...)."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from fastdeploy.config import EngineConfig
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.submission import Submission
from fastdeploy.entrypoints.multimodal import prompts_for
from fastdeploy.entrypoints.prompts import Prepared, normalize_conversations, normalize_prompts
from fastdeploy.input.media import MediaError
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.outputs import RequestOutput
from fastdeploy.tool_parsers.calls import check_tools

logger = logging.getLogger(__name__)


def _unless_media_fail(prepare: Callable[..., Prepared], *args: Any) -> tuple[Prepared, str | None]:
    """The prepared prompt; for media that cannot be used, an empty prompt and the error that fails its
    request alone (the other prompts of the call still run)."""
    try:
        return prepare(*args), None
    except MediaError as e:
        return (e.prompt, [], None), str(e)


class LLM:
    """Runs a local checkpoint in this process. See docs/offline_inference.md for the parameters."""

    def __init__(self, model: str, revision: str | None = "master", tokenizer: str | None = None,
                 enable_logprob: bool = False, chat_template: str | None = None, **kwargs: Any):
        # FastDeploy's signature (these four may be passed by position); the rest are EngineArgs fields.
        self.config = EngineConfig.from_kwargs(model, revision=revision, tokenizer=tokenizer,
                                               enable_logprob=enable_logprob, chat_template=chat_template, **kwargs)
        self.engine = LLMEngine(self.config)
        self._prompts = prompts_for(self.config, self.engine.tokenizer)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def _check_master(self) -> bool:
        """FastDeploy's multi-node guard, always True here: under paddle.distributed.launch only rank 0's LLM(...)
        returns (the other ranks serve its steps and exit), so the code after it runs on rank 0 alone."""
        return True

    # ---- public API -----------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, stream: bool = False
                 ) -> list[RequestOutput] | Iterator[list[RequestOutput | None]]:
        """Complete each prompt. With n > 1 a prompt gives n outputs, one after another.
        stream=True returns a generator: each item is a list with one slot per output, holding a
        RequestOutput with only the new tokens and text where the step produced some, else None."""
        items = normalize_prompts(prompts)
        params = self._params_per_prompt(sampling_params, len(items), stream)
        groups: list[Submission] = []
        for item, p in zip(items, params):
            start = time.time()
            (text, ids, mm), error = _unless_media_fail(self._prompts.from_prompt, item)
            groups.append(self.engine.make_submission(text, ids, p, sum(map(len, groups)), start, mm=mm,
                                                      error=error))
        return self._stream(groups, use_tqdm) if stream else self._run(groups, use_tqdm)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None, tools: Any = None, stream: bool = False
             ) -> list[RequestOutput] | Iterator[list[RequestOutput | None]]:
        """Render each conversation with the chat template, then complete it as generate() does. `tools`
        (OpenAI tool dicts, or one) are rendered by the template; with LLM(tool_call_parser=...) the calls
        the model writes come back in outputs.tool_calls (see docs/tool_calling.md)."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        tools = check_tools(tools)
        conversations = normalize_conversations(messages)
        params = self._params_per_prompt(sampling_params, len(conversations), stream)
        thinking = bool((chat_template_kwargs or {}).get("enable_thinking", True))
        groups: list[Submission] = []
        for conversation, p in zip(conversations, params):
            start = time.time()
            (text, ids, mm), error = _unless_media_fail(self._prompts.from_chat, conversation, chat_template_kwargs,
                                                        chat_template, tools)
            groups.append(self.engine.make_submission(text, ids, p, sum(map(len, groups)), start, thinking, mm=mm,
                                                      error=error, tool_calls=tools is not None))
        return self._stream(groups, use_tqdm) if stream else self._run(groups, use_tqdm)

    # ---- helpers --------------------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(sampling_params: Any, count: int, stream: bool = False) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * count
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            if len(sampling_params) != count:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries but there are {count} prompts; "
                                 "pass one SamplingParams or one per prompt")
            params = list(sampling_params)
        else:
            raise TypeError("sampling_params must be a SamplingParams, a list of them, or None")
        if stream and any(p.ranks_candidates for p in params):
            raise ValueError("best_of > n needs the finished candidates to rank them; not with stream=True")
        return params

    def _run(self, groups: list[Submission], use_tqdm: bool) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        for step_outputs in self._steps(groups, use_tqdm, stream=False):
            outputs.update((o.request_id, o) for o in step_outputs)
        kept: list[RequestOutput] = []
        for group in groups:  # best_of candidates come best first: the first n are returned
            ranked = sorted((outputs[i] for i in group.request_ids), key=lambda o: o.outputs.index)
            kept += ranked[:group.num_returned]
        if len(kept) < len(outputs):  # best_of dropped candidates: number the outputs returned
            for i, output in enumerate(kept):
                output.outputs.index = i
        return kept

    def _stream(self, groups: list[Submission], use_tqdm: bool) -> Iterator[list[RequestOutput | None]]:
        position = {request_id: i for i, request_id in enumerate(i for g in groups for i in g.request_ids)}
        for step_outputs in self._steps(groups, use_tqdm, stream=True):
            # Another thread stepping the engine may have made two deltas of one request since the last
            # chunk: each goes in a chunk of its own, in order, so none is lost.
            chunk: list[RequestOutput | None] = [None] * len(position)
            for output in step_outputs:
                i = position[output.request_id]
                if chunk[i] is not None:
                    yield chunk
                    chunk = [None] * len(position)
                chunk[i] = output
            yield chunk

    def _steps(self, groups: list[Submission], use_tqdm: bool, stream: bool) -> Iterator[list[RequestOutput]]:
        """Submit the prompts and step the engine until their requests are done; yield the outputs each step
        made for them (another thread stepping the same engine may have made some: they are here too)."""
        engine = self.engine
        arrived: deque[RequestOutput] = deque()  # filled inside the steps (of any thread)
        ids = [i for g in groups for i in g.request_ids]
        engine.submit(groups, arrived.append, stream)
        unfinished = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, tokens_in, tokens_out = time.perf_counter(), 0, 0
        try:
            while True:
                outputs = [arrived.popleft() for _ in range(len(arrived))]
                finished = [o for o in outputs if o.finished]
                unfinished.difference_update(o.request_id for o in finished)
                tokens_out += sum(len(o.outputs.token_ids) for o in outputs if stream or o.finished)
                tokens_in += sum(o.prompt_token_ids_len for o in finished)
                if finished and use_tqdm:
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"est. speed input: {tokens_in / elapsed:.2f} toks/s, "
                                        f"output: {tokens_out / elapsed:.2f} toks/s")
                    bar.update(len(finished))
                if outputs:
                    yield outputs
                if not unfinished:
                    return
                engine.step()
        except BaseException:
            engine.cancel(sorted(unfinished))  # leave the engine usable after Ctrl-C, an error, or a dropped stream
            raise
        finally:
            bar.close()
