"""Issue 41, point 4: what reading media may do under a MediaPolicy (fastdeploy/input/media.py) — local
files only inside --allowed-local-media-path (no symlink escape, no devices), http(s) hosts and redirects
within the allowed domains and never to another scheme, bytes and time bounded in total, pixel bombs refused
from the header, request video options capped, a default per-prompt limit on the server — and, through the
real server on the tiny VL fixture, a local path and a redirect to file:// answered 400 with the server
serving a normal image after."""
from __future__ import annotations

import http.server
import io
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from PIL import Image

from conftest import serve

from fastdeploy.model_executor.models.ernie4_5_vl.processor import MediaProcessor
from fastdeploy.input.media import TRUSTED, MediaPolicy, load_image, read_bytes

ROOT = Path(__file__).resolve().parent.parent
VL = ROOT / "tests/fixtures/models/ernie45_vl_tiny_hf"


def png_bytes(width: int, height: int) -> bytes:
    """A valid 1-bit greyscale PNG of one colour, written by hand so a 30000x30000 one is a few KB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = b"\x00" + b"\x00" * ((width + 7) // 8)
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


def small_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


@contextmanager
def media_server() -> Iterator[str]:
    """127.0.0.1 http server: /ok.png an image, /big 2 MB, /drip one byte every 0.2 s (declaring 1000),
    /to?url redirects to url, /loop redirects to itself."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            path, _, query = self.path.partition("?")
            if path == "/ok.png":
                self._send(small_png())
            elif path == "/big":
                self._send(b"\x00" * (2 << 20))
            elif path == "/drip":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    for _ in range(100):  # bounded: 20 s at most
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    pass  # the client gave up, as it should
            elif path in ("/to", "/loop"):
                self.send_response(302)
                self.send_header("Location", query if path == "/to" else "/loop")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.send_error(404)

        def _send(self, payload: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            try:
                self.wfile.write(payload)
            except OSError:
                pass  # the client stopped reading at its byte cap

        def log_message(self, *args):
            pass

    with serve(Handler) as url:
        yield url


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    with media_server() as url:
        yield url


@pytest.fixture()
def media_dir(tmp_path: Path) -> Path:
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "ok.png").write_bytes(small_png())
    (tmp_path / "secret.txt").write_bytes(b"secret")
    (inside / "escape.png").symlink_to(tmp_path / "secret.txt")
    (inside / "zero.png").symlink_to("/dev/zero")
    return inside


LOCAL = MediaPolicy(allowed_media_domains=("127.0.0.1",))  # the tests' own HTTP server


def test_local_files_refused_without_an_allowed_dir(media_dir):
    policy = MediaPolicy()
    for source in (str(media_dir / "ok.png"), f"file://{media_dir / 'ok.png'}", "/etc/passwd", "/dev/zero"):
        with pytest.raises(ValueError, match="not allowed on this server"):
            read_bytes(source, policy)


def test_local_files_only_inside_the_allowed_dir(media_dir):
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    assert read_bytes(str(media_dir / "ok.png"), policy) == small_png()
    assert load_image(f"file://{media_dir / 'ok.png'}", policy).size == (32, 32)
    for source in (str(media_dir.parent / "secret.txt"), str(media_dir / ".." / "secret.txt"), "/etc/passwd",
                   str(media_dir / "escape.png"), f"file://{media_dir / 'escape.png'}", "/dev/zero"):
        with pytest.raises(ValueError, match="outside the allowed"):
            read_bytes(source, policy)
    assert read_bytes(str(media_dir / "escape.png"), TRUSTED) == b"secret"  # offline LLM: its caller is trusted


def test_devices_are_refused_even_when_allowed():
    with pytest.raises(ValueError, match="not a regular file"):
        read_bytes("/dev/zero", TRUSTED)  # would grow memory without bound
    with pytest.raises(ValueError, match="not a regular file"):
        read_bytes("/dev/zero", MediaPolicy(allowed_local_media_path="/dev"))


def test_local_file_over_the_byte_cap(media_dir):
    (media_dir / "big.bin").write_bytes(b"\x00" * 5000)
    with pytest.raises(ValueError, match="more than the 4096"):
        read_bytes(str(media_dir / "big.bin"), MediaPolicy(allowed_local_media_path=str(media_dir), max_bytes=4096))


def test_redirects_to_file_and_other_hosts_refused(host, media_dir):
    policy = MediaPolicy(allowed_local_media_path="/", allowed_media_domains=("127.0.0.1",))  # even with local files
    with pytest.raises(ValueError, match="only http"):
        read_bytes(f"{host}/to?file://{media_dir / 'ok.png'}", policy)
    allowed = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    assert read_bytes(f"{host}/to?/ok.png", allowed) == small_png()  # within the domain: followed
    port = host.rsplit(":", 1)[1]
    with pytest.raises(ValueError, match="'localhost' are not allowed"):
        read_bytes(f"{host}/to?http://localhost:{port}/ok.png", allowed)
    with pytest.raises(ValueError, match="'localhost' are not allowed"):
        read_bytes(f"http://localhost:{port}/ok.png", allowed)
    with pytest.raises(ValueError, match="redirected more than"):
        read_bytes(f"{host}/loop", LOCAL)


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/ok.png", "http://localhost:{port}/ok.png",
                                 "http://[::ffff:127.0.0.1]:{port}/ok.png", "http://169.254.169.254/latest/meta-data",
                                 "http://10.1.2.3/x.png", "http://[::1]:{port}/x.png", "http://0.0.0.0:{port}/x.png"])
