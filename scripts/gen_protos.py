"""Regenerate the gRPC modules from ``jaxserve/server/protos/jaxserve.proto``.

    pip install -e ".[dev]"   # grpcio-tools, pinned so the generated code matches the protobuf runtime floor
    python scripts/gen_protos.py [--out DIR]

Writes ``jaxserve_pb2.py``, ``jaxserve_pb2.pyi`` and ``jaxserve_pb2_grpc.py`` next to the .proto file (or into
``--out``) and rewrites the stub's ``import jaxserve_pb2`` to a package-relative import, so the modules import as
``jaxserve.server.protos.jaxserve_pb2`` / ``jaxserve.server.protos.jaxserve_pb2_grpc`` from any working directory.

grpcio-tools 1.85.1 bundles protoc 35.1: its code requires protobuf >= 7.35.1 and grpcio >= 1.85.1 at run time,
which is what pyproject.toml declares. Moving the pin means moving those floors with it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[1] / "jaxserve" / "server" / "protos"
PROTO = "jaxserve.proto"
GENERATED = ("jaxserve_pb2.py", "jaxserve_pb2.pyi", "jaxserve_pb2_grpc.py")


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            str(PROTO_DIR / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    stub = out / "jaxserve_pb2_grpc.py"
    text, count = re.subn(r"^import jaxserve_pb2 as", "from . import jaxserve_pb2 as", stub.read_text(), flags=re.M)
    if count != 1:
        raise RuntimeError(f"expected one 'import jaxserve_pb2' in {stub}, found {count}")
    stub.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder (default: next to the .proto)")
    out = parser.parse_args().out
    generate(out)
    print(f"wrote {', '.join(GENERATED)} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
