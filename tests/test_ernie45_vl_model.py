"""ERNIE-4.5-VL language model against transformers' records for the tiny VL fixture
(tools/make_ernie45_vl_fixture.py, tests/fixtures/reference/ernie45_vl_tiny.json), in both checkpoint
layouts: token types, 3-D positions and rope_delta exactly; prefill routing (how many tokens' expert sets
the correction bias changed, the smallest top-k margin); the prefill's top-20 logprobs and the 8 greedy
steps (tokens exactly, top-5 logprobs within 1e-3), prefilled then decoded through the paged KV cache the
way the engine drives a model (forward_context), alone and chunked inside an image beside another request.

The -Paddle layout is written here from the fixture's own tensors (tmp dir): `ernie.` prefix, [in, out]
linear weights, fused qkv / up_gate (experts too), routers and correction bias as stored, `vision_model.*`
and `ernie.resampler_model.*`, raw U16 bf16, and Baidu's flat config (`moe_num_experts: [8, 8]`,
`freq_allocation`, `im_patch_id`, ...; it names the fixture's start/end/video token ids, which differ
from Baidu's vocabulary).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import paddle
import pytest

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.model_executor.models.ernie4_5_vl.positions import prompt_positions, text_positions, token_types
from fastdeploy.model_executor.checkpoint import Checkpoint
from fastdeploy.model_executor.models.ernie4_5_vl.config import Ernie45VLConfig
from fastdeploy.model_executor.forward_context import allocate_kv_caches, build_forward_context, forward_context
from fastdeploy.model_executor.layers.moe_multimodal import ModalitySplit, MultimodalMoE
from fastdeploy.model_executor.load import load_model
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.models.ernie4_5_vl.model import Rotary3D

from test_ernie45_vl_vision import image_inputs, video_inputs

VL = Path(__file__).resolve().parent / "fixtures" / "models" / "ernie45_vl_tiny_hf"
REF = json.loads((VL.parent.parent / "reference" / "ernie45_vl_tiny.json").read_text())
CASES = REF["cases"]
BY_NAME = {c["name"]: c for c in CASES}
BLOCK_SIZE, TOL = 16, 1e-3
MARGIN_TOL = 2e-6  # recomputed min top-k margin vs transformers' (float32 router on slightly different inputs)


# ---- the -Paddle layout, written from the fixture ----
def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """name -> (safetensors dtype, array of the stored bytes: uint16 bits for U16, float32 for F32)."""
    header, offset = {}, 0
    for name, (dtype, array) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


def paddle_tensors() -> dict[str, tuple[str, np.ndarray]]:
    with Checkpoint(str(VL)) as ckpt:
        src = {n: (ckpt.tensors[n].dtype, np.array(ckpt.lazy(n).raw)) for n in ckpt.tensors}
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, (dtype, array) in src.items():
        kind = "U16" if dtype == "BF16" else dtype
        if name.startswith("model.vision_model."):
            out[name.removeprefix("model.")] = (kind, array.T if array.ndim == 2 else array)
        elif name.startswith("model.resampler_model."):
            out["ernie." + name.removeprefix("model.")] = (kind, array.T if array.ndim == 2 else array)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            if name.endswith("q_proj.weight"):
                parts = [src[name.replace("q_proj", p)][1] for p in ("q_proj", "k_proj", "v_proj")]
                out["ernie." + name.removeprefix("model.").replace("q_proj", "qkv_proj")] = (
                    kind, np.concatenate(parts).T)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            if name.endswith("gate_proj.weight"):
                parts = [src[name.replace("gate_proj", p)][1] for p in ("gate_proj", "up_proj")]
                out["ernie." + name.removeprefix("model.").replace("gate_proj", "up_gate_proj")] = (
                    kind, np.concatenate(parts).T)
        else:  # routers [hidden, E] and the bias as stored; other 2-D linears [in, out]; embedding as is
            keep = "mlp.gate." in name or name.endswith(("embed_tokens.weight", "correction_bias"))
            out["ernie." + name.removeprefix("model.")] = (kind, array if keep or array.ndim == 1 else array.T)
    return out


def baidu_flat_config() -> dict:
    hf = json.loads((VL / "config.json").read_text())
    text, vision = hf["text_config"], hf["vision_config"]
    flat = {k: v for k, v in text.items() if k not in ("rope_parameters", "mlp_layer_types", "model_type")}
    flat.update({
        "architectures": ["Ernie4_5_VLMoeForConditionalGeneration"], "model_type": "ernie4_5_moe_vl",
        "dtype": "bfloat16", "rope_theta": 100.0, "rope_3d": True, "freq_allocation": 2,
        "moe_num_experts": [8, 8], "moe_layer_start_index": 1, "moe_layer_end_index": [2, 2],
        "moe_layer_interval": 1, "moe_gate_act": "softmax", "im_patch_id": hf["image_token_id"],
        "spatial_conv_size": 2, "temporal_conv_size": 2, "pixel_hidden_size": vision["hidden_size"],
        "vision_config": {"depth": vision["depth"], "embed_dim": vision["hidden_size"], "hidden_size": 64,
                          "mlp_ratio": 4, "num_heads": vision["num_heads"], "patch_size": 14, "in_channels": 3,
                          "spatial_merge_size": 2, "hidden_act": "quick_gelu"}})
    flat.update({k: hf[k] for k in ("image_start_token_id", "image_end_token_id", "video_start_token_id",
                                    "video_end_token_id", "video_token_id")})
    return flat


@pytest.fixture(scope="module")
def paddle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vl_paddle")
    write_safetensors(out / "model.safetensors", paddle_tensors())
    (out / "config.json").write_text(json.dumps(baidu_flat_config()))
    for name in ("generation_config.json",):
        (out / name).write_text((VL / name).read_text())
    return out


@pytest.fixture(scope="module", params=["hf", "paddle"])
def model(request: pytest.FixtureRequest, paddle_dir: Path) -> paddle.nn.Layer:
    return load_model(ModelConfig.from_pretrained(VL if request.param == "hf" else paddle_dir), dtype="float32")


@pytest.fixture(scope="module")
def hf_model() -> paddle.nn.Layer:
    return load_model(ModelConfig.from_pretrained(VL), dtype="float32")


# ---- inputs of a case ----
def case_inputs(case: dict, tokens) -> tuple[np.ndarray, np.ndarray, int]:
    positions, delta = prompt_positions(case["input_ids"], tokens, case.get("image_grid_thw"),
                                        case.get("video_grid_thw"))
    return token_types(case["input_ids"], tokens), positions, delta


_FEATURES: dict[tuple[int, str], np.ndarray] = {}


def vision_features(model: paddle.nn.Layer, case: dict) -> np.ndarray | None:
    """encode_vision's rows for the case's placeholders, in prompt order (images and videos interleaved as
    their placeholders appear)."""
    key = (id(model), case["name"])
    if key not in _FEATURES:
        tokens = model.vl.tokens
        ids = np.asarray(case["input_ids"])
        kinds = token_types(ids, tokens)[np.isin(ids, [tokens.image, tokens.video])]
        if not kinds.size:
            return None
        out = np.empty((kinds.size, model.config.hidden_size), dtype=np.float32)
        for kind, inputs in ((1, image_inputs), (2, video_inputs)):
            if np.any(kinds == kind):
                pixels, grid = inputs(case)
                out[kinds == kind] = model.encode_vision(paddle.to_tensor(pixels), grid).numpy()
        _FEATURES[key] = out
    return _FEATURES[key]


class Runner:
    """Steps the model as the engine does: ragged batch + forward context over the paged KV cache."""

    def __init__(self, model: paddle.nn.Layer, num_blocks: int = 128) -> None:
        cfg = model.config
        self.model = model
        self.caches = allocate_kv_caches(cfg.num_hidden_layers, num_blocks, BLOCK_SIZE, cfg.num_key_value_heads,
                                         cfg.head_dim)
        self.next_block, self.tables, self.done = 0, {}, {}

    def step(self, chunks: dict[int, tuple[list[int], np.ndarray, np.ndarray, np.ndarray | None]]
             ) -> dict[int, np.ndarray]:
        """request -> (ids, positions [3, n], token types [n], vision rows of its placeholders or None);
        returns request -> logprobs [n, vocab]."""
        ids, positions, types, feats, q_lens, c_lens, tables = [], [], [], [], [], [], []
        for req, (chunk, pos, kinds, rows) in chunks.items():
            start = self.done.get(req, 0)
            table = self.tables.setdefault(req, [])
            while len(table) * BLOCK_SIZE < start + len(chunk):
                table.append(self.next_block)
                self.next_block += 1
            ids += chunk
            positions.append(pos)
            types.append(kinds)
            if rows is not None and len(rows):
                feats.append(rows)
            q_lens.append(len(chunk))
            c_lens.append(start + len(chunk))
            tables.append(table)
            self.done[req] = start + len(chunk)
        ctx = build_forward_context(q_lens, c_lens, tables, BLOCK_SIZE, self.caches)
        with forward_context(ctx), paddle.no_grad():
            hidden = self.model(paddle.to_tensor(ids, dtype="int64"), paddle.to_tensor(np.concatenate(positions, 1)),
                                paddle.to_tensor(np.concatenate(types)),
                                paddle.to_tensor(np.concatenate(feats)) if feats else None)
            logprobs = paddle.nn.functional.log_softmax(self.model.compute_logits(hidden), axis=-1).numpy()
        out, offset = {}, 0
        for req, (chunk, *_) in chunks.items():
            out[req] = logprobs[offset:offset + len(chunk)]
            offset += len(chunk)
        return out


def check_step(logprobs: np.ndarray, expected: dict, where: str) -> float:
    assert int(logprobs.argmax()) == expected["token"], f"{where}: greedy token"
    assert np.argsort(-logprobs, kind="stable")[:5].tolist() == [t for t, _ in expected["top5"]], where
    diff = max(abs(logprobs[t] - lp) for t, lp in expected["top5"])
    assert diff < TOL, f"{where}: top-5 logprobs differ by {diff}"
    return float(diff)


def decode(runner: Runner, req: int, last: np.ndarray, case: dict, length: int, delta: int, where: str) -> None:
    """Greedy steps from `last` (logprobs of the prompt's last token), one token per step."""
    generated = []
    for j, step in enumerate(case["steps"]):
        check_step(last, step, f"{where} step {j}")
        generated.append(int(last.argmax()))
        pos = text_positions(length + j, 1, delta)
        last = runner.step({req: (generated[-1:], pos, np.zeros(1, np.int64), None)})[req][-1]
    assert generated == case["output_token_ids"]


# ---- routing, recomputed from what each MoE layer received ----
def routing_stats(captured: list[tuple[MultimodalMoE, np.ndarray, np.ndarray]]) -> dict:
    margins, changed, routed = [], 0, 0
    for layer, x, kinds in captured:
        for modality, rows in ((0, kinds == 0), (1, kinds != 0)):
            if not rows.any():
                continue
            gate = layer.gate.text if modality == 0 else layer.gate.vision
            logits = x[rows] @ gate.dense()
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            biased = probs + layer.moe_statics.bias(modality).numpy()
            ordered = -np.sort(-biased, axis=-1)
            margins.append(float((ordered[:, layer.top_k - 1] - ordered[:, layer.top_k]).min()))
            chosen = np.sort(np.argsort(-biased, axis=-1, kind="stable")[:, :layer.top_k], axis=-1)
            plain = np.sort(np.argsort(-probs, axis=-1, kind="stable")[:, :layer.top_k], axis=-1)
            changed += int((chosen != plain).any(-1).sum())
            routed += int(rows.sum())
            # The compiled op routes these rows exactly as recomputed here.
            experts = layer.experts.text if modality == 0 else layer.experts.vision
            _, ids, _ = ops.fused_moe(paddle.to_tensor(x[rows]), gate.value, layer.moe_statics.bias(modality),
                                      experts.up_gate.value, experts.down.value, layer.top_k, layer.norm_min, 0,
                                      layer.num_experts[modality], return_routing=True)
            np.testing.assert_array_equal(np.sort(ids.numpy(), axis=-1), chosen)
    return {"min_topk_margin": min(margins), "routed_tokens": routed, "bias_changed_choices": changed}


def capture_moe_inputs(model: paddle.nn.Layer) -> tuple[list, list]:
    captured, handles = [], []
    for layer in model.model.layers:
        if isinstance(layer.mlp, MultimodalMoE):
            def hook(mod, args, _captured=captured):
                x, split = args
                kinds = np.zeros(x.shape[0], np.int64)
                if split.vision is not None:
                    kinds[split.vision.numpy()] = 1
                _captured.append((mod, x.numpy(), kinds))
            handles.append(layer.mlp.register_forward_pre_hook(hook))
    return captured, handles


# ---- tests ----
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_token_types_positions_and_rope_delta_are_the_references(case):
    tokens = ModelConfig.from_pretrained(VL).multimodal.tokens
    types, positions, delta = case_inputs(case, tokens)
    assert types.tolist() == case["moe_mm_token_type_ids"]
    placeholders = np.where(np.isin(case["input_ids"], [tokens.image, tokens.video]), types, 0)
    assert placeholders.tolist() == case["mm_token_type_ids"]
    assert positions.tolist() == case["position_ids"] and delta == case["rope_delta"]


def test_the_reference_cases_are_not_degenerate():
    assert {c["name"] for c in CASES} == {"text_only", "one_image", "two_images", "one_video", "image_and_video"}
    for case in CASES:
        assert len(set(case["output_token_ids"])) >= 5 and case["min_top2_logit_gap"] > 10 * TOL


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_prefill_then_decode_match_transformers(model, case):
    types, positions, delta = case_inputs(case, model.vl.tokens)
    runner = Runner(model)
    captured, handles = capture_moe_inputs(model)
    try:
        logprobs = runner.step({0: (case["input_ids"], positions, types, vision_features(model, case))})[0]
    finally:
        for handle in handles:
            handle.remove()
    stats = routing_stats(captured)
    ref = case["routing_prefill"]
    assert stats["routed_tokens"] == ref["routed_tokens"]
    assert stats["bias_changed_choices"] == ref["bias_changed_choices"]
    assert abs(stats["min_topk_margin"] - ref["min_topk_margin"]) < MARGIN_TOL
    last = logprobs[-1]
    ref_top = case["prefill"]["top20_logprobs"]
    assert np.argsort(-last, kind="stable")[:20].tolist() == [t for t, _ in ref_top]
    assert max(abs(last[t] - lp) for t, lp in ref_top) < TOL
    decode(runner, 0, last, case, len(case["input_ids"]), delta, case["name"])


def test_a_prefill_chunk_may_cut_an_image_and_share_the_step(hf_model):
    """image_and_video in three chunks (the first ends inside the image, the second inside the video)
    batched with one_image in two chunks and text_only in one, then all three decode together: each step
    passes only its own columns of positions / types and the vision rows of its own placeholders."""
    names = ["image_and_video", "one_image", "text_only"]
    cases = [BY_NAME[n] for n in names]
    inputs = [case_inputs(c, hf_model.vl.tokens) for c in cases]
    tokens = hf_model.vl.tokens
    placeholder = [np.isin(c["input_ids"], [tokens.image, tokens.video]) for c in cases]
    feats = [vision_features(hf_model, c) for c in cases]
    first_image = [int(np.flatnonzero(p)[0]) if p.any() else 0 for p in placeholder]
    cuts = [[0, first_image[0] + 7, first_image[0] + 30, len(cases[0]["input_ids"])],
            [0, first_image[1] + 2, len(cases[1]["input_ids"])], [0, len(cases[2]["input_ids"])]]
    runner = Runner(hf_model)
    last: dict[int, np.ndarray] = {}
    for step in range(3):
        chunks = {}
        for r, (case, (types, positions, _), cut) in enumerate(zip(cases, inputs, cuts)):
            if step + 1 < len(cut):
                lo, hi = cut[step], cut[step + 1]
                rows = feats[r][placeholder[r][:lo].sum():placeholder[r][:hi].sum()] if feats[r] is not None else None
                chunks[r] = (case["input_ids"][lo:hi], positions[:, lo:hi], types[lo:hi], rows)
        out = runner.step(chunks)
        for r, chunk in chunks.items():
            if runner.done[r] == len(cases[r]["input_ids"]):
                last[r] = out[r][-1]
    generated: dict[int, list[int]] = {r: [] for r in range(3)}
    for j in range(4):
        chunks = {}
        for r, case in enumerate(cases):
            check_step(last[r], case["steps"][j], f"{names[r]} batched step {j}")
            generated[r].append(int(last[r].argmax()))
            pos = text_positions(len(case["input_ids"]) + j, 1, inputs[r][2])
            chunks[r] = (generated[r][-1:], pos, np.zeros(1, np.int64), None)
        last = {r: lp[-1] for r, lp in runner.step(chunks).items()}


def test_text_only_batches_may_pass_one_position_row(hf_model):
    """The engine's text-only call (positions [T], no token types) equals the 3-D one with t = h = w."""
    case = BY_NAME["text_only"]
    ids = paddle.to_tensor(case["input_ids"])
    outs = []
    for positions, types in ((paddle.arange(len(case["input_ids"])), None),
                             (paddle.to_tensor(np.tile(np.arange(len(case["input_ids"])), (3, 1))),
                              paddle.zeros([len(case["input_ids"])], dtype="int64"))):
        ctx = build_forward_context([len(ids)], [len(ids)], [list(range(8))], BLOCK_SIZE,
                                    allocate_kv_caches(3, 8, BLOCK_SIZE, 2, 16))
        with forward_context(ctx), paddle.no_grad():
            outs.append(hf_model(ids, positions, types).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])


