"""A real S3 API server for the source tests: moto's standalone server on a free port of 127.0.0.1,
with fake credentials in the standard AWS environment (which boto3 reads)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

# Distinctive, so a test can assert they never show up in an error, a log line or a status body.
ACCESS_KEY = "AKIAAPPLIANCETESTKEY"
SECRET_KEY = "appliance-test-secret-must-never-be-shown"
BUCKET = "adapters"


@pytest.fixture(scope="session")
def s3_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3(s3_url: str):
    """A boto3 client of the test server (the test's own view of the store), with the bucket made."""
    import boto3

    client = boto3.session.Session().client("s3", endpoint_url=s3_url, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    return client


def upload(s3, local_dir: Path, prefix: str) -> str:
    """The adapter dir's files under s3://BUCKET/prefix/; returns that URI."""
    for f in local_dir.iterdir():
        if f.is_file():
            s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
    return f"s3://{BUCKET}/{prefix}"