def test_without_allowed_domains_only_public_addresses_are_fetched(host, url):
    """Loopback, private, link-local (cloud metadata) and unspecified addresses are refused before connecting,
    however the host is written; naming the host in allowed_media_domains is the way to allow one."""
    port = host.rsplit(":", 1)[1]
    started = time.monotonic()
    with pytest.raises(ValueError, match="not a public address"):
        read_bytes(url.format(port=port), MediaPolicy())
    assert time.monotonic() - started < 1.0  # refused, not tried
    assert read_bytes(f"{host}/ok.png", LOCAL) == small_png()
    assert read_bytes(f"{host}/ok.png", TRUSTED) == small_png()  # offline LLM: any host


def test_a_name_that_resolves_again_elsewhere_is_caught_at_the_peer(host, monkeypatch):
    """DNS rebinding: the check's lookup says public, the connection's lookup says loopback."""
    port = int(host.rsplit(":", 1)[1])
    real, calls = socket.getaddrinfo, []

    def rebinding(name, *args, **kwargs):
        calls.append(name)
        if name == "media.example" and len(calls) == 1:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port))]
        return real("127.0.0.1" if name == "media.example" else name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with pytest.raises(ValueError, match="'media.example' is at 127.0.0.1, not a public address"):
        read_bytes(f"http://media.example:{port}/ok.png", MediaPolicy())
    assert len(calls) == 2


def test_download_over_the_byte_cap_stopped(host):
    with pytest.raises(ValueError, match="more than the 1048576"):
        read_bytes(f"{host}/big", MediaPolicy(allowed_media_domains=("127.0.0.1",), max_bytes=1 << 20))
    assert len(read_bytes(f"{host}/big", LOCAL)) == 2 << 20


def test_slow_drip_stopped_by_the_total_timeout(host):
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 1.0 s|timed out|Timeout"):
        read_bytes(f"{host}/drip", MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout=1.0))
    assert time.monotonic() - start < 3.0  # each byte came within the timeout: only a total deadline stops it


def test_pixel_bomb_refused_before_decoding():
    bomb = png_bytes(30000, 30000)
    assert len(bomb) < 200_000
    for policy in (MediaPolicy(), TRUSTED):  # offline too: a 400, not Pillow's exception (a 500)
        with pytest.raises(ValueError, match="pixels than the|pixels, more than"):
            load_image(bomb, policy)
    with pytest.raises(ValueError, match="12000x12000 pixels, more than"):  # under Pillow's own limit
        load_image(png_bytes(12000, 12000), MediaPolicy(max_image_pixels=100_000_000 - 1))
    with pytest.raises(ValueError, match="more than the 1000"):
        load_image(png_bytes(40, 40), MediaPolicy(max_image_pixels=1000))
    assert load_image(png_bytes(40, 40), MediaPolicy()).size == (40, 40)


def test_request_video_options_capped():
    policy = MediaPolicy(max_video_frames=180, max_video_fps=2.0)
    for options in ({"max_frames": 181}, {"target_frames": 1000}, {"min_frames": 500}, {"fps": 30}):
        with pytest.raises(ValueError, match="exceeds the server's limit"):
            policy.check_video_options({"video": b"", **options})
    policy.check_video_options({"video": b"", "max_frames": 30, "fps": 1})  # lowering is fine
    processor = MediaProcessor.from_pretrained(VL, None, None, policy)
    with pytest.raises(ValueError, match="exceeds the server's limit"):
        processor.video({"video": "/never/read.mp4", "max_frames": 10_000})


def test_default_limit_of_media_per_prompt():
    server = MediaProcessor.from_pretrained(VL, None, None, MediaPolicy(limit_mm_per_prompt={"image": 16}))
    with pytest.raises(ValueError, match="50 images, more than limit_mm_per_prompt"):
        server.check_limits(50, 0)
    assert MediaProcessor.from_pretrained(VL, {"image": 100}, None, MediaPolicy(limit_mm_per_prompt={"image": 16})
                                          ).limits == {"image": 100}  # the operator's own limit wins
    assert MediaProcessor.from_pretrained(VL).limits == {}  # offline LLM: none unless given


def test_bad_policies_refused(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="host names"):
        MediaPolicy(allowed_media_domains=("http://x.com/",))
    with pytest.raises(ValueError, match="max_bytes"):
        MediaPolicy(max_bytes=0)
    with pytest.raises(ValueError, match="fetch_timeout"):
        MediaPolicy(fetch_timeout=float("nan"))


def test_server_refuses_local_and_redirected_file_media(host, media_dir):
    from test_api_server import KEY, Server
    from test_api_server_multimodal import data_url, image_messages

    s = Server(str(VL), "--api-key", KEY, "--max-model-len", "1024", "--served-model-name", "vl",
               "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "5")
    try:
        client = s.client()

        def chat(url: str):
            return client.chat.completions.create(model="vl", messages=image_messages(url), temperature=0,
                                                  max_tokens=2)

        for url, message in ((str(media_dir / "ok.png"), "not allowed on this server"),
                             (f"file://{media_dir / 'ok.png'}", "not allowed on this server"),
                             (f"{host}/to?file://{media_dir / 'ok.png'}", "only http"),
                             (data_url(png_bytes(30000, 30000), "image/png"), "pixels than the"),
                             (data_url(png_bytes(9000, 9000), "image/png"), "pixels, more than")):
            with pytest.raises(openai.BadRequestError, match=message) as caught:
                chat(url)
            assert caught.value.body["param"] == "messages"
        many = image_messages(data_url(small_png(), "image/png"))
        many[0]["content"] = many[0]["content"][:1] * 50 + many[0]["content"][1:]
        with pytest.raises(openai.BadRequestError, match="limit_mm_per_prompt"):
            client.chat.completions.create(model="vl", messages=many, max_tokens=2)
        assert chat(f"{host}/ok.png").choices[0].finish_reason in ("length", "stop")
    finally:
        assert s.stop() == 0
