"""A property-based sweep over model shapes and formats (issue 40: a head_dim that was not a multiple of 16
corrupted the heap in the compiled step, because every test used the fixtures' shapes).

Hypothesis draws small random checkpoints (tests/shape_models.py: family, head_dim 4..264, GQA groups, hidden
and FFN widths and vocabularies off the kernels' tile multiples, MoE sizes, 1-2 layers, fp32 / bf16 / fp16
storage) and formats (no / wint8 / wint4 quantization, float32 / bfloat16 / block_wise_fp8 KV cache, every
ISA this CPU has). For each: the compiled step gives the layer path's logits and KV cache bit for bit, and
the layer path agrees with an independent float64 numpy forward. Then LLM.generate on the issue's head_dims
gives each request the tokens it gets alone, and the OpenAI server answers as LLM.generate does.
"""
from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from paddle import nn

from fastdeploy import LLM, SamplingParams, ops
from fastdeploy.model_executor.forward_context import allocate_kv_caches
from fastdeploy.model_executor.load import load_model
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.weight_format import named_weights
from fastdeploy.ops import build
from fastdeploy.step_types import ForwardBatch
from fastdeploy.worker.forward import run_step
from shape_models import FAMILIES, Numerics, SweepShape, reference_logits, unpacked_weights, write_model
from test_api_server import Server
from test_compiled_step import BLOCK, assert_same_bits, random_steps, schedule

LIB = build.library()
# Every ISA this CPU runs, as tests/test_ops.py finds them (without the library: "avx2", which load() fails on).
ISAS = [name for name in ("avx512_bf16", "avx512", "avx2")
        if LIB is not None and build.set_isa(name) == name] or ["avx2"]
if LIB is not None:
    build.set_isa("best")


@dataclass(frozen=True)
class Format:
    quantization: str | None
    kv_cache: str
    isa: str


def sample_shape(pick: Callable[[Sequence[Any]], Any], head_dim: int | None = None,
                 family: str | None = None) -> SweepShape:
    """One shape; `pick(options)` chooses one of a sequence (a hypothesis draw, or a seeded generator's)."""
    family = family or pick(FAMILIES)
    kv_heads, group = pick(range(1, 4)), pick(range(1, 9))
    layers = pick((1, 2))
    moe = {}
    if family == "ernie45_moe":
        experts = pick(range(2, 7))
        moe = dict(experts=experts, top_k=pick(range(1, min(experts, 3) + 1)),
                   expert_ffn=pick([f for f in range(8, 161) if f % 16]), shared=pick(range(3)),
                   moe_start=pick(range(layers)))
    elif family == "qwen3_moe":
        experts = pick(range(2, 9))
        moe = dict(experts=experts, top_k=pick(range(1, min(experts, 4) + 1)),
                   expert_ffn=pick([f for f in range(8, 161) if f % 16]), sparse_step=pick((1, 2)),
                   mlp_only=pick(((), (0,))), norm_topk=pick((True, False)))
    return SweepShape(
        family, vocab=pick([v for v in range(1025, 1301) if v % 16]),  # >= 1024: the fixture tokenizers' ids fit
        hidden=pick([h for h in range(24, 201) if h % 16]), layers=layers, heads=kv_heads * group, kv_heads=kv_heads,
        head_dim=head_dim or pick(range(4, 265, 4)),
        # FFN widths with every remainder mod 16, 32 and 128 the kernels tile by
        ffn=pick([f for f in range(17, 301) if f % 16]), dtype=pick(("F32", "BF16", "F16")), **moe)


@st.composite
def shapes(draw: st.DrawFn) -> SweepShape:
    return sample_shape(lambda options: draw(st.sampled_from(options)))


formats = st.builds(Format, st.sampled_from([None, "wint8", "wint4"]),
                    st.sampled_from(["float32", "bfloat16", "block_wise_fp8"]), st.sampled_from(ISAS))


def logit_positions(batches: Sequence[ForwardBatch]) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """Each request's tokens (keyed by its first block) and, for every logit row of the steps in order, its
    (request, position)."""
    tokens: dict[int, list[int]] = {}
    rows = []
    for batch in batches:
        starts = np.cumsum([0, *batch.query_lens])
        for b, table in enumerate(batch.block_tables):
            tokens.setdefault(table[0], []).extend(batch.token_ids[starts[b]:starts[b + 1]].tolist())
        for r in batch.logit_rows:
            b = int(np.searchsorted(starts, r, side="right")) - 1
            rows.append((batch.block_tables[b][0], int(batch.positions[r])))
    return tokens, rows


