"""Write a directory completely or not at all: build it in a temp sibling, rename it into place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(dst: Path) -> Iterator[Path]:
    """Yields a temp dir beside `dst`; on success it becomes `dst` (0755 dir, 0644 files), on any error
    it is removed, so a failed write never leaves a half-written `dst`. `dst` must be absent or empty."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)            # mkdtemp makes it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
