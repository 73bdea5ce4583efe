"""Images (and the raw bytes of videos) from what users pass: a PIL image, bytes, a file path, a
`file://` URL, a `data:` base64 URL or an http(s) URL (fetched with a timeout and a size limit).

Every failure is a ValueError that names the source, raised before any model work starts.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import requests
from PIL import Image, UnidentifiedImageError

FETCH_TIMEOUT_S = 10.0
MAX_FETCH_BYTES = 64 << 20  # larger downloads are refused, not truncated
_CHUNK = 1 << 16



class MediaError(ValueError):
    """A prompt's media cannot be used: unreadable or undecodable, over limit_mm_per_prompt, not matching the
    placeholders, or sent to a text-only model. LLM.generate / chat fail only that prompt's request with
    it (`prompt`: its rendered text, when known); the server answers 400."""

    def __init__(self, message: str, prompt: str | None = None):
        super().__init__(message)
        self.prompt = prompt


def _describe(source: object) -> str:
    text = str(source)
    return text if len(text) <= 100 else text[:97] + "..."


def _fetch(url: str) -> bytes:
    try:
        with requests.get(url, timeout=FETCH_TIMEOUT_S, stream=True) as response:
            if response.status_code != 200:
                raise ValueError(f"could not fetch {_describe(url)}: HTTP {response.status_code}")
            declared = int(response.headers.get("Content-Length") or 0)
            if declared > MAX_FETCH_BYTES:
                raise ValueError(f"{_describe(url)} is {declared} bytes, more than the {MAX_FETCH_BYTES} allowed")
            body = bytearray()
            for chunk in response.iter_content(_CHUNK):
                body += chunk
                if len(body) > MAX_FETCH_BYTES:
                    raise ValueError(f"{_describe(url)} is larger than the {MAX_FETCH_BYTES} bytes allowed")
            return bytes(body)
    except requests.RequestException as e:
        raise ValueError(f"could not fetch {_describe(url)}: {type(e).__name__}: {e}") from None


def _data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"a data URL must be 'data:<mime>;base64,<payload>', got {_describe(url)}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the data URL's payload is not valid base64: {_describe(url)}") from None


def read_bytes(source: bytes | str | os.PathLike[str]) -> bytes:
    """The bytes behind a source: bytes as they are, a path, file://, data: or http(s) URL."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise TypeError(f"a media source must be bytes, a path or a URL, got {type(source).__name__}")
    scheme = urlparse(source).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch(source)
    if scheme == "data":
        return _data_url(source)
    path = Path(unquote(urlparse(source).path)) if scheme == "file" else Path(source)
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"could not read {_describe(source)}: {e.strerror or e}") from None


def load_image(source: Image.Image | bytes | str | os.PathLike[str]) -> Image.Image:
    """A decoded PIL image (fully loaded, so a lazy decoder's errors surface here)."""
    if isinstance(source, Image.Image):
        return source
    data = read_bytes(source)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"{_describe(source) if not isinstance(source, bytes) else 'the image bytes'} "
                         f"could not be decoded as an image: {e}") from None
    return image
