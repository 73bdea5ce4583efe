"""The compiled forward step (worker/compiled_step.py, custom_ops/decoder_step.cc) against the
layer-by-layer Paddle path it replaces: same logits and same KV cache, bit for bit, for every model
family, checkpoint layout and weight format, through prefill chunks, decode steps and mixed batches.
(The layer path itself is checked against transformers by the parity tests.)"""
from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import numpy as np
import paddle
import pytest

from fastdeploy import ops
from fastdeploy.model_executor.forward_context import allocate_kv_caches, build_forward_context, forward_context
from fastdeploy.step_types import block_table_array
from fastdeploy.model_executor.load import load_model
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.sampling.policy import InForward, pack_token_ids, param_table
from fastdeploy.sampling.sampler import Sampler
from fastdeploy.step_types import ForwardBatch, SamplingBatch
from fastdeploy.model_executor.models.compiled_description import unsupported_reason
from fastdeploy.worker.compiled_step import CompiledDecoder
from fastdeploy.worker.forward import run_step

MODELS = Path(__file__).parent / "fixtures" / "models"
BLOCK = 16
MAX_LEN = 128


def schedule(model_vocab: int, seed: int) -> list[ForwardBatch]:
    """Three requests: two prefill in chunks (one with logit rows for prompt logprobs), then decode
    together while the third one's prompt arrives in the same steps."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, model_vocab, size=n).tolist() for n in (37, 20, 21)]
    done, tables, steps = [0, 0, 0], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], []

    def step(chunks: dict[int, list[int]], logit_rows: list[int]) -> ForwardBatch:
        ids, pos, q, c, t = [], [], [], [], []
        for r, toks in chunks.items():
            ids += toks
            pos += range(done[r], done[r] + len(toks))
            done[r] += len(toks)
            q.append(len(toks))
            c.append(done[r])
            t.append(tables[r])
        return ForwardBatch(np.asarray(ids, np.int64), np.asarray(pos, np.int64), q, c, t,
                            np.asarray(logit_rows, np.int64))

    steps.append(step({0: prompts[0][:16], 1: prompts[1]}, [15, 35, 0, 3]))
    steps.append(step({0: prompts[0][16:]}, [20]))
    for i in range(4):
        chunk = {0: [int(rng.integers(3, model_vocab))], 1: [int(rng.integers(3, model_vocab))]}
        if i < 2:
            chunk[2] = prompts[2][i * 11:(i + 1) * 11]
        rows = [0, 1] + ([1 + len(chunk[2])] if i == 1 else [])
        steps.append(step(chunk, rows))
    steps.append(step({2: [5]}, []))  # a step without logits
    return steps


def assert_same_bits(model, batches: list[ForwardBatch], kv_dtype: str) -> int:
    """Runs the batches through the layer path and the compiled step, each on its own zeroed caches: the same
    logits at every step and the same caches at the end. Returns the logit rows compared."""
    cfg = model.config

    def caches() -> list[paddle.Tensor]:
        out = allocate_kv_caches(cfg.num_hidden_layers, 12, BLOCK, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
        for c in out:
            c.fill_(0.0)
        return out

    layer_caches, compiled_caches = caches(), caches()
    compiled = CompiledDecoder.build(model, compiled_caches, BLOCK, MAX_LEN)
    assert compiled is not None
    compared = 0
    for i, batch in enumerate(batches):
        expected = run_step(model, batch, BLOCK, layer_caches)
        got = compiled.forward(batch)
        if expected is None:
            assert got is None
            continue
        np.testing.assert_array_equal(got.numpy(), expected.numpy(),
                                      err_msg=f"step {i} logits, rows {batch.logit_rows}")
        compared += len(batch.logit_rows)
    for layer, (a, b) in enumerate(zip(layer_caches, compiled_caches)):
        np.testing.assert_array_equal(a.astype("float32").numpy(), b.astype("float32").numpy(),
                                      err_msg=f"layer {layer} KV cache")
    return compared


@pytest.mark.parametrize("quantization", [None, "wint8", "wint4"])
@pytest.mark.parametrize("name", ["ernie45_tiny_hf", "ernie45_tiny_paddle", "ernie45_moe_tiny_hf",
                                  "ernie45_moe_tiny_paddle", "qwen2_tiny", "qwen3_tiny", "qwen3_moe_tiny",
                                  "ernie45_vl_tiny_hf", "llama3_tiny", "mistral_tiny"])
def test_same_bits_as_the_layer_path(name: str, quantization: str | None) -> None:
    model = load_model(ModelConfig.from_pretrained(MODELS / name), quantization=quantization)
    assert unsupported_reason(model) is None
    # every cache kind over the grid
    kv_dtype = {None: "float32", "wint8": "bfloat16", "wint4": "block_wise_fp8"}[quantization]
    assert assert_same_bits(model, schedule(model.config.vocab_size, seed=len(name)), kv_dtype) > 0



def chunks(rng: np.random.Generator, vocab: int, counts: dict[int, int], done: list[int], tables: list[list[int]]
           ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
    """One step's ragged batch: `counts[r]` random tokens for request r after its `done[r]` (moved on)."""
    ids, pos, q, c, t = [], [], [], [], []
    for r, n in counts.items():
        ids += rng.integers(3, vocab, n).tolist()
        pos += range(done[r], done[r] + n)
        done[r] += n
        q.append(n)
        c.append(done[r])
        t.append(tables[r])
    return ids, pos, q, c, t

