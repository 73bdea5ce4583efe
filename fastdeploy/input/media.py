"""Images (and the raw bytes of videos) from what users pass: a PIL image, bytes, a file path, a
`file://` URL, a `data:` base64 URL or an http(s) URL, read under a `MediaPolicy`.

The policy is the trust line for media (docs/security.md, issue 41 point 4): the OpenAI server builds one
from its flags (no local files unless under --allowed-local-media-path, http(s) hosts limited by
--allowed-media-domains, bounded bytes, time, pixels, frames and items); offline `LLM` uses
`MediaPolicy.trusted()` (its caller may read any local file). Every failure is a ValueError that names the
source, raised before any model work starts.
"""
from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import logging
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urljoin, urlparse

import requests
import urllib3
from PIL import Image, UnidentifiedImageError
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0
MAX_FETCH_BYTES = 64 << 20  # larger media are refused, not truncated
TRUSTED_MAX_BYTES = 2 << 30
MAX_IMAGE_PIXELS = 64 << 20  # 8192 x 8192: ~192 MB once decoded to RGB
MAX_REDIRECTS = 5
_CHUNK = 1 << 16
_REDIRECTS = (301, 302, 303, 307, 308)


class MediaError(ValueError):
    """A prompt's media cannot be used: unreadable or undecodable, over limit_mm_per_prompt, not matching the
    placeholders, or sent to a text-only model. LLM.generate / chat fail only that prompt's request with
    it (`prompt`: its rendered text, when known); the server answers 400."""

    def __init__(self, message: str, prompt: str | None = None):
        super().__init__(message)
        self.prompt = prompt


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What reading media may do. `allowed_local_media_path`: local paths / file:// only for regular files
    whose resolved real path lies inside this directory (None: refused). `allowed_media_domains`: the http(s)
    hosts media (and their redirects) may come from, exact host names (None: any host, and then, with
    `public_hosts_only`, only hosts whose addresses are public: not loopback, private, link-local (cloud
    metadata), shared or reserved, checked before connecting and at the connected peer). `max_bytes` and
    `fetch_timeout` bound one item in total (not per read). `max_image_pixels` is checked from the image's
    header before it is decoded. `limit_mm_per_prompt` applies when the engine's own is not set.
    `max_video_frames` / `max_video_fps` cap what a request's video options may ask for (None: no cap)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    max_bytes: int = MAX_FETCH_BYTES
    fetch_timeout: float = FETCH_TIMEOUT_S
    max_image_pixels: int = MAX_IMAGE_PIXELS
    limit_mm_per_prompt: Mapping[str, int] | None = None
    max_video_frames: int | None = None
    max_video_fps: float | None = None
    public_hosts_only: bool = True

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            real = os.path.realpath(self.allowed_local_media_path)
            if not os.path.isdir(real):
                raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", real)
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains if d.strip())
            if not domains or any("/" in d or ":" in d for d in domains):
                raise ValueError(f"allowed_media_domains must be host names, got {self.allowed_media_domains!r}")
            object.__setattr__(self, "allowed_media_domains", domains)
        for name in ("max_bytes", "max_image_pixels", "max_video_frames"):
            value = getattr(self, name)
            if (value is not None or name != "max_video_frames") and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("fetch_timeout", "max_video_fps"):
            value = getattr(self, name)
            if (value is not None or name != "max_video_fps") and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")):
                raise ValueError(f"{name} must be a positive number of seconds/frames, got {value!r}")

    @classmethod
    def trusted(cls) -> MediaPolicy:
        """Offline LLM's: any local file, any host, items up to 2 GiB (long local videos); images up to where
        Pillow itself gives up."""
        return cls(allowed_local_media_path="/", max_bytes=TRUSTED_MAX_BYTES,
                   max_image_pixels=2 * Image.MAX_IMAGE_PIXELS, public_hosts_only=False)

    def check_video_options(self, options: Mapping[str, Any]) -> None:
        """A request's video options may lower the server's frames / fps, not raise them past the caps."""
        caps = {"max_frames": self.max_video_frames, "min_frames": self.max_video_frames,
                "target_frames": self.max_video_frames, "fps": self.max_video_fps}
        for key, cap in caps.items():
            value = options.get(key)
            if cap is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
                raise ValueError(f"the video's {key}={value} exceeds the server's limit of {cap}")


TRUSTED = MediaPolicy.trusted()


def _describe(source: object) -> str:
    text = str(source)
    return text if len(text) <= 100 else text[:97] + "..."


