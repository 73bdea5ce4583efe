"""Multi-turn chat with streaming: each answer is printed as it is generated.

    python examples/chat.py [--model DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fastdeploy import LLM, SamplingParams

DEMO_MODEL = Path(__file__).resolve().parent.parent / "models" / "ernie-4.5-demo"
QUESTIONS = ["What does the open function return?", "And how do I close it again?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL))
    args = parser.parse_args()
    llm = LLM(model=args.model, max_model_len=1024)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, seed=1)

    conversation = [{"role": "system", "content": "You answer questions about Python."}]
    for question in QUESTIONS:
        conversation.append({"role": "user", "content": question})
        print(f"User: {question}\nAssistant: ", end="", flush=True)
        answer = ""
        for chunk in llm.chat(conversation, params, use_tqdm=False, stream=True):
            delta = chunk[0]
            if delta is not None:
                answer += delta.outputs.text
                print(delta.outputs.text, end="", flush=True)
        print("\n")
        conversation.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    main()
