"""s3://bucket/prefix through boto3: one prefix listing, then only the adapter's files.

Credentials and region come from the standard AWS chain; settings.s3_endpoint_url
points at MinIO, SeaweedFS, R2 and the like. Only direct children of the prefix
are taken, so adapters saved side by side under one prefix never mix.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from cluster.errors import AdapterNotFoundError, BadAdapterSourceError, SourceUnavailableError
from cluster.sources import (ACCEPTED_FORMS, ADAPTER_CONFIG, AdapterSource, Progress, SourceSettings,
                             check_components, copy_stream, is_adapter_file)

logger = logging.getLogger(__name__)

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}


@dataclass(frozen=True)
class S3Object:
    name: str  # relative to the prefix
    key: str
    size: int
    etag: str


class S3Source(AdapterSource):
    """The adapter stored under s3://bucket/prefix/ (adapter_config.json and *.safetensors)."""

    def __init__(self, bucket: str, prefix: str, settings: SourceSettings) -> None:
        super().__init__(f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}", settings)
        self.bucket, self.prefix = bucket, prefix

    @classmethod
    def parse(cls, uri: str, settings: SourceSettings) -> "S3Source":
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise BadAdapterSourceError(
                f"malformed S3 URI {uri!r}: bucket {bucket!r} is not a valid bucket name; "
                f"accepted forms: {ACCEPTED_FORMS}")
        prefix = prefix.rstrip("/")
        parts = prefix.split("/") if prefix else []
        check_components(uri, parts)
        if any(p in ("", ".") for p in parts):
            raise BadAdapterSourceError(f"malformed S3 URI {uri!r}: empty or '.' component in the prefix")
        return cls(bucket, prefix, settings)

    def describe(self) -> str:
        at = f" at {self.settings.s3_endpoint_url}" if self.settings.s3_endpoint_url else ""
        return f"{self.uri}{at}"

    def _client(self):
        t = self.settings.timeout_s
        config = Config(connect_timeout=t, read_timeout=t, retries={"max_attempts": 3, "mode": "standard"})
        try:
            return boto3.session.Session().client("s3", endpoint_url=self.settings.s3_endpoint_url, config=config)
        except (BotoCoreError, ValueError) as exc:
            raise SourceUnavailableError(f"cannot set up an S3 client for {self.describe()}: {exc}") from exc

    def _fail(self, exc: Exception, doing: str) -> Exception:
        """The typed error for a boto3 failure while `doing` something."""
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _NOT_FOUND_CODES:
                return AdapterNotFoundError(f"{self.describe()}: {code} while {doing}")
            return SourceUnavailableError(f"{self.describe()}: S3 answered {status} {code} while {doing}: {exc}")
        return SourceUnavailableError(f"{self.describe()} failed while {doing}: {exc}")

    def list_objects(self, client=None) -> list[S3Object]:
        """The adapter files directly under the prefix; AdapterNotFoundError without a config."""
        client = client or self._client()
        base = f"{self.prefix}/" if self.prefix else ""
        found, skipped = [], []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base, Delimiter="/"):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(base):]
                    if is_adapter_file(name):
                        found.append(S3Object(name, obj["Key"], int(obj["Size"]), obj.get("ETag", "").strip('"')))
                    else:
                        skipped.append(name)
        except (BotoCoreError, ClientError) as exc:
            raise self._fail(exc, "listing the prefix") from exc
        if not any(o.name == ADAPTER_CONFIG for o in found):
            raise AdapterNotFoundError(f"{self.describe()} holds no {ADAPTER_CONFIG}")
        if skipped:
            logger.info("%s: skipping %d non-adapter files %s", self.describe(), len(skipped), skipped[:10])
        return sorted(found, key=lambda o: o.name)

    def fingerprint(self) -> str:
        listing = "\n".join(f"{o.name} {o.size} {o.etag}" for o in self.list_objects())
        return "s3:" + hashlib.sha256(listing.encode()).hexdigest()

    def _download(self, staging: Path) -> None:
        client = self._client()
        for obj in self.list_objects(client):
            progress = Progress(self.describe(), obj.name, obj.size)
            try:
                # IfMatch pins the object listed above: a file replaced meanwhile fails instead of mixing versions.
                body = client.get_object(Bucket=self.bucket, Key=obj.key,
                                         **({"IfMatch": f'"{obj.etag}"'} if obj.etag else {}))["Body"]
                with body:
                    copy_stream(body, staging / obj.name, progress)
            except (BotoCoreError, ClientError) as exc:
                raise self._fail(exc, f"downloading {obj.name}") from exc
            if progress.done != obj.size:
                raise SourceUnavailableError(
                    f"{self.describe()}: {obj.name} changed during download ({progress.done} of {obj.size} bytes)")
