"""Reference outputs of transformers' ERNIE-4.5-VL image processor for tests/test_image_processor.py.

    /work/refenv/bin/python tools/make_vl_image_reference.py    # a Python with transformers + pillow

Each case is a synthetic image (`synthetic_image`: numpy noise over a gradient, in a PIL mode, with a
seed) and optional min/max_pixels; the file records the processor's grid, the patches' shape, sums and
256 values at seeded positions (the full arrays would be megabytes).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference" / "ernie45_vl_image_processor.json"
CASES = [  # (width, height, mode, seed, processor overrides)
    (64, 48, "RGB", 0, {}),
    (1, 1, "RGB", 1, {}),
    (300, 5, "RGB", 2, {}),
    (100, 37, "RGBA", 3, {}),
    (333, 500, "L", 4, {}),
    (900, 700, "RGB", 5, {"max_pixels": 200_000}),
    (30, 40, "RGB", 6, {"min_pixels": 100_000}),
    (1280, 720, "P", 7, {}),
]
SAMPLES = 256


def synthetic_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    ramp = np.add.outer(np.linspace(0, 120, height), np.linspace(0, 120, width))
    pixels = np.clip(ramp[..., None] + rng.integers(0, 136, (height, width, 4)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGBA")
    return image if mode == "RGBA" else image.convert("RGB").convert(mode)


def summary(patches: np.ndarray, seed: int) -> dict:
    flat = patches.reshape(-1).astype(np.float64)
    picks = np.random.default_rng(seed).integers(0, flat.size, SAMPLES)
    return {"shape": list(patches.shape), "sum": float(flat.sum()), "abs_sum": float(np.abs(flat).sum()),
            "positions": picks.tolist(), "values": flat[picks].tolist()}


def main() -> None:
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil)

    cases = []
    for width, height, mode, seed, overrides in CASES:
        size = {"shortest_edge": overrides.get("min_pixels", 56 * 56),
                "longest_edge": overrides.get("max_pixels", 28 * 28 * 6177)}
        out = Ernie4_5_VLMoeImageProcessorPil(size=size)(synthetic_image(width, height, mode, seed))
        cases.append({"width": width, "height": height, "mode": mode, "seed": seed, "overrides": overrides,
                      "grid_thw": np.asarray(out["image_grid_thw"]).tolist()[0],
                      **summary(np.asarray(out["pixel_values"]), seed)})
    OUT.write_text(json.dumps({"processor": "Ernie4_5_VLMoeImageProcessorPil", "cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