def layer_path_logits(model: nn.Layer, batches: Sequence[ForwardBatch], kv_cache: str) -> np.ndarray:
    cfg = model.config
    caches = allocate_kv_caches(cfg.num_hidden_layers, 12, BLOCK, cfg.num_key_value_heads, cfg.head_dim, kv_cache)
    logits = [run_step(model, batch, BLOCK, caches) for batch in batches]
    return np.concatenate([x.numpy() for x in logits if x is not None] or [np.zeros((0, cfg.vocab_size))])


def tolerance(s: SweepShape, fmt: Format) -> tuple[float, float]:
    """(largest |logit - reference| / largest |reference logit| of a row, the MoE routing gap below which a
    row is not compared). The reference rounds where each format rounds (shape_models.Numerics), so what is
    left is float32 against float64 plus, in rounded formats, values the two round to neighbouring codes (one
    bf16, e4m3 or Q8_0 step of one value moves the logits by up to ~1e-3 of their scale). The largest errors
    over ~700 drawn examples (calibration runs and this sweep): fp32 and fp16 checkpoints 2.3e-6; with a bf16
    or fp8 KV cache 3.6e-3; bf16 checkpoints 6.4e-3; wint8 / wint4 3.8e-2 (a Q8_0 step is 1/127 of the
    largest of 32 inputs); wint8 / wint4 with an fp8 cache 5.5e-2. Each bound is ~3x the largest seen (fp32
    ~10x); the order is test_weight_formats' demo-model bounds' (bf16 < wint8 < wint4, fp8 KV near wint8). A
    routing gap below the hidden state's error may choose other experts (a jump of ~0.1-0.3, not a bug), so
    a request's rows from a closer choice on are not compared: gaps under 1e-4 in float32, 2e-2 rounded, 5e-2
    quantized (an int4 model with an fp8 cache chose another expert at a gap of 0.0245)."""
    if fmt.quantization:
        return (0.15 if fmt.kv_cache == "block_wise_fp8" else 0.1), 5e-2
    if s.dtype == "BF16":
        return 0.02, 2e-2
    if fmt.kv_cache != "float32":
        return 1e-2, 2e-2
    return 3e-5, 1e-4


def numerics(s: SweepShape, fmt: Format) -> Numerics:
    """The rounding a model of `s` loaded as `fmt` does: int8/int4 weights take Q8_0 inputs, bf16 ones (a bf16
    checkpoint under dtype "auto") bf16 inputs; fp32 and fp16 checkpoints compute in float32."""
    return Numerics("q8" if fmt.quantization else "bf16" if s.dtype == "BF16" else "fp32", fmt.kv_cache)


def reference_weights(model: nn.Layer, s: SweepShape, fmt: Format,
                      checkpoint: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights the reference multiplies by: the checkpoint's, or for a quantized model the ones dequantized
    from what it holds, once those are checked to be within a quantization step of the checkpoint's (so a
    misplaced packed weight still fails) and the unquantized ones equal."""
    if not fmt.quantization:
        return checkpoint
    weights = unpacked_weights(named_weights(model), s)
    for name, w in checkpoint.items():  # int4: a step is max|group of a column| / 8, int8 max|column| / 127
        quantized = w.ndim == 2 and ".mlp.gate." not in name and "moe_statics" not in name  # the router stays fp32
        step = np.abs(w).max(axis=-1, keepdims=True) / 7 if quantized else 0.0
        assert np.all(np.abs(weights[name] - w) <= step + 1e-7), f"{s} {fmt}: packed {name} is not the checkpoint's"
    return weights


def reference_errors(s: SweepShape, fmt: Format, weights: dict[str, np.ndarray], batches: Sequence[ForwardBatch],
                     got: np.ndarray, interleaved: bool | None = None) -> np.ndarray:
    """Each compared logit row's error over the tolerance (> 1 fails)."""
    tokens, rows = logit_positions(batches)
    refs = {r: reference_logits(weights, s, seq, numerics(s, fmt), interleaved) for r, seq in tokens.items()}
    tol, margin = tolerance(s, fmt)
    keep = [i for i, (r, pos) in enumerate(rows) if refs[r][1][:pos + 1].min() > margin]
    assert np.isfinite(got).all()
    if not keep:
        return np.zeros(0)
    ref = np.stack([refs[rows[i][0]][0][rows[i][1]] for i in keep])
    return np.abs(got[keep] - ref).max(axis=1) / np.abs(ref).max() / tol


def load(path: Path, fmt: Format) -> nn.Layer:
    assert ops.set_isa(fmt.isa) == fmt.isa  # before loading: the model is packed and run under this ISA
    return load_model(ModelConfig.from_pretrained(path), quantization=fmt.quantization)


