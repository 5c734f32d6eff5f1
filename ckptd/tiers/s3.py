"""The S3 tier: the durable, off-node copy of each checkpoint, and its background upload queue.

Object layout: `<run>/<step>/<path>` for each DCP file and `<run>/<step>/_COMMITTED`, a small JSON
manifest written LAST, so a checkpoint exists on S3 exactly when its marker does: a reader that
lists markers never sees a half-uploaded checkpoint, and delete removes the marker first.

Uploads run in one background thread (`UploadQueue`) because S3 is the slowest tier and must never
delay the commit of the faster ones; failures are retried with exponential backoff.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from ckptd.config import S3Config
from ckptd.tiers import CheckpointKey
from scaletrain.v1 import common_pb2

log = logging.getLogger(__name__)

MARKER = "_COMMITTED"
_MiB = 1 << 20


def make_s3_client(config: S3Config):  # boto3 clients have no importable type
    """A boto3 S3 client for an S3-compatible endpoint: path addressing, bounded retries/timeouts.

    boto3's own retries stay low because the upload queue retries whole files with backoff; reads
    fall through to another tier instead of waiting.
    """
    return boto3.session.Session().client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region,
        aws_access_key_id=config.access_key_id or None,
        aws_secret_access_key=config.secret_access_key or None,
        config=BotoConfig(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=16,
        ),
    )


class S3Tier:
    """Committed checkpoints as objects in one bucket."""

    tier = common_pb2.TIER_S3

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.bucket = config.bucket
        self._client = make_s3_client(config)
        self._transfer = TransferConfig(
            multipart_threshold=64 * _MiB, multipart_chunksize=32 * _MiB, max_concurrency=4
        )
        self._bucket_ready = False

    def object_key(self, key: CheckpointKey, path: str) -> str:
        return f"{key.run}/{key.step}/{path}"

    def ensure_bucket(self) -> None:
        """Create the bucket on first use; done lazily so an unreachable S3 never blocks startup."""
        if self._bucket_ready:
            return
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                raise
            try:
                self._client.create_bucket(Bucket=self.bucket)
            except ClientError as create_exc:
                code = create_exc.response.get("Error", {}).get("Code")
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
        self._bucket_ready = True

    def put(self, key: CheckpointKey, files: list[tuple[str, Path, int]], manifest: bytes) -> None:
        """Upload (path, local file, size) triples, check each size, then write the marker."""
        self.ensure_bucket()
        for path, local, size in files:
            object_key = self.object_key(key, path)
            self._client.upload_file(str(local), self.bucket, object_key, Config=self._transfer)
            stored = self._client.head_object(Bucket=self.bucket, Key=object_key)["ContentLength"]
            if stored != size:
                raise OSError(f"s3://{self.bucket}/{object_key} holds {stored} bytes, sent {size}")
        self._client.put_object(
            Bucket=self.bucket,
            Key=self.object_key(key, MARKER),
            Body=manifest,
            ContentType="application/json",
        )

    def has(self, key: CheckpointKey) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.object_key(key, MARKER))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def read_range(self, key: CheckpointKey, path: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        reply = self._client.get_object(
            Bucket=self.bucket,
            Key=self.object_key(key, path),
            Range=f"bytes={offset}-{offset + length - 1}",
        )
        return reply["Body"].read()

    def delete(self, key: CheckpointKey) -> bool:
        """Remove the marker first (the checkpoint is gone from then on), then its files."""
        prefix = f"{key.run}/{key.step}/"
        existed = self.has(key)
        self._client.delete_object(Bucket=self.bucket, Key=self.object_key(key, MARKER))
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            objects = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if objects:
                existed = True
                self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})
        return existed

    def list(self) -> list[CheckpointKey]:
        keys = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            for obj in page.get("Contents", []):
                run, _, rest = obj["Key"].partition("/")
                step, _, name = rest.partition("/")
                if name == MARKER and step.isdigit():
                    keys.append(CheckpointKey(run, int(step)))
        return sorted(keys)


class UploadQueue:
    """Runs upload jobs one at a time in a daemon thread, retrying with exponential backoff.

    A job raises to ask for a retry; after the last attempt `on_failure` gets a one-line reason.
    Jobs still queued at close are simply dropped: the caller's persistent state (the SSD tier
    and the catalog) re-queues them at the next start.
    """

    def __init__(
        self,
        job: Callable[[CheckpointKey], None],
        on_failure: Callable[[CheckpointKey, str], None],
        attempts: int,
        backoff_s: float,
    ) -> None:
        self._job = job
        self._on_failure = on_failure
        self._attempts = max(1, attempts)
        self._backoff_s = backoff_s
        self._queue: queue.Queue[CheckpointKey | None] = queue.Queue()
        self._queued: set[CheckpointKey] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-s3-upload", daemon=True)
        self._thread.start()

    def submit(self, key: CheckpointKey) -> None:
        with self._lock:
            if key in self._queued:
                return
            self._queued.add(key)
        self._queue.put(key)

    def close(self, timeout_s: float) -> None:
        """Let the job in flight finish for up to `timeout_s`, then stop."""
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            key = self._queue.get()
            if key is None:
                return
            with self._lock:
                self._queued.discard(key)
            self._attempt(key)

    def _attempt(self, key: CheckpointKey) -> None:
        for attempt in range(1, self._attempts + 1):
            try:
                self._job(key)
                return
            except Exception as exc:  # any failure of a job is retried
                reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
                log.warning(
                    "S3 upload of %s failed (attempt %d/%d): %s",
                    key,
                    attempt,
                    self._attempts,
                    reason,
                )
                if attempt == self._attempts:
                    self._on_failure(key, reason)
                    return
                if self._stop.wait(self._backoff_s * 2 ** (attempt - 1)):
                    return
