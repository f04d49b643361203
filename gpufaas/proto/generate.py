"""Regenerates the message modules from gpufaas.proto (run after editing the .proto; output is committed)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc


def main() -> int:
    here = Path(__file__).resolve().parent
    root = here.parent.parent
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"--python_out={root}",
        f"--pyi_out={root}",
        str(here.relative_to(root) / "gpufaas.proto"),
    ]
    return int(protoc.main(args))


if __name__ == "__main__":
    sys.exit(main())
