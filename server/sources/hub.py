"""`hf://org/name[@revision]`: an adapter repository on the Hugging Face Hub, read through
`huggingface_hub` with its own cache, token and `HF_ENDPOINT` / `HF_HUB_OFFLINE` rules."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from server.core.adapter_files import CONTENT_FILES
from server.core.adapter_sources import AdapterSourceFailed
from server.core.errors import AdapterInvalid, AdapterSourceMissing
from server.sources.remote import Deadline, Transient

_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubRemote:
    scheme = "hf"

    def version(self, location: str, deadline: Deadline) -> str | None:
        _, revision = parse_hub(location)
        return revision if revision and _COMMIT.match(revision) else None

    def download(self, location: str, dest: Path, deadline: Deadline) -> int:
        repo, revision = parse_hub(location)
        snapshot = Path(_snapshot(repo, revision, deadline))
        total = 0
        for name in CONTENT_FILES:
            if (snapshot / name).is_file():
                shutil.copyfile(snapshot / name, dest / name)
                total += (dest / name).stat().st_size
        return total


def parse_hub(location: str) -> tuple[str, str | None]:
    rest = location.removeprefix("hf://")
    repo, _, revision = rest.partition("@")
    if not _REPO.match(repo) or ".." in repo:
        raise AdapterInvalid(f"{location} is not hf://org/name[@revision]", param="src")
    return repo, revision or None


def _snapshot(repo: str, revision: str | None, deadline: Deadline) -> str:
    from huggingface_hub import errors as hub
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            repo_id=repo, revision=revision, allow_patterns=list(CONTENT_FILES),
            etag_timeout=deadline.io_timeout(),
        )
    except hub.LocalEntryNotFoundError as exc:
        raise AdapterSourceFailed(f"hf://{repo} is not in the local Hub cache and the Hub "
                                  f"cannot be reached: {exc}", param="src") from None
    except (hub.RevisionNotFoundError, hub.EntryNotFoundError) as exc:
        raise AdapterSourceMissing(f"No adapter found at hf://{repo}: {exc}", param="src") from None
    except hub.GatedRepoError:
        raise AdapterSourceFailed(f"hf://{repo} is gated: the token has no access",
                                  param="src") from None
    except hub.RepositoryNotFoundError:
        raise AdapterSourceMissing(f"No adapter found at hf://{repo}", param="src") from None
    except hub.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403):
            raise AdapterSourceFailed(f"The Hub refused access to hf://{repo}",
                                      param="src") from None
        raise Transient(f"the Hub answered {status}") from None
    except OSError as exc:
        raise Transient(f"{type(exc).__name__}: {exc}") from None
