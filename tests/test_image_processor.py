"""ERNIE-4.5-VL image preprocessing against transformers' Ernie4_5_VLMoeImageProcessorPil
(tools/make_vl_image_reference.py recorded its outputs for these synthetic images)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fastdeploy.model_executor.models.ernie4_5_vl.image_processor import (
    ImageProcessorConfig, preprocess_image, smart_resize)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_vl_image_reference import synthetic_image  # noqa: E402

REF = json.loads((ROOT / "tests/fixtures/reference/ernie45_vl_image_processor.json").read_text())["cases"]


@pytest.mark.parametrize("case", REF, ids=lambda c: f"{c['width']}x{c['height']}-{c['mode']}")
def test_patches_and_grid_equal_the_reference_processor(case):
    image = synthetic_image(case["width"], case["height"], case["mode"], case["seed"])
    patches, grid = preprocess_image(image, ImageProcessorConfig(**case["overrides"]))
    assert list(grid) == case["grid_thw"]
    assert list(patches.shape) == case["shape"] and patches.dtype == np.float32
    flat = patches.reshape(-1).astype(np.float64)
    np.testing.assert_allclose(flat[case["positions"]], case["values"], rtol=0, atol=1e-5)
    assert flat.sum() == pytest.approx(case["sum"], abs=1e-5 * flat.size)
    assert np.abs(flat).sum() == pytest.approx(case["abs_sum"], rel=1e-7)


def test_smart_resize_rules():
    assert smart_resize(48, 64, 28, 56 * 56, 28 * 28 * 6177) == (56, 56)
    h, w = smart_resize(2000, 3000, 28, 3136, 200_000)
    assert h % 28 == w % 28 == 0 and h * w <= 200_000 and abs(w / h - 1.5) < 0.1
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 28, 3136, 10**7)


def test_config_from_a_checkpoint_and_overrides(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 1000, "longest_edge": 500_000}, "patch_size": 14, "merge_size": 2}))
    cfg = ImageProcessorConfig.from_pretrained(tmp_path, max_pixels=300_000)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.factor) == (1000, 300_000, 28)
    with pytest.raises(ValueError, match="min_pixels"):
        ImageProcessorConfig.from_pretrained(tmp_path, min_pixels=600_000)
    with pytest.raises(ValueError, match="max_pixels"):
        ImageProcessorConfig.from_pretrained(tmp_path, size=5)
    assert ImageProcessorConfig.from_pretrained(tmp_path / "missing") == ImageProcessorConfig()
