"""MkDocs hooks (``hooks:`` in mkdocs.yml): the reference pages generated from the code are
added to the build as files of their own, so they are written afresh by every build and
never stored in docs/."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

# MkDocs loads this file by its path: the repository's root makes ``tooling`` importable.
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tooling.docs.reference import PAGES  # noqa: E402


def on_files(files: Files, config: Any) -> Files:
    for path, make in PAGES.items():
        files.append(File.generated(config, path, content=make()))
    return files