def random_steps(vocab: int, seed: int) -> list[ForwardBatch]:
    """Six steps of chunks of one to three requests (at most 10 tokens each, within 4 blocks of 16), with up
    to four logit rows drawn anywhere in the step (so repeated, unordered, or none; none in the first)."""
    rng = np.random.default_rng(seed)
    done, tables, steps = [0, 0, 0], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], []
    for step in range(6):
        chosen = rng.permutation(3)[:rng.integers(1, 4)]
        ids, pos, q, c, t = chunks(rng, vocab, {int(r): int(rng.integers(1, 11)) for r in chosen}, done, tables)
        rows = rng.integers(0, len(ids), int(rng.integers(0, 5))) if step else np.zeros(0, np.int64)
        steps.append(ForwardBatch(np.asarray(ids, np.int64), np.asarray(pos, np.int64), q, c, t,
                                  rows.astype(np.int64)))
    return steps


@pytest.mark.parametrize("name", ["ernie45_tiny_hf", "ernie45_moe_tiny_paddle"])
def test_last_layer_kept_rows_give_the_layer_paths_bits(name: str) -> None:
    """The compiled step's last layer goes past K/V only for each request's rows from its first logit row on.
    Random steps give the layer path's logits and KV cache, bit for bit."""
    model = load_model(ModelConfig.from_pretrained(MODELS / name))
    assert assert_same_bits(model, random_steps(model.config.vocab_size, seed=7), "bfloat16") > 0


@pytest.mark.parametrize("quantization", [None, "wint4"])
def test_greedy_tokens_inside_the_step_are_the_argmax_of_its_logits(quantization: str | None) -> None:
    """forward_tokens (the runner's path for all-greedy steps) gives numpy's argmax of the logits forward
    returns for the same batch (run twice: the second writes the same K/V to the same slots)."""
    model = load_model(ModelConfig.from_pretrained(MODELS / "ernie45_moe_tiny_hf"), quantization=quantization)
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 12, BLOCK, cfg.num_key_value_heads, cfg.head_dim, "bfloat16")
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    checked = 0
    for batch in schedule(cfg.vocab_size, seed=3):
        logits = compiled.forward(batch)
        tokens = compiled.forward_tokens(batch)
        if logits is None:
            assert tokens == []
            continue
        np.testing.assert_array_equal(tokens, np.argmax(logits.numpy(), axis=1))
        checked += len(tokens)
    assert checked > 0


