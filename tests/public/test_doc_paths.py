"""Every repository path the README and the current docs (docs/*.md) name in backticks exists, so a reader who
follows one lands on the file (the history under docs/benchmarks/ and docs/gpu/ records paths as they were)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("jaxserve", "sharding", "pallas_kernels", "scripts", "tests", "deploy", "examples")
PATH = re.compile(r"`((?:%s)/[A-Za-z0-9_./-]*)`" % "|".join(TOP_FOLDERS))


@pytest.mark.quick
def test_every_path_the_docs_name_exists():
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]
               for path in PATH.findall(doc.read_text()) if not (ROOT / path).exists()]
    assert not missing, missing
    # The proto lives with the gRPC front end.
    assert "`jaxserve/server/protos/jaxserve.proto`" in (ROOT / "docs" / "serving.md").read_text()