def test_3d_rotary_reduces_to_ernie_1d_and_allocates_frequencies_per_axis():
    rotary = Rotary3D(16, 100.0, (3, 3, 2))
    pos = paddle.to_tensor(np.arange(0, 700, 7, dtype=np.int64))
    cos3, sin3 = rotary.cos_sin(paddle.stack([pos, pos, pos]))
    cos1, sin1 = ops.rotary_cos_sin(pos, ops.default_inv_freq(16, 100.0))
    np.testing.assert_array_equal(cos3.numpy(), cos1.numpy())
    np.testing.assert_array_equal(sin3.numpy(), sin1.numpy())
    t, h, w = np.array([5]), np.array([11]), np.array([23])
    cos, _ = rotary.cos_sin(paddle.to_tensor(np.stack([t, h, w])))
    inv = 1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)
    # transformers: freqs [h f0, w f1, h f2, w f3, h f4, w f5, t f6, t f7] (mrope_section [3, 3, 2])
    expected = np.cos(np.array([h, w, h, w, h, w, t, t]).reshape(-1) * inv)
    np.testing.assert_allclose(cos.numpy()[0], expected, atol=1e-6)


def test_both_config_spellings_give_the_same_settings(paddle_dir):
    hf, flat = ModelConfig.from_pretrained(VL), ModelConfig.from_pretrained(paddle_dir)
    assert hf.multimodal == flat.multimodal
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.rope_theta, hf.tie_word_embeddings) == \
        (flat.hidden_size, flat.num_hidden_layers, flat.head_dim, flat.rope_theta, flat.tie_word_embeddings)
    vl = hf.multimodal
    assert (vl.num_experts, vl.moe_intermediate_size, vl.top_k, vl.moe_layers, vl.mrope_section) == \
        ((8, 8), (48, 16), 3, (1, 2), (3, 3, 2))
    raw = baidu_flat_config()
    for change, error, match in (({"moe_layer_end_index": [2, 1]}, NotImplementedError, "vision experts in"),
                                 ({"freq_allocation": 3}, ValueError, "h == w"),
                                 ({"rope_3d": False}, ValueError, "rope_3d"),
                                 ({"moe_num_experts": [8, 8, 8]}, ValueError, "moe_num_experts")):
        with pytest.raises(error, match=match):
            Ernie45VLConfig.from_hf_config({**raw, **change}, "config.json", 3, 16)
    tokens = Ernie45VLConfig.from_hf_config({k: v for k, v in raw.items() if "video_token" not in k},
                                            "config.json", 3, 16).tokens
    assert tokens.video == tokens.image == 1018  # Baidu's: videos use the image placeholder


