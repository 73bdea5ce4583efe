"""ERNIE-4.5 dense forward vs transformers' greedy outputs (tests/fixtures/reference/ernie45_tiny_greedy.json,
written by tools/make_model_reference.py from the HF copy of the tiny checkpoint). Both checkpoint
layouts must reproduce transformers' tokens exactly and its logprobs within 1e-3, whether the sequence
is run in one forward, prefilled then decoded token by token through the paged KV cache, or batched
with other requests in chunks."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.numpy import save_file

from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.forward_context import allocate_kv_caches, build_forward_context, forward_context
from fastdeploy.model_executor.load import Checkpoint, load_model

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = json.loads((FIXTURES / "reference" / "ernie45_tiny_greedy.json").read_text())
CASES = REFERENCE["cases"]
BLOCK_SIZE = 16
TOL = 1e-3


@pytest.fixture(scope="module", params=["ernie45_tiny_hf", "ernie45_tiny_paddle"])
def model(request: pytest.FixtureRequest) -> paddle.nn.Layer:
    return load_model(ModelConfig.from_pretrained(FIXTURES / "models" / request.param), dtype="float32")


class Runner:
    """Drives the model the way the engine does: a ragged batch of new tokens plus a forward context."""

    def __init__(self, model: paddle.nn.Layer, num_blocks: int = 64) -> None:
        cfg = model.config
        self.model = model
        self.caches = allocate_kv_caches(cfg.num_hidden_layers, num_blocks, BLOCK_SIZE,
                                         cfg.num_key_value_heads, cfg.head_dim)
        self.next_block = 0
        self.tables: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """chunks: request -> its next tokens. Returns request -> logprobs [len(chunk), vocab]."""
        ids, positions, q_lens, c_lens, tables = [], [], [], [], []
        for req, tokens in chunks.items():
            start = self.done.get(req, 0)
            table = self.tables.setdefault(req, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.next_block)
                self.next_block += 1
            ids += tokens
            positions += range(start, start + len(tokens))
            q_lens.append(len(tokens))
            c_lens.append(start + len(tokens))
            tables.append(table)
            self.done[req] = start + len(tokens)
        ctx = build_forward_context(q_lens, c_lens, tables, BLOCK_SIZE, self.caches)
        with forward_context(ctx), paddle.no_grad():
            hidden = self.model(paddle.to_tensor(ids, dtype="int64"), paddle.to_tensor(positions, dtype="int64"))
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == paddle.float32 and logits.shape == [len(ids), self.model.config.vocab_size]
        logprobs = paddle.nn.functional.log_softmax(logits, axis=-1).numpy()
        out, offset = {}, 0
        for req, tokens in chunks.items():
            out[req] = logprobs[offset:offset + len(tokens)]
            offset += len(tokens)
        return out


def assert_matches(logprobs: np.ndarray, expected: dict, where: str) -> None:
    """logprobs [vocab] of one position vs one reference entry {token, logprob, top5}."""
    assert int(logprobs.argmax()) == expected["top5"][0][0], f"{where}: argmax"
    assert abs(logprobs[expected["token"]] - expected["logprob"]) < TOL, f"{where}: chosen logprob"
    ours_top = np.argsort(-logprobs, kind="stable")[:5].tolist()
    assert ours_top == [t for t, _ in expected["top5"]], f"{where}: top-5 ids"
    for token, lp in expected["top5"]:
        assert abs(logprobs[token] - lp) < TOL, f"{where}: logprob of top-5 token {token}"


def test_reference_is_not_degenerate() -> None:
    # Greedy continuations that loop on one token would let a broken model pass.
    for case in CASES:
        assert len(case["output_token_ids"]) == REFERENCE["max_new_tokens"] == 24
        assert len(set(case["output_token_ids"])) >= 12
    assert sorted(len(c["prompt_token_ids"]) for c in CASES) == [1, 3, 8, 17, 31, 64, 65, 130]


@pytest.mark.parametrize("case_idx", range(len(CASES)))
def test_teacher_forced_single_forward(model: paddle.nn.Layer, case_idx: int) -> None:
    case = CASES[case_idx]
    prompt, outputs = case["prompt_token_ids"], case["output_token_ids"]
    logprobs = Runner(model).step({0: prompt + outputs[:-1]})[0]
    n = len(prompt)
    assert logprobs[n - 1:].argmax(-1).tolist() == outputs
    for j, step in enumerate(case["steps"]):
        assert_matches(logprobs[n - 1 + j], step, f"prompt len {n}, step {j}")
    if case["prompt_logprobs"] is not None:
        assert case["prompt_logprobs"][0] is None
        for p, entry in enumerate(case["prompt_logprobs"][1:], start=1):
            assert entry["token"] == prompt[p]
            assert_matches(logprobs[p - 1], entry, f"prompt len {n}, prompt position {p}")


def check_prefill_then_decode(model: paddle.nn.Layer, case: dict, matches) -> None:
    """One request: the whole prompt in one step, then one token per step through the KV cache;
    every step's logits match the reference and greedy reproduces its tokens."""
    runner = Runner(model)
    last = runner.step({0: case["prompt_token_ids"]})[0][-1]
    generated = []
    for j, step in enumerate(case["steps"]):
        matches(last, step, f"prompt len {len(case['prompt_token_ids'])}, decode step {j}")
        generated.append(int(last.argmax()))
        last = runner.step({0: generated[-1:]})[0][-1]
    assert generated == case["output_token_ids"]


