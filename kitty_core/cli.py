"""What every command line here needs: counts checked as they are parsed, output paths checked
before the work that fills them, and result files written whole or not at all.

A result is written to a temporary file in its folder and renamed over the old one (`os.replace`,
atomic on one filesystem), so a run that fails while writing (a full disk, an interrupt) leaves the
previous file as it was.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def count(minimum: int):
    """An argparse type: an integer of at least `minimum`, or a usage error that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"needs an integer of at least {minimum}, got {text!r}")
        return value
    return parse


def positive(text: str) -> float:
    """An argparse type: a number above 0, or a usage error that says so."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise argparse.ArgumentTypeError(f"needs a number above 0, got {text!r}")
    return value


def writable(path: Path, folder: bool = False) -> Path:
    """Check that `path` (a file, or with `folder` a directory of files) can be written, creating its
    folder; ValueError naming the path and the cause, before any work is done for it."""
    where = path if folder else path.parent
    if not folder and path.is_dir():
        raise ValueError(f"cannot write {path}: it is a directory; give a file name")
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        raise ValueError(f"cannot write to {where}: {err.strerror or err}; choose another path") from err
    return path


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(temporary path)`, then the temporary file renamed to `path`; on any failure the
    temporary file is removed and `path` keeps what it held."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def write_csv(path: Path, df) -> None:
    write_atomic(path, lambda tmp: df.to_csv(tmp, index=False))