def test_one_placeholder_id_for_images_and_videos_is_told_apart_by_the_start_token():
    tokens = ModelConfig.from_pretrained(VL).multimodal.tokens
    case = BY_NAME["image_and_video"]
    shared = type(tokens)(**{**{f: getattr(tokens, f) for f in tokens.__slots__}, "video": tokens.image})
    ids = [tokens.image if i == tokens.video else i for i in case["input_ids"]]
    assert token_types(ids, shared).tolist() == case["moe_mm_token_type_ids"]
    positions, delta = prompt_positions(ids, shared, case["image_grid_thw"], case["video_grid_thw"])
    assert positions.tolist() == case["position_ids"] and delta == case["rope_delta"]
    with pytest.raises(ValueError, match="video grids"):
        prompt_positions(case["input_ids"], tokens, case["image_grid_thw"], case["video_grid_thw"] * 2)


def test_vision_feature_rows_must_match_the_placeholders(hf_model):
    case = BY_NAME["one_image"]
    types, positions, _ = case_inputs(case, hf_model.vl.tokens)
    ctx = build_forward_context([len(types)], [len(types)], [[0, 1, 2]], BLOCK_SIZE,
                                allocate_kv_caches(3, 3, BLOCK_SIZE, 2, 16))
    with forward_context(ctx), paddle.no_grad(), pytest.raises(ValueError, match="4 image/video placeholder"):
        hf_model(paddle.to_tensor(case["input_ids"]), paddle.to_tensor(positions), paddle.to_tensor(types),
                 paddle.zeros([3, 64]))


