"""The S3 tier: the durable, off-node copy of each checkpoint.

Object layout: `<run>/<step>/<path>` for each DCP file and `<run>/<step>/_COMMITTED`, the manifest
(`ckptd.manifest`) written LAST, so a checkpoint exists on S3 exactly when its marker does: a
reader that lists markers never sees a half-uploaded checkpoint, and delete removes the marker
first.

Each file goes up as a multipart upload whose parts are sent in parallel. Every part carries a
Content-MD5 that S3 checks on receipt, its returned ETag is compared with the MD5, and once the
upload is completed the object's size and multipart ETag (the MD5 of the part MD5s) are checked
with a HEAD: a file counts as uploaded only when S3 provably holds exactly its bytes. Every
request is retried with exponential backoff and full jitter under connect and read timeouts, so
an S3 that is slow or away costs the S3 tier time and nothing else (uploads run in the background,
see `ckptd.uploads`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from ckptd.config import S3Config
from ckptd.crash import crash_point
from ckptd.manifest import MARKER, Manifest
from ckptd.tiers import CheckpointKey
from scaletrain.v1 import common_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
# Errors that no retry can fix: the request itself (or the credentials, or the bucket) is wrong.
_PERMANENT = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoSuchBucket",
    "InvalidBucketName",
    "InvalidArgument",
    "EntityTooLarge",
}
_MISSING = ("404", "NoSuchKey", "NotFound")

# Reads a byte range [offset, offset+length) of a checkpoint file, verified, from a faster tier.
PartSource = Callable[[str, int, int], bytes]


def make_s3_client(config: S3Config):  # boto3 clients have no importable type
    """A boto3 S3 client for an S3-compatible endpoint: path addressing, our own retries.

    botocore's retries are off because `S3Tier` retries each request itself with backoff and
    jitter; its default CRC32 trailer is off because every body carries a Content-MD5 instead.
    """
    return boto3.session.Session().client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region,
        aws_access_key_id=config.access_key_id or None,
        aws_secret_access_key=config.secret_access_key or None,
        config=BotoConfig(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1},
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            max_pool_connections=max(16, 2 * config.parallel_parts),
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _md5(data: bytes) -> tuple[str, str]:
    digest = hashlib.md5(data, usedforsecurity=False).digest()
    return digest.hex(), base64.b64encode(digest).decode()


class S3Tier:
    """Committed checkpoints as objects in one bucket."""

    tier = common_pb2.TIER_S3

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.bucket = config.bucket
        self._client = make_s3_client(config)
        self._parts = ThreadPoolExecutor(config.parallel_parts, thread_name_prefix="ckptd-s3-part")
        self._bucket_ready = False

    def close(self) -> None:
        self._parts.shutdown(wait=False, cancel_futures=True)

    def object_key(self, key: CheckpointKey, path: str) -> str:
        return f"{key.run}/{key.step}/{path}"

    # -- retries ---------------------------------------------------------------------------------

    def call(self, what: str, fn: Callable[[], T], attempts: int | None = None) -> T:
        """Run one request, retrying transient failures with exponential backoff and jitter."""
        attempts = attempts or self.config.attempts
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except (ClientError, BotoCoreError, OSError) as exc:
                if _code(exc) in _PERMANENT or _code(exc) in _MISSING or attempt == attempts:
                    raise
                cap = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
                delay = random.uniform(0, cap)  # "full jitter": retries of many clients spread
                log.info("S3 %s failed (%s); retry %d in %.2fs", what, exc, attempt, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def ensure_bucket(self) -> None:
        """Create the bucket on first use; done lazily so an unreachable S3 never blocks startup."""
        if self._bucket_ready:
            return
        try:
            self.call("head bucket", lambda: self._client.head_bucket(Bucket=self.bucket))
        except ClientError as exc:
            if _code(exc) not in (*_MISSING, "NoSuchBucket"):
                raise
            try:
                self.call("create bucket", lambda: self._client.create_bucket(Bucket=self.bucket))
            except ClientError as create_exc:
                if _code(create_exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
        self._bucket_ready = True

    # -- upload ----------------------------------------------------------------------------------

    def put(self, manifest: Manifest, source: PartSource, node: str) -> list[str]:
        """Upload `node`'s part of `manifest` from `source` and verify each file; then write the
        marker if every node's part is there. Returns the paths S3 still lacks (none: the
        marker is written), which other nodes are to upload."""
        self.ensure_bucket()
        part = manifest.files_on(node)
        self.abort_incomplete(manifest.key, {f.path for f in part})
        for record in part:
            if self._size_of(manifest.key, record.path) != record.size:  # a retry skips what is up
                self._put_file(manifest.key, record.path, record.size, source)
        crash_point("s3-files-uploaded")
        return self.complete(manifest)

    def complete(self, manifest: Manifest) -> list[str]:
        """Write the marker once every file of `manifest` is on S3 at its size; returns the
        paths still missing (the marker is then not written)."""
        missing = [f.path for f in manifest.files if self._size_of(manifest.key, f.path) != f.size]
        if not missing:
            self._put_object(self.object_key(manifest.key, MARKER), manifest.to_json())
        return missing

    def _size_of(self, key: CheckpointKey, path: str) -> int | None:
        object_key = self.object_key(key, path)
        try:
            head = self.call(
                f"check {object_key}",
                lambda: self._client.head_object(Bucket=self.bucket, Key=object_key),
            )
        except ClientError as exc:
            if _code(exc) in _MISSING:
                return None
            raise
        return int(head["ContentLength"])

    def _put_file(self, key: CheckpointKey, path: str, size: int, source: PartSource) -> None:
        object_key = self.object_key(key, path)
        part_bytes = self.config.part_bytes
        if size <= part_bytes:
            self._put_object(object_key, source(path, 0, size))
            return
        upload_id = self.call(
            f"start upload of {object_key}",
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=object_key),
        )["UploadId"]
        try:
            offsets = range(0, size, part_bytes)
            jobs = [
                self._parts.submit(
                    self._put_part, object_key, upload_id, number, path, offset,
                    min(part_bytes, size - offset), source,
                )
                for number, offset in enumerate(offsets, 1)
            ]  # fmt: skip
            md5s = [job.result() for job in jobs]
            parts = [{"ETag": f'"{m.hex()}"', "PartNumber": n} for n, m in enumerate(md5s, 1)]
            self.call(
                f"complete upload of {object_key}",
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=object_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except BaseException:
            # If this fails too, abort_incomplete() of the next attempt cleans up.
            with contextlib.suppress(ClientError, BotoCoreError, OSError):
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=object_key, UploadId=upload_id
                )
            raise
        etag = hashlib.md5(b"".join(md5s), usedforsecurity=False).hexdigest() + f"-{len(md5s)}"
        self._verify(object_key, size, etag)

    def _put_part(
        self,
        object_key: str,
        upload_id: str,
        number: int,
        path: str,
        offset: int,
        length: int,
        source: PartSource,
    ) -> bytes:
        data = source(path, offset, length)
        md5_hex, md5_b64 = _md5(data)
        reply = self.call(
            f"upload part {number} of {object_key}",
            lambda: self._client.upload_part(
                Bucket=self.bucket,
                Key=object_key,
                UploadId=upload_id,
                PartNumber=number,
                Body=data,
                ContentMD5=md5_b64,
            ),
        )
        if reply["ETag"].strip('"') != md5_hex:
            raise OSError(f"S3 stored part {number} of {object_key} with ETag {reply['ETag']}")
        crash_point("s3-part-uploaded")
        return bytes.fromhex(md5_hex)

    def _put_object(self, object_key: str, data: bytes) -> None:
        md5_hex, md5_b64 = _md5(data)
        self.call(
            f"upload {object_key}",
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=object_key, Body=data, ContentMD5=md5_b64
            ),
        )
        self._verify(object_key, len(data), md5_hex)

    def _verify(self, object_key: str, size: int, etag: str) -> None:
        head = self.call(
            f"check {object_key}",
            lambda: self._client.head_object(Bucket=self.bucket, Key=object_key),
        )
        stored, stored_etag = head["ContentLength"], head["ETag"].strip('"')
        if stored != size or stored_etag != etag:
            raise OSError(
                f"s3://{self.bucket}/{object_key} holds {stored} bytes with ETag {stored_etag}; "
                f"sent {size} bytes with ETag {etag}"
            )

    def abort_incomplete(self, key: CheckpointKey, paths: set[str] | None = None) -> int:
        """Abort multipart uploads left under `key` by an earlier, interrupted attempt (only of
        `paths`, if given: other nodes may be uploading the other files right now)."""
        prefix = f"{key.run}/{key.step}/"
        listing = self.call(
            f"list uploads under {prefix}",
            lambda: self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix),
        )
        uploads = [
            u
            for u in listing.get("Uploads") or []
            if paths is None or u["Key"].removeprefix(prefix) in paths
        ]
        for upload in uploads:
            self.call(
                f"abort upload of {upload['Key']}",
                lambda u=upload: self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                ),
            )
        return len(uploads)

    # -- the Tier interface ----------------------------------------------------------------------

    def has(self, key: CheckpointKey) -> bool:
        try:
            self.call(
                f"check {key}",
                lambda: self._client.head_object(
                    Bucket=self.bucket, Key=self.object_key(key, MARKER)
                ),
            )
        except ClientError as exc:
            if _code(exc) in _MISSING:
                return False
            raise
        return True

    def manifest(self, key: CheckpointKey) -> Manifest | None:
        """The marker of `key`, or None if S3 holds no committed copy."""
        object_key = self.object_key(key, MARKER)
        try:
            reply = self.call(
                f"read {object_key}",
                lambda: self._client.get_object(Bucket=self.bucket, Key=object_key)["Body"].read(),
            )
        except ClientError as exc:
            if _code(exc) in (*_MISSING, "NoSuchBucket"):
                return None
            raise
        return Manifest.from_json(reply, f"s3://{self.bucket}/{object_key}")

    def read_range(self, key: CheckpointKey, path: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        object_key = self.object_key(key, path)
        return self.call(
            f"read {object_key}",
            lambda: self._client.get_object(
                Bucket=self.bucket, Key=object_key, Range=f"bytes={offset}-{offset + length - 1}"
            )["Body"].read(),
            attempts=2,  # a reader has other tiers to fall back on
        )

    def delete(self, key: CheckpointKey) -> bool:
        """Remove the marker first (the checkpoint is gone from then on), then its files."""
        prefix = f"{key.run}/{key.step}/"
        existed = self.has(key)
        self.call(
            f"delete {prefix}{MARKER}",
            lambda: self._client.delete_object(Bucket=self.bucket, Key=prefix + MARKER),
        )
        crash_point("s3-marker-deleted")
        for objects in self._pages(prefix):
            existed = True
            self.call(
                f"delete objects under {prefix}",
                lambda o=objects: self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in o]}
                ),
            )
        self.abort_incomplete(key)
        return existed

    def _pages(self, prefix: str) -> list[list[str]]:
        pages = self.call(
            f"list {prefix}",
            lambda: [
                [obj["Key"] for obj in page.get("Contents", [])]
                for page in self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=prefix
                )
            ],
        )
        return [page for page in pages if page]

    def list(self) -> list[CheckpointKey]:
        """Every checkpoint with a marker in the bucket (none if the bucket does not exist)."""
        keys = []
        try:
            pages = self._pages("")
        except ClientError as exc:
            if _code(exc) == "NoSuchBucket":
                return []
            raise
        for page in pages:
            for object_key in page:
                run, _, rest = object_key.partition("/")
                step, _, name = rest.partition("/")
                if name == MARKER and step.isdigit():
                    keys.append(CheckpointKey(run, int(step)))
        return sorted(keys)


def describe(exc: BaseException) -> str:
    """One line for a failed S3 operation, for tier errors and logs."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
