"""Where an adapter `path` (YAML `path:`, admin `lora_path`) is read from: a local directory as given,
or a remote URI checked against lora.allowed_sources, then resolved to a revision and fetched into
the disk cache (cache.py). What comes back is a local directory for the confined reader
(lora/adapter_files.py), for which the cache directory is an adapter root.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from appliance.config.schema import LoRAConfig
from appliance.lora.adapter_files import AdapterError
from appliance.lora.sources.cache import DiskCache
from appliance.lora.sources.uri import RemoteURI, SourceError, check_allowed, is_remote, parse_allowed, parse_uri

if TYPE_CHECKING:
    from appliance.lora.sources.worker import FetchWorkers


@dataclass(frozen=True)
class Fetched:
    dir: Path  # the cache entry holding the adapter's two files
    source: str  # the normalised URI (what the registry and the plan show)
    revision: str  # etag:... (s3) or commit:... (hf)
    downloaded: bool  # false: a cache hit


def shown_as_source(e: AdapterError, fetched: Optional[Fetched]) -> AdapterError:
    """The reader's refusal of a fetched adapter, naming its URI instead of its cache entry."""
    if fetched is None:
        return e
    return type(e)(str(e).replace(str(fetched.dir), fetched.source))


class AdapterSources:
    """One per LoRA config; instances sharing a cache dir share downloads through its file locks."""

    def __init__(self, cfg: LoRAConfig, workers: Optional["FetchWorkers"] = None) -> None:
        # workers: run each remote fetch in a worker process (lora.fetch_in_subprocess; worker.py)
        self.cfg = cfg
        self.workers = workers
        self.allowed: list[RemoteURI] = parse_allowed(cfg.allowed_sources)
        self.cache = DiskCache(Path(cfg.adapter_cache_dir).expanduser(), cfg.adapter_cache_bytes)
        self._fetchers: dict[str, Any] = {}
        self._lock = threading.Lock()  # the fetchers are made once, by whichever thread asks first

    def check(self, path: str) -> None:
        """SourceError unless `path` is local or a well-formed URI under lora.allowed_sources (no store call)."""
        if is_remote(path):
            check_allowed(parse_uri(path), self.allowed)

    def fetch(self, path: str) -> Optional[Fetched]:
        """None for a local path (read as before); else the adapter in the disk cache at its current
        revision. SourceError (nothing fetched) when the URI is malformed or not allowed."""
        if not is_remote(path):
            return None
        uri = parse_uri(path)
        check_allowed(uri, self.allowed)
        if self.workers is not None:  # the same steps below, in a worker process
            fetched = self.workers.fetch(path)
            assert fetched is not None
            self.cache.downloads += fetched.downloaded
            return fetched
        fetcher = self.fetcher(uri.scheme)
        rev = fetcher.resolve(uri, self.cfg.max_adapter_bytes)
        self.cache.root.mkdir(parents=True, exist_ok=True)
        d, downloaded = self.cache.get(str(uri), str(rev), lambda tmp: fetcher.download(uri, rev, tmp))
        return Fetched(d, str(uri), str(rev), downloaded)

    def refresh(self, source: str, cached: Path) -> Path:
        """The dir of a registered remote adapter for a cold read: `cached` while it is on disk, else
        fetched again (evicted by the size bound; the reader's checksum check refuses other bytes)."""
        if self.cache.lookup(cached):
            return cached
        fetched = self.fetch(source)
        assert fetched is not None
        return fetched.dir

    def local(self, path: str) -> tuple[str, Optional[Fetched]]:
        """The local dir to read for `path`: itself when local, else its fetched cache entry."""
        fetched = self.fetch(path)
        return (path, None) if fetched is None else (str(fetched.dir), fetched)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    def fetcher(self, scheme: str) -> Any:
        with self._lock:
            return self._make(scheme)

    def _make(self, scheme: str) -> Any:
        if scheme not in self._fetchers:
            if scheme == "s3":
                from appliance.lora.sources.s3 import S3Fetcher

                self._fetchers[scheme] = S3Fetcher(self.cfg.s3_endpoint_url, self.cfg.s3_region,
                                                   self.cfg.fetch_timeout_s)
            elif scheme == "hf":
                from appliance.lora.sources.hub import HubFetcher

                self._fetchers[scheme] = HubFetcher(self.cfg.hub_cache_dir, self.cfg.fetch_timeout_s)
            else:  # parse_uri admits only the schemes above
                raise SourceError(f"unknown adapter source scheme {scheme!r}")
        return self._fetchers[scheme]