def test_tensor_parallel_shares_add_up_to_the_whole_layer():
    """Two ranks' shares of a MoE layer (each half of both expert sets and of the shared experts) sum to
    the single-rank layer on mixed text / image rows (the engine does not run VL with TP yet)."""
    config = ModelConfig.from_pretrained(VL)
    whole = load_model(config).model.layers[1].mlp
    shares = [load_model(config, TPGroup(rank, 2)).model.layers[1].mlp for rank in range(2)]
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.standard_normal((40, 64), dtype=np.float32))
    split = ModalitySplit.from_token_types(rng.integers(0, 3, 40))
    total = shares[0].partial(x, split) + shares[1].partial(x, split)
    expected = whole.partial(x, split).numpy()  # outputs ~50: float32 sums in another order differ by ~1e-6 rel.
    np.testing.assert_allclose(total.numpy(), expected, rtol=0, atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
def test_quantization_covers_the_text_model_and_the_vision_tower_in_int8(quantization):
    model = load_model(ModelConfig.from_pretrained(VL), quantization=quantization)
    text_fmt = {"wint8": "int8", "wint4": "int4"}[quantization]
    assert model.model.layers[0].self_attn.qkv_proj.packed.fmt == text_fmt
    assert model.model.layers[1].mlp.experts.vision.up_gate.value.fmt == text_fmt
    assert model.model.layers[1].mlp.gate.vision.value.fmt == "fp32"  # routers never quantized
    assert model.vision_encoder.vision_model.blocks[0].attn.qkv.packed.fmt == "int8"
    assert model.vision_encoder.resampler_model.mlp.packed.fmt == "int8"
    case = BY_NAME["one_image"]
    types, positions, _ = case_inputs(case, model.vl.tokens)
    logprobs = Runner(model).step({0: (case["input_ids"], positions, types, vision_features(model, case))})[0]
    if quantization == "wint8":  # int4 moves this random tiny model's logits more than its top-2 gap
        assert int(logprobs[-1].argmax()) == case["output_token_ids"][0]


def test_other_multimodal_architectures_are_still_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"]}))
    with pytest.raises(NotImplementedError, match="multimodal"):
        ModelConfig.from_pretrained(tmp_path)


def test_llm_with_two_ranks():
    """LLM drives the VL checkpoint with the experts of both sets split over two ranks (each rank encodes
    the media with its own copy of the vision tower): text, image and video prompts, batched, give
    transformers' tokens."""
    from fastdeploy import LLM, SamplingParams
    from test_ernie45_vl_generate import generate_prompt

    cases = [BY_NAME[name] for name in ("text_only", "two_images", "image_and_video")]
    llm = LLM(model=str(VL), tensor_parallel_size=2, max_model_len=1024)
    prompts = [{"prompt_token_ids": case["input_ids"]} if case["name"] == "text_only" else generate_prompt(case)
               for case in cases]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.prompt_token_ids == case["input_ids"], case["name"]
        assert out.outputs.token_ids == case["output_token_ids"][:8], case["name"]


def test_pure_paddle_fallback_matches_too(hf_model):
    from conftest import compiled_ops
    case = BY_NAME["image_and_video"]
    types, positions, _ = case_inputs(case, hf_model.vl.tokens)
    features = vision_features(hf_model, case)
    with compiled_ops(False):
        last = Runner(hf_model).step({0: (case["input_ids"], positions, types, features)})[0][-1]
    check_step(last, case["steps"][0], "reference ops")