@pytest.mark.parametrize("touched", [False, True])
def test_sampled_tokens_inside_the_step_are_the_sampling_ops(touched: bool) -> None:
    """forward_tokens with a parameter table (the runner's path whenever only the sampler reads the logits)
    draws what the sampling op draws from the logits forward returns: temperature, top-k, top-p, min-p and
    greedy rows mixed, each with its own uniform; `touched`: with banned ids and repetition / frequency /
    presence penalties over prompt and output ids too."""
    model = load_model(ModelConfig.from_pretrained(MODELS / "ernie45_moe_tiny_hf"))
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 12, BLOCK, cfg.num_key_value_heads, cfg.head_dim, "bfloat16")
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    rng = np.random.default_rng(4)
    sampler, checked = Sampler(), 0
    for batch in schedule(cfg.vocab_size, seed=5):
        rows = len(batch.logit_rows)
        if not rows:
            continue
        lists = {}
        if touched:
            ids = lambda n: rng.integers(0, cfg.vocab_size, n).tolist()  # noqa: E731
            lists = dict(banned_token_ids=[ids(rng.integers(0, 4)) for _ in range(rows)],
                         prompt_token_ids=[ids(rng.integers(1, 20)) for _ in range(rows)],
                         output_token_ids=[ids(rng.integers(0, 10)) for _ in range(rows)],
                         repetition_penalty=rng.choice([1.0, 1.3, 0.8], rows).tolist(),
                         frequency_penalty=rng.choice([0.0, 0.5], rows).tolist(),
                         presence_penalty=rng.choice([0.0, -0.4], rows).tolist())
        policy = SamplingBatch.from_lists(
            rows, temperature=rng.choice([0.0, 0.6, 1.0, 1.7], rows).tolist(), top_k=rng.choice([0, 3, 40], rows).tolist(),
            top_p=rng.choice([1.0, 0.8], rows).tolist(), min_p=rng.choice([0.0, 0.1], rows).tolist(),
            uniforms=rng.random(rows).tolist(), **lists)
        token_ids, offsets = pack_token_ids(policy, cfg.vocab_size)
        logits = compiled.forward(batch)
        how = InForward(param_table(policy, policy.greedy_mask()), np.concatenate([offsets, token_ids]))
        tokens = compiled.forward_tokens(batch, how)
        assert tokens == sampler(logits, policy).tolist()
        checked += rows
    assert checked > 0


def test_bad_token_lists_are_a_clear_error() -> None:
    """The in-forward draw checks its token lists (offsets, ids in the vocabulary) before anything runs."""
    model = load_model(ModelConfig.from_pretrained(MODELS / "qwen2_tiny"))
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    batch = ForwardBatch(np.ones(2, np.int64), np.arange(2, dtype=np.int64), [2], [2], [[0]], np.asarray([1]))
    table = param_table(SamplingBatch.from_lists(1, uniforms=[0.5]), np.ones(1, bool))
    for lists, what in (([0, 0, 0, 2, 5], "offsets must run"), ([0, 1, 1, 0, 5], "offsets must run"),
                        ([0, 2, 1, 2, 5, 6], "must not decrease"), ([0, 1, 1, 1, cfg.vocab_size], "token id"),
                        ([0, 1, 1, 1, -1], "token id"), ([0, 0, 0], "token list")):
        with pytest.raises(ValueError, match=what):
            compiled.forward_tokens(batch, InForward(table, np.asarray(lists, np.int64)))


def hidden_steps(vocab: int, seed: int) -> list[ForwardBatch]:
    """Steps asking for final-normed hidden rows (MTP drafting), on three requests: prompt chunks asking every
    row with each request's last row's logits; decode rows with drafts (several query rows per request) asking
    every row's logits and hidden; hidden rows unordered, repeated and overlapping logit rows; hidden rows
    without any logit rows; and one request's hidden rows beside another's logit rows."""
    rng = np.random.default_rng(seed)
    done, tables = [0, 0, 0], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]

    def step(counts: dict[int, int], logit_rows: list[int], hidden_rows: list[int] | None = None) -> ForwardBatch:
        ids, pos, q, c, t = chunks(rng, vocab, counts, done, tables)
        every = list(range(len(ids)))
        return ForwardBatch(np.asarray(ids, np.int64), np.asarray(pos, np.int64), q, c, t,
                            np.asarray(logit_rows, np.int64),
                            hidden_rows=np.asarray(every if hidden_rows is None else hidden_rows, np.int64))

    return [step({0: 21, 1: 9}, [20, 29]),  # (a) prompt chunks
            step({0: 5, 2: 6}, [4, 10]),
            step({0: 4, 1: 3, 2: 2}, list(range(9))),  # (b) verifying drafts
            step({0: 3, 1: 3}, [5, 2], [4, 1, 4, 0, 5, 2]),
            step({0: 3, 1: 2}, [], [1, 2, 4]),  # (c) no logit rows
            step({0: 2, 2: 4}, [1], [4, 3])]


