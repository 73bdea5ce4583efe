"""llama.cpp's one-stream decode on one prompt: plain, and each of its n-gram speculation modes (used by
speculative.py's --llama-bin).

Every figure is decode tok/s after the first token, as llama.cpp reports it:
  plain          llama-bench's tg (no prompt)
  llama-lookup   the lookup example's "decoded N tokens ... speed" line (not its "encoded" line, the prompt)
  server:TYPE    llama-server --spec-type TYPE (ngram-simple, ngram-map-k, ngram-mod), one request to a server
                 started for it, `timings.predicted_per_second`. A fresh server per request: ngram-mod keeps its
                 n-gram table across requests, so a repeated request drafts the previous answer, which is not the
                 workload (a text the model has not produced before).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

SERVER_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


def _threads() -> str:
    return str(len(os.sched_getaffinity(0)))


def plain(bin_dir: Path, gguf: Path, max_tokens: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(max_tokens),
                          "-t", _threads(), "-o", "json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["avg_ts"]


def lookup(bin_dir: Path, gguf: Path, prompt: str, max_tokens: int, k: int) -> tuple[float, int, int]:
    """llama-lookup's decode tok/s, drafted and accepted counts."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        for _ in range(3):  # llama.cpp logs from a thread of its own; a busy machine may cut the last lines
            out = subprocess.run([str(bin_dir / "llama-lookup"), "-m", str(gguf), "-f", f.name, "-n", str(max_tokens),
                                  "--spec-draft-n-max", str(k), "--temp", "0", "--ignore-eos", "-t", _threads()],
                                 capture_output=True, text=True, check=True).stderr
            found = [re.search(pattern, out) for pattern in (
                r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s*([\d.]+) t/s", r"n_drafted\s*=\s*(\d+)",
                r"n_accept\s*=\s*(\d+)")]
            if all(found):
                return float(found[0][1]), int(found[1][1]), int(found[2][1])
    raise RuntimeError(f"llama-lookup printed no decode figures: ...{out[-500:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server(bin_dir: Path, gguf: Path, prompt: str, max_tokens: int, k: int, spec_type: str) -> tuple[float, int, int]:
    """One greedy request to a fresh llama-server with `--spec-type spec_type`: decode tok/s, drafted, accepted."""
    port = _free_port()
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                             str(port), "-t", _threads(), "-np", "1", "--spec-type", spec_type,
                             "--spec-draft-n-max", str(k)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server --spec-type {spec_type} did not start") from None
                time.sleep(0.1)
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True})
        req = urllib.request.Request(f"{base}/completion", body.encode(), {"Content-Type": "application/json"})
        timings = json.load(urllib.request.urlopen(req, timeout=600))["timings"]
        return timings["predicted_per_second"], timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def best_of(bin_dir: Path, gguf: Path, prompt: str, max_tokens: int, k: int, repeats: int) -> dict[str, dict]:
    """Each mode's best of `repeats`: {mode: {"rate", "drafted", "accepted"}}."""
    modes = {"plain": lambda: (plain(bin_dir, gguf, max_tokens), 0, 0),
             "llama-lookup": lambda: lookup(bin_dir, gguf, prompt, max_tokens, k)}
    for t in SERVER_TYPES:
        modes[f"server:{t}"] = lambda t=t: server(bin_dir, gguf, prompt, max_tokens, k, t)
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for mode, measure in modes.items():
            rate, drafted, accepted = measure()
            if rate > best.get(mode, {}).get("rate", 0.0):
                best[mode] = dict(rate=rate, drafted=drafted, accepted=accepted)
    return best
