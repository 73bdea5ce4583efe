"""Offline inference demo: LLM.generate with several prompts and LLM.chat with two conversations.

    python examples/offline_inference.py                 # the bundled demo model
    python examples/offline_inference.py --model DIR     # any local checkpoint directory
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from fastdeploy import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "models" / "ernie-4.5-demo"

PROMPTS = [
    "The list type",
    "To open a file for reading,",
    "A dictionary maps",
    "Exceptions are raised when",
]
CONVERSATIONS = [
    [{"role": "user", "content": "How do I read a file line by line?"}],
    [{"role": "system", "content": "You are a helpful Python tutor."},
     {"role": "user", "content": "What is a generator?"}],
]


def show(outputs) -> None:
    for out in outputs:
        m = out.metrics
        print(f"--- prompt: {out.prompt!r}")
        print(f"    text:   {out.outputs.text!r}")
        print(f"    tokens: {len(out.prompt_token_ids)} in, {len(out.outputs.token_ids)} out, "
              f"finish_reason={out.outputs.finish_reason}, time to first token "
              f"{m.inference_start_time + m.first_token_time - m.arrival_time:.3f} s, total {m.model_execute_time:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL), help="checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    llm = LLM(model=args.model, max_model_len=1024, max_num_seqs=8)
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.15, max_tokens=args.max_tokens, seed=0)

    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    show(outputs)
    generated = sum(len(o.outputs.token_ids) for o in outputs)
    print(f"generate: {generated} tokens in {time.perf_counter() - start:.2f} s "
          f"({generated / (time.perf_counter() - start):.1f} tokens/s)\n")

    start = time.perf_counter()
    outputs = llm.chat(CONVERSATIONS, params, chat_template_kwargs={"enable_thinking": False})
    show(outputs)
    generated = sum(len(o.outputs.token_ids) for o in outputs)
    print(f"chat: {generated} tokens in {time.perf_counter() - start:.2f} s "
          f"({generated / (time.perf_counter() - start):.1f} tokens/s)")


if __name__ == "__main__":
    main()
