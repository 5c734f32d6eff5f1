"""The committed generated code is exactly what the .proto sources produce."""

from __future__ import annotations

from pathlib import Path

from scaletrain import protogen


def test_regenerating_the_grpc_code_changes_nothing(tmp_path: Path):
    fresh = protogen.generate(tmp_path)
    committed_dir = protogen.ROOT / "scaletrain" / "v1"
    assert [p.name for p in fresh] == sorted(p.name for p in committed_dir.glob("*_pb2*.py*")), (
        "a generated module is missing or stale: run `make proto`"
    )
    for path in fresh:
        assert path.read_bytes() == (committed_dir / path.name).read_bytes(), (
            f"{path.name} differs from proto/: run `make proto` and commit the result"
        )


def test_the_contracts_are_importable_as_scaletrain_v1_and_not_as_proto():
    from scaletrain.v1 import checkpoint_pb2, telemetry_pb2

    assert checkpoint_pb2.DESCRIPTOR.package == "scaletrain.v1"
    assert telemetry_pb2.DESCRIPTOR.package == "scaletrain.v1"
    assert not (protogen.ROOT / "proto" / "__init__.py").exists()
