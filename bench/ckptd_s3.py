"""S3 tier upload throughput against a plain boto3 multipart upload of the same bytes.

Both go to the same local SeaweedFS with the same part size and parts in flight. The tier's
figure is ckptd's own upload of a committed checkpoint (its `ckptd_tier_seconds` for S3 writes):
every part read back from the SSD copy and verified against its block CRCs, sent with a
Content-MD5, its ETag checked, the object's size and multipart ETag checked with a HEAD, and the
commit marker written last. The baseline is `boto3 upload_file` of the SSD file with boto3's
defaults (which add a CRC32 per part). Target: ratio >= 0.8.

Run: `.venv/bin/python bench/ckptd_s3.py [--mib 256] [--runs 3]`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from ckptd_common import MiB, bench_parser, best_of, chunked, line, payload, save_one_shard, timed

from ckptd.config import CkptdConfig, S3Config
from ckptd.retention import RetentionPolicy
from ckptd.store import CheckpointStore
from ckptd.tiers import CheckpointKey
from scaletrain.app.seaweed import SeaweedS3
from scaletrain.v1 import checkpoint_pb2, common_pb2

PART_MIB, PARALLEL = 16, 4
COMMITTED = checkpoint_pb2.TIER_STATE_COMMITTED


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    data = payload(args.mib)
    shard = chunked(data)
    with (
        tempfile.TemporaryDirectory(prefix="ckptd-bench-") as tmp,
        SeaweedS3(Path(tmp) / "s3") as s3,
    ):
        s3_config = S3Config(
            **{
                **vars(s3.s3_config("bench")),
                "part_bytes": PART_MIB * MiB,
                "parallel_parts": PARALLEL,
            }
        )
        config = CkptdConfig(
            data_dir=Path(tmp) / "ckptd",
            memory_budget_bytes=512 * MiB,
            s3=s3_config,
            retention=RetentionPolicy(memory_last=0, ssd_last=100, s3_every=1),
        )
        plain = boto3.session.Session().client(
            "s3", endpoint_url=s3_config.endpoint_url, region_name="us-east-1",
            aws_access_key_id=s3_config.access_key_id,
            aws_secret_access_key=s3_config.secret_access_key,
            config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip
        transfer = TransferConfig(
            multipart_threshold=PART_MIB * MiB, multipart_chunksize=PART_MIB * MiB,
            max_concurrency=PARALLEL,
        )  # fmt: skip
        steps = iter(range(1, 1000))
        with CheckpointStore(config) as store:
            store.wait_background(60)  # the bucket exists once the startup sync is done

            def tier() -> float:
                step = next(steps)
                before = upload_seconds(store)
                save_one_shard(store, step, shard)
                key = CheckpointKey("bench", step)
                while store.catalog.tier_state(key, common_pb2.TIER_S3) != COMMITTED:
                    time.sleep(0.01)
                return upload_seconds(store) - before

            def baseline() -> float:
                local = store.ssd.path_of(CheckpointKey("bench", 1), "__0_0.distcp")
                return timed(
                    lambda: plain.upload_file(str(local), "bench", "plain/x", Config=transfer)
                )

            tier_s = best_of(1, tier)[0]  # the first save also gives the baseline its file
            plain_s, tier_s2 = best_of(args.runs, baseline, tier)
            tier_s = min(tier_s, tier_s2)
    print(line("plain boto3 multipart upload_file", len(data), plain_s))
    print(line("ckptd S3 tier (verified, marker last)", len(data), tier_s))
    print(f"ratio S3 tier / boto3: {plain_s / tier_s:.2f}  (target >= 0.8)")


def upload_seconds(store: CheckpointStore) -> float:
    value = store.metrics.registry.get_sample_value(
        "ckptd_tier_seconds_sum", {"tier": "S3", "op": "write"}
    )
    return value or 0.0


if __name__ == "__main__":
    main()
