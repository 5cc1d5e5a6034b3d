"""A model named by a local directory or by a Hugging Face Hub id, resolved to a local directory.

    resolve_model("path/to/dir")           -> Path (an existing directory: used as is)
    resolve_model("moonshotai/Kimi-K2.6")  -> the snapshot directory in the Hub cache (huggingface_hub)

A name that is not an existing directory and has the Hub's `owner/name` shape goes through
`huggingface_hub.snapshot_download`: online it downloads what is missing into the library's cache
(HF_HUB_CACHE / HF_HOME, resumable, with HF_TOKEN for gated repos); with HF_HUB_OFFLINE=1 it returns the
cached snapshot or fails. `owner/name@revision` picks a branch, tag or commit. huggingface_hub comes with the
`serve` extra; without it a Hub id is an error naming the extra, never a guess.
"""
from __future__ import annotations

import re
from pathlib import Path

from ddtree.errors import InputError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")


class ModelNotFoundError(InputError):
    """Neither a local directory nor a Hub id that could be resolved."""


def resolve_model(name, flag: str = "--model") -> Path | None:
    if name is None:
        return None
    path = Path(name)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{flag} {name}: not a directory (a checkpoint or engine directory, or a Hub id)")
    text = str(name)
    if not HUB_ID.match(text):
        raise ModelNotFoundError(f"{flag} {name}: no such directory, and not a Hugging Face Hub id (owner/name)")
    repo_id, _, revision = text.partition("@")
    try:
        from huggingface_hub import constants, snapshot_download  # huggingface_hub: the serve extra
        from huggingface_hub.errors import (  # huggingface_hub: the serve extra
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError as e:
        raise ModelNotFoundError(f"{flag} {name}: no such directory; resolving it as a Hugging Face Hub id needs "
                                 "huggingface_hub (the 'serve' extra: pip install 'ddtree[serve]')") from e
    try:
        return Path(snapshot_download(repo_id, revision=revision or None))
    except LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE is set and " if constants.HF_HUB_OFFLINE else ""
        raise ModelNotFoundError(f"{flag} {name}: {where}the Hub cache ({constants.HF_HUB_CACHE}) has no snapshot "
                                 f"of {repo_id}{'@' + revision if revision else ''}: {e}") from None
    except (RepositoryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelNotFoundError(f"{flag} {name}: could not fetch it from the Hugging Face Hub: "
                                 f"{type(e).__name__}: {e}") from None
