"""MTP drafting on the runner's side (speculative.py's "mtp"): after a step is sampled, ERNIE-4.5's MTP layer
(model_executor/models/ernie4_5_mtp.py) catches up with each MTP request and drafts its next step's tokens.

A request's MTP row at position i needs the main model's final hidden state h_i and the token x_{i+1} after it.
A step computed h for the request's query rows, positions P..P+n-1; which of them are final depends on sampling:
- a prompt chunk that does not sample: all n, x_{i+1} being the next query token, and for the last row the prompt
  token after the chunk;
- a request that samples with k drafts (its last k query tokens): its last token and the m drafts before the
  first mismatch, n - k + m rows, the last of them followed by the token sampled there (the step's new token).
The rows' MTP K/V go into the MTP layer's cache at their positions (a rejected draft's is overwritten by the next
step). The last row's output gives the first draft (greedy: argmax of the shared LM head); a further draft runs
the layer again one position on, with the previous draft as its token and the previous output as its hidden
state (FastDeploy's chaining), its K/V in the slots the scheduler reserved past the step's tokens.

`MtpProposer` (rank 0) decides the rows and the drafts; `MtpLayer` runs the layer on one rank's shard from the hidden
states that rank kept, so with tensor parallel each run is also sent to the workers (messages.MtpStep).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.forward_context import build_forward_context, forward_context
from fastdeploy.model_executor.models.ernie4_5_mtp import mtp_forward
from fastdeploy.step_types import ForwardBatch, SchedulerOutput, TopLogprobs
from fastdeploy.worker import messages
from fastdeploy.worker.compiled_step import CompiledDecoder
from fastdeploy.worker.messages import MtpLayerStep
from fastdeploy.worker.worker_group import WorkerGroup


@dataclass(slots=True)
class _CatchUp:
    """The MTP rows of a step: per entry its final rows (x_{i+1}, position i, h_i's row in the step's hidden
    states), where its last row is, and how many drafts it makes."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)


class MtpLayer:
    """One rank's MTP layer runs and the hidden states they read: the main model's of the step (`main`, set after
    its forward) and the last run's kept outputs. By the compiled step when it covers the layer (`compiled`: a
    CompiledDecoder of the MTP layer, which makes its input from hidden states), else layer by layer."""

    def __init__(self, model: nn.Layer, kv_caches: Sequence[paddle.Tensor], block_size: int,
                 compiled: CompiledDecoder | None = None) -> None:
        self.model, self.kv_caches, self.block_size, self.compiled = model, kv_caches, block_size, compiled
        self.main = self.last = np.zeros((0, model.config.hidden_size), np.float32)

    def run(self, step: MtpLayerStep) -> paddle.Tensor | None:
        """The layer over the step's rows (its K/V into its cache): the logits of `out_rows` (None: no rows), whose
        outputs o become `last`."""
        hidden = (self.main if step.from_main else self.last)[step.sources]
        ids = np.asarray(step.ids, np.int64)
        if self.compiled is not None:  # the whole layer, its input made from `hidden`, in one compiled call
            rows = np.asarray(step.out_rows, np.int64)
            batch = ForwardBatch(ids, np.asarray(step.positions, np.int64), np.asarray(step.lens, np.int64),
                                 np.asarray(step.ends, np.int64), step.table, rows, hidden_rows=rows)
            logits = self.compiled.forward(batch, np.ascontiguousarray(hidden, dtype=np.float32))
            self.last = self.compiled.hidden
            return logits
        ctx = build_forward_context(np.asarray(step.lens, np.int64), np.asarray(step.ends, np.int64), step.table,
                                    self.block_size, self.kv_caches)
        with forward_context(ctx):
            out = mtp_forward(self.model, paddle.to_tensor(ids), paddle.to_tensor(np.asarray(step.positions, np.int64)),
                              paddle.to_tensor(hidden))
        if not step.out_rows:
            return None
        last = paddle.gather(out, _index(step.out_rows))
        self.last = last.numpy()
        return self.model.compute_logits(last)  # on every rank: a vocabulary-parallel head gathers across them


