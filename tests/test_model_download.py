"""A repo id with no copy on disk is downloaded from the hub (model_download.py), against a local stand-in.

The stand-in answers the three requests huggingface_hub's snapshot_download makes: the model-info API
(`/api/models/{repo}/revision/{rev}`, giving the commit), the file tree (`/api/models/{repo}/tree/{rev}`,
names and sizes) and `/{repo}/resolve/{rev}/{file}` (HEAD: ETag, X-Repo-Commit and Content-Length; GET:
the bytes, honouring `Range` for a resumed transfer). It serves the tiny ERNIE-4.5 checkpoint plus files
loading does not need, and records every request.
"""
from __future__ import annotations

import hashlib
import http.server
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest

from conftest import TINY_HF, serve
from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor import model_download
from fastdeploy.model_executor.model_download import ModelDownloadError
from fastdeploy.model_executor.model_resolve import resolve_model

REPO = "baidu/ERNIE-4.5-0.3B-Paddle"
COMMIT = "c" * 40
CHECKPOINT = {p.name: p.read_bytes() for p in sorted(TINY_HF.iterdir())}
UNNEEDED = {"pytorch_model.bin": bytes(2 << 20), "original/model.safetensors": b"\0" * 4096,
            "README.md": b"# tiny\n", ".gitattributes": b"*.safetensors filter=lfs\n"}
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [[3, 4, 5, 6]]


class FakeHub:
    """One repo at one commit; `drop_once` files have their first GET cut off half way, `fail_once` files
    have theirs answered 500."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_once: set[str] = set()
        self.fail_once: set[str] = set()
        self.lock = threading.Lock()

    def fetched(self, since: int = 0) -> list[str]:
        """The files GET-requested (in order) from request number `since` on."""
        with self.lock:
            return [path.split(f"/resolve/{COMMIT}/", 1)[1] for method, path, _ in self.requests[since:]
                    if method == "GET" and "/resolve/" in path]

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802 - the stdlib's name
                self._answer(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                with hub.lock:
                    hub.requests.append((self.command, self.path, self.headers.get("Range")))
                path = self.path.split("?", 1)[0]
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                    self._json(m[1], m[2], {"id": m[1], "sha": COMMIT,
                                            "siblings": [{"rfilename": f} for f in hub.files]})
                elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                    self._json(m[1], m[2], [{"type": "file", "path": f, "size": len(b), "oid": _sha1(b)}
                                            for f, b in hub.files.items()])
                elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    self._file(m[1], m[2], m[3], body)
                else:
                    self._error(404, "RepoNotFound")

            def _known(self, repo: str, revision: str) -> bool:
                if repo != REPO:
                    self._error(404, "RepoNotFound")
                elif revision not in ("main", COMMIT):
                    self._error(404, "RevisionNotFound")
                else:
                    return True
                return False

            def _json(self, repo: str, revision: str, value: object) -> None:
                if self._known(repo, revision):
                    payload = json.dumps(value).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

            def _file(self, repo: str, revision: str, name: str, body: bool) -> None:
                if not self._known(repo, revision):
                    return
                data = hub.files.get(name)
                if data is None:
                    self._error(404, "EntryNotFound")
                    return
                with hub.lock:
                    fail = body and name in hub.fail_once
                    drop = body and not fail and name in hub.drop_once
                    (hub.fail_once if fail else hub.drop_once).discard(name) if body else None
                if fail:
                    time.sleep(0.5)  # let the other files finish first, as a large file's failure would
                    self._error(500, "")
                    return
                start = int(m[1]) if (m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")) else 0
                self.send_response(206 if start else 200)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if body:
                    # A dropped transfer: half the promised bytes, then the connection closes (HTTP/1.0).
                    self.wfile.write(data[start:len(data) // 2] if drop else data[start:])

            def _error(self, status: int, code: str) -> None:
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        return Handler


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The stand-in hub serving the checkpoint and the unneeded files, an empty hub cache and an empty home."""
    fake = FakeHub({**CHECKPOINT, **UNNEEDED})
    (tmp_path / "home").mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # FastDeploy's own download directory: empty
    monkeypatch.delenv("FD_MODEL_CACHE", raising=False)
    with serve(fake.handler()) as url:
        monkeypatch.setattr(model_download, "HUB_ENDPOINT", url)
        yield fake


