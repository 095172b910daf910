"""URI parsing and the lora.allowed_sources allowlist (appliance/lora/sources/uri.py)."""

from __future__ import annotations

import pytest

from appliance.lora.sources.uri import (RemoteURI, SourceError, allowed, check_allowed, is_remote, parse_allowed,
                                        parse_uri)


@pytest.mark.parametrize("text, want", [
    ("s3://bucket/adapters/sql", RemoteURI("s3", "bucket", "adapters/sql")),
    ("s3://bucket/adapters/sql/", RemoteURI("s3", "bucket", "adapters/sql")),
    ("s3://my.bucket-1", RemoteURI("s3", "my.bucket-1", "")),
    ("hf://org/repo", RemoteURI("hf", "org/repo", "")),
    ("hf://org/repo@v1.2", RemoteURI("hf", "org/repo", "", "v1.2")),
    ("hf://Org_1/my-repo.x@0123456789abcdef0123456789abcdef01234567/sub/dir",
     RemoteURI("hf", "Org_1/my-repo.x", "sub/dir", "0123456789abcdef0123456789abcdef01234567")),
])
def test_parse(text: str, want: RemoteURI) -> None:
    got = parse_uri(text)
    assert got == want
    assert parse_uri(str(got)) == got  # the normalised form parses to itself


@pytest.mark.parametrize("text, why", [
    ("s3://", "bucket"),
    ("s3://Bad_Bucket/x", "bucket"),
    ("s3://user:secret@bucket/x", "user info"),
    ("s3://bucket/../other", "'..'"),
    ("s3://bucket/a//b", "empty"),
    ("s3://bucket/a?versionId=1", "no query"),
    ("s3://bucket/a#frag", "fragment"),
    ("s3://bucket/a\\b", "backslash"),
    ("s3://bucket/a\x00b", "control"),
    ("hf://org", "ORG/REPO"),
    ("hf://org/..", "'..'"),
    ("hf://org/re..po", "repo id"),
    ("hf://-org/repo", "repo id"),
    ("hf://org/repo@", "empty revision"),
    ("hf://org/repo@../x", "'..'"),
    ("hf://org/repo/sub@x", "'@'"),
    ("gs://bucket/x", "not a remote adapter URI"),
    ("/srv/adapters/x", "not a remote adapter URI"),
])
def test_parse_refuses(text: str, why: str) -> None:
    with pytest.raises(SourceError) as e:
        parse_uri(text)
    assert why in str(e.value)
    assert "secret" not in str(e.value)


def test_is_remote() -> None:
    assert is_remote("s3://b/x") and is_remote("hf://o/r")
    assert not is_remote("/srv/s3://x") and not is_remote("s3:/b") and not is_remote("relative/dir")


ALLOW = ["s3://models/adapters", "s3://team-b", "hf://acme", "hf://other/one-repo", "hf://other/mono/loras"]


@pytest.mark.parametrize("uri, ok", [
    ("s3://models/adapters/sql", True),
    ("s3://models/adapters", True),
    ("s3://models/adapters-evil/sql", False),  # a prefix counts in whole components only
    ("s3://models/other/sql", False),
    ("s3://models", False),
    ("s3://team-b/anything/at/all", True),
    ("s3://team-c/x", False),
    ("hf://acme/any-repo", True),
    ("hf://acme/any-repo@dev/sub", True),
    ("hf://acme-evil/repo", False),
    ("hf://other/one-repo@v2", True),
    ("hf://other/two-repo", False),
    ("hf://other/mono/loras/sql", True),
    ("hf://other/mono", False),
    ("hf://other/mono/lorasx", False),
])
def test_allowlist(uri: str, ok: bool) -> None:
    entries = parse_allowed(ALLOW)
    assert allowed(parse_uri(uri), entries) is ok
    if not ok:
        with pytest.raises(SourceError, match="not under lora.allowed_sources"):
            check_allowed(parse_uri(uri), entries)


def test_empty_allowlist_refuses_everything() -> None:
    with pytest.raises(SourceError, match="empty: no remote source is allowed"):
        check_allowed(parse_uri("s3://bucket/x"), [])


@pytest.mark.parametrize("bad", ["s3://Bad_Bucket", "hf://org/repo@main", "hf://../x", "/local/dir"])
def test_allowlist_entries_checked(bad: str) -> None:
    with pytest.raises(ValueError, match=r"lora.allowed_sources\[1\]"):
        parse_allowed(["s3://fine", bad])
