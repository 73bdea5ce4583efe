"""The `fastdeploy` command (fastdeploy/cli/): its help, `serve` as a real server subprocess, `chat` and
`complete` against it, `run-batch` on a batch file and `collect-env`; every generated text is checked against
LLM.generate / LLM.chat greedy in this process on the same model."""
import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.cli import bench
from fastdeploy.cli.batch_engine import BatchEngine
from fastdeploy.cli.batch_lines import BatchRequest, LineFailure, parse_line
from fastdeploy.cli.main import main
from fastdeploy.ops import runtime_info
from fastdeploy.outputs import CompletionOutput, RequestOutput
from test_api_server import MAX_MODEL_LEN, ROOT, free_port, wait_until_healthy

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PROMPT = "The capital of France is"


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `fastdeploy ARGV` run in this process."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


@pytest.fixture(scope="module")
def llm(tiny_hf: str) -> LLM:
    return LLM(tiny_hf, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(tiny_hf: str):
    """`python -m fastdeploy serve MODEL ...` (the model positional, as `vllm serve MODEL`) on a free port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastdeploy", "serve", tiny_hf, "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()


def test_console_script_help_lists_the_commands():
    script = Path(sys.executable).parent / "fastdeploy"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("serve", "chat", "complete", "bench", "run-batch", "collect-env"):
        assert command in result.stdout


@pytest.mark.parametrize("argv, flags", [
    (["serve"], ["[MODEL]", "--model", "--port", "--host", "--api-key", "--max-model-len", "--tensor-parallel-size"]),
    (["chat"], ["--url", "--model", "--api-key", "--system-prompt", "--quick"]),
    (["complete"], ["--url", "--model", "--api-key", "--prompt", "--quick"]),
    (["bench"], ["latency", "throughput", "serve"]),
    (["run-batch"], ["--input-file", "--output-file", "--model", "--max-model-len", "--quantization"]),
    (["collect-env"], ["collect-env"]),
])
def test_each_command_help_names_its_flags(argv, flags, capsys):
    status, out, _ = run_main([*argv, "--help"], capsys)
    assert status == 0
    for flag in flags:
        assert flag in out
    if argv == ["run-batch"]:
        assert "--port" not in out  # the server's HTTP flags mean nothing offline


def test_serve_refuses_a_missing_or_doubled_model(capsys):
    status, _, err = run_main(["serve", "--port", "1"], capsys)
    assert status == 2 and "--model" in err
    with pytest.raises(SystemExit, match="the model is given twice"):
        main(["serve", "a", "--model", "b"])


def test_bench_passes_flags_to_the_script_and_says_when_the_scripts_are_missing(monkeypatch, tmp_path, capfd):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--help"])  # the script's own --help, not bench's
    assert exit_info.value.code == 0
    assert "--base-url" in capfd.readouterr().out
    monkeypatch.setattr(bench, "BENCHMARKS_DIR", tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency"])
    assert exit_info.value.code == 2
    assert "not found" in capfd.readouterr().err


def test_serve_answers_health(server):
    _, url = server
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


def test_complete_quick_prints_the_greedy_completion(server, llm, capsys):
    _, url = server
    expected = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs.text
    status, out, err = run_main(["complete", "--url", f"{url}/v1", "--quick", PROMPT, "--temperature", "0",
                                 "--max-tokens", str(MAX_TOKENS)], capsys)
    assert status == 0, err
    assert out == expected + "\n"


def test_chat_keeps_the_conversation_of_stdin_lines(server, llm, capsys, monkeypatch):
    _, url = server
    first, second = "Hello there", "And then?"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{first}\n{second}\n"))
    status, out, err = run_main(["chat", "--url", f"{url}/v1", "--temperature", "0", "--max-tokens",
                                 str(MAX_TOKENS)], capsys)
    assert status == 0, err
    turn = [{"role": "user", "content": first}]
    answer1 = llm.chat(turn, GREEDY, use_tqdm=False)[0].outputs.text
    turn += [{"role": "assistant", "content": answer1}, {"role": "user", "content": second}]
    answer2 = llm.chat(turn, GREEDY, use_tqdm=False)[0].outputs.text
    assert out == f"{answer1}\n{answer2}\n"


def test_client_reports_an_unreachable_server(capsys):
    status, _, err = run_main(["complete", "--url", f"http://127.0.0.1:{free_port()}/v1", "--quick", "x",
                               "--model", "m"], capsys)
    assert status == 1 and "cannot reach the server" in err


def test_run_batch_matches_llm_and_reports_a_bad_line(tiny_hf, llm, tmp_path, capsys):
    chat1 = [{"role": "user", "content": "Hello there"}]
    chat2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": chat1, "max_tokens": MAX_TOKENS, "temperature": 0}},
        {"custom_id": "completion-1", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}},
        {"custom_id": "chat-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": chat2, "max_completion_tokens": MAX_TOKENS, "temperature": 0}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([json.dumps(lines[0]), json.dumps(lines[1]), '{"custom_id": "broken", "method": ',
                                 json.dumps(lines[2])]) + "\n")
    target = tmp_path / "out.jsonl"
    status, _, err = run_main(["run-batch", "-i", str(source), "-o", str(target), "--model", tiny_hf,
                               "--max-model-len", str(MAX_MODEL_LEN)], capsys)
    assert status == 0, err
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(out) == 4
    chats = llm.chat([chat1, chat2], GREEDY, use_tqdm=False)
    completion = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert [o["custom_id"] for o in out] == ["chat-1", "completion-1", None, "chat-2"]
    for line in (out[0], out[1], out[3]):
        assert line["error"] is None and line["response"]["status_code"] == 200
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == chats[0].outputs.text
    assert out[3]["response"]["body"]["choices"][0]["message"]["content"] == chats[1].outputs.text
    body = out[1]["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == completion.outputs.text
    assert body["usage"]["prompt_tokens"] == len(completion.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(completion.outputs.token_ids)
    assert out[2]["response"] is None and out[2]["error"]["code"] == "invalid_json_line"
    assert "line 3" in out[2]["error"]["message"]


class RecordingLLM:
    """Stands in for LLM in BatchEngine: records each call's prompts and returns outputs naming them."""

    def __init__(self):
        self.calls: list[tuple[str, list]] = []

    def _outputs(self, prompts: list) -> list[RequestOutput]:
        return [RequestOutput(request_id=str(i), prompt_token_ids=[1, 2], finished=True,
                              outputs=CompletionOutput(index=i, send_idx=0, token_ids=[3], text=json.dumps(p),
                                                       finish_reason="stop"))
                for i, p in enumerate(prompts)]

    def chat(self, prompts, params, chat_template_kwargs=None, tools=None):
        if any(m["content"] == "render error" for conversation in prompts for m in conversation):
            raise ValueError("cannot render")
        self.calls.append(("chat", prompts))
        return self._outputs(prompts)

    def generate(self, prompts, params):
        self.calls.append(("generate", prompts))
        return self._outputs(prompts)


def test_run_batch_submits_the_lines_together_and_isolates_a_failing_one():
    def line(number: int, url: str, body: dict) -> BatchRequest:
        text = json.dumps({"custom_id": f"id-{number}", "method": "POST", "url": url, "body": body})
        return parse_line(text, number, ["m"])

    chat = [line(i, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"q{i}"}]}) for i in (1, 2)]
    completions = [line(3, "/v1/completions", {"prompt": ["a", "b"]}), line(4, "/v1/completions", {"prompt": "c"})]
    fake = RecordingLLM()
    results = BatchEngine(fake).run([chat[0], completions[0], chat[1], completions[1]])
    # One call per kind, holding all its lines' prompts: the engine gets them together, not one at a time.
    assert sorted(fake.calls) == [("chat", [r.prompts[0] for r in chat]), ("generate", ["a", "b", "c"])]
    assert [c.text for c in results[1].choices] == ['"a"', '"b"']
    bad = line(5, "/v1/chat/completions", {"messages": [{"role": "user", "content": "render error"}]})
    fake.calls.clear()
    results = BatchEngine(fake).run([chat[0], bad, chat[1]])
    assert isinstance(results[1], LineFailure) and results[1].status == 400 and "cannot render" in results[1].message
    assert [r.choices[0].text for r in (results[0], results[2])] == [json.dumps(c.prompts[0]) for c in chat]


def test_collect_env_reports_the_ops_isa(capsys):
    status, out, _ = run_main(["collect-env"], capsys)
    assert status == 0
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    info = runtime_info()
    assert lines["Ops ISA"].split()[0] == info["active_isa"]
    assert "CPU ISA flags" in lines and "paddlepaddle" in lines


def test_serve_stops_on_sigterm_with_exit_0(server):
    """Last in the module: the shared server goes down."""
    proc, _ = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
