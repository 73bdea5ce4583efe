"""A `model` argument that is a repo id ("baidu/ERNIE-4.5-0.3B-Paddle") -> a local copy, downloaded if need be.

A copy on disk wins; the places looked at are the ones the usual download tools fill.
- FastDeploy's own download directory: `$FD_MODEL_CACHE/<repo id>` or `~/<repo id>` (FastDeploy downloads
  there, spelling Baidu's repos "PaddlePaddle/..." on AIStudio / ModelScope and "baidu/..." on Hugging Face).
  Such a flat copy records no revision, so it is used only for the default revision.
- The Hugging Face hub cache where huggingface_hub puts it (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`, read by that library at import):
  `models--ORG--NAME/snapshots/<commit>/`, the commit found through `refs/<branch>` or given as a hash.
With no copy there, model_download.py fetches the files loading needs from the hub into that same cache.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from fastdeploy.model_executor.model_download import (
    IGNORED_PATTERNS,
    MODEL_FILE_PATTERNS,
    HubUnreachableError,
    download_model,
)

logger = logging.getLogger(__name__)

DEFAULT_REVISION = "master"  # FastDeploy's default; the hub calls its default branch "main"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache the `hf download` command fills by default, as huggingface_hub locates it."""
    return Path(hf_constants.HF_HUB_CACHE).expanduser()


def fastdeploy_download_dir() -> Path:
    """Where FastDeploy's own LLM(model=<repo id>) downloads to (its FD_MODEL_CACHE, else the home directory)."""
    where = os.environ.get("FD_MODEL_CACHE")  # env-ok: FastDeploy's own name for this location
    return Path(where or os.path.expanduser("~")).expanduser()


def _spellings(repo_id: str) -> list[str]:
    """The repo id as given, then Baidu's other organisation name (AIStudio/ModelScope: PaddlePaddle, hub: baidu)."""
    org, _, name = repo_id.partition("/")
    names = [repo_id]
    if org.lower() == "baidu":
        names.append(f"PaddlePaddle/{name}")
    elif org.lower() == "paddlepaddle":
        names.append(f"baidu/{name}")
    return names


def looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~"))
            and not any(p in (".", "..") for p in parts))


def resolve_model(model: str, revision: str | None = DEFAULT_REVISION, cache_dir: str | os.PathLike[str] | None = None
                  ) -> str:
    """`model` itself when it is a directory; else the local copy of the repo id `model` at `revision`
    (None or "master": the default branch; a branch / tag name or a commit hash otherwise), downloaded into the
    hub cache `cache_dir` (default: huggingface_hub's) when there is none.
    ValueError saying where it looked and how to download it when the hub cannot be reached, or naming the
    repo id when the hub has no such repo; model_download.ModelDownloadError when a download stops part way."""
    if os.path.isdir(model) or not looks_like_repo_id(model):
        return model
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a branch, tag or commit hash string, got {type(revision).__name__}")
    default = revision in (None, DEFAULT_REVISION, "main")
    hub = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    looked: list[str] = []
    if default:
        for name in _spellings(model):
            flat = fastdeploy_download_dir() / name
            looked.append(str(flat))
            if (flat / "config.json").is_file():
                logger.info("model %s: using FastDeploy's download at %s", model, flat)
                return str(flat)
    hub_revision = "main" if default else revision
    incomplete: list[str] = []
    for name in _spellings(model):
        looked.append(str(hub / f"models--{name.replace('/', '--')}") + f" (revision {hub_revision})")
        try:
            # The same patterns as the download, so a snapshot holding just the needed files counts as complete.
            path = snapshot_download(name, revision=hub_revision, cache_dir=hub, local_files_only=True,
                                     allow_patterns=list(MODEL_FILE_PATTERNS), ignore_patterns=list(IGNORED_PATTERNS))
        except LocalEntryNotFoundError as e:
            # huggingface_hub 2.x names a snapshot that an interrupted download left short of files
            if getattr(e, "snapshot_path", None):
                incomplete.append(str(e.snapshot_path))
            continue
        logger.info("model %s (revision %s): using the hub cache copy %s", model, hub_revision, path)
        return path
    try:
        return download_model(_spellings(model), hub_revision, hub)
    except HubUnreachableError as e:
        partial = f" An interrupted download is in {', '.join(incomplete)}." if incomplete else ""
        raise ValueError(
            f"model {model!r} is neither a local directory nor a repo id found on disk, and it could not be "
            f"downloaded: {e}.{partial} Looked in: {'; '.join(looked)}. Download it where there is a connection, "
            f"e.g. `hf download {model}{'' if default else ' --revision ' + revision}` (fills the hub cache), "
            "or pass the checkpoint directory") from e
