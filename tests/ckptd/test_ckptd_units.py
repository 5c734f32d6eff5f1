"""Small pure pieces of ckptd: name validation, block checksums, configuration."""

from __future__ import annotations

import pytest

from ckptd.config import CkptdConfig, S3Config
from ckptd.store import check_path, check_run
from ckptd.tiers import BLOCK_BYTES, BlockCrcs, block_span, first_bad_block
from scaletrain.errors import InvalidArgument


@pytest.mark.parametrize("run", ["llama-8b", "run_1", "exp.2026-11-30T12:00", "a"])
def test_ordinary_run_names_are_accepted(run: str) -> None:
    assert check_run(run) == run


@pytest.mark.parametrize(
    "run", ["", "..", ".", "a/b", "a\\b", "/abs", "x\x00y", "-flag", "a b", "x" * 129]
)
def test_run_names_that_could_escape_or_confuse_are_rejected_in_one_line(run: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_run(run)
    assert "\n" not in str(err.value) and "run name" in str(err.value)


@pytest.mark.parametrize("path", [".metadata", "__0_0.distcp", "sub/__1_0.distcp"])
def test_dcp_file_names_are_accepted(path: str) -> None:
    assert check_path(path) == path


@pytest.mark.parametrize(
    "path",
    ["", "../x", "a/../../b", "/etc/passwd", "a//b", "./x", "x\x00", "a\\b", "_COMMITTED"],
)
def test_file_paths_outside_the_checkpoint_dir_or_reserved_are_rejected(path: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_path(path)
    assert "\n" not in str(err.value)


def test_block_crcs_find_the_one_flipped_byte_whatever_the_write_sizes() -> None:
    data = bytes(range(256)) * (3 * BLOCK_BYTES // 256) + b"tail"
    crcs = BlockCrcs()
    for i in range(0, len(data), 100_003):  # writes that straddle block boundaries
        crcs.update(data[i : i + 100_003])
    packed = crcs.packed()
    assert len(packed) == 4 * 4  # three full blocks and a short one
    assert first_bad_block(data, 0, packed) is None
    damaged = bytearray(data)
    damaged[2 * BLOCK_BYTES + 7] ^= 1
    assert first_bad_block(bytes(damaged), 0, packed) == 2
    start, end = block_span(2 * BLOCK_BYTES + 5, 10, len(data))
    assert (start, end) == (2 * BLOCK_BYTES, 3 * BLOCK_BYTES)
    assert first_bad_block(bytes(damaged[start:end]), start, packed) == 2
    assert block_span(len(data) - 2, 2, len(data)) == (3 * BLOCK_BYTES, len(data))


def test_s3_config_never_shows_its_secret_and_reads_credentials_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    config = S3Config.from_env("http://127.0.0.1:9000", bucket="ckpts")
    assert (config.access_key_id, config.secret_access_key) == ("AKIDEXAMPLE", "very-secret-value")
    assert "very-secret-value" not in repr(config)
    assert "very-secret-value" not in repr(CkptdConfig(data_dir="/tmp/x", s3=config))


def test_a_negative_memory_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        CkptdConfig(data_dir="/tmp/x", memory_budget_bytes=-1)
