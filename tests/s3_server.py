"""A real S3 API for tests: moto's server on a free local port, with one empty bucket, and the environment that points
AWS clients at it (botocore and s3fs read `AWS_ENDPOINT_URL`; lightning_trn's s3torchconnector client too)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

SECRET = "TEST-SECRET-KEY-d41d8cd98f00b204"


@contextmanager
def moto_s3(bucket: str) -> Iterator[str]:
    """Start the server, set the environment, create `bucket`; yields the endpoint URL. Everything is put back after."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": endpoint,
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
