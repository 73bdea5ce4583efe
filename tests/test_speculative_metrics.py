"""Speculative decoding's metrics in /metrics (FastDeploy's `fastdeploy:spec_decode_*`): a server on the demo model
with n-gram drafts answers greedy requests whose output repeats itself. Its counters then hold exactly the
acceptances the requests' streams show (each step emits its accepted drafts and one token of the model's own),
more drafts than that, the outputs' tokens as emitted, and the rate is accepted / drafted. Without a
speculative_config none of them exists (tests/test_metrics.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

from fastdeploy import LLM, SamplingParams
from tests.test_api_server import MAX_MODEL_LEN, ROOT, TIMEOUT_S, Server
from tests.test_metrics import SPECULATIVE, documented, exported_families, scrape

DEMO = ROOT / "models" / "ernie-4.5-demo"
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = ["The list type is a mutable sequence type. The list type", "class C:\n    def __init__(self, value):\n"]
MAX_TOKENS = 40


@dataclass(frozen=True)
class Run:
    """One greedy request run alone by LLM.generate(stream=True) under SPEC."""

    prompt_token_ids: list[int]
    text: str


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    llm = LLM(model=str(DEMO), max_model_len=MAX_MODEL_LEN, speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[str, Run] = {}
    for prompt in PROMPTS:
        deltas = [items[0] for items in llm.generate([prompt], params, stream=True, use_tqdm=False)
                  if items[0] is not None]
        counts = [(d.metrics.num_draft_tokens, d.metrics.num_accepted_tokens) for d in deltas]
        assert counts == sorted(counts) and deltas[-1].finished  # every delta carries the running counts
        assert sum(len(d.outputs.token_ids) for d in deltas) == MAX_TOKENS
        assert len(deltas) + counts[-1][1] == MAX_TOKENS  # a delta per step: its accepted drafts and one more
        out[prompt] = Run(deltas[0].prompt_token_ids, "".join(d.outputs.text for d in deltas))
    return out


@pytest.fixture(scope="module")
def server():
    s = Server(str(DEMO), "--speculative-config", json.dumps(SPEC))
    yield s
    assert s.stop() == 0


def complete(server: Server, run: Run) -> str:
    r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                   json={"prompt": run.prompt_token_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return r.json()["choices"][0]["text"]


def complete_streamed(server: Server, run: Run) -> tuple[str, int]:
    """The streamed text and the number of steps: with return_token_ids every step sends a chunk (its accepted
    drafts and one token more), even when its text is held back."""
    text, steps = [], 0
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                      json={"prompt": run.prompt_token_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    text.append(choice["text"])
                    steps += bool(choice.get("completion_token_ids"))
    return "".join(text), steps


def test_registered_with_a_speculative_config(server: Server) -> None:
    exported = exported_families(server)
    assert exported == documented(speculative=True)
    assert sorted(name for name in exported if name.startswith(SPECULATIVE)) == [
        "fastdeploy:spec_decode_draft_acceptance_rate", "fastdeploy:spec_decode_num_accepted_tokens_total",
        "fastdeploy:spec_decode_num_draft_tokens_total", "fastdeploy:spec_decode_num_emitted_tokens_total"]
    _, samples = scrape(server)  # registered from the start, before any request (the first test here)
    assert [v for k, v in samples.items() if k.startswith(SPECULATIVE) and not k.endswith("_created")] == [0] * 4


def test_counts_are_the_requests_drafts_and_acceptances(server: Server, runs: dict[str, Run]) -> None:
    """How many drafts a step verifies follows measured step times (the scheduler drafts what pays), so a
    request's counts are read from its own stream: each step emits its accepted drafts and one token more."""
    _, before = scrape(server)
    streamed = [runs[PROMPTS[0]], runs[PROMPTS[1]]]
    steps = []
    for run in streamed:
        text, n = complete_streamed(server, run)
        assert text == run.text  # the same tokens as LLM.generate gave
        steps.append(n)
    _, middle = scrape(server)
    assert complete(server, runs[PROMPTS[0]]) == runs[PROMPTS[0]].text  # counted when its output arrives
    _, after = scrape(server)

    def grew(name: str, start: dict = before, end: dict = middle) -> float:
        return end[f"fastdeploy:{name}"] - start[f"fastdeploy:{name}"]

    accepted = len(streamed) * MAX_TOKENS - sum(steps)
    assert 0 < accepted == grew("spec_decode_num_accepted_tokens_total") < grew("spec_decode_num_draft_tokens_total")
    assert grew("spec_decode_num_emitted_tokens_total") == grew("generation_tokens_total") == len(streamed) * MAX_TOKENS
    whole = {name: grew(name, middle, after) for name in ("spec_decode_num_accepted_tokens_total",
                                                         "spec_decode_num_draft_tokens_total",
                                                         "spec_decode_num_emitted_tokens_total")}
    assert 0 < whole["spec_decode_num_accepted_tokens_total"] <= whole["spec_decode_num_draft_tokens_total"]
    assert whole["spec_decode_num_emitted_tokens_total"] == MAX_TOKENS
    # The rate is over everything since the server started.
    total_accepted = after["fastdeploy:spec_decode_num_accepted_tokens_total"]
    total_drafted = after["fastdeploy:spec_decode_num_draft_tokens_total"]
    assert after["fastdeploy:spec_decode_draft_acceptance_rate"] == total_accepted / total_drafted