# The issue's head_dims (not multiples of 16) on top of the drawn examples.
ISSUE_EXAMPLES = [
    (SweepShape("ernie45_moe", vocab=1031, hidden=72, layers=2, heads=4, kv_heads=1, head_dim=8, ffn=100, experts=5,
                top_k=2, expert_ffn=40, shared=1, moe_start=1, dtype="BF16"), Format("wint4", "bfloat16", ISAS[-1])),
    (SweepShape("qwen2", vocab=1100, hidden=88, layers=2, heads=6, kv_heads=2, head_dim=20, ffn=150, dtype="F32"),
     Format(None, "float32", ISAS[0])),
    (SweepShape("qwen3", vocab=1237, hidden=40, layers=1, heads=9, kv_heads=3, head_dim=24, ffn=33, dtype="F16"),
     Format(None, "block_wise_fp8", ISAS[len(ISAS) // 2])),
    (SweepShape("ernie45", vocab=1297, hidden=120, layers=2, heads=12, kv_heads=2, head_dim=40, ffn=270, dtype="BF16"),
     Format("wint8", "bfloat16", ISAS[-1])),
    # Qwen3-MoE (issue 46): GQA groups of 3, head_dim 36, layer 0 dense by mlp_only_layers, layer 1 MoE, top-3 of 7
    (SweepShape("qwen3_moe", vocab=1117, hidden=56, layers=2, heads=6, kv_heads=2, head_dim=36, ffn=70, experts=7,
                top_k=3, expert_ffn=24, mlp_only=(0,), dtype="BF16"), Format("wint4", "block_wise_fp8", ISAS[0])),
    # Llama 3 (issue 46): llama3-scaled rotary in all three bands, every bias, untied head; odd sizes, head_dim 28
    (SweepShape("llama", vocab=1109, hidden=90, layers=2, heads=6, kv_heads=2, head_dim=28, ffn=131, dtype="F32"),
     Format(None, "float32", ISAS[-1])),
]


def with_issue_examples(test: Callable[..., None]) -> Callable[..., None]:
    for shape, fmt in ISSUE_EXAMPLES:
        test = example(shape=shape, fmt=fmt, seed=1, steady=True)(test)
    return test


@with_issue_examples
# A fixed seed and no example database: every run draws the same examples (and seeds 1 and 2 passed too).
@seed(40)
@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes(), fmt=formats, seed=st.integers(0, 2 ** 31 - 1), steady=st.booleans())
def test_compiled_step_layer_path_and_numpy_agree(tmp_path_factory: pytest.TempPathFactory, shape: SweepShape,
                                                   fmt: Format, seed: int, steady: bool) -> None:
    """(a) the compiled step gives the layer path's logits and KV cache bits over prefill chunks, decodes and
    mixed steps (schedule) or random ragged steps; (b) the layer path's logits agree with the numpy forward;
    (c) neither crashes."""
    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as d:
        checkpoint = write_model(Path(d), shape, seed)
        try:
            model = load(Path(d), fmt)
            batches = schedule(shape.vocab, seed) if steady else random_steps(shape.vocab, seed)
            assert_same_bits(model, batches, fmt.kv_cache)
            got = layer_path_logits(model, batches, fmt.kv_cache)
        finally:
            ops.set_isa("best")
        errors = reference_errors(shape, fmt, reference_weights(model, shape, fmt, checkpoint), batches, got)
        assert np.all(errors <= 1), f"{shape} {fmt}: logits off the reference by {errors.max():.3g} x the tolerance"


@pytest.mark.parametrize("shape, fmt, perturbed", [
    (SweepShape("ernie45_moe", vocab=1031, hidden=72, layers=2, heads=6, kv_heads=2, head_dim=20, ffn=100, experts=4,
                top_k=2, expert_ffn=40, shared=1, moe_start=1, dtype="F32"), Format(None, "float32", "best"),
     ("model.layers.0.self_attn.v_proj.weight", (25, 7), 1.01)),
    (SweepShape("qwen2", vocab=1031, hidden=72, layers=2, heads=6, kv_heads=2, head_dim=20, ffn=100, dtype="BF16"),
     Format("wint4", "block_wise_fp8", "best"), ("model.layers.0.self_attn.v_proj.weight", (slice(20, 40),), 1.5))],
    ids=["fp32", "wint4-fp8"])
def test_reference_tells_a_wrong_model(tmp_path: Path, shape: SweepShape, fmt: Format,
                                       perturbed: tuple[str, tuple[int, ...], float]) -> None:
    """The numpy check fails a model that differs by one weight (in float32 one of a value projection by 1 %; in
    the loosest format, wint4 weights and an fp8 cache, one kv head's value projection by 50 %), or that rotates
    the other pairs; and it passes the model itself."""
    checkpoint = write_model(tmp_path, shape, seed=3)
    model = load_model(ModelConfig.from_pretrained(tmp_path), quantization=fmt.quantization)
    batches = schedule(shape.vocab, seed=3)
    got = layer_path_logits(model, batches, fmt.kv_cache)
    weights = reference_weights(model, shape, fmt, checkpoint)
    assert 0 < reference_errors(shape, fmt, weights, batches, got).max() <= 1
    assert reference_errors(shape, fmt, weights, batches, got, interleaved=not shape.interleaved).max() > 1
    name, index, factor = perturbed
    wrong = dict(weights)  # (for the int4 model: its dequantized weights, which the check multiplies by)
    wrong[name] = weights[name].copy()
    wrong[name][index] *= factor
    assert reference_errors(shape, fmt, wrong, batches, got).max() > 1
    if fmt.quantization:  # and the packed weights are checked against such a checkpoint
        with pytest.raises(AssertionError, match=name):
            reference_weights(model, shape, fmt, {**checkpoint, name: wrong[name]})


# ---------------------------------------------------------------------------------- end to end

# The issue's head_dims, each with a family, checkpoint dtype and quantization (the other sizes are drawn).
ISSUE_MODELS = {8: ("ernie45_moe", "BF16", "wint4"), 20: ("qwen2", "F16", None),
                24: ("qwen3", "BF16", {"quantization": "wint8", "kv_cache_quant_type": "block_wise_fp8"}),
                40: ("ernie45", "F32", None)}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@dataclass(frozen=True)
class IssueModel:
    path: Path
    shape: SweepShape
    quantization: str | dict[str, str] | None
    prompts: list[dict[str, list[int]]]


@pytest.fixture(scope="module")
def issue_models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, IssueModel]:
    """For each of the issue's head_dims, a model of ISSUE_MODELS' family and format with the other sizes drawn,
    and 12 token-id prompts of 3..80 tokens."""
    out = {}
    for head_dim, (family, dtype, quantization) in ISSUE_MODELS.items():
        rng = np.random.default_rng(head_dim)

        def pick(options):
            return options[int(rng.integers(len(options)))]
        shape = dataclasses.replace(sample_shape(pick, head_dim, family), dtype=dtype)
        path = tmp_path_factory.mktemp(f"head_dim_{head_dim}")
        write_model(path, shape, seed=head_dim)
        prompts = [{"prompt_token_ids": rng.integers(3, shape.vocab, int(n)).tolist()}
                   for n in rng.integers(3, 81, 12)]
        out[head_dim] = IssueModel(path, shape, quantization, prompts)
    return out


def issue_llm(model: IssueModel) -> LLM:
    llm = LLM(model=str(model.path), max_model_len=512, quantization=model.quantization)
    assert llm.engine.runner.compiled is not None  # the runner takes the compiled step
    return llm


@pytest.mark.parametrize("head_dim", ISSUE_MODELS)
def test_generate_gives_each_request_what_it_gets_alone(issue_models: dict[int, IssueModel], head_dim: int) -> None:
    model = issue_models[head_dim]
    batched = issue_llm(model).generate(model.prompts, GREEDY, use_tqdm=False)
    alone = issue_llm(model)  # its own engine: no prefix cached by the batched run
    for prompt, out in zip(model.prompts, batched):
        assert len(out.outputs.token_ids) == 24
        assert out.outputs.token_ids == alone.generate([prompt], GREEDY, use_tqdm=False)[0].outputs.token_ids, \
            f"{model.shape} {model.quantization}: prompt of {len(prompt['prompt_token_ids'])} tokens"


def test_server_answers_as_generate(issue_models: dict[int, IssueModel]) -> None:
    """The OpenAI server on the head_dim 40 model: a completion gives LLM.generate's tokens and text."""
    model = issue_models[40]
    prompt = model.prompts[0]["prompt_token_ids"]
    expected = issue_llm(model).generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs
    server = Server(str(model.path), "--served-model-name", "sweep")  # unquantized, as ISSUE_MODELS says
    try:
        r = server.client().completions.create(model="sweep", prompt=prompt, temperature=0, max_tokens=24,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
    finally:
        code = server.stop()
    assert code == 0
    assert r.choices[0].completion_token_ids == expected.token_ids
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == 24
