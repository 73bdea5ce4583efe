"""Loading without a float32 model: every weight goes from the memory-mapped checkpoint straight into
its packed format, the memory plan refuses a model that cannot fit before allocating it, and the peak
memory of loading stays within the packed size plus a small margin."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.layers.packed import Precision, named_slots, packed_parameters
from fastdeploy.model_executor.load import Checkpoint, load_model, load_weights, plan_loading
from fastdeploy.model_executor.memory_plan import RUNTIME_BYTES, weights_bytes
from fastdeploy.model_executor.models.registry import get_model_class
from fastdeploy.model_executor.weight_format import named_weights
from fastdeploy.ops.pack import pack_weight

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "fixtures" / "models"
FIXTURES = ["ernie45_tiny_hf", "ernie45_tiny_paddle", "ernie45_moe_tiny_hf", "ernie45_moe_tiny_paddle", "qwen2_tiny",
            "qwen3_tiny", "llama3_tiny", "mistral_tiny"]
GIB = 1 << 30


@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_streamed_quantized_weights_equal_packing_the_float_weights(fixture: str, quantization: str) -> None:
    """Every rank's packed weights (tp 1 and 2) hold exactly what packing that rank's float32 matrix
    gives: quantizing while streaming from the file changes nothing."""
    config = ModelConfig.from_pretrained(MODELS / fixture)
    for tp in (TPGroup(0, 1), TPGroup(0, 2), TPGroup(1, 2)):
        exact = named_weights(load_model(config, tp))  # unquantized: the stored values, exactly
        model = load_model(config, tp, quantization)
        for name, slot in named_slots(model):
            fmt = slot.target.value.fmt
            assert fmt == Precision(quantization).format_for(slot.target)
            reference = exact[name].T if slot.linear_in_out is False else exact[name]  # the table is [hidden, rows]
            expected = ops.unpack_weight(pack_weight(np.ascontiguousarray(reference), fmt)).numpy()
            got = slot.dense().T if slot.linear_in_out is False else slot.dense()
            np.testing.assert_array_equal(got, expected, err_msg=f"{fixture} {tp} {name} {fmt}")


def build(fixture: str, tp: TPGroup = TPGroup(0, 1)):
    from fastdeploy.distributed.parallel_state import building_for

    config = ModelConfig.from_pretrained(MODELS / fixture)
    with building_for(tp):
        return config, get_model_class(config.architectures)(config)


def test_model_too_large_is_refused_before_allocating() -> None:
    config, model = build("ernie45_moe_tiny_hf")
    weights = packed_parameters(model)
    with Checkpoint(config.model_path) as ckpt:
        plan_loading(model, ckpt)  # records how each weight is stored, which decides its format
    need = {q: weights_bytes(weights, Precision(q)) for q in (None, "wint4")}
    assert need["wint4"] < need[None]
    # Between what wint4 and bf16 need: bf16 is refused, naming what fits, before any weight is allocated.
    budget = RUNTIME_BYTES + (need[None] + need["wint4"]) // 2
    with Checkpoint(config.model_path) as ckpt, pytest.raises(ValueError) as err:
        load_weights(model, ckpt, Precision(), available_bytes=budget)
    message = str(err.value)
    assert "need ~" in message and "GiB is available" in message and "quantization='wint4' needs" in message
    assert all(w.value is None for w in weights)
    with Checkpoint(config.model_path) as ckpt:
        load_weights(model, ckpt, Precision("wint4"), available_bytes=budget)  # fits
    assert sum(w.value.nbytes for w in weights) == need["wint4"]  # the plan's estimate is exact
    assert {w.value.fmt for w in weights} == {"int4", "int8", "fp32"}  # layers, vocabulary table, f32 router
    with Checkpoint(config.model_path) as ckpt, pytest.raises(ValueError, match="no supported quantization fits"):
        load_weights(build("ernie45_moe_tiny_hf")[1], ckpt, Precision("wint4"), available_bytes=RUNTIME_BYTES)


def test_tensor_parallel_ranks_count_all_ranks_weights() -> None:
    config, model = build("qwen2_tiny", TPGroup(0, 2))
    with Checkpoint(config.model_path) as ckpt:
        plan_loading(model, ckpt)
    one_rank = weights_bytes(packed_parameters(model), Precision())
    with Checkpoint(config.model_path) as ckpt, pytest.raises(ValueError, match="need ~"):
        load_weights(model, ckpt, Precision(), available_bytes=RUNTIME_BYTES + int(one_rank * 1.5), tp_size=2)
    with Checkpoint(config.model_path) as ckpt:
        load_weights(model, ckpt, Precision(), available_bytes=RUNTIME_BYTES + int(one_rank * 2.5), tp_size=2)


RSS_SCRIPT = """
import json, resource, sys
from fastdeploy import ops
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.load import load_model
from fastdeploy.model_executor.weight_format import weight_bytes
ops.library()  # build/register the compiled ops before measuring
config = ModelConfig.from_pretrained(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = load_model(config, quantization=None if sys.argv[2] == "none" else sys.argv[2])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "peak": peak, "weights": weight_bytes(model)}))
"""
MARGIN = 64 << 20  # Python objects, allocator slack, the pages of the tensor being packed


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ERNIE-4.5-MoE-shaped random checkpoint of ~270 MB (bf16), written by the benchmarks' writer."""
    sys.path.insert(0, str(ROOT / "tools"))
    from random_checkpoint import ModelShape, write_checkpoint

    shape = ModelShape("ernie_moe", vocab=32000, hidden=1024, layers=4, heads=8, kv_heads=2, head_dim=128,
                       ffn=4096, experts=16, top_k=4, expert_ffn=512, shared_experts=2)
    out = tmp_path_factory.mktemp("medium") / "ernie-moe-medium"
    write_checkpoint(out, shape, shape.layers, progress=False)
    return out


@pytest.mark.parametrize("quantization", ["none", "wint4"])
def test_loading_peak_memory_is_the_packed_weights(medium_checkpoint: Path, quantization: str) -> None:
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(medium_checkpoint), quantization],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    files = sum(f.stat().st_size for f in medium_checkpoint.glob("*.safetensors"))
    assert files > 250e6
    grew = r["peak"] - r["before"]
    assert grew <= r["weights"] + MARGIN, (grew / 2**20, r["weights"] / 2**20)
    if quantization == "wint4":
        assert r["weights"] < files / 3  # int4 experts: about a quarter of bf16