def layer_path(model, batch: ForwardBatch, caches: list[paddle.Tensor]) -> tuple[np.ndarray, np.ndarray | None]:
    """The Paddle path's final-normed hidden states of every row (DecoderModel's output) and the logits of
    the batch's logit rows, as run_step computes them."""
    ctx = build_forward_context(batch.query_lens, batch.context_lens, batch.block_tables, BLOCK, caches)
    with forward_context(ctx):
        hidden = model.model(paddle.to_tensor(batch.token_ids), paddle.to_tensor(batch.positions))
    if not len(batch.logit_rows):
        return hidden.numpy(), None
    return hidden.numpy(), model.compute_logits(paddle.gather(hidden, paddle.to_tensor(batch.logit_rows))).numpy()


@pytest.mark.parametrize("quantization", [None, "wint4"])
@pytest.mark.parametrize("name", ["ernie45_tiny_hf", "ernie45_moe_tiny_hf"])
def test_hidden_rows_are_the_layer_paths_final_hidden_states(name: str, quantization: str | None) -> None:
    """The compiled step hands back the layer path's final-normed hidden states of the rows asked for, bit for
    bit, through forward and forward_tokens, with the layer path's logits (or tokens) and KV cache."""
    model = load_model(ModelConfig.from_pretrained(MODELS / name), quantization=quantization)
    cfg = model.config

    def caches() -> list[paddle.Tensor]:
        out = allocate_kv_caches(cfg.num_hidden_layers, 12, BLOCK, cfg.num_key_value_heads, cfg.head_dim, "bfloat16")
        for c in out:
            c.fill_(0.0)
        return out

    layer_caches, compiled_caches = caches(), caches()
    compiled = CompiledDecoder.build(model, compiled_caches, BLOCK, MAX_LEN)
    for i, batch in enumerate(hidden_steps(cfg.vocab_size, seed=11)):
        hidden, logits = layer_path(model, batch, layer_caches)
        if i % 2:
            tokens = compiled.forward_tokens(batch)
            assert tokens == ([] if logits is None else np.argmax(logits, axis=1).tolist()), f"step {i} tokens"
        else:
            got = compiled.forward(batch)
            if logits is None:
                assert got is None
            else:
                np.testing.assert_array_equal(got.numpy(), logits, err_msg=f"step {i} logits")
        assert compiled.hidden.dtype == np.float32
        assert compiled.hidden.shape == (len(batch.hidden_rows), cfg.hidden_size)
        np.testing.assert_array_equal(compiled.hidden, hidden[batch.hidden_rows],
                                      err_msg=f"step {i} hidden rows {batch.hidden_rows}")
    for layer, (a, b) in enumerate(zip(layer_caches, compiled_caches)):
        np.testing.assert_array_equal(a.astype("float32").numpy(), b.astype("float32").numpy(),
                                      err_msg=f"layer {layer} KV cache")


def test_asking_hidden_rows_leaves_the_logits_alone() -> None:
    """The same batch with and without hidden rows (run twice on one cache: the second writes the same K/V to
    the same slots) gives the same logits; a step without hidden rows hands back none, and a batch whose
    arrays are the kept ones but whose hidden rows are new is read afresh."""
    model = load_model(ModelConfig.from_pretrained(MODELS / "ernie45_moe_tiny_hf"))
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim, "bfloat16")
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    ids = np.random.default_rng(2).integers(3, cfg.vocab_size, 12)
    plain = ForwardBatch(ids, np.arange(12, dtype=np.int64), np.asarray([7, 5]), np.asarray([7, 5]),
                         np.asarray([[0], [1]], np.int64), np.asarray([6, 11], np.int64))
    expected = compiled.forward(plain).numpy()
    assert compiled.hidden.shape == (0, cfg.hidden_size)
    asking = dataclasses.replace(plain, hidden_rows=np.asarray([0, 3, 9, 6], np.int64))
    np.testing.assert_array_equal(compiled.forward(asking).numpy(), expected)
    first = compiled.hidden
    assert first.shape == (4, cfg.hidden_size)
    again = dataclasses.replace(plain, hidden_rows=np.asarray([9], np.int64))  # same arrays, new hidden rows
    np.testing.assert_array_equal(compiled.forward(again).numpy(), expected)
    np.testing.assert_array_equal(compiled.hidden, first[2:3])
    compiled.forward(plain)
    assert compiled.hidden.shape == (0, cfg.hidden_size) and first.shape == (4, cfg.hidden_size)