class MtpProposer:
    """Rank 0's drafting: which rows catch up, the layer runs (sent to the tensor-parallel workers too, which run
    them on their own hidden states), the greedy drafts and their logprobs."""

    def __init__(self, layer: MtpLayer, workers: WorkerGroup | None = None) -> None:
        self.layer, self.workers = layer, workers

    def propose(self, step: SchedulerOutput, sampled: Sequence[int], hidden: np.ndarray
                ) -> tuple[list[list[int]], list[list[TopLogprobs]]]:
        """Each MtpRows entry's drafts for its next step, and their logprobs where asked (MtpRows.logprobs_k);
        `hidden` [len(hidden_rows), H]: the main model's final hidden states of step.forward.hidden_rows (each
        worker keeps its own)."""
        self.layer.main = hidden
        rows = catch_up_rows(step, sampled)
        table = step.forward.block_tables[step.mtp.batch_index]
        ends = [p + 1 for p in np.asarray(rows.positions)[rows.last_rows].tolist()]
        limits, want = rows.limits, step.mtp.logprobs_k.tolist()
        drafts: list[list[int]] = [[] for _ in limits]
        tops: list[list[TopLogprobs]] = [[] for _ in limits]
        active = [e for e, limit in enumerate(limits) if limit > 0]
        logits = self._run(MtpLayerStep(rows.ids, rows.positions, rows.lens, ends, table, True, rows.sources,
                                        [rows.last_rows[e] for e in active]))
        for j in range(max(limits, default=0)):
            tokens = logits.argmax(axis=-1).tolist()
            for e, token in zip(active, tokens):
                drafts[e].append(int(token))
            asked = [i for i, e in enumerate(active) if want[e] >= 0]
            if asked:
                logprobs = paddle.nn.functional.log_softmax(paddle.gather(logits, _index(asked)), axis=-1).numpy()
                for row, i in zip(logprobs, asked):
                    tops[active[i]].append(self._top(row, tokens[i], want[active[i]]))
            going = [i for i, e in enumerate(active) if limits[e] > j + 1]
            if not going:
                break
            # One more row per drafting request: the draft just made, one position on, from the last output.
            active = [active[i] for i in going]
            ends_j = [ends[e] + j + 1 for e in active]
            logits = self._run(MtpLayerStep([drafts[e][-1] for e in active], [end - 1 for end in ends_j],
                                            [1] * len(active), ends_j, table[active], False, going,
                                            list(range(len(active)))))
        return drafts, tops

    def _run(self, step: MtpLayerStep) -> paddle.Tensor | None:
        if self.workers is None:
            return self.layer.run(step)
        return self.workers.run_step(messages.MtpStep(step), lambda: self.layer.run(step))

    @staticmethod
    def _top(row: np.ndarray, token: int, k: int) -> TopLogprobs:
        best = np.argsort(-row, kind="stable")[:k]
        return TopLogprobs(best.astype(np.int64), row[best].astype(np.float32), float(row[token]),
                           int((row > row[token]).sum()) + 1)



def catch_up_rows(step: SchedulerOutput, sampled: Sequence[int]) -> _CatchUp:
    """Which of each MTP entry's query rows have a final hidden state now, with the token after each (the module
    doc); an entry drafts only if it sampled a token (-1: the sampler failed)."""
    forward, mtp = step.forward, step.mtp
    starts = np.concatenate([[0], np.cumsum(forward.query_lens)]).tolist()
    rows, offset = _CatchUp(), 0
    for e, b in enumerate(mtp.batch_index.tolist()):
        start, n = starts[b], int(forward.query_lens[b])
        begin = int(forward.context_lens[b]) - n
        tokens = forward.token_ids[start:start + n].tolist()
        k, first = int(mtp.num_drafts[e]), int(mtp.first_sample[e])
        if first < 0:
            used, tail = n, int(mtp.next_token[e])
        else:
            accepted = 0
            while accepted < k and sampled[first + accepted] == tokens[n - k + accepted]:
                accepted += 1
            used, tail = n - k + accepted, int(sampled[first + accepted])
        rows.ids += tokens[1:used] + [max(tail, 0)]
        rows.positions += range(begin, begin + used)
        rows.lens.append(used)
        rows.sources += range(offset, offset + used)
        rows.last_rows.append(len(rows.ids) - 1)
        rows.limits.append(int(mtp.draft_limit[e]) if first >= 0 and tail >= 0 else 0)
        offset += n
    return rows


def _index(rows: Sequence[int]) -> paddle.Tensor:
    return paddle.to_tensor(np.asarray(rows, np.int64))
