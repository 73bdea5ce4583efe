"""Speculative decoding's metrics in /metrics (FastDeploy's `fastdeploy:spec_decode_*`): a server on the demo model
with n-gram drafts answers greedy requests whose output repeats itself. Its counters then hold exactly the drafts
and acceptances LLM.generate reports for the same requests run alone, the emitted tokens are the outputs' tokens
(each step's accepted drafts and one token of the model's own), and the rate is accepted / drafted. Without a
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
    drafted: int
    accepted: int
    steps: int  # stream deltas: one per step, each emitting the step's accepted drafts and one token more


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
        out[prompt] = Run(deltas[0].prompt_token_ids, "".join(d.outputs.text for d in deltas), *counts[-1],
                          steps=len(deltas))
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


def complete_streamed(server: Server, run: Run) -> str:
    text = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                      json={"prompt": run.prompt_token_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[len("data: "):])["choices"]]
    return "".join(text)


def test_registered_with_a_speculative_config(server: Server) -> None:
    exported = exported_families(server)
    assert exported == documented(speculative=True)
    assert sorted(name for name in exported if name.startswith(SPECULATIVE)) == [
        "fastdeploy:spec_decode_draft_acceptance_rate", "fastdeploy:spec_decode_num_accepted_tokens_total",
        "fastdeploy:spec_decode_num_draft_tokens_total", "fastdeploy:spec_decode_num_emitted_tokens_total"]
    _, samples = scrape(server)  # registered from the start, before any request (the first test here)
    assert [v for k, v in samples.items() if k.startswith(SPECULATIVE) and not k.endswith("_created")] == [0] * 4


def test_counts_are_the_requests_drafts_and_acceptances(server: Server, runs: dict[str, Run]) -> None:
    _, before = scrape(server)
    sent = [runs[PROMPTS[0]], runs[PROMPTS[1]]]
    for run in sent:
        assert complete(server, run) == run.text  # the same tokens, so the same drafts
    sent.append(runs[PROMPTS[0]])
    assert complete_streamed(server, sent[-1]) == sent[-1].text  # counted delta by delta
    _, after = scrape(server)

    def grew(name: str) -> float:
        return after[f"fastdeploy:{name}"] - before[f"fastdeploy:{name}"]

    drafted, accepted = sum(r.drafted for r in sent), sum(r.accepted for r in sent)
    assert 0 < accepted < drafted  # the demo model repeats itself: most drafts are right, not all
    assert grew("spec_decode_num_draft_tokens_total") == drafted
    assert grew("spec_decode_num_accepted_tokens_total") == accepted
    emitted = grew("spec_decode_num_emitted_tokens_total")
    assert emitted == grew("generation_tokens_total") == len(sent) * MAX_TOKENS == accepted + sum(r.steps for r in sent)
    # The rate is over everything since the server started.
    total_accepted = after["fastdeploy:spec_decode_num_accepted_tokens_total"]
    total_drafted = after["fastdeploy:spec_decode_num_draft_tokens_total"]
    assert after["fastdeploy:spec_decode_draft_acceptance_rate"] == total_accepted / total_drafted
