"""`S3CacheStore`: the compile-cache archives kept under an `s3://bucket/prefix`.

boto3 is imported only when a store is used (install `boto3` for S3 caches). Credentials come from boto3's usual
chain (environment, config files, instance role) and are never put into messages: `redact` strips them from
any error text before it is logged.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

_SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
ARCHIVE_SUFFIX = ".tar.gz"


def is_s3_url(url: str) -> bool:
    """Whether `url` names an S3 location (`s3://bucket[/prefix]`)."""
    return url.startswith("s3://")


def redact(text: str) -> str:
    """`text` with any AWS credential from the environment replaced by `***`."""
    for name in _SECRET_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


class S3CacheStore:
    """Lists, downloads and uploads `*.tar.gz` archives under one S3 prefix.

    `connect_timeout` and `max_attempts` are kept small so an unreachable endpoint costs seconds, not minutes.
    `endpoint_url` (else boto3's `AWS_ENDPOINT_URL`) selects an S3-compatible service.
    """

    def __init__(
        self, url: str, endpoint_url: str | None = None, connect_timeout: float = 5.0, max_attempts: int = 2
    ) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"Expected an S3 URL like 's3://bucket/prefix', got {url!r}.")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self._endpoint_url = endpoint_url
        self._connect_timeout = connect_timeout
        self._max_attempts = max_attempts
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The boto3 S3 client, created on first use."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=self._connect_timeout,
                read_timeout=max(self._connect_timeout, 60.0),
                retries={"max_attempts": self._max_attempts, "mode": "standard"},
            )
            session = boto3.session.Session()  # its own: reads the credentials in force now, not cached ones
            self._client = session.client("s3", endpoint_url=self._endpoint_url, config=config)
        return self._client

    def key(self, name: str) -> str:
        """The object key for archive file `name` under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def list_archives(self) -> list[str]:
        """Keys of all archives under the prefix, oldest first."""
        paginator = self.client.get_paginator("list_objects_v2")
        prefix = f"{self.prefix}/" if self.prefix else ""
        found = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                if item["Key"].endswith(ARCHIVE_SUFFIX):
                    found.append((item["LastModified"], item["Key"]))
        return [key for _, key in sorted(found)]

    def download(self, key: str, path: str) -> None:
        """Copy object `key` to local file `path`."""
        self.client.download_file(self.bucket, key, path)

    def upload(self, path: str, key: str) -> None:
        """Copy local file `path` to object `key`."""
        self.client.upload_file(path, self.bucket, key)
