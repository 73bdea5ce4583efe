import http.server
import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

# Before pytest's faulthandler is enabled (after conftest files load): fastdeploy's import takes down the crash
# handlers Paddle's import installs, so faulthandler chains to the default ones rather than being displaced.
import fastdeploy  # noqa: F401

FIXTURES = Path(__file__).parent / "fixtures"
TINY_HF = FIXTURES / "models" / "ernie45_tiny_hf"
TINY_PADDLE = FIXTURES / "models" / "ernie45_tiny_paddle"
REFERENCE = FIXTURES / "reference"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sanitize", action="store_true",
                     help="run the compiled ops built with AddressSanitizer and UndefinedBehaviorSanitizer (through "
                          "`make sanitize`, which preloads their runtime)")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("sanitize"):
        return
    import paddle

    from fastdeploy.ops import build
    if "libasan" not in Path("/proc/self/maps").read_text():
        pytest.exit("--sanitize needs the ASan runtime preloaded: run `make sanitize`", returncode=4)
    build.use_sanitizers()
    # Every tensor its own allocation, bordered by ASan's redzones: Paddle 3.3 already gives each CPU tensor
    # its own posix_memalign, and this flag keeps it so should a Paddle pool CPU memory (an overflow into a
    # neighbour in the same chunk would go unseen).
    paddle.set_flags({"FLAGS_use_system_allocator": True})
    if build.library() is None:
        pytest.exit("the sanitized custom ops did not load (see the warning above)", returncode=4)


# Tests of the C library's own allocator, which ASan replaces: meaningless in the sanitized run.
NOT_UNDER_SANITIZERS = ("tests/test_ops.py::test_keep_freed_memory_stops_page_faults_on_reallocation",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("sanitize"):
        return
    dropped = [item for item in items if item.nodeid in NOT_UNDER_SANITIZERS]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


@pytest.fixture(scope="session")
def tiny_hf() -> str:
    return str(TINY_HF)


@pytest.fixture(scope="session")
def tiny_paddle() -> str:
    return str(TINY_PADDLE)


TOKENIZER_NAMES = ("ernie_sp", "bpe_json")


@pytest.fixture(scope="session")
def reference() -> dict:
    """transformers' results on the tokenizer fixtures (tools/make_tokenizer_reference.py)."""
    return json.loads((REFERENCE / "tokenizer_reference.json").read_text(encoding="utf-8"))["fixtures"]


@pytest.fixture(scope="module", params=TOKENIZER_NAMES)
def case(request, reference):
    """(our Tokenizer, transformers' reference entries) for each tokenizer fixture."""
    from fastdeploy.input.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(FIXTURES / "tokenizers" / request.param), reference[request.param]


@contextmanager
def compiled_ops(enabled: bool):
    """With enabled=False every fastdeploy.ops wrapper runs its pure-Paddle reference, as when the
    compiled library cannot be built."""
    from fastdeploy import ops
    from fastdeploy.ops import build
    with pytest.MonkeyPatch.context() as mp:
        if not enabled:
            mp.setattr(build, "_tried", True)
            mp.setattr(build, "_library", None)
        assert (ops.library() is not None) == enabled
        yield


@contextmanager
def serve_files(files: Mapping[str, bytes]) -> Iterator[str]:
    """A local http server on 127.0.0.1 answering GET `path` with files[path], anything else 404; yields its
    base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            payload = files.get(self.path)
            if payload is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    with serve(Handler) as url:
        yield url


@contextmanager
def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded http server on 127.0.0.1 with this handler, on a free port; yields its base URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
