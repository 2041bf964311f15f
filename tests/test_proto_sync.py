"""The committed generated code must be exactly what protoc makes of proto/ today."""
import filecmp
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_generated_python_matches_the_proto_files(tmp_path):
    subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, timeout=120)
    generated = sorted(p.name for p in (tmp_path / "epd" / "v1").glob("*_pb2*.py"))
    committed = sorted(p.name for p in (REPO / "epd" / "v1").glob("*_pb2*.py"))
    assert generated == committed
    stale = [name for name in generated
             if not filecmp.cmp(tmp_path / "epd" / "v1" / name, REPO / "epd" / "v1" / name, shallow=False)]
    assert not stale, f"regenerate with scripts/gen_proto.sh: {stale} differ from proto/"
