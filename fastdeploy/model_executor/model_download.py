"""Downloading a repo id's checkpoint from the Hugging Face hub into the standard hub cache.

model_resolve.py calls this only after finding no copy on disk. The work is huggingface_hub's
`snapshot_download`: it lays the files out as `models--ORG--NAME/snapshots/<commit>/` (what the
local lookup reads next time), shows tqdm progress, keeps every finished file, and resumes a file
whose connection drops mid-way from the byte it reached. A file left unfinished when the call itself
fails is not kept by huggingface_hub 2.x, so the next call fetches just the files still missing.

Before that, one bounded request for the repo's metadata tells apart "no connection" (the caller
turns that into its offline error), "no such repo / revision" and "go ahead", so an offline machine
fails in about a second rather than through the library's longer retries.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

logger = logging.getLogger(__name__)

# The hub to download from. None: huggingface_hub's configured endpoint (https://huggingface.co unless
# that library is set up otherwise). A module attribute, not a parameter, so tests can point it at a
# local stand-in; the project reads no environment variable for it.
HUB_ENDPOINT: str | None = None

# Seconds the metadata request may take to connect and answer: long enough for a slow link, short
# enough that a machine without one hears so quickly.
METADATA_TIMEOUT = 10.0

# The files loading reads (model_config.py, checkpoint.py, input/tokenizer.py, input/chat_template.py,
# the ERNIE-4.5-VL processors), plus the tokenizer vocabularies other tools expect beside them. Weights
# in other formats (*.bin, *.pdparams, *.gguf), README / LICENSE and sub-folders are not fetched.
MODEL_FILE_PATTERNS: tuple[str, ...] = (
    "config*.json", "generation_config.json",
    "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "*.tiktoken", "vocab*.json", "vocab*.txt", "merges.txt",
    "chat_template*", "preprocessor_config.json", "video_preprocessor_config.json",
)
# The loader reads the checkpoint directory's top level only (fnmatch's `*` also matches "/").
IGNORED_PATTERNS: tuple[str, ...] = ("*/*",)

# Threads fetching files at once: a shard each; more only competes for the same link.
DOWNLOAD_WORKERS = 4


class HubUnreachableError(OSError):
    """The hub did not answer (no connection, DNS failure, timeout, or huggingface_hub's offline mode)."""


class ModelDownloadError(RuntimeError):
    """A download that started but did not finish; the files fetched so far stay in the cache."""


def endpoint() -> str:
    """The hub URL used, for messages."""
    return HUB_ENDPOINT or HfApi().endpoint


# Packages whose exceptions mean the request never got an answer (refused, DNS, timeout, dropped). Named
# rather than imported: huggingface_hub 1.x uses httpx, 2.x its fork httpx2.
_HTTP_CLIENT_PACKAGES = ("httpx", "httpx2", "httpcore", "h11", "ssl", "socket")


def _from_http_client(error: Exception) -> bool:
    return isinstance(error, OSError) or any(
        cls.__module__.split(".")[0] in _HTTP_CLIENT_PACKAGES for cls in type(error).__mro__)


def _find_on_hub(names: Sequence[str], revision: str) -> str:
    """The first of `names` (spellings of one repo id) that exists on the hub at `revision`."""
    api = HfApi(endpoint=HUB_ENDPOINT)
    for name in names:
        try:
            info = api.model_info(name, revision=revision, timeout=METADATA_TIMEOUT)
        except RepositoryNotFoundError:
            continue  # also what the hub answers for a private repo without a token
        except GatedRepoError as e:
            raise ValueError(f"model {name!r} is a gated repo on {endpoint()}: accept its terms on the hub and log in "
                             f"(`hf auth login`) to download it") from e
        except RevisionNotFoundError as e:
            raise ValueError(f"model {name!r} exists on {endpoint()} but has no revision {revision!r} "
                             "(a branch, tag or commit hash)") from e
        except (HfHubHTTPError, OfflineModeIsEnabled) as e:
            raise HubUnreachableError(f"{endpoint()} answered {type(e).__name__}: {e}") from e
        except Exception as e:
            if not _from_http_client(e):
                raise
            raise HubUnreachableError(f"{endpoint()} is not reachable ({type(e).__name__}: {e})") from e
        logger.info("model %s: found on %s at revision %s (commit %s)", name, endpoint(), revision, info.sha)
        return name
    spelled = " or ".join(repr(n) for n in names)
    raise ValueError(f"model {names[0]!r} is not a local directory, not on disk, and no repo {spelled} exists on "
                     f"{endpoint()} (check the spelling; a private repo needs `hf auth login`)")


def download_model(names: Sequence[str], revision: str, cache_dir: Path) -> str:
    """Download the repo named by the first existing spelling in `names` at `revision` (a hub branch, tag or
    commit hash) into the hub cache `cache_dir`; returns the snapshot directory.
    HubUnreachableError when the hub cannot be reached, ValueError when the repo or revision does not exist,
    ModelDownloadError when the transfer fails part way (calling again fetches what is missing)."""
    name = _find_on_hub(names, revision)
    logger.info("model %s: downloading revision %s from %s into %s", name, revision, endpoint(), cache_dir)
    try:
        path = snapshot_download(name, revision=revision, cache_dir=cache_dir, endpoint=HUB_ENDPOINT,
                                 allow_patterns=list(MODEL_FILE_PATTERNS), ignore_patterns=list(IGNORED_PATTERNS),
                                 etag_timeout=METADATA_TIMEOUT, max_workers=DOWNLOAD_WORKERS)
    except (ValueError, TypeError):
        raise
    except Exception as e:  # network drops past huggingface_hub's own retries, disk full, hub errors
        raise ModelDownloadError(
            f"downloading model {name!r} (revision {revision}) from {endpoint()} into {cache_dir} stopped: "
            f"{type(e).__name__}: {e}. The files finished so far are kept; calling again fetches the rest") from e
    logger.info("model %s: downloaded to %s", name, path)
    return path
