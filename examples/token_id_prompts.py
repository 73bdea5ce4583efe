"""Prompts given as token ids, and per-prompt sampling parameters, with logprobs.

    python examples/token_id_prompts.py [--model DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fastdeploy import LLM, SamplingParams

DEMO_MODEL = Path(__file__).resolve().parent.parent / "models" / "ernie-4.5-demo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL))
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=512)
    tokenizer = llm.get_tokenizer()

    prompts = [
        tokenizer.encode("The import statement"),                       # one tokenized prompt
        {"prompt_token_ids": tokenizer.encode("A tuple is")},           # the dict form
        {"prompt": "Strings can be"},                                    # text in the dict form
    ]
    per_prompt = [
        SamplingParams(temperature=0, max_tokens=24),                    # greedy
        SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=3),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, logprobs=2, stop=["."]),
    ]
    for out in llm.generate(prompts, per_prompt, use_tqdm=False):
        print(f"[{out.outputs.index}] {tokenizer.decode(out.prompt_token_ids)!r} -> {out.outputs.text!r} "
              f"({out.outputs.finish_reason}, stop_reason={out.outputs.stop_reason!r})")
        if out.outputs.logprobs:
            first = out.outputs.logprobs[0]
            print("    first token candidates:",
                  {lp.decoded_token: round(lp.logprob, 3) for lp in sorted(first.values(), key=lambda lp: lp.rank)})


if __name__ == "__main__":
    main()