def _check_url(url: str, policy: MediaPolicy, original: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{_describe(original)} redirects to {parsed.scheme or 'a'}: URL; only http(s) is followed")
    host = (parsed.hostname or "").lower().rstrip(".")
    if not host:
        raise ValueError(f"{_describe(url)} has no host")
    if policy.allowed_media_domains is not None and host not in policy.allowed_media_domains:
        raise ValueError(f"media from {host!r} are not allowed on this server (--allowed-media-domains)"
                         + ("" if url == original else f"; {_describe(original)} redirected there"))


def _check_address(address: str, host: str) -> None:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone index is not part of the address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_global:
        raise ValueError(f"media host {host!r} is at {ip}, not a public address: this server fetches only from "
                         "public addresses unless --allowed-media-domains names the host")


class _PublicPeer:
    """An urllib3 connection that refuses a host with any non-public address before connecting, and checks
    the connected peer again before a byte is sent (the name may resolve differently the second time)."""

    host: str
    port: int

    def _new_conn(self) -> socket.socket:
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError:
            infos = []  # the connection itself reports the name as unresolvable
        for info in infos:
            _check_address(info[4][0], self.host)
        sock = super()._new_conn()  # type: ignore[misc]
        try:
            _check_address(sock.getpeername()[0], self.host)
        except BaseException:
            sock.close()
            raise
        return sock


class _PublicHTTP(_PublicPeer, HTTPConnection):
    pass


class _PublicHTTPS(_PublicPeer, HTTPSConnection):
    pass


class _PublicOnly(HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": type("PublicHTTPPool", (urllib3.HTTPConnectionPool,), {"ConnectionCls": _PublicHTTP}),
            "https": type("PublicHTTPSPool", (urllib3.HTTPSConnectionPool,), {"ConnectionCls": _PublicHTTPS})}


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    """GET with redirects followed by hand (each hop checked against the policy) and one deadline for all of
    it: connecting, redirects and the body."""
    deadline = time.monotonic() + policy.fetch_timeout
    limit, current = policy.max_bytes, url
    session = requests.Session()
    session.trust_env = False  # no proxies or .netrc from the environment: the policy alone decides
    if policy.allowed_media_domains is None and policy.public_hosts_only:
        for scheme in ("http://", "https://"):
            session.mount(scheme, _PublicOnly())
    try:
        for _ in range(MAX_REDIRECTS + 1):
            _check_url(current, policy, url)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ValueError(f"fetching {_describe(url)} took longer than {policy.fetch_timeout} s")
            # identity: a compressed body could inflate past max_bytes inside one read
            with session.get(current, timeout=remaining, stream=True, allow_redirects=False,
                             headers={"Accept-Encoding": "identity"}) as response:
                if response.status_code in _REDIRECTS and response.headers.get("Location"):
                    current = urljoin(current, response.headers["Location"])
                    continue
                if response.status_code != 200:
                    raise ValueError(f"could not fetch {_describe(url)}: HTTP {response.status_code}")
                declared = response.headers.get("Content-Length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise ValueError(f"{_describe(url)} is {declared} bytes, more than the {limit} allowed")
                body = bytearray()
                while True:
                    chunk = response.raw.read1(_CHUNK)  # one socket read at most, so the deadline is seen
                    if not chunk:
                        return bytes(body)
                    body += chunk
                    if len(body) > limit:
                        raise ValueError(f"{_describe(url)} is larger than the {limit} bytes allowed")
                    if time.monotonic() > deadline:
                        raise ValueError(f"fetching {_describe(url)} took longer than {policy.fetch_timeout} s")
        raise ValueError(f"{_describe(url)} redirected more than {MAX_REDIRECTS} times")
    except (requests.RequestException, OSError) as e:
        raise ValueError(f"could not fetch {_describe(url)}: {type(e).__name__}: {e}") from None
    finally:
        session.close()


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"a data URL must be 'data:<mime>;base64,<payload>', got {_describe(url)}")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise ValueError(f"the data URL holds more than the {policy.max_bytes} bytes allowed")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the data URL's payload is not valid base64: {_describe(url)}") from None


def _read_local(path: str, source: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise ValueError(f"local media ({_describe(source)}) are not allowed on this server "
                         "(--allowed-local-media-path)")
    real = os.path.realpath(path)  # symlinks resolved: a link inside the directory may not point out of it
    if os.path.commonpath([real, policy.allowed_local_media_path]) != policy.allowed_local_media_path:
        raise ValueError(f"{_describe(source)} is outside the allowed local media directory")
    try:
        with open(real, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):  # /dev/zero, FIFOs, sockets: endless or blocking
                raise ValueError(f"{_describe(source)} is not a regular file")
            if info.st_size > policy.max_bytes:
                raise ValueError(f"{_describe(source)} is {info.st_size} bytes, more than the "
                                 f"{policy.max_bytes} allowed")
            data = f.read(policy.max_bytes + 1)  # the file may have grown since fstat
    except OSError as e:
        raise ValueError(f"could not read {_describe(source)}: {e.strerror or e}") from None
    if len(data) > policy.max_bytes:
        raise ValueError(f"{_describe(source)} is larger than the {policy.max_bytes} bytes allowed")
    return data


def read_bytes(source: bytes | str | os.PathLike[str], policy: MediaPolicy = TRUSTED) -> bytes:
    """The bytes behind a source: bytes as they are, a path, file://, data: or http(s) URL."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise TypeError(f"a media source must be bytes, a path or a URL, got {type(source).__name__}")
    scheme = urlparse(source).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch(source, policy)
    if scheme == "data":
        return _data_url(source, policy)
    if scheme not in ("", "file") and "://" in source:
        raise ValueError(f"unsupported media URL scheme {scheme!r}: {_describe(source)}")
    path = unquote(urlparse(source).path) if scheme == "file" and "://" in source else source
    return _read_local(str(Path(path)), source, policy)


def load_image(source: Image.Image | bytes | str | os.PathLike[str], policy: MediaPolicy = TRUSTED) -> Image.Image:
    """A decoded PIL image (fully loaded, so a lazy decoder's errors surface here). The pixel count is
    checked from the header before anything is decoded."""
    if isinstance(source, Image.Image):
        return source
    data = read_bytes(source, policy)
    name = _describe(source) if not isinstance(source, (bytes, bytearray, memoryview)) else "the image bytes"
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width * height > policy.max_image_pixels:
            raise ValueError(f"{name} is {width}x{height} pixels, more than the {policy.max_image_pixels} allowed")
        image.load()
    except Image.DecompressionBombError as e:  # Pillow's own limit (2 x Image.MAX_IMAGE_PIXELS), met in open()
        raise ValueError(f"{name} has more pixels than the {policy.max_image_pixels} allowed: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"{name} could not be decoded as an image: {e}") from None
    return image
