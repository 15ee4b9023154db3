"""`s3://bucket/prefix/name`: a folder of adapter files in S3 or an S3-compatible store.

Credentials, region and endpoint come from boto3's standard chain (environment, shared files,
instance roles; `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` for S3-compatible stores). boto3's
own retries are off: the fetcher retries transient failures within its one time bound.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from server.core.adapter_sources import AdapterSourceFailed
from server.core.errors import AdapterInvalid, AdapterSourceMissing
from server.sources.archive import check_member
from server.sources.remote import Deadline, Transient

_CHUNK = 1 << 20
_MAX_OBJECTS = 1_000
_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_REFUSED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
            "ExpiredToken", "InvalidToken", "AllAccessDisabled"}


class S3Remote:
    scheme = "s3"

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._client: Any = None

    def version(self, location: str, deadline: Deadline) -> str | None:
        listing = self._list(location, deadline)
        digest = hashlib.sha256()
        for key, size, etag in listing:
            digest.update(f"{key}\0{size}\0{etag}\n".encode())
        return digest.hexdigest()

    def download(self, location: str, dest: Path, deadline: Deadline) -> int:
        bucket, prefix = _split(location)
        total = 0
        for key, _, _ in self._list(location, deadline):
            relative = key[len(prefix):]
            check_member(relative)
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            total += self._get(bucket, key, target, deadline, self._max_bytes - total)
        return total

    def _list(self, location: str, deadline: Deadline) -> list[tuple[str, int, str]]:
        bucket, prefix = _split(location)
        found: list[tuple[str, int, str]] = []
        with _mapped(location):
            pages = self._s3().get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            )
            for page in pages:
                deadline.check(location)
                for item in page.get("Contents", []):
                    if not item["Key"].endswith("/"):
                        found.append((item["Key"], int(item["Size"]), str(item.get("ETag"))))
        if not found:
            raise AdapterSourceMissing(f"No adapter found at {location}", param="src")
        if len(found) > _MAX_OBJECTS:
            raise AdapterInvalid(f"{location} holds more than {_MAX_OBJECTS} objects",
                                 param="src")
        if sum(size for _, size, _ in found) > self._max_bytes:
            raise AdapterInvalid(
                f"{location} holds more than {self._max_bytes} bytes (adapterCacheGiB)",
                param="src",
            )
        return sorted(found)

    def _get(self, bucket: str, key: str, target: Path, deadline: Deadline, room: int) -> int:
        written = 0
        with _mapped(f"s3://{bucket}/{key}"):
            body = self._s3().get_object(Bucket=bucket, Key=key)["Body"]
            with target.open("wb") as handle:
                while chunk := body.read(_CHUNK):
                    deadline.check(f"s3://{bucket}/{key}")
                    written += len(chunk)
                    if written > room:
                        raise AdapterInvalid(f"s3://{bucket}/{key} grew beyond the cache budget",
                                             param="src")
                    handle.write(chunk)
        return written

    def _s3(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            config = Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1})
            self._client = boto3.session.Session().client("s3", config=config)
        return self._client


def _split(location: str) -> tuple[str, str]:
    """`s3://bucket/prefix/name` -> (bucket, "prefix/name/")."""
    rest = location.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise AdapterInvalid(f"{location} is not s3://bucket/path/to/adapter", param="src")
    return bucket, prefix + "/"


@contextlib.contextmanager
def _mapped(location: str) -> Iterator[None]:
    """botocore's failures as the fetcher's: missing, refused, or transient."""
    from botocore import exceptions as boto

    try:
        yield
    except boto.ClientError as exc:
        raise _client_error(exc, location) from None
    except (boto.NoCredentialsError, boto.PartialCredentialsError):
        raise AdapterSourceFailed("No S3 credentials are configured", param="src") from None
    except (boto.BotoCoreError, OSError) as exc:
        raise Transient(type(exc).__name__) from None


def _client_error(exc: Any, location: str) -> Exception:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    if code in _NOT_FOUND:
        return AdapterSourceMissing(f"No adapter found at {location}", param="src")
    if code in _REFUSED:
        return AdapterSourceFailed(f"The S3 store refused access to {location} ({code})",
                                   param="src")
    if status >= 500 or code in {"SlowDown", "Throttling", "RequestTimeout"}:
        return Transient(f"S3 answered {code or status}")
    return AdapterSourceFailed(f"S3 answered {code or status} for {location}", param="src")
