"""Remote adapter locations (`s3://BUCKET/PREFIX`, `hf://ORG/REPO[@REVISION][/SUBDIR]`) and the
`lora.allowed_sources` allowlist they must match before anything is fetched. Pure Python.

A `path` that is neither is a local directory, confined to lora.adapter_roots as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from appliance.lora.adapter_files import AdapterError

SCHEMES = ("s3", "hf")
# S3's bucket naming rules (3..63 of lowercase letters, digits, dots and hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# The Hub's repo-id part rule: letters, digits, '-', '_', '.', not starting with '.' or '-'.
_HUB_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}$")
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,127}$")
_KEY_PART = re.compile(r"^[^\x00-\x1f\x7f]+$")


class SourceError(AdapterError):
    """A remote adapter that cannot be served (not allowed, missing, too big, unreachable): HTTP 400,
    nothing registered. Messages name the URI, never a credential."""


class SourceMissing(SourceError):
    """Nothing at that URI (no such object, bucket, repo or revision): the resolver tries its next template."""


@dataclass(frozen=True)
class RemoteURI:
    scheme: str  # s3 | hf
    root: str  # s3: the bucket; hf: ORG/REPO
    path: str  # s3: the key prefix (no leading or trailing '/'); hf: the subdir in the repo ('' = top)
    revision: Optional[str] = None  # hf only: a branch, tag or commit; None = main

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.scheme}://{self.root}{rev}{'/' + self.path if self.path else ''}"

    def key(self, name: str) -> str:
        """The object key (s3) or repo file path (hf) of one adapter file."""
        return f"{self.path}/{name}" if self.path else name


def is_remote(path: str) -> bool:
    return any(path.startswith(f"{s}://") for s in SCHEMES)


def parse_uri(text: str, allow_revision: bool = True) -> RemoteURI:
    """`text` as a RemoteURI, or SourceError naming what is wrong. `..`, empty components, a query,
    a fragment and credentials in the URI are refused: each component is a plain name."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in SCHEMES:
        raise SourceError(f"{text!r}: not a remote adapter URI (expected s3://BUCKET/PREFIX or "
                          "hf://ORG/REPO[@REVISION][/SUBDIR])")
    if any(c in rest for c in "?#\\") or (scheme == "s3" and "@" in rest.split("/")[0]):
        raise SourceError(f"{scheme}:// URI: no query, fragment, backslash or user info allowed")
    parts = rest.strip("/").split("/") if rest.strip("/") else []
    if any(p in ("", ".", "..") for p in parts) or any(not _KEY_PART.match(p) for p in parts):
        raise SourceError(f"{text!r}: empty, '.' or '..' path components (or control characters) are refused")
    if scheme == "s3":
        if not parts or not _BUCKET.match(parts[0]):
            raise SourceError(f"{text!r}: not a valid S3 bucket name")
        return RemoteURI("s3", parts[0], "/".join(parts[1:]))
    if len(parts) < 2:
        raise SourceError(f"{text!r}: expected hf://ORG/REPO[@REVISION][/SUBDIR]")
    repo, at, revision = parts[1].partition("@")
    if at and not revision:
        raise SourceError(f"{text!r}: empty revision after '@'")
    if not _HUB_PART.match(parts[0]) or not _HUB_PART.match(repo) or ".." in repo:
        raise SourceError(f"{text!r}: not a valid Hugging Face repo id")
    if revision and (not allow_revision or not _REVISION.match(revision) or ".." in revision):
        raise SourceError(f"{text!r}: not a valid revision {revision!r}")
    if any("@" in p for p in parts[2:]):
        raise SourceError(f"{text!r}: '@' is only allowed after the repo name")
    return RemoteURI("hf", f"{parts[0]}/{repo}", "/".join(parts[2:]), revision or None)


def parse_allowed(entries: Sequence[str], key: str = "lora.allowed_sources") -> list[RemoteURI]:
    """lora.allowed_sources as RemoteURIs; a bad entry is a ValueError naming its index."""
    out = []
    for i, e in enumerate(entries):
        try:
            out.append(parse_allowed_entry(e))
        except SourceError as err:
            raise ValueError(f"{key}[{i}]: {err}") from None
    return out


def parse_allowed_entry(text: str) -> RemoteURI:
    """One allowlist entry: like a URI, but `hf://ORG` (a whole organisation) is allowed too."""
    if text.startswith("hf://") and "/" not in text[5:].strip("/"):
        org = text[5:].strip("/")
        if not _HUB_PART.match(org):
            raise SourceError(f"{text!r}: not a valid Hugging Face organisation")
        return RemoteURI("hf", org, "")
    return parse_uri(text, allow_revision=False)


def allowed(uri: RemoteURI, entries: Sequence[RemoteURI]) -> bool:
    """Whether `uri` lies under one entry: same scheme; same bucket (s3) and a key prefix made of
    whole components; same repo (hf), a whole organisation, or a subdir made of whole components."""
    for e in entries:
        if e.scheme != uri.scheme:
            continue
        if uri.scheme == "hf" and "/" not in e.root:  # hf://ORG: every repo of the organisation
            if uri.root.split("/")[0] == e.root:
                return True
            continue
        if e.root == uri.root and (not e.path or uri.path == e.path or uri.path.startswith(e.path + "/")):
            return True
    return False


def check_allowed(uri: RemoteURI, entries: Sequence[RemoteURI]) -> None:
    if not allowed(uri, entries):
        raise SourceError(f"{uri}: refused: not under lora.allowed_sources "
                          f"{[str(e) for e in entries] or '(empty: no remote source is allowed)'}")
