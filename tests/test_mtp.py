"""MTP speculative decoding (issue 44): ERNIE-4.5's multi-token-prediction layer against a numpy reference written
from FastDeploy's ernie4_5_mtp model, its drafts against that reference along real runs, and outputs unchanged by
it in every setting the engine has.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.numpy import save_file

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.sampling_params import GuidedDecodingParams
from fastdeploy.model_executor.checkpoint import Checkpoint
from fastdeploy.model_executor.load import load_model
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.forward_context import allocate_kv_caches, build_forward_context, forward_context
from fastdeploy.model_executor.models.ernie4_5_mtp import mtp_forward
from fastdeploy.speculative import MtpDrafter
from fastdeploy.step_types import ForwardBatch
from fastdeploy.worker.forward import forward_hidden
from tests.conftest import FIXTURES

MODELS = FIXTURES / "models"


def mtp_tensors(fixture: str, seed: int) -> dict[str, np.ndarray]:
    """An MTP layer for a tiny fixture, HF names and layout: its last decoder layer's tensors (experts too, for
    MoE) with noise, random norms and projection."""
    source = MODELS / fixture.replace("_paddle", "_hf")  # the Paddle copies hold the same values
    config = json.loads((source / "config.json").read_text())
    hidden, last = config["hidden_size"], config["num_hidden_layers"] - 1
    rng = np.random.default_rng(seed)
    out = {}
    with Checkpoint(str(source)) as checkpoint:
        for name in sorted(checkpoint.tensors):
            if f".layers.{last}." in name:
                value = checkpoint.read(name)
                noise = rng.standard_normal(value.shape).astype(np.float32) * 0.05 * float(np.abs(value).mean() + 1e-3)
                out[name.replace(f"layers.{last}.", "mtp_block.0.")] = value + noise
    out["model.mtp_linear_proj.0.weight"] = (rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden)
                                             ).astype(np.float32)
    for name in ("mtp_emb_norm", "mtp_hidden_norm"):
        out[f"model.{name}.0.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    return out


def paddle_layout(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named tensors as the -Paddle repos store them: `ernie.`, [in, out], fused q/k/v and gate/up."""
    out = {}
    for name, value in tensors.items():
        name = "ernie." + name[len("model."):]
        if name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue  # fused with q_proj / gate_proj below
        if name.endswith("q_proj.weight"):
            hf = "model." + name[len("ernie."):]
            parts = [tensors[hf.replace("q_proj", n)].T for n in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = np.ascontiguousarray(np.concatenate(parts, axis=1))
        elif name.endswith("gate_proj.weight"):
            up = tensors["model." + name[len("ernie."):].replace("gate_proj", "up_proj")]
            fused = np.concatenate([value.T, up.T], axis=1)
            out[name.replace("gate_proj", "up_gate_proj")] = np.ascontiguousarray(fused)
        else:
            out[name] = value.T.copy() if value.ndim == 2 and "moe_statics" not in name else value
    return out


def with_mtp(tmp_path: Path, fixture: str, seed: int = 0) -> Path:
    """A copy of a tiny fixture with an MTP layer, one safetensors file (float32)."""
    source = MODELS / fixture
    out = tmp_path / f"{fixture}_mtp"
    out.mkdir(parents=True)
    for f in source.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    with Checkpoint(str(source)) as checkpoint:
        tensors = {n: checkpoint.read(n) for n in checkpoint.tensors if ".mtp_" not in n}
    extra = mtp_tensors(fixture, seed)
    save_file({**tensors, **(paddle_layout(extra) if fixture.endswith("paddle") else extra)},
              str(out / "model.safetensors"))
    return out


# ---- the numpy reference (FastDeploy's Ernie4_5_MTPModel over one sequence, HF-layout dense weights) ----------
def rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rotate(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """ERNIE-4.5's interleaved rotary: pairs (x[2i], x[2i+1]) turned by position * theta^(-2i/D)."""
    d = x.shape[-1]
    angle = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)[None]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def decoder_layer(x: np.ndarray, w: dict, p: str, c: dict, positions: np.ndarray) -> np.ndarray:
    eps, d, heads, kv_heads = c["rms_norm_eps"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    theta = c["rope_parameters"]["rope_theta"]
    h = rms(x, w[p + "input_layernorm.weight"], eps)
    q = rotate((h @ w[p + "self_attn.q_proj.weight"].T).reshape(len(x), heads, d), positions, theta)
    k = rotate((h @ w[p + "self_attn.k_proj.weight"].T).reshape(len(x), kv_heads, d), positions, theta)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(len(x), kv_heads, d)
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((len(x), len(x)), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("hts,shd->thd", probs, v).reshape(len(x), heads * d) @ w[p + "self_attn.o_proj.weight"].T
    h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    return x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T


def reference_mtp(w: dict, c: dict, hidden: np.ndarray, next_tokens: list[int]) -> np.ndarray:
    """o_i for positions 0..T-1 from the main model's final hidden states h_i and tokens x_{i+1}."""
    eps = c["rms_norm_eps"]
    embedded = rms(w["model.embed_tokens.weight"][next_tokens], w["model.mtp_emb_norm.0.weight"], eps)
    joined = np.concatenate([embedded, rms(hidden, w["model.mtp_hidden_norm.0.weight"], eps)], axis=-1)
    z = joined @ w["model.mtp_linear_proj.0.weight"].T
    u = decoder_layer(z, w, "model.mtp_block.0.", c, np.arange(len(z), dtype=np.float64))
    return rms(u, w["model.norm.weight"], eps)


def checkpoint_arrays(path: Path) -> dict[str, np.ndarray]:
    with Checkpoint(str(path)) as checkpoint:
        return {n: checkpoint.read(n).astype(np.float64) for n in checkpoint.tensors}


def model_of(llm: LLM):
    return llm.engine.runner.model


def main_hidden(model, tokens: list[int], layers: int, c: dict, kv_cache_dtype: str = "float32") -> np.ndarray:
    """The loaded model's final hidden states over `tokens` (one request, fresh caches)."""
    block = 16
    caches = allocate_kv_caches(layers + 1, -(-len(tokens) // block) + 1, block, c["num_key_value_heads"],
                                c["head_dim"], kv_cache_dtype)
    n = np.asarray([len(tokens)], np.int64)
    table = np.arange(-(-len(tokens) // block), dtype=np.int64)[None]
    batch = ForwardBatch(np.asarray(tokens, np.int64), np.arange(len(tokens), dtype=np.int64), n, n, table, n - 1)
    return forward_hidden(model, batch, block, caches).numpy().astype(np.float64), caches, table


@pytest.mark.parametrize("fixture", ["ernie45_tiny_hf", "ernie45_tiny_paddle"])
def test_mtp_layer_matches_the_numpy_reference(tmp_path: Path, fixture: str) -> None:
    path = with_mtp(tmp_path, fixture)
    c = json.loads((MODELS / "ernie45_tiny_hf" / "config.json").read_text())  # the Paddle copy's, HF-spelled
    llm = LLM(model=str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 1}, block_size=16)
    model = model_of(llm)
    tokens = np.random.default_rng(1).integers(3, c["vocab_size"], size=37).tolist()
    hidden, caches, table = main_hidden(model, tokens, c["num_hidden_layers"], c)
    # The reference reads HF names and layout: the same values as the Paddle copy.
    w = checkpoint_arrays(with_mtp(tmp_path / "hf", "ernie45_tiny_hf"))
    expected = reference_mtp(w, c, hidden[:-1], tokens[1:])
    n = np.asarray([len(tokens) - 1], np.int64)
    with forward_context(build_forward_context(n, n, table, 16, caches)):
        got = mtp_forward(model, paddle.to_tensor(np.asarray(tokens[1:], np.int64)),
                          paddle.to_tensor(np.arange(len(tokens) - 1, dtype=np.int64)),
                          paddle.to_tensor(hidden[:-1].astype(np.float32))).numpy()
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)
    logits = expected @ w["model.embed_tokens.weight"].T
    got_tokens = model.compute_logits(paddle.to_tensor(got)).argmax(-1).numpy()
    assert (got_tokens == logits.argmax(-1)).mean() > 0.95  # near-ties aside


# ---- the engine: drafts as the reference makes them, outputs as without speculation ------------------------------
def layer_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fastdeploy.worker.compiled_step.CompiledDecoder.build",
                        classmethod(lambda cls, *args, **kwargs: None))


class Oracle:
    """Proposes each request's true continuation (from the run without speculation) with some tokens changed, in
    place of the MTP drafts, so that steps accept several drafts and reject others; and records what the runner
    drafted after each step, with the request's tokens then."""

    def __init__(self, expected: list, rng: np.random.Generator) -> None:
        self.reference = [o.prompt_token_ids + o.outputs.token_ids for o in expected]
        self.rng = rng
        self.offers: list[tuple[list[int], list[int]]] = []

    def propose(self, drafter: MtpDrafter, tokens: list[int], limit: int) -> list[int]:
        full = next((f for f in self.reference if f[:len(tokens)] == list(tokens)), [])
        drafts = full[len(tokens):len(tokens) + limit]
        return [t if self.rng.random() < 0.75 else int(self.rng.integers(3, 1000)) for t in drafts]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from fastdeploy.engine.scheduler import Scheduler

        oracle, update = self, Scheduler.update_from_output

        def recording_update(scheduler, step, output):
            result = update(scheduler, step, output)
            if step.model_input.mtp is not None:
                for i, drafts in zip(step.model_input.mtp.batch_index.tolist(), output.draft_token_ids):
                    if drafts and not step.requests[i].is_finished:  # a finished request's drafts are dropped
                        oracle.offers.append((list(step.requests[i].token_ids), drafts))
            return result
        monkeypatch.setattr(Scheduler, "update_from_output", recording_update)
        monkeypatch.setattr(MtpDrafter, "propose",
                            lambda drafter, tokens, limit: oracle.propose(drafter, tokens, limit))


def reference_drafts(model, c: dict, tokens: list[int], drafts: list[int], kv_cache_dtype: str) -> list[bool]:
    """Whether each draft is the argmax (within 1e-3: near-ties) of the MTP layer run over the whole sequence in one
    go: rows 0..n-2 from the main model's hidden states, then one row per earlier draft from the last output."""
    hidden, caches, table = main_hidden(model, tokens, c["num_hidden_layers"], c, kv_cache_dtype)
    table = np.arange(-(-(len(tokens) + len(drafts)) // 16), dtype=np.int64)[None]
    if caches[0].shape[1] < table.shape[1]:
        return [True] * len(drafts)  # (never: main_hidden leaves a spare block)
    n = len(tokens) - 1
    ids, rows, start, out = tokens[1:], hidden[:-1].astype(np.float32), 0, []
    for j, draft in enumerate(drafts):
        q = np.asarray([len(ids)], np.int64)
        with forward_context(build_forward_context(q, np.asarray([start + len(ids)], np.int64), table, 16, caches)):
            o = mtp_forward(model, paddle.to_tensor(np.asarray(ids, np.int64)),
                            paddle.to_tensor(np.arange(start, start + len(ids), dtype=np.int64)), paddle.to_tensor(rows))
        logits = model.compute_logits(o[-1:]).numpy()[0]
        out.append(bool(logits[draft] >= logits.max() - 1e-3))
        start, ids, rows = n + j, [draft], o[-1:].numpy()
    return out


@pytest.mark.parametrize("fixture, k, compiled", [("ernie45_tiny_hf", 1, False), ("ernie45_tiny_hf", 3, False),
                                                  ("ernie45_moe_tiny_hf", 2, False), ("ernie45_tiny_hf", 3, True),
                                                  ("ernie45_moe_tiny_hf", 2, True)])
def test_drafts_follow_the_reference_through_accepted_and_rejected_drafts(tmp_path, monkeypatch, fixture, k,
                                                                          compiled) -> None:
    """Whatever a step accepted, the MTP layer's cache holds exactly the rows a whole-sequence run would, so every
    draft is what the reference (the layer path, all rows at once) drafts from the request's tokens at that point;
    on the compiled step (model and MTP layer) or layer by layer."""
    from tests.test_speculative import generate, repeating_prompts

    if not compiled:
        layer_path_only(monkeypatch)
    path = with_mtp(tmp_path, fixture, seed=3)
    c = json.loads((path / "config.json").read_text())
    prompts = repeating_prompts(6, seed=k)
    params = [SamplingParams(temperature=0, max_tokens=16 + 3 * i) for i in range(len(prompts))]
    engine = dict(model=str(path), block_size=16, max_num_seqs=4)
    expected = generate(LLM(**engine), prompts, params)
    oracle = Oracle(expected, np.random.default_rng(k))
    oracle.install(monkeypatch)
    llm = LLM(**engine, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    got = generate(llm, prompts, params)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert 0.4 * drafted < accepted < drafted, (accepted, drafted)
    assert len(oracle.offers) > 30 and all(len(d) <= k for _, d in oracle.offers)
    model = model_of(llm)
    assert (llm.engine.runner.mtp.layer.compiled is not None) == compiled
    checked = [reference_drafts(model, c, tokens, drafts, llm.config.kv_cache_dtype) for tokens, drafts in oracle.offers]
    assert all(all(ok) for ok in checked), [i for i, ok in enumerate(checked) if not all(ok)]


@pytest.mark.parametrize("fixture", ["ernie45_tiny_hf", "ernie45_moe_tiny_hf"])
def test_tensor_parallel_two_ranks(tmp_path, monkeypatch, fixture) -> None:
    """Every rank runs the MTP layer on its shard (the workers on their own hidden states): outputs as without
    speculation, and (dense) the drafts the ones a one-rank model's MTP layer makes over the whole sequence. An MoE
    layer's routing may flip on the last bits two ranks' sums differ by, so there only the outputs are compared."""
    from tests.test_speculative import generate, repeating_prompts

    path = with_mtp(tmp_path, fixture, seed=7)
    c = json.loads((path / "config.json").read_text())
    prompts = repeating_prompts(5, seed=13)
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=16 + 2 * i) for i in range(5)]
    engine = dict(model=str(path), block_size=16, tensor_parallel_size=2)
    expected = generate(LLM(**engine), prompts, params)
    oracle = Oracle(expected, np.random.default_rng(6))
    oracle.install(monkeypatch)
    llm = LLM(**engine, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    got = generate(llm, prompts, params)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0 and len(oracle.offers) > 20
    if "moe" in fixture:
        return
    one_rank = model_of(LLM(model=str(path), block_size=16, speculative_config={"method": "mtp"}))
    checked = [reference_drafts(one_rank, c, tokens, drafts, llm.config.kv_cache_dtype)
               for tokens, drafts in oracle.offers]
    assert all(all(ok) for ok in checked), [i for i, ok in enumerate(checked) if not all(ok)]


@pytest.mark.parametrize("fixture, k, quantization", [("ernie45_tiny_hf", 2, None), ("ernie45_moe_tiny_paddle", 1, "wint4")])
def test_every_engine_setting_gives_the_same_outputs(tmp_path, monkeypatch, fixture, k, quantization) -> None:
    """Preemption (a small KV pool), chunked prefill with a small budget, prefix caching with n=2 samples, seeded
    sampling, penalties, logprobs and prompt logprobs, stop strings, logit bias and a grammar: the same outputs with MTP drafts
    (oracle-corrected so that steps accept several) as without."""
    from tests.test_speculative import assert_same_outputs, generate, repeating_prompts

    path = with_mtp(tmp_path, fixture, seed=5)
    prompts = repeating_prompts(8, seed=5)
    engine = dict(model=str(path), block_size=16, max_num_seqs=6, enable_chunked_prefill=True, max_num_batched_tokens=24,
                  num_gpu_blocks_override=9, kv_cache_ratio=1.0, enable_prefix_caching=True, quantization=quantization)
    plain = generate(LLM(**engine), prompts, [SamplingParams(temperature=0, max_tokens=20)] * len(prompts))
    stops = [o.outputs.text[len(o.outputs.text) // 2:][:3] or None for o in plain]
    params = [SamplingParams(max_tokens=20, temperature=0.9 if i % 2 else 0, seed=i, n=2 if i % 3 == 0 else 1,
                             logprobs=2 if i % 4 == 1 else None, prompt_logprobs=1 if i == 2 else None,
                             repetition_penalty=1.2 if i == 5 else 1.0, stop=[stops[i]] if stops[i] and i % 2 == 0 else None,
                             logits_processors_args={"logit_bias": {7: 2.0}} if i == 3 else None,
                             guided_decoding=GuidedDecodingParams(regex="[0-9a-f ]{6,30}") if i == 4 else None)
              for i in range(len(prompts))]
    expected = generate(LLM(**engine), prompts, params)
    Oracle(expected, np.random.default_rng(2)).install(monkeypatch)
    llm = LLM(**engine, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    got = generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_outputs(got, expected)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


def test_random_mtp_drafts_change_nothing(tmp_path) -> None:
    """The MTP layer's own drafts (mostly rejected with random weights), greedy and seeded: outputs unchanged."""
    from tests.test_speculative import generate, mixed_params, repeating_prompts

    path = with_mtp(tmp_path, "ernie45_tiny_hf", seed=1)
    prompts = repeating_prompts(10, seed=2)
    params = mixed_params(len(prompts))
    expected = generate(LLM(model=str(path), block_size=16, max_num_seqs=4), prompts, params)
    got = generate(LLM(model=str(path), block_size=16, max_num_seqs=4,
                       speculative_config={"method": "mtp", "num_speculative_tokens": 3}), prompts, params)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert sum(o.metrics.num_draft_tokens for o in got) > 50


@pytest.mark.parametrize("fixture, extra, error, match", [
    ("qwen3_tiny", {}, ValueError, "ERNIE-4.5 text model"),
    ("ernie45_tiny_hf", {}, ValueError, "has no MTP tensors"),
])
def test_mtp_where_it_cannot_run_is_refused_before_loading(fixture, extra, error, match) -> None:
    with pytest.raises(error, match=match):
        LLM(model=str(MODELS / fixture), speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **extra)


def test_mtp_weights_from_a_directory_of_their_own(tmp_path) -> None:
    """FastDeploy's `"model": ".../mtp"`: the MTP tensors come from that directory (the same parameters as when the
    checkpoint carries them), the rest from the model's."""
    from tests.test_speculative import generate, mixed_params, repeating_prompts

    path = with_mtp(tmp_path, "ernie45_tiny_paddle", seed=3)
    apart = tmp_path / "mtp"
    apart.mkdir()
    with Checkpoint(str(path)) as checkpoint:
        save_file({n: checkpoint.read(n) for n in checkpoint.tensors if ".mtp_" in n}, str(apart / "model.safetensors"))
    config = ModelConfig.from_pretrained(str(MODELS / "ernie45_tiny_paddle"))
    loaded = dict(load_model(config, mtp_weights=str(apart)).named_parameters())
    together = dict(load_model(ModelConfig.from_pretrained(str(path)), mtp_weights=str(path)).named_parameters())
    assert any("mtp_block" in n for n in loaded) and loaded.keys() == together.keys()
    for name, value in together.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value.numpy(), err_msg=name)

    prompts = repeating_prompts(6, seed=4)
    params = mixed_params(len(prompts))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "model": str(apart)}
    expected = generate(LLM(model=str(MODELS / "ernie45_tiny_paddle"), block_size=16), prompts, params)
    got = generate(LLM(model=str(MODELS / "ernie45_tiny_paddle"), block_size=16, speculative_config=spec), prompts, params)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0
    for where, match in ((MODELS / "ernie45_tiny_hf", "has no MTP tensors"), (apart / "model.safetensors", "directory")):
        with pytest.raises(ValueError, match=match):
            LLM(model=str(MODELS / "ernie45_tiny_paddle"), speculative_config={**spec, "model": str(where)})


def test_num_model_steps_caps_the_layers_drafts_and_ngram_adds_the_rest(tmp_path, monkeypatch) -> None:
    """num_model_steps=2 of 3: the layer never drafts more than two; with mtp_strategy "with_ngram" n-gram lookups
    extend its drafts. The layer's drafts are replaced by the request's first tokens (an n-gram that occurred before,
    so the lookup finds what followed it), and every request drafts all it may. Outputs unchanged either way."""
    from fastdeploy.engine.scheduler import Scheduler
    from tests.test_speculative import generate, mixed_params, repeating_prompts

    path = with_mtp(tmp_path, "ernie45_tiny_hf", seed=2)
    prompts = repeating_prompts(6, seed=6)
    params = mixed_params(len(prompts))
    expected = generate(LLM(model=str(path), block_size=16), prompts, params)
    update, propose = Scheduler.update_from_output, MtpDrafter.propose
    made, proposed = [], []

    def steered_update(scheduler, step, output):
        result = update(scheduler, step, output)
        for i, drafts in zip(step.model_input.mtp.batch_index.tolist() if step.model_input.mtp else (),
                             output.draft_token_ids):
            request = step.requests[i]
            if drafts and not request.is_finished:
                made.append(len(drafts))
                request.drafter.offer(request.token_ids[:len(drafts)], request.num_tokens, [])
        return result

    def recorded_propose(drafter, tokens, limit):
        proposed.append((len(drafter.drafts) if len(tokens) == drafter.after else 0, propose(drafter, tokens, limit)))
        return proposed[-1][1]

    monkeypatch.setattr(Scheduler, "update_from_output", steered_update)
    monkeypatch.setattr(MtpDrafter, "propose", recorded_propose)
    monkeypatch.setattr(MtpDrafter, "length", lambda drafter, threshold, probe=False: drafter.k)
    for strategy in ("default", "with_ngram"):
        made.clear(), proposed.clear()
        spec = {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 2, "mtp_strategy": strategy}
        got = generate(LLM(model=str(path), block_size=16, speculative_config=spec), prompts, params)
        assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
        assert max(made) == 2
        extended = sum(len(drafts) > mtp for mtp, drafts in proposed)
        assert (extended > 0) == (strategy == "with_ngram"), strategy


# ---- the demo model's trained MTP head ---------------------------------------------------------------------------
DEMO = Path(__file__).resolve().parents[1] / "models" / "ernie-4.5-demo"
DEMO_PROMPTS = ["The list type is a mutable sequence", "A dictionary maps", "class C:\n    def __init__(self, value):\n",
                "To open a file for reading,"]
DEMO_PARAMS = [SamplingParams(temperature=0, max_tokens=48, logprobs=2),
               SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=48, logprobs=2)]


@pytest.fixture(scope="module")
def demo_runs() -> tuple[list, list]:
    prompts, params = DEMO_PROMPTS * 2, DEMO_PARAMS * len(DEMO_PROMPTS)
    expected = LLM(model=str(DEMO), max_model_len=256).generate(prompts, params, use_tqdm=False)
    got = LLM(model=str(DEMO), max_model_len=256, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
              ).generate(prompts, params, use_tqdm=False)
    return expected, got


def test_demo_mtp_head_drafts_are_accepted_and_change_nothing(demo_runs) -> None:
    from tests.test_speculative import assert_same_outputs

    expected, got = demo_runs
    assert_same_outputs(got, expected)
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert drafted > 100 and accepted > 0.5 * drafted, (accepted, drafted)  # a trained head, not chance


def test_demo_mtp_draft_logprobs_are_the_drafting_distributions(demo_runs) -> None:
    """One entry per accepted draft, at its token; MTP drafts greedily, so the token is the entry's best."""
    for out in demo_runs[1]:
        entries = out.outputs.draft_logprobs
        assert len(entries) == len(out.outputs.token_ids)
        kept = [(t, e) for t, e in zip(out.outputs.token_ids, entries) if e is not None]
        assert len(kept) == out.metrics.num_accepted_tokens
        for token, entry in kept:
            assert entry[token].rank == 1 and entry[token].logprob <= 0 and len(entry) <= 3
            assert entry[token].logprob == max(lp.logprob for lp in entry.values())


def test_server_returns_draft_logprobs(demo_runs) -> None:
    from tests.test_api_server import Server

    expected = demo_runs[1][0]  # the first prompt, greedy, under MTP
    server = Server(str(DEMO), "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1}))
    try:
        client = server.client()
        body = dict(model=server_model(client), prompt=expected.prompt_token_ids, max_tokens=48, temperature=0,
                    logprobs=2)
        plain = client.completions.create(**body)
        assert plain.choices[0].model_extra.get("draft_logprobs") is None  # not asked for
        r = client.completions.create(**body, extra_body={"include_draft_logprobs": True})
        assert r.choices[0].text == plain.choices[0].text
        drafts = r.choices[0].model_extra["draft_logprobs"]
        assert 0 < len(drafts["tokens"]) == len(drafts["token_logprobs"]) == len(drafts["top_logprobs"]) < 48
        for token, logprob, top in zip(drafts["tokens"], drafts["token_logprobs"], drafts["top_logprobs"]):
            assert logprob == max(top.values()) and top[token] == logprob  # a greedy draft: its entry's best
        chat = client.chat.completions.create(model=body["model"], messages=[{"role": "user", "content": "A list"}],
                                              max_tokens=24, temperature=0, logprobs=True, top_logprobs=1,
                                              extra_body={"include_draft_logprobs": True})
        content = chat.choices[0].model_extra["draft_logprobs"]["content"]
        assert content and all(item["logprob"] <= 0 and len(item["top_logprobs"]) == 1 for item in content)
    finally:
        assert server.stop() == 0


def server_model(client) -> str:
    return client.models.list().data[0].id
