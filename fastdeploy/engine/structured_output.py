"""The engine's structured-output manager: every grammar goes through it (vLLM V1's StructuredOutputManager).

It holds `GuidedDecoding` (guided/matcher.py: llguidance, the compiled-spec cache and the mask worker) and
does, step by step, what a constrained request needs: give it its matcher when it is made, start the step's
mask computation before the forward, and after the step feed the new tokens to the matchers, finishing the
requests whose grammar is complete. Each request's matcher state rides on its record (`Request.grammar`, so
it lives and dies with the request); only this class creates, reads or advances it, and the step builder only
asks whether a request has one.

Reasoning models: while a request's output is in its thinking part the constraint waits; it applies from the
first token after the end of thinking (vLLM's and FastDeploy's behaviour), once any forced end-of-thinking
tokens have been emitted.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fastdeploy.engine.request import Request
from fastdeploy.engine.scheduler import Scheduler
from fastdeploy.engine.step_builder import ScheduledStep
from fastdeploy.guided.matcher import GrammarMasks, GuidedDecoding


class StructuredOutputManager:
    """The engine's one home for grammars: attach, masks before the forward, matchers advanced after it."""

    def __init__(self, guided: GuidedDecoding) -> None:
        self.guided = guided

    def attach(self, request: Request, reasoning: bool) -> str | None:
        """Give a request with params.guided_decoding its matcher (waiting for the end of the thinking part
        when its output begins with one: `reasoning`); the error (for error_code 400) when the spec cannot
        be used with this model."""
        spec = request.params.guided_decoding
        if spec is None:
            return None
        if reasoning and not request.params.detokenize:
            return "guided_decoding on a thinking output needs detokenize=True (the end of thinking is found in the text)"
        try:
            request.grammar = self.guided.new_state(spec, after_reasoning=reasoning)
        except ValueError as e:
            return str(e)
        return None

    def start_masks(self, step: ScheduledStep) -> GrammarMasks | None:
        """Put the constrained sampling rows and their bitmask (being filled on the worker thread) on the
        step's model input; the handle to wait on, or None when no row is constrained. A drafting request's
        row after j drafts is masked as the grammar stands after them."""
        rows, drafts, seen = [], [], {}
        for j, r in enumerate(step.rows):
            offset = seen[id(r)] = seen.get(id(r), -1) + 1
            if r.grammar is not None and r.grammar.active and not r.forced_tokens:
                rows.append(j)
                drafts.append(r.draft_token_ids[:offset])
        if not rows:
            return None
        banned = step.model_input.sampling.banned_token_ids
        bitmask, masks = self.guided.start_masks([step.rows[j].grammar for j in rows], [banned[j] for j in rows],
                                                 drafts)
        step.model_input.guided_rows = np.asarray(rows, dtype=np.int64)
        step.model_input.token_bitmask = bitmask
        return masks

    @staticmethod
    def advance(scheduler: Scheduler, samplers: Sequence[Request],
                on_error: Callable[[Request, Exception], None]) -> None:
        """After the scheduler applied a step: feed each constrained request's new tokens to its matcher. A
        completed grammar finishes the request ("stop"); a token the grammar rejects (only possible for a
        token the grammar did not choose, e.g. forced) fails it; a matcher that raised, here or computing the
        step's mask, fails its request alone (on_error)."""
        for request in samplers:
            state = request.grammar
            if state is None or not state.active or request.is_finished:
                continue
            if state.failure is not None:  # its mask could not be computed: the step sampled it unconstrained
                on_error(request, state.failure)
                continue
            try:
                synced = state.conflict is None and state.sync(request.output_token_ids)
            except Exception as e:  # noqa: BLE001 - this request's grammar only
                on_error(request, e)
                continue
            if not synced:
                request.error_code = 400
                request.error_msg = state.conflict or \
                    f"the output left the guided_decoding grammar: {state.matcher.get_error()}"
                scheduler.finish_request(request, "abort")
            elif state.finished:
                scheduler.finish_request(request, "stop")

    @staticmethod
    def activate_after_reasoning(requests: Sequence[Request]) -> None:
        """Start the waiting constraint of requests whose thinking part has ended (the output processor said
        so of this step's token), once any forced end-of-thinking tokens are out."""
        for request in requests:
            state = request.grammar
            if state is not None and not state.active and not request.is_finished and not request.forced_tokens:
                state.start = request.num_output_tokens
