"""Generate the Python stubs in `common/pb/` from `protos/` (`make protos`).

protoc emits absolute imports rooted at the proto include path (`from sluice.v1 import worker_pb2`); we
keep the descriptor file names short and package-qualified (`sluice/v1/worker.proto`, which also avoids
clashing with aetcd's plain `rpc.proto`), and rewrite those imports to live under
`sluice_inference.common.pb`. The same function renders into a temporary folder for the staleness test, so the
check and the build cannot drift.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PB_PACKAGE = "sluice_inference.common.pb"
PB_DIR = ROOT / "common" / "pb"
_TOP_PACKAGES = ("inference", "sluice")
_IMPORT_RE = re.compile(rf"^(from|import) ({'|'.join(_TOP_PACKAGES)})([. ])", re.MULTILINE)


def proto_files() -> list[Path]:
    """Every .proto under protos/, sorted so generation is deterministic."""
    return sorted(PROTO_ROOT.rglob("*.proto"))


def _rewrite_imports(text: str) -> str:
    return _IMPORT_RE.sub(lambda m: f"{m.group(1)} {PB_PACKAGE}.{m.group(2)}{m.group(3)}", text)


def render(out_dir: Path) -> None:
    """Run protoc (python, grpc and mypy stubs) into `out_dir` and rewrite imports to
    `sluice_inference.common.pb`."""
    from grpc_tools import protoc  # a dev dependency: only generation needs it

    out_dir.mkdir(parents=True, exist_ok=True)
    scripts = Path(sys.executable).parent  # mypy-protobuf installs its protoc plugins next to python
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--plugin=protoc-gen-mypy={scripts / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={scripts / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    for path in out_dir.rglob("*.py*"):
        path.write_text(_rewrite_imports(path.read_text()))
    for folder in [out_dir, *(p for p in out_dir.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


def generated_files(folder: Path) -> dict[str, str]:
    """Relative path → content of every generated file under `folder`."""
    return {
        str(p.relative_to(folder)): p.read_text()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.name != "py.typed"
    }


def stale_files() -> list[str]:
    """Files in common/pb that differ from a fresh generation (empty when up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        render(Path(tmp))
        fresh = generated_files(Path(tmp))
    committed = generated_files(PB_DIR) if PB_DIR.exists() else {}
    return sorted(k for k in fresh.keys() | committed.keys() if fresh.get(k) != committed.get(k))


def main(argv: list[str] | None = None) -> int:
    """Regenerate common/pb, or with --check report stale stubs and exit 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether common/pb is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: common/pb/{name}")
        return 1 if stale else 0
    if PB_DIR.exists():
        shutil.rmtree(PB_DIR)
    render(PB_DIR)
    (PB_DIR / "py.typed").touch()
    print(f"generated {len(generated_files(PB_DIR))} files in {PB_DIR.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
