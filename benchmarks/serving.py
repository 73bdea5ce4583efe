"""Serving benchmark: streamed completions against any OpenAI-compatible server, next to offline generate.

    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8180/v1
    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:8180/v1 --offline /path/to/model \
        --concurrency 1,16,64 --json results.json
    .venv/bin/python benchmarks/serving.py --offline /path/to/model --concurrency 1,4   # no server

Workload, the same for every concurrency level and for --offline: --num-requests prompts per level
(default max(2 x concurrency, 8): at least two full waves) of exactly --prompt-len random token ids
(numpy, --seed; ids in [--vocab-low, --vocab-high); fresh prompts per level so no prefix cache helps),
sent to /v1/completions as token-id lists so the length is exact on any server; greedy, exactly
--output-len output tokens (max_tokens plus the vLLM/FastDeploy extras ignore_eos and min_tokens;
--no-ignore-eos leaves them out). An asyncio semaphore keeps `concurrency` requests in flight; each is
streamed with stream_options.include_usage after one warm-up request, and the client records:
  TTFT    send -> first chunk carrying a token (text, or for a server that streams a chunk per token
          with empty text, as llama-server does for tokens that decode to nothing, the chunk itself)
  ITL     gaps between consecutive such chunks (a chunk with several tokens is one gap)
  tokens  usage.completion_tokens of the final chunk (else the number of such chunks)
Per level: requests ok / failed (the first error is printed), wall time (first send -> last response),
output tok/s = completion tokens / wall, requests/s, TTFT and ITL p50/p99 in ms.

--offline MODEL runs the same prompts through LLM.generate(stream=True) in this process, one
LLM(max_num_seqs=concurrency, **--offline-kwargs) per level after a short warm-up. The client's semaphore
is emulated: the first `concurrency` requests (in the order of their first tokens) are sent at the start,
each later one when an earlier one finishes, all in the times the stream's consumer sees, so TTFT and ITL
mean what they mean for the server. Start the server with the same settings, and stop it (or leave it
idle) during the offline runs: they share the cores.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from large_models import isa  # a sibling script: benchmarks/ is sys.path[0]

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sample:
    """One request as the client saw it (seconds)."""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def make_prompts(rng: np.random.Generator, count: int, args: argparse.Namespace) -> list[list[int]]:
    return rng.integers(args.vocab_low, args.vocab_high, size=(count, args.prompt_len)).tolist()


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.error is None]
    errors = [s.error for s in samples if s.error is not None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    gaps = [g for s in ok for g in s.gaps]
    tokens = sum(s.tokens for s in ok)
    return {"ok": len(ok), "failed": len(errors), "first_error": errors[0] if errors else None,
            "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "req_s": len(ok) / wall,
            "ttft_p50_ms": ms(ttfts, 50), "ttft_p99_ms": ms(ttfts, 99),
            "itl_p50_ms": ms(gaps, 50), "itl_p99_ms": ms(gaps, 99)}


# ---- server ---------------------------------------------------------------------------------
async def stream_one(client, model: str, prompt: list[int], args: argparse.Namespace, sample: Sample) -> None:
    extra = {} if args.no_ignore_eos else {"ignore_eos": True, "min_tokens": args.output_len}
    sent, last, chunks, usage = time.perf_counter(), None, 0, None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=args.output_len, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    async with stream:  # closes the connection if the timeout cancels us
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            # A chunk per token, text or not; not the closing one (finish_reason alone) or a usage-only one.
            if any(c.text or c.finish_reason is None for c in chunk.choices):
                if last is None:
                    sample.ttft = now - sent
                else:
                    sample.gaps.append(now - last)
                last, chunks = now, chunks + 1
    sample.tokens = usage if usage is not None else chunks


async def one_request(client, model: str, prompt: list[int], args: argparse.Namespace,
                      slots: asyncio.Semaphore) -> Sample:
    async with slots:
        sample = Sample()
        try:
            await asyncio.wait_for(stream_one(client, model, prompt, args, sample), args.timeout)
        except Exception as e:  # noqa: BLE001 - counted and reported per level
            sample = Sample(error=f"{type(e).__name__}: {e}"[:300])
        return sample


async def run_server(args: argparse.Namespace, levels: list[tuple[int, list[list[int]]]],
                     warmup: list[int]) -> tuple[str, list[dict]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, timeout=args.timeout, max_retries=0)
    try:
        model = args.model or (await asyncio.wait_for(client.models.list(), args.timeout)).data[0].id
        first = await one_request(client, model, warmup, args, asyncio.Semaphore(1))
        if first.error:
            hint = "" if args.no_ignore_eos or "BadRequest" not in first.error else \
                "\n(a server refusing the ignore_eos / min_tokens extras needs --no-ignore-eos)"
            raise SystemExit(f"warm-up request failed: {first.error}{hint}")
        results = []
        for concurrency, prompts in levels:
            slots = asyncio.Semaphore(concurrency)
            bar = tqdm(total=len(prompts), desc=f"server c={concurrency}", dynamic_ncols=True)

            async def tracked(prompt: list[int]) -> Sample:
                sample = await one_request(client, model, prompt, args, slots)
                bar.update()
                return sample

            start = time.perf_counter()
            samples = await asyncio.gather(*(tracked(p) for p in prompts))
            results.append({"mode": "server", "concurrency": concurrency, "num_requests": len(prompts),
                            **summarize(samples, time.perf_counter() - start)})
            bar.close()
        return model, results
    finally:
        await client.close()


# ---- offline --------------------------------------------------------------------------------
def run_offline(args: argparse.Namespace, concurrency: int, prompts: list[list[int]],
                warmup: list[int]) -> dict:
    sys.path.insert(0, str(ROOT))
    from fastdeploy import LLM, SamplingParams

    kwargs = {"max_model_len": max(2048, args.prompt_len + args.output_len), **json.loads(args.offline_kwargs)}
    llm = LLM(model=args.offline, max_num_seqs=concurrency, **kwargs)
    llm.generate([warmup], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    n = len(prompts)
    samples = [Sample() for _ in range(n)]
    first, last, done = [None] * n, [None] * n, [None] * n
    bar = tqdm(total=n, desc=f"offline c={concurrency}", dynamic_ncols=True)
    start = time.perf_counter()
    for step in llm.generate(prompts, params, use_tqdm=False, stream=True):
        now = time.perf_counter()
        for i, out in enumerate(step):
            if out is None:
                continue
            if out.outputs.token_ids:
                if last[i] is None:
                    first[i] = now
                else:
                    samples[i].gaps.append(now - last[i])
                last[i] = now
                samples[i].tokens += len(out.outputs.token_ids)
            if out.finished:
                done[i] = now
                bar.update()
                if out.error_code != 200:
                    samples[i].error = f"{out.error_code}: {out.error_msg}"
    wall = time.perf_counter() - start
    bar.close()
    # Emulated client semaphore: k-th request to start is "sent" when the (k - concurrency)-th one finished.
    finishes = sorted(t for t in done if t is not None)
    for k, i in enumerate(sorted((i for i in range(n) if first[i] is not None), key=lambda i: first[i])):
        sent = start if k < concurrency else finishes[k - concurrency]
        samples[i].ttft = max(0.0, first[i] - sent)
    del llm
    gc.collect()
    return {"mode": "offline", "concurrency": concurrency, "num_requests": n, **summarize(samples, wall)}


# ---- report ---------------------------------------------------------------------------------
COLUMNS = [("mode", "{}"), ("concurrency", "{}"), ("ok", "{}"), ("failed", "{}"), ("wall_s", "{:.2f}"),
           ("output_tok_s", "{:.1f}"), ("req_s", "{:.2f}"), ("ttft_p50_ms", "{:.1f}"), ("ttft_p99_ms", "{:.1f}"),
           ("itl_p50_ms", "{:.1f}"), ("itl_p99_ms", "{:.1f}"), ("vs_offline", "{:.2f}")]


def print_table(results: list[dict], output_len: int) -> None:
    offline = {r["concurrency"]: r["output_tok_s"] for r in results if r["mode"] == "offline"}
    for r in results:
        if r["mode"] == "server" and offline.get(r["concurrency"]):
            r["vs_offline"] = r["output_tok_s"] / offline[r["concurrency"]]
    rows = [[name for name, _ in COLUMNS]]
    rows += [[fmt.format(r[name]) if name in r else "-" for name, fmt in COLUMNS] for r in results]
    widths = [max(len(row[j]) for row in rows) for j in range(len(COLUMNS))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    for r in results:
        if r["failed"]:
            print(f"{r['mode']} c={r['concurrency']}: {r['failed']} failed, first: {r['first_error']}")
        expected = r["ok"] * output_len
        if r["output_tokens"] != expected:
            print(f"{r['mode']} c={r['concurrency']}: {r['output_tokens']} output tokens, not {expected}: "
                  "outputs were not of fixed length (EOS; or the server ignored ignore_eos / min_tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", help="e.g. http://127.0.0.1:8180/v1 (omit to run --offline only)")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--model", help="model name for requests (default: the first id of GET /v1/models)")
    parser.add_argument("--concurrency", default="1,16,64", help="comma list of levels")
    parser.add_argument("--num-requests", type=int, help="per level (default max(2 x concurrency, 8))")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-low", type=int, default=3)
    parser.add_argument("--vocab-high", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (and per HTTP read)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="omit the ignore_eos / min_tokens extras")
    parser.add_argument("--offline", metavar="MODEL_PATH", help="also run the workload through LLM.generate")
    parser.add_argument("--offline-kwargs", default="{}", help='JSON LLM() kwargs, e.g. \'{"quantization": "wint4"}\'')
    parser.add_argument("--json", type=Path, help="append the results here")
    args = parser.parse_args()
    if not args.base_url and not args.offline:
        parser.error("give --base-url, --offline, or both")

    rng = np.random.default_rng(args.seed)
    warmup = make_prompts(rng, 1, args)[0]
    levels = [(c, make_prompts(rng, args.num_requests or max(2 * c, 8), args))
              for c in (int(x) for x in args.concurrency.split(","))]
    results, model = [], args.offline
    if args.base_url:
        model, results = asyncio.run(run_server(args, levels, warmup))
    if args.offline:
        results += [run_offline(args, c, prompts, warmup) for c, prompts in levels]
    print(f"\nmodel {model}, prompt {args.prompt_len} tokens, output {args.output_len} tokens, "
          f"{os.cpu_count()} cpus, {isa()}")
    print_table(results, args.output_len)
    if args.json:
        common = {"base_url": args.base_url, "model": model, "offline_model": args.offline,
                  "prompt_len": args.prompt_len, "output_len": args.output_len, "isa": isa(),
                  "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        old += [{**common, **r} for r in results]
        args.json.write_text(json.dumps(old, indent=2))


if __name__ == "__main__":
    main()