@pytest.mark.parametrize("case_idx", range(len(CASES)))
def test_prefill_then_decode_with_kv_cache(model: paddle.nn.Layer, case_idx: int) -> None:
    check_prefill_then_decode(model, CASES[case_idx], assert_matches)


def check_batched_chunked(model: paddle.nn.Layer, cases: list[dict], matches) -> None:
    """All requests in one ragged batch per step: prompts split over two steps (a 1-token prompt
    decodes in the second step while the others still prefill), then four decode steps together;
    every logits row that predicts a reference output token must match it."""
    runner = Runner(model)
    seqs = {i: c["prompt_token_ids"] + c["output_token_ids"] for i, c in enumerate(cases)}
    prompt_len = {i: len(c["prompt_token_ids"]) for i, c in enumerate(cases)}
    fed = dict.fromkeys(seqs, 0)
    first = {i: math.ceil(n / 2) for i, n in prompt_len.items()}
    second = {i: (n - first[i]) or 1 for i, n in prompt_len.items()}
    checked = 0
    for sizes in [first, second] + [dict.fromkeys(seqs, 1)] * 4:
        out = runner.step({i: seqs[i][fed[i]:fed[i] + sizes[i]] for i in seqs})
        for i, logprobs in out.items():
            fed[i] += sizes[i]
            k = fed[i] - prompt_len[i]  # the last logits predict output token k
            if k >= 0:
                matches(logprobs[-1], cases[i]["steps"][k], f"request {i}, output {k}")
                checked += 1
    assert checked == len(cases) * 5 + sum(n == 1 for n in prompt_len.values())


def test_batched_chunked_prefill_and_decode(model: paddle.nn.Layer) -> None:
    check_batched_chunked(model, CASES, assert_matches)


def test_use_bias_in_both_layouts(tmp_path: Path) -> None:
    """transformers with use_bias and the recorded biases (reference `bias_variant`), written as an HF
    checkpoint (separate q/k/v, gate/up biases) and as a Paddle one (fused qkv / up_gate biases)."""
    variant = REFERENCE["bias_variant"]
    biases = {name: np.asarray(values, dtype=np.float32) for name, values in variant["biases"].items()}
    paddle_biases = {}
    for i in range(2):
        h, p = f"model.layers.{i}.", f"ernie.layers.{i}."
        paddle_biases[p + "self_attn.qkv_proj.bias"] = np.concatenate(
            [biases[h + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        paddle_biases[p + "mlp.up_gate_proj.bias"] = np.concatenate(
            [biases[h + "mlp.gate_proj.bias"], biases[h + "mlp.up_proj.bias"]])
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            paddle_biases[p + n + ".bias"] = biases[h + n + ".bias"]
    for layout, extra in (("hf", biases), ("paddle", paddle_biases)):
        source = FIXTURES / "models" / f"ernie45_tiny_{layout}"
        out = tmp_path / layout
        out.mkdir()
        config = json.loads((source / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "use_bias": True}))
        with Checkpoint(str(source)) as ckpt:
            tensors = {n: ckpt.read(n) for n in ckpt.tensors}
        save_file({**tensors, **extra}, str(out / "model.safetensors"))
        model = load_model(ModelConfig.from_pretrained(out), dtype="float32")
        for case in variant["cases"]:
            prompt, outputs = case["prompt_token_ids"], case["output_token_ids"]
            logprobs = Runner(model).step({0: prompt + outputs[:-1]})[0]
            for j, step in enumerate(case["steps"]):
                assert_matches(logprobs[len(prompt) - 1 + j], step, f"{layout} with bias, step {j}")
