"""Regenerates ``externalscaler_pb2.py`` from ``proto/externalscaler.proto`` (grpcio-tools).

python -m router.adapters.keda.generate          # writes the module next to this file
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = ROOT / "proto" / "externalscaler.proto"
MODULE = Path(__file__).resolve().parent / "externalscaler_pb2.py"


def generated() -> str:
    """The module's text as grpcio-tools writes it today (messages only: the service is ours)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        code = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={out}", str(PROTO)])
        if code != 0:
            raise RuntimeError(f"protoc failed with {code}")
        return (Path(out) / "externalscaler_pb2.py").read_text()


def main() -> int:
    MODULE.write_text(generated())
    print(f"wrote {MODULE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
