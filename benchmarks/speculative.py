"""Speculative decoding (ngram or MTP) against plain decoding: output tok/s and the drafts' acceptance, same run.

    .venv/bin/python benchmarks/speculative.py                                  # the demo model, 1/16/64 streams
    .venv/bin/python benchmarks/speculative.py --model PATH --quantization wint4 --streams 1 --json out.json
    .venv/bin/python benchmarks/speculative.py --method mtp --num-speculative-tokens 1 --random ernie-4.5-21b-a3b \
        --layers 4 --quantization wint4 --streams 1 --workloads fresh   # MTP's cost per step (random: no draft kept)

Workloads, with a fixed number of output tokens (no EOS):
  copy     prompts whose answer repeats their context: a passage of real prose (paragraphs of this repository's
           docs/*.md) followed by its first words again, so a model that continues the text copies it (greedy;
           tools/train_copy_model.py makes a demo model that does)
  fresh    random token ids, greedy: nothing in the prompt to copy, though a model's greedy output may loop
  sampled  random token ids, sampled at temperature 1 (seeded, so the same tokens with and without speculation):
           an output that seldom repeats itself, what drafting costs when its drafts fail
`--llama-bin DIR --gguf FILE` also runs llama.cpp on the copy workload at one stream, the same model and format in
GGUF: plain decode, `llama-lookup` and llama-server's n-gram speculation modes, k drafts (llama_cpp_ngram.py),
decode tok/s against ours measured the same way (after the first token).
`--random SHAPE --layers N` writes (once, into benchmarks/.cache) a random checkpoint of that shape cut to N layers,
with an MTP layer (tools/random_checkpoint.py). Each (workload, streams) pair runs plain and with
speculative_config alternately, --repeats times each, on one LLM per setting; the best of each is reported with the
ratio and the accepted share of the drafts (one stream: decode tok/s after the first token; more: output tok/s);
"paired ratio" is the median over the repeats of each speculative run's rate over the plain run just before it,
which a machine whose speed drifts between runs moves less than the ratio of the bests. `--control` adds a second
plain LLM to the rotation and prints its paired ratio to the first: how far apart two identical instances run on
this machine, the resolution of the other ratios.
`--speculative-config JSON` replaces the config built from --method and --num-speculative-tokens (e.g. MTP with
"mtp_strategy": "with_ngram"). Prints the kernels' ISA: compare figures only between runs on the same
kind of machine.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tools"))

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.ops.build import runtime_info  # noqa: E402
import llama_cpp_ngram  # noqa: E402
from random_checkpoint import SHAPES, write_checkpoint  # noqa: E402


def passages(min_chars: int = 300, max_chars: int = 700) -> list[str]:
    """Paragraphs of prose from docs/*.md (no tables, code or headings), longest first, cut to max_chars."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for block in re.split(r"\n\s*\n", path.read_text()):
            if len(block) >= min_chars and not re.match(r"\s*([|#`-]|\d+\.)", block):
                found.append(" ".join(block.split())[:max_chars])
    return sorted(found, key=len, reverse=True)


def prompts(workload: str, n: int, seed: int, vocab: int) -> list[dict | str]:
    if workload == "copy":
        texts = passages()
        return [f"{t}\n\n{' '.join(t.split()[:8])}" for t in (texts[i % len(texts)] for i in range(n))]
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, size=128).tolist()} for _ in range(n)]


def decode_rate(outputs: list) -> float:
    """One stream's decode tok/s after its first token (what llama.cpp's figures count)."""
    (o,) = outputs
    return (len(o.outputs.token_ids) - 1) / (o.metrics.model_forward_time - o.metrics.first_token_time)


def run(llm: LLM, batch: list, max_tokens: int, workload: str) -> tuple[float, int, int]:
    if workload == "sampled":
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
                  for i in range(len(batch))]
    else:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    failed = [o.error_msg for o in outputs if o.error_code != 200]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")
    tokens = sum(len(o.outputs.token_ids) for o in outputs)
    rate = decode_rate(outputs) if len(outputs) == 1 else tokens / seconds
    return rate, sum(o.metrics.num_draft_tokens for o in outputs), sum(o.metrics.num_accepted_tokens for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "ernie-4.5-demo"))
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--workloads", default="copy,fresh,sampled")
    parser.add_argument("--method", choices=("ngram", "mtp"), default="ngram")
    parser.add_argument("--random", choices=sorted(SHAPES), help="a random checkpoint of this shape, with an MTP layer")
    parser.add_argument("--layers", type=int, default=4, help="with --random: its depth")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--control", action="store_true", help="a second plain LLM, to show the instances' spread")
    parser.add_argument("--speculative-config", type=json.loads, help="the whole speculative_config, as JSON")
    parser.add_argument("--llama-bin", type=Path, help="llama.cpp's build/bin (llama-bench, llama-lookup, llama-server)")
    parser.add_argument("--gguf", type=Path, help="with --llama-bin: the same model as GGUF")
    parser.add_argument("--json", type=Path, help="append the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = args.speculative_config or {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    args.method, args.num_speculative_tokens = spec["method"], spec.get("num_speculative_tokens", 4)
    if args.random:
        args.model = str(ROOT / "benchmarks" / ".cache" / f"{args.random}-{args.layers}l-mtp")
        write_checkpoint(Path(args.model), SHAPES[args.random], args.layers, mtp=True)
    streams = [int(s) for s in args.streams.split(",")]
    common = dict(model=args.model, quantization=args.quantization, max_model_len=args.max_model_len,
                  max_num_seqs=max(streams))
    llms = {"plain": LLM(**common), "spec": LLM(**common, speculative_config=spec)}
    if args.control:
        llms["control"] = LLM(**common)
    vocab = llms["plain"].engine.vocab_size
    rt = runtime_info()
    print(f"kernels {rt['active_isa']} of {rt['detected_isa']}, {rt['num_threads']} threads; model {args.model} "
          f"({args.quantization or 'as stored'}); {args.max_tokens} output tokens; speculative_config {spec}")
    rows = []
    cases = [(w, s) for w in args.workloads.split(",") for s in streams]
    with tqdm(total=len(cases) * args.repeats * len(llms), desc="runs") as bar:
        for workload, n in cases:
            batch = prompts(workload, n, seed=n, vocab=vocab)
            for llm in llms.values():  # warm-up
                run(llm, batch[:1], 8, workload)
            rates: dict[str, list[float]] = {name: [] for name in llms}
            drafted = accepted = 0
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    rate, d, a = run(llm, batch, args.max_tokens, workload)
                    rates[name].append(rate)
                    if name == "spec":
                        drafted, accepted = d, a
                    bar.update()
            paired = float(np.median(np.divide(rates["spec"], rates["plain"])))
            rows.append(dict(workload=workload, streams=n, plain=max(rates["plain"]), spec=max(rates["spec"]),
                             paired=paired, method=args.method, drafted=drafted, accepted=accepted,
                             isa=rt["active_isa"], model=args.model, quantization=args.quantization))
            if args.control:
                rows[-1]["control"] = float(np.median(np.divide(rates["control"], rates["plain"])))
            if args.llama_bin and workload == "copy" and n == 1:
                rows[-1]["llama"] = llama_cpp_ngram.best_of(args.llama_bin, args.gguf, batch[0], args.max_tokens,
                                                            args.num_speculative_tokens, args.repeats)
    control = " control paired |" if args.control else ""
    print(f"| workload | streams | plain tok/s | {args.method} tok/s | ratio | paired ratio | drafts accepted |{control}")
    print("|---|---|---|---|---|---|---|" + "---|" * bool(control))
    for r in rows:
        share = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "no drafts"
        print(f"| {r['workload']} | {r['streams']} | {r['plain']:.1f} | {r['spec']:.1f} | "
              f"{r['spec'] / r['plain']:.2f}x | {r['paired']:.2f}x | {share} |"
              + (f" {r['control']:.2f}x |" if "control" in r else ""))
    for r in (r for r in rows if "llama" in r):
        print("llama.cpp, copy, one stream, decode tok/s (best of each): " + ", ".join(
            f"{mode} {m['rate']:.1f}" + (f" ({m['accepted']}/{m['drafted']} drafts accepted)" if m["drafted"] else "")
            for mode, m in r["llama"].items()))
        top = max(r["llama"], key=lambda mode: r["llama"][mode]["rate"])
        print(f"ours with {args.method}: {r['spec']:.1f} tok/s, {r['spec'] / r['llama'][top]['rate']:.2f}x "
              f"llama.cpp's best ({top})")
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(rows) + "\n")


if __name__ == "__main__":
    main()