@pytest.fixture(scope="module")
def expected_tokens() -> list[int]:
    return LLM(str(TINY_HF), max_model_len=64).generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs.token_ids


def _snapshot(tmp_path: Path) -> Path:
    return tmp_path / "hub" / "models--baidu--ERNIE-4.5-0.3B-Paddle" / "snapshots" / COMMIT


def test_repo_id_is_downloaded_then_found_on_disk(hub: FakeHub, tmp_path: Path, expected_tokens: list[int]) -> None:
    llm = LLM(REPO, max_model_len=64)
    assert llm.config.model == str(_snapshot(tmp_path))
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs.token_ids == expected_tokens
    assert sorted(hub.fetched()) == sorted(CHECKPOINT)  # none of UNNEEDED, each needed file once
    before = len(hub.requests)
    assert resolve_model(REPO) == str(_snapshot(tmp_path))  # the second time the copy on disk is used
    assert len(hub.requests) == before


def test_dropped_transfer_resumes_where_it_stopped(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    expected_tokens: list[int]) -> None:
    # huggingface_hub writes what it received chunk by chunk (10 MB by default, larger than this file)
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 16384)
    hub.drop_once.add("model.safetensors")
    llm = LLM(REPO, max_model_len=64)
    ranges = [rng for method, path, rng in hub.requests if method == "GET" and path.endswith(".safetensors")]
    half = len(CHECKPOINT["model.safetensors"]) // 2
    assert len(ranges) == 2 and ranges[0] is None
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", ranges[1])[1])  # the retry asks only for the rest
    assert half - 16384 < resumed_at <= half
    assert (_snapshot(tmp_path) / "model.safetensors").read_bytes() == CHECKPOINT["model.safetensors"]
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs.token_ids == expected_tokens


def test_failed_download_keeps_its_files_and_the_next_call_fetches_the_rest(
        hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.fail_once.add("model.safetensors")
    with pytest.raises(ModelDownloadError, match=f"(?s){REPO}.*calling again fetches the rest"):
        resolve_model(REPO)
    first = hub.fetched()
    assert "model.safetensors" in first and len(first) > 1
    live = model_download.HUB_ENDPOINT
    monkeypatch.setattr(model_download, "HUB_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(ValueError, match="An interrupted download is in"):  # offline meanwhile: said so
        resolve_model(REPO)

    monkeypatch.setattr(model_download, "HUB_ENDPOINT", live)
    before = len(hub.requests)
    assert resolve_model(REPO) == str(_snapshot(tmp_path))
    # the weights again, plus any file the failure stopped before it began; nothing fetched is fetched again
    assert sorted(hub.fetched(before)) == sorted({"model.safetensors"} | set(CHECKPOINT) - set(first))
    assert sorted(p.name for p in _snapshot(tmp_path).iterdir()) == sorted(CHECKPOINT)


def _closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_fails_fast_saying_where_it_looked_and_how_to_fetch(hub: FakeHub, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_download, "HUB_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        LLM(REPO, max_model_len=64)
    assert time.monotonic() - start < 5
    message = str(e.value)
    assert "could not be downloaded" in message and "is not reachable" in message
    assert str(tmp_path / "hub" / "models--baidu--ERNIE-4.5-0.3B-Paddle") in message
    assert str(tmp_path / "home" / "baidu" / "ERNIE-4.5-0.3B-Paddle") in message
    assert f"hf download {REPO}" in message
    assert not (tmp_path / "hub" / "models--baidu--ERNIE-4.5-0.3B-Paddle" / "snapshots").exists()


def test_unknown_repo_or_revision_is_named(hub: FakeHub) -> None:
    with pytest.raises(ValueError, match="no repo 'baidu/No-Such-Model' or 'PaddlePaddle/No-Such-Model' exists"):
        resolve_model("baidu/No-Such-Model")
    with pytest.raises(ValueError, match=f"{REPO}.*has no revision 'v9'"):
        resolve_model(REPO, revision="v9")
    assert hub.fetched() == []
