"""Adapters from the Hugging Face Hub through huggingface_hub (its cache, its HF_TOKEN and
HF_HUB_OFFLINE handling; this module reads no environment variable).

The revision is the commit huggingface_hub resolved (a branch or tag moves; a commit is stable): the
snapshot folder it returns is named after it. Only the adapter's two files are fetched
(allow_patterns), into huggingface_hub's own cache (lora.hub_cache_dir), then copied into the
appliance's bounded adapter cache like any remote adapter.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from appliance.lora.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from appliance.lora.sources.uri import RemoteURI, SourceError, SourceMissing

FILES = (CONFIG_FILE, WEIGHTS_FILE)


@dataclass(frozen=True)
class HubRevision:
    commit: str
    snapshot: Path  # huggingface_hub's snapshot folder of that commit

    def __str__(self) -> str:
        return f"commit:{self.commit}"


class HubFetcher:
    def __init__(self, cache_dir: Optional[str], timeout_s: float) -> None:
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s

    def resolve(self, uri: RemoteURI, max_bytes: int) -> HubRevision:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        try:
            snap = Path(snapshot_download(uri.root, revision=uri.revision, cache_dir=self.cache_dir,
                                          allow_patterns=[uri.key(f) for f in FILES],
                                          etag_timeout=self.timeout_s))
        except RevisionNotFoundError:
            raise SourceMissing(f"{uri}: revision {uri.revision!r} does not exist") from None
        except RepositoryNotFoundError:
            raise SourceMissing(f"{uri}: repository {uri.root!r} does not exist (or HF_TOKEN cannot read it)") from None
        except LocalEntryNotFoundError:
            raise SourceError(f"{uri}: not in the local Hugging Face cache and the Hub cannot be reached "
                              "(offline or timed out)") from None
        except (HfHubHTTPError, OSError) as e:
            raise SourceError(f"{uri}: Hub download failed ({type(e).__name__})") from None
        size = 0
        for f in FILES:
            p = snap / uri.key(f)
            if not p.is_file():
                raise SourceError(f"{uri}: no {uri.key(f)} at revision {snap.name} (not a PEFT LoRA adapter?)")
            size += p.stat().st_size
        if size > max_bytes:
            raise SourceError(f"{uri}: {size} bytes, more than lora.max_adapter_bytes ({max_bytes}); refused")
        return HubRevision(snap.name, snap)

    def download(self, uri: RemoteURI, rev: HubRevision, dest: Path) -> None:
        for f in FILES:
            shutil.copyfile(rev.snapshot / uri.key(f), dest / f)  # follows the snapshot's blob links
