"""Saved result files, read and checked in one place: the lab's pages and the command lines that
add to a file read them through these functions, which check that a file holds what its kind needs
before anything uses it. A file that does not raises `ResultFileError`, naming the file and what is
wrong; the pages skip it with a warning.

    e2e_*.json        `bench e2e --out`: {settings: {model, device, dtype, caches, ...}, points: [...]}
    kernels_*.json    `bench kernels --out x.json`: {settings: {device}, results: [{batch, length, ...}]}
    accuracy / rules  `evaluate --json` (and the boost sweep): {settings, results: [{method, kl, ...}]}
    passkey_*.csv     `passkey --csv`: method, length, depth, correct

A JSON result file carries `format_version` (`stamp` adds it as a command writes the file): a reader
refuses a file of a later format, which this version would misread, by name and with what to do. A
file without it was written before the field existed and reads as format 1. CSV tables carry no
version (other tools read them as plain tables); their columns are checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .config import parse_method


class ResultFileError(ValueError):
    """A result file that cannot be used; the message names it and says why."""


E2E_SETTINGS = ("model", "prompt", "generate", "caches")
E2E_POINTS = ("cache", "batch")
E2E_TIMED = ("at", "max_batch")  # the columns of points that were timed (`tokens_per_s`), as `bench.e2e_table` reads
KERNEL_COLUMNS = ("batch", "length", "boost_rate", "fused_ms", "unfused_ms", "sdpa_fp16_ms")
ACCURACY_COLUMNS = ("method", "kl", "perplexity", "top1", "bits_per_element")
PASSKEY_COLUMNS = ("method", "length", "depth", "correct")


FORMAT_VERSION = 1  # of the JSON result files; raise it when a reader of the old layout would misread the new


def stamp(found: dict) -> dict:
    """A result object as a command writes it: with this version's `format_version` first."""
    return {"format_version": FORMAT_VERSION, **{k: v for k, v in found.items() if k != "format_version"}}


def check_version(found: dict, name: str) -> None:
    """ResultFileError for a result object of a format this version does not read."""
    version = found.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ResultFileError(f"{name} has format_version {version!r}, not a version number (1, 2 ...)")
    if version > FORMAT_VERSION:
        raise ResultFileError(f"{name} is of result format {version}, newer than this version reads "
                              f"({FORMAT_VERSION}): update kitty-lab, or run the command that wrote it again")


def _json(path: Path) -> dict:
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ResultFileError(f"{Path(path).name} cannot be read as JSON ({err})") from None
    if not isinstance(found, dict):
        raise ResultFileError(f"{Path(path).name} holds a {type(found).__name__}, not a result object")
    check_version(found, Path(path).name)
    return found


def _need(found: dict, keys, where: str, path: Path) -> None:
    missing = [k for k in keys if k not in found]
    if missing:
        raise ResultFileError(f"{Path(path).name} has no {', '.join(missing)} in {where}")


def _records(found: dict, key: str, columns, path: Path) -> pd.DataFrame:
    rows = found.get(key)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ResultFileError(f"{Path(path).name} has no list of records under {key!r}")
    df = pd.DataFrame(rows)
    missing = [c for c in columns if c not in df] if rows else []
    if missing:
        raise ResultFileError(f"{Path(path).name}: its {key} lack the columns {', '.join(missing)}")
    return df


def read_e2e(path: Path) -> dict:
    """An end-to-end run: settings, points (as a DataFrame) and, if any, skipped caches and real
    generations ("validation")."""
    found = _json(path)
    _need(found, ("settings", "points"), "the file", path)
    if not isinstance(found["settings"], dict):
        raise ResultFileError(f"{Path(path).name}: settings is not an object")
    _need(found["settings"], E2E_SETTINGS, "settings", path)
    if not isinstance(found["settings"]["caches"], list):
        raise ResultFileError(f"{Path(path).name}: settings.caches is not a list")
    points = _records(found, "points", E2E_POINTS, path)
    missing = [c for c in E2E_TIMED if c not in points] if "tokens_per_s" in points else []
    if missing:
        raise ResultFileError(f"{Path(path).name}: its timed points lack the columns {', '.join(missing)}")
    return {**found, "points": points,
            "validation": found.get("validation") if isinstance(found.get("validation"), list) else [],
            "skipped": found.get("skipped") if isinstance(found.get("skipped"), list) else []}


def read_kernels(path: Path) -> tuple[dict, pd.DataFrame]:
    """(settings, one row per timed shape) of a kernel benchmark."""
    found = _json(path)
    _need(found, ("settings", "results"), "the file", path)
    if not isinstance(found["settings"], dict) or "device" not in found["settings"]:
        raise ResultFileError(f"{Path(path).name}: settings lack the device")
    df = _records(found, "results", KERNEL_COLUMNS, path)
    if df.empty:
        raise ResultFileError(f"{Path(path).name} holds no timed shapes")
    return found["settings"], df


def read_accuracy(path: Path) -> pd.DataFrame:
    """The `results` of an accuracy run, with `rule` and `boost_rate` columns from each method."""
    df = _records(_json(path), "results", ACCURACY_COLUMNS, path)
    if df.empty:
        raise ResultFileError(f"{Path(path).name} holds no results")
    try:
        parsed = [parse_method(m) for m in df.method]
    except (ValueError, TypeError) as err:
        raise ResultFileError(f"{Path(path).name} names a method this version cannot read: {err}") from None
    df["rule"] = [c.selection if c.quantize and c.key_bits == 2 and c.boost_rate > 0 else "preset" for c in parsed]
    df["boost_rate"] = [boost_share(c) for c in parsed]
    return df


def boost_share(c) -> float:
    """Share of key channels above 2 bits: FP16 and 4-bit keys count as 1."""
    return c.boost_rate if c.quantize and c.key_bits == 2 else 1.0


def read_passkey(path: Path) -> pd.DataFrame:
    """Passkey trials, one row each."""
    try:
        df = pd.read_csv(path)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # pandas' ParserError and EmptyDataError are ValueErrors
        raise ResultFileError(f"{Path(path).name} cannot be read as CSV ({err})") from None
    missing = [c for c in PASSKEY_COLUMNS if c not in df]
    if missing:
        raise ResultFileError(f"{Path(path).name} lacks the columns {', '.join(missing)}")
    if df.empty or not pd.api.types.is_numeric_dtype(df["correct"]):
        raise ResultFileError(f"{Path(path).name} holds no trials with a numeric 'correct'")
    return df
