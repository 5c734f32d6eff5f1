"""Regenerates the Python code of the gRPC contracts in proto/ into scaletrain/v1/.

Run with `python -m scaletrain.protogen`; a test checks that doing so changes nothing, so the
committed generated code always matches the .proto sources.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Compile proto/scaletrain/v1/*.proto into `out_dir`/scaletrain/v1/; return the outputs."""
    from grpc_tools import protoc

    sources = sorted(PROTO_ROOT.glob("scaletrain/v1/*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(s.relative_to(PROTO_ROOT)) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted((out_dir / "scaletrain" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
    sys.exit(0)
