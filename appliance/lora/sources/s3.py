"""Adapters from S3 or an S3-compatible store (MinIO, Ceph, moto) through boto3.

Credentials come from boto3's standard chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profiles,
instance roles); this module never reads or names them. The revision of an adapter is the ETags of its
two files (HEAD, before any body is read); each body is fetched with If-Match on that ETag, streamed
to disk under lora.max_adapter_bytes and the time budget, and checked against the ETag's MD5 when the
ETag is one (single-part uploads).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from appliance.lora.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from appliance.lora.sources.uri import RemoteURI, SourceError, SourceMissing

FILES = (CONFIG_FILE, WEIGHTS_FILE)
_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class S3Revision:
    etags: tuple[str, ...]  # per FILES, quotes stripped
    sizes: tuple[int, ...]

    def __str__(self) -> str:
        return "etag:" + ",".join(self.etags)


class S3Fetcher:
    def __init__(self, endpoint_url: Optional[str], region: Optional[str], timeout_s: float) -> None:
        import boto3
        from botocore.config import Config

        self.timeout_s = timeout_s
        for name in ("botocore", "boto3", "s3transfer", "urllib3"):
            # Their DEBUG records carry request headers (the access key id in Authorization): INFO at most.
            lg = logging.getLogger(name)
            if lg.getEffectiveLevel() < logging.INFO:
                lg.setLevel(logging.INFO)
        # A session of its own: boto3's default session is shared module state.
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region,
            config=Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2}))

    def resolve(self, uri: RemoteURI, max_bytes: int) -> S3Revision:
        """The ETags and sizes of the adapter's two files; refused before any download when they are
        missing or together larger than `max_bytes`."""
        etags, sizes = [], []
        for name in FILES:
            head = self._call(uri, name, "head_object", Bucket=uri.root, Key=uri.key(name))
            etags.append(str(head.get("ETag", "")).strip('"'))
            sizes.append(int(head.get("ContentLength", 0)))
        if sum(sizes) > max_bytes:
            raise SourceError(f"{uri}: {sum(sizes)} bytes, more than lora.max_adapter_bytes ({max_bytes}); refused "
                              "unread")
        return S3Revision(tuple(etags), tuple(sizes))

    def download(self, uri: RemoteURI, rev: S3Revision, dest: Path) -> None:
        """Both files into `dest`, each the exact object `rev` names (If-Match), its size as HEAD said,
        its MD5 equal to a plain ETag, all within lora.fetch_timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        for name, etag, size in zip(FILES, rev.etags, rev.sizes):
            obj = self._call(uri, name, "get_object", Bucket=uri.root, Key=uri.key(name), IfMatch=f'"{etag}"')
            md5 = hashlib.md5(usedforsecurity=False)
            got = 0
            body = obj["Body"]
            try:
                with open(dest / name, "wb") as f:
                    for chunk in iter(lambda: self._read(body, uri, name), b""):
                        got += len(chunk)
                        if got > size:
                            raise SourceError(f"{uri}: {name} is longer than the {size} bytes its HEAD declared")
                        if time.monotonic() > deadline:
                            raise SourceError(f"{uri}: download took longer than lora.fetch_timeout_s "
                                              f"({self.timeout_s} s)")
                        md5.update(chunk)
                        f.write(chunk)
            finally:
                body.close()
            if got != size:
                raise SourceError(f"{uri}: {name} ended after {got} of {size} bytes")
            if _MD5_ETAG.match(etag) and md5.hexdigest() != etag:
                raise SourceError(f"{uri}: {name}: content does not match its ETag (MD5); refused")

    def _read(self, body: Any, uri: RemoteURI, name: str) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            return body.read(_CHUNK)
        except (BotoCoreError, OSError) as e:
            raise SourceError(f"{uri}: {name}: download failed ({type(e).__name__})") from None

    def _call(self, uri: RemoteURI, name: str, op: str, **kw: Any) -> Any:
        """One S3 call; its failures as SourceError with the object's URI and the error code only (no
        request ids, headers or signatures, which could carry credential material)."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = f"s3://{uri.root}/{uri.key(name)}"
        try:
            return getattr(self.client, op)(**kw)
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("404", "NoSuchKey", "NotFound"):
                hint = " (not a PEFT LoRA adapter prefix?)" if name == CONFIG_FILE else ""
                raise SourceMissing(f"{uri}: {where} does not exist{hint}") from None
            if code == "NoSuchBucket":
                raise SourceMissing(f"{uri}: bucket {uri.root!r} does not exist") from None
            if code in ("403", "AccessDenied"):
                raise SourceError(f"{uri}: access to {where} denied (check the AWS credentials' permissions)") from None
            if code in ("412", "PreconditionFailed"):
                raise SourceError(f"{uri}: {where} changed while it was downloaded; try again") from None
            raise SourceError(f"{uri}: {where}: S3 error {code or status}") from None
        except NoCredentialsError:
            raise SourceError(f"{uri}: no AWS credentials found (the standard AWS environment)") from None
        except BotoCoreError as e:  # connect/read timeouts, unreachable endpoint
            raise SourceError(f"{uri}: {where}: S3 request failed ({type(e).__name__})") from None
