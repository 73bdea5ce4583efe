"""Loading images from every accepted source, and the errors for bad ones (http against a local
server on 127.0.0.1)."""
import base64
import io

import numpy as np
import pytest
from PIL import Image

from fastdeploy.input import media

from conftest import serve_files


def png_bytes(width=20, height=10) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def server():
    with serve_files({"/cat.png": png_bytes(), "/bad.png": b"not an image"}) as url:
        yield url


def test_every_source_gives_the_same_pixels(tmp_path, server):
    data = png_bytes()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    expected = np.asarray(Image.open(io.BytesIO(data)))
    sources = [data, str(path), path, f"file://{path}", "data:image/png;base64," + base64.b64encode(data).decode(),
               f"{server}/cat.png", Image.open(io.BytesIO(data))]
    for source in sources:
        np.testing.assert_array_equal(np.asarray(media.load_image(source)), expected)


@pytest.mark.parametrize("make, message", [
    (lambda tmp, srv: tmp / "missing.png", "missing.png"),
    (lambda tmp, srv: f"{srv}/nothing.png", "HTTP 404"),
    (lambda tmp, srv: f"{srv}/bad.png", "could not be decoded"),
    (lambda tmp, srv: b"\x89PNG broken", "could not be decoded"),
    (lambda tmp, srv: "data:image/png;base64,@@@", "base64"),
    (lambda tmp, srv: "data:image/png,plain", "data URL"),
    (lambda tmp, srv: "http://127.0.0.1:9/unreachable.png", "127.0.0.1:9"),
])
def test_bad_sources_name_themselves(tmp_path, server, make, message):
    with pytest.raises(ValueError, match=message):
        media.load_image(make(tmp_path, server))


def test_downloads_over_the_size_limit_are_refused(server):
    with pytest.raises(ValueError, match="allowed"):
        media.load_image(f"{server}/cat.png", media.MediaPolicy(max_bytes=100))


def test_non_source_types_are_a_type_error():
    with pytest.raises(TypeError, match="media source"):
        media.read_bytes(42)
