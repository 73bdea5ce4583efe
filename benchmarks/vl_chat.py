"""Image and video chat on an ERNIE-4.5-VL-28B-A3B-shaped model with random weights:

    .venv/bin/python benchmarks/vl_chat.py --layers 4 [--formats bf16,wint8,wint4] [--video-frames 30] [--json F]

The checkpoint (tools/random_checkpoint.py; --layers cuts the text depth, the vision tower keeps its 32
blocks) is written to benchmarks/.cache/ on first use. Per format, in its own process:
- image: one 448x448 image and a short question; time to first token (the whole call: preprocessing,
  vision encoder, prefill, first sample), of which the vision encoder's share, then decode tok/s over
  64 more tokens;
- video: `--video-frames` pre-decoded 448x448 frames (resized by the model's video processor settings,
  so each frame pair becomes one temporal patch grid); time to first token and the encoder's share.
Greedy, fixed lengths (ignore_eos).
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from large_models import CACHE, FORMATS, isa  # noqa: E402
from random_checkpoint import SHAPES, write_checkpoint  # noqa: E402

MODEL = "ernie-4.5-vl-28b-a3b"
DECODE_TOKENS = 64
QUESTION = "Describe what you see in detail."


def _timed_encoder(model) -> list[float]:
    """Wrap the model's vision encoder so every call's seconds are appended to the returned list."""
    seconds: list[float] = []
    encode = model.encode_vision

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = encode(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out

    model.encode_vision = timed
    return seconds


def run_child(ckpt: str, fmt: str, video_frames: int) -> dict:
    from fastdeploy import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=ckpt, quantization=FORMATS[fmt], max_model_len=32768, enable_prefix_caching=False)
    result: dict = {"load_s": time.perf_counter() - start}
    encoder_s = _timed_encoder(llm.engine.runner.model)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))
    frames = rng.integers(0, 256, (video_frames, 448, 448, 3), dtype=np.uint8)
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True, detokenize=False)
    warm = [{"role": "user", "content": [{"type": "image", "image": image.crop((0, 0, 56, 56))}, {"type": "text", "text": "hi"}]}]
    llm.chat(warm, SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
    for name, part in (("image", {"type": "image", "image": image}), ("video", {"type": "video", "video": frames})):
        encoder_s.clear()
        conversation = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
        t0 = time.time()
        out = llm.chat(conversation, params if name == "image" else SamplingParams(
            temperature=0, max_tokens=1, detokenize=False), use_tqdm=False)[0]
        if out.error_code != 200:
            raise RuntimeError(f"{name}: {out.error_msg}")
        m = out.metrics
        entry = {"prompt_tokens": len(out.prompt_token_ids),
                 "vision_tokens": out.num_input_image_tokens + out.num_input_video_tokens,
                 "ttft_s": m.inference_start_time + m.first_token_time - t0, "encoder_s": sum(encoder_s)}
        if name == "image":
            entry["decode_tok_s"] = DECODE_TOKENS / (m.model_forward_time - m.first_token_time)
        result[name] = entry
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="text layers (the vision tower stays whole)")
    parser.add_argument("--formats", default="bf16,wint8,wint4")
    parser.add_argument("--video-frames", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        logging.disable(logging.WARNING)
        print(json.dumps(run_child(args.child[0], args.child[1], int(args.child[2]))))
        return
    shape = SHAPES[MODEL]
    ckpt = CACHE / f"{MODEL}-{args.layers}l"
    write_checkpoint(ckpt, shape, args.layers)
    print(f"# {MODEL}, {args.layers} of {shape.layers} text layers, vision tower whole; {isa()}", flush=True)
    results = {}
    for fmt in [f for f in args.formats.split(",") if f]:
        done = subprocess.run([sys.executable, __file__, "--child", str(ckpt), fmt, str(args.video_frames)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{fmt}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        r = results[fmt] = json.loads(done.stdout.strip().splitlines()[-1])
        i, v = r["image"], r["video"]
        print(f"{fmt:6s} load {r['load_s']:5.1f} s  image ({i['vision_tokens']} tokens): TTFT {i['ttft_s']:6.2f} s "
              f"(encoder {i['encoder_s']:6.2f} s), decode {i['decode_tok_s']:5.1f} tok/s  video "
              f"({args.video_frames} frames, {v['vision_tokens']} tokens): TTFT {v['ttft_s']:7.2f} s (encoder "
              f"{v['encoder_s']:7.2f} s)  peak RSS {r['peak_rss_gib']:5.2f} GiB", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": MODEL, "layers": args.layers, "isa": isa(),
                                         "video_frames": args.video_frames, "results": results}, indent=2))


if __name__ == "__main__":
    main()