def test_bad_hidden_rows_are_a_clear_error_before_any_work() -> None:
    """A hidden row outside the step's rows is refused, naming it, and nothing (the KV cache here) is written."""
    model = load_model(ModelConfig.from_pretrained(MODELS / "qwen2_tiny"))
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    for c in kv:
        c.fill_(0.0)
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    for logit_rows, hidden_rows in (([1], [0, 2]), ([1], [-1]), ([], [3])):
        batch = ForwardBatch(np.ones(2, np.int64), np.arange(2, dtype=np.int64), [2], [2], [[0]],
                             np.asarray(logit_rows, np.int64), hidden_rows=np.asarray(hidden_rows, np.int64))
        with pytest.raises(ValueError, match=r"hidden row -?\d+ outside \[0, 2\)"):
            compiled.forward(batch)
        assert compiled.hidden.shape == (0, cfg.hidden_size)
    # Through the library itself: a negative count, or rows without an output buffer.
    good = ForwardBatch(np.ones(2, np.int64), np.arange(2, dtype=np.int64), [2], [2], [[0]],
                        np.zeros(0, np.int64), hidden_rows=np.asarray([0], np.int64))
    for field, value in (("n_hidden", -1), ("hidden", None)):
        raw = compiled._batch(good)
        raw.hidden = 0 if field == "n_hidden" else None
        setattr(raw, field, value)
        assert compiled._step(ctypes.byref(compiled._model), ctypes.byref(raw), compiled._workspace) == 1
        assert b"hidden rows" in compiled._error()
    assert all(not c.astype("float32").numpy().any() for c in kv)


def test_multimodal_steps_run_compiled_only_without_vision_rows() -> None:
    """ERNIE-4.5-VL (whose text-only steps are checked above): a step of text tokens with 3-D positions
    (t = h = w) runs compiled on its 1-D positions; one with image tokens or unequal rows does not."""
    text = ForwardBatch(np.asarray([5, 6], np.int64), np.asarray([[7, 8]] * 3, np.int64), [2], [9], [[0]],
                        np.asarray([1], np.int64), token_types=np.zeros(2, np.int64))
    ran = CompiledDecoder.covers(text)
    assert ran is not None and ran.positions.tolist() == [7, 8] and ran.token_types is None
    image = ForwardBatch(text.token_ids, text.positions, [2], [9], [[0]], text.logit_rows,
                         token_types=np.asarray([0, 1], np.int64))
    assert CompiledDecoder.covers(image) is None
    moved = ForwardBatch(text.token_ids, np.asarray([[7, 8], [7, 9], [7, 8]], np.int64), [2], [9], [[0]],
                         text.logit_rows, token_types=np.zeros(2, np.int64))
    assert CompiledDecoder.covers(moved) is None


def test_block_tables_are_padded_to_the_widest() -> None:
    np.testing.assert_array_equal(block_table_array([[3, 1], [7], []]), [[3, 1], [7, 0], [0, 0]])
    np.testing.assert_array_equal(block_table_array([[2, 5], [4, 6]]), [[2, 5], [4, 6]])
    assert block_table_array([[]]).shape == (1, 1) and block_table_array([[9]]).dtype == np.int64


def test_bad_batch_is_a_clear_error() -> None:
    model = load_model(ModelConfig.from_pretrained(MODELS / "qwen2_tiny"))
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    for ids, positions, rows, what in (([cfg.vocab_size], [0], [0], "token id"), ([1], [MAX_LEN], [0], "position"),
                                       ([1], [0], [1], "logit row")):
        batch = ForwardBatch(np.asarray(ids, np.int64), np.asarray(positions, np.int64), [1], [1], [[0]],
                             np.asarray(rows, np.int64))
        with pytest.raises(ValueError, match=what):
            compiled.forward(batch)
    # The step derives the cache slots: a block outside the 4-block cache, a table too short for the
    # context, query lengths that do not add up to the tokens, more new tokens than context.
    for query_lens, context_lens, tables, what in (([1], [1], [[4]], "not a cache block"),
                                                   ([1], [BLOCK + 1], [[0]], "new tokens"),
                                                   ([2], [2], [[0]], "new tokens"),
                                                   ([1, 1], [1, 0], [[0], [1]], "new tokens")):
        batch = ForwardBatch(np.ones(1, np.int64), np.zeros(1, np.int64), query_lens, context_lens, tables,
                             np.zeros(1, np.int64))
        with pytest.raises(ValueError, match=what):
            compiled.forward(batch)


