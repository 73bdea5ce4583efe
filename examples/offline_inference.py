"""Offline inference demo: LLM.generate with several prompts, LLM.chat with two conversations, and one stream
with speculative decoding (the checkpoint's MTP layer drafting; ngram for a checkpoint without one).

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
          f"({generated / (time.perf_counter() - start):.1f} tokens/s)\n")

    speculation(args.model, 4 * args.max_tokens)


def speculation(model: str, max_tokens: int) -> None:
    """The same greedy stream without and with speculative decoding: same text, fewer steps."""
    prompt, params = "The list type", SamplingParams(temperature=0, max_tokens=max_tokens)
    plain = LLM(model=model, max_model_len=1024, max_num_seqs=1)
    try:
        spec = {"method": "mtp", "num_speculative_tokens": 1}
        drafting = LLM(model=model, max_model_len=1024, max_num_seqs=1, speculative_config=spec)
    except ValueError:  # no MTP layer in this checkpoint
        spec = {"method": "ngram", "num_speculative_tokens": 4}
        drafting = LLM(model=model, max_model_len=1024, max_num_seqs=1, speculative_config=spec)
    timed = []
    for llm in (plain, drafting):
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        timed.append((out, time.perf_counter() - start))
    (base, base_s), (out, spec_s) = timed
    m = out.metrics
    print(f"speculative decoding {spec}: the same {len(out.outputs.token_ids)} tokens "
          f"({out.outputs.token_ids == base.outputs.token_ids}); {m.num_accepted_tokens} of {m.num_draft_tokens} "
          f"drafts accepted ({m.num_accepted_tokens / max(m.num_draft_tokens, 1):.0%}); "
          f"{len(base.outputs.token_ids) / base_s:.0f} -> {len(out.outputs.token_ids) / spec_s:.0f} tokens/s")


if __name__ == "__main__":
    main()
