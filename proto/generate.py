"""Generate the Python gRPC code for every .proto under proto/.

The generated modules are committed (so `pip install` needs no code
generator); CI runs `python proto/generate.py --check` to prove they match
the .proto files. Run without flags after editing a .proto.

Generation uses grpcio-tools 1.78, whose protoc emits code that loads on any
protobuf 6.x runtime (the range LMCache requires).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: only needed to regenerate

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    for proto in protos:
        rel = proto.relative_to(PROTO_ROOT)
        rc = protoc.main(
            [
                "protoc",
                f"-I{PROTO_ROOT}",
                f"-I{include}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                str(rel),
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {rel} (exit {rc})")
    return [p for p in out_dir.rglob("*") if p.suffix in (".py", ".pyi")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed code differs from a fresh generation")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            rel = path.relative_to(tmp)
            target = ROOT / rel
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(str(rel))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
                print(f"wrote {rel}")
    if stale:
        print("generated code is out of date: run `python proto/generate.py` and commit:\n  " + "\n  ".join(stale))
        return 1
    if args.check:
        print("generated code is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
