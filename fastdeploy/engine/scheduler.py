"""Continuous batching with a token budget per step (vLLM V1's idea).

There are no prefill and decode phases: each step every scheduled request gets enough new
tokens for its computed tokens to catch up with its known tokens, within the step's budget. A
prompt chunk and a single decode token are the same thing. Running requests go first, then
waiting ones in arrival order. When blocks run out, the newest running request is preempted:
its blocks are freed and it is recomputed later (its generated tokens are kept).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # per request, this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted = False

        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new

        # Admitting new work right after a preemption would only thrash the cache.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            leader = request.prefix_leader
            if leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens:
                break  # a sibling sample waits one step to reuse its leader's cached prompt blocks
            hits = self.block_manager.match_prefix(request)
            num_new = request.num_tokens - request.num_computed_tokens - len(hits) * self.block_manager.block_size
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate(request, num_new, hits):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.metrics.inference_start_time is None:
                request.metrics.inference_start_time = time.time()
                request.metrics.time_in_queue = request.metrics.inference_start_time - request.metrics.arrival_time
            self.running.append(request)
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new
        return ScheduledBatch(scheduled, counts)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.debug("preempted request %s (recomputed later)", request.request_id)

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.release(request)