@pytest.mark.parametrize("name", ["qwen3_tiny", "ernie45_moe_tiny_hf"])
def test_model_outside_the_step_contract_is_refused_before_any_work(name: str) -> None:
    """The step checks its model description at every call: a size its buffers are carved from that disagrees
    with a weight's is an error naming it, and nothing (the KV cache here) is written."""
    model = load_model(ModelConfig.from_pretrained(MODELS / name))
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    for c in kv:
        c.fill_(0.0)
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    batch = ForwardBatch(np.ones(3, np.int64), np.arange(3, dtype=np.int64), [3], [3], [[0]], np.asarray([2]))
    m, layer = compiled._model, compiled._layers[1]
    moe = layer.router.w is not None
    changes = [(m, "head_dim", cfg.head_dim + 1, "head_dim"), (m, "head_dim", cfg.head_dim // 2, "qkv"),
               (m, "kv_heads", 3, "kv heads"), (m, "hidden", cfg.hidden_size + 16, "embedding"),
               (m, "cache_slots", 4 * BLOCK + 1, "cache slots"), (m, "cache_kind", 7, "cache kind"),
               (layer.o, "K", 8, "o_proj"), (layer.qkv, "fmt", 9, "qkv")]
    if moe:
        changes += [(m, "max_top_k", layer.top_k - 1, "top-"), (layer, "expert_start", 1, "experts"),
                    (layer.router, "N", layer.num_experts + 1, "router")]
    else:
        changes += [(m, "max_ffn", layer.down.K - 1, "FFN"), (layer.up_gate, "N", layer.down.K, "up_gate")]
    for struct, field, value, what in changes:
        kept = getattr(struct, field)
        setattr(struct, field, value)
        try:
            with pytest.raises(ValueError, match=what):
                compiled.forward(batch)
        finally:
            setattr(struct, field, kept)
    assert all(not c.astype("float32").numpy().any() for c in kv)
    assert compiled.forward(batch).shape == [1, cfg.vocab_size]
    # and the caches it is given must be the ones it will read: one per layer, [2, blocks, KVH, BLOCK, D]
    for caches, block in ((kv[:-1], BLOCK), (kv, 2 * BLOCK), (kv[:-1] + [kv[-1].astype("bfloat16")], BLOCK)):
        with pytest.raises(ValueError, match="KV caches of shape"):
            CompiledDecoder.build(model, caches, block, MAX_LEN)


def test_used_by_the_runner_and_not_under_tensor_parallel() -> None:
    from fastdeploy import LLM
    assert ops.library() is not None
    llm = LLM(model=str(MODELS / "ernie45_moe_tiny_hf"), max_model_len=MAX_LEN)
    assert llm.engine.runner.compiled is not None
    model = load_model(ModelConfig.from_pretrained(MODELS / "qwen3_tiny"))
    model.lm_head.tp = type(model.lm_head.tp)(rank=0, size=2)  # as a rank of two would be built
    assert unsupported_reason(model) == "tensor parallel"


def test_input_rows_stand_in_for_the_embedding() -> None:
    """Given the tokens' embedding rows as input_hidden, the step computes what it computes from the ids (the MTP
    layer is run this way, from its own input rows); a wrong shape or dtype is refused before the call."""
    model = load_model(ModelConfig.from_pretrained(MODELS / "ernie45_tiny_hf"))
    cfg = model.config
    kv = allocate_kv_caches(cfg.num_hidden_layers, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    compiled = CompiledDecoder.build(model, kv, BLOCK, MAX_LEN)
    ids = np.random.default_rng(5).integers(3, cfg.vocab_size, 9)
    batch = ForwardBatch(ids, np.arange(9, dtype=np.int64), np.asarray([9]), np.asarray([9]), np.asarray([[0]]),
                         np.asarray([4, 8], np.int64), hidden_rows=np.asarray([8], np.int64))
    expected, expected_hidden = compiled.forward(batch).numpy(), compiled.hidden
    rows = model.model.embed_tokens(paddle.to_tensor(ids)).numpy().astype(np.float32)
    np.testing.assert_array_equal(compiled.forward(batch, rows).numpy(), expected)
    np.testing.assert_array_equal(compiled.hidden, expected_hidden)
    shifted = compiled.forward(batch, rows + 0.5).numpy()
    assert not np.allclose(shifted, expected)  # the rows are read, not the ids
    for bad in (rows[:8], rows.astype(np.float64), np.repeat(rows, 2, axis=1)[:, ::2]):
        with pytest.raises(ValueError, match="input_hidden must be a contiguous float32 array of shape"):
            compiled.forward(batch, bad)
