"""Saved result files, one format per kind, written and read in one place. The command lines build
what they write through these functions (`e2e_result`, `kernel_result`, `stamp`); the lab's pages,
and the commands that add to a file, read it back through `read_*`, which check that a file holds
what its kind needs before anything uses it. A file that does not raises `ResultFileError`, naming
the file and what is wrong; the pages skip it with a warning.

    e2e_*.json        `bench e2e --out`: {settings: {model, shape, device, gpu, dtype, torch, transformers,
                      prompt, generate, budget_gib, points, steps, decode, caches, fused, launch,
                      alloc_conf, sharding (only for a model split over GPUs), page_kernel, runs}, points: [...],
                      probes: [...], skipped: [...], validation: [...], summary: [...]}
    kernels_*.json    `bench kernels --out x.json`: {settings: {device, torch, launch}, results: [{batch, length, ...}]}
    kernels_cuda_*.csv `bench kernels --cuda --out x.csv`: batch, length, boost_rate, cuda_ms, triton_ms, cudnn_ms, ...
    accuracy / rules  `evaluate --json` (and the boost sweep): {settings, results: [{method, kl, ...}]}
    passkey_*.csv     `passkey --csv`: method, length, depth, correct

An e2e file may hold the caches of several commands of the same setup (`SETUP`): `bench e2e
--merge` replaces the caches it measured again and keeps the others (`merge_runs`), and
`settings.runs` names each command and what it measured. Its `summary` is `e2e_table` of its
points, written so that a reader without pandas (docs/figures/memory_throughput.py) can draw it;
`e2e_table` and `real_table` are also what the CLI prints and the Memory page shows.

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


E2E_SETTINGS = ("model", "prompt", "generate", "caches")  # what every reader of an e2e file needs
# the settings two e2e runs must share for one file to hold both (`setup_differences`, `bench e2e --merge`)
SETUP = ("model", "shape", "gpu", "dtype", "torch", "transformers", "prompt", "generate", "budget_gib", "points",
         "steps", "decode", "fused", "alloc_conf", "sharding", "page_kernel")
# which kernel a triton engine's decode steps read the pages with (an e2e file's `page_kernel`; files of
# earlier versions, where Triton read them unless a cache named `pages=cuda`, have none, and do not merge)
PAGE_KERNEL_RULE = "CUDA (kernels/cuda_decode.py) where it applies, else Triton, unless the cache names its pages"
E2E_POINTS = ("cache", "batch")
E2E_TIMED = ("at", "max_batch")  # the columns of points that were timed (`tokens_per_s`), as `e2e_table` reads
KERNEL_COLUMNS = ("batch", "length", "boost_rate", "fused_ms", "unfused_ms", "sdpa_fp16_ms")
CUDA_KERNEL_COLUMNS = ("batch", "length", "boost_rate", "cuda_ms", "triton_ms", "cudnn_ms")
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


def e2e_result(settings: dict, points: list[dict], probes: list[dict], skipped: list[dict],
               validation: list[dict], earlier: dict | None = None, command: str | None = None) -> dict:
    """An e2e result object as `bench e2e --out` writes it, format version first: this command's
    settings and rows, merged into `earlier` (a file of the same setup, `merge_runs`) when given, and
    the summary table of its points."""
    run = {"settings": settings, "points": points, "probes": probes, "skipped": skipped, "validation": validation}
    run = merge_runs(earlier, run, command) if earlier else run
    run["summary"] = e2e_table(pd.DataFrame(run["points"])).to_dict(orient="records")
    return stamp(run)


def setup_differences(a: dict, b: dict) -> list[str]:
    """The settings of `SETUP` in which two e2e runs differ (model, GPU, versions, lengths, budget,
    points and steps timed, decoding, page kernel); a file from before a setting existed reads False."""
    return [k for k in SETUP if a.get(k, False) != b.get(k, False)]


def merge_runs(earlier: dict, run: dict, command: str) -> dict:
    """An e2e result file with `run` added to `earlier`: the caches `run` measured replace their rows
    in `earlier`, the others stay; settings list the commands and what each measured."""
    mine = set(run["settings"]["caches"])
    keep = lambda rows: [r for r in rows if r["cache"] not in mine]  # noqa: E731
    settings = dict(run["settings"])
    before = earlier["settings"].get("runs") or [{"command": None, "caches": earlier["settings"]["caches"]}]
    # a command stays listed while a cache it measured does, or if it measured none (it validated)
    runs = [dict(r, caches=[c for c in r["caches"] if c not in mine]) for r in before]
    runs = [r for r, was in zip(runs, before) if r["caches"] or not was["caches"]]
    settings["runs"] = runs + [{"command": command, "caches": run["settings"]["caches"]}]
    settings["caches"] = [c for r in settings["runs"] for c in r["caches"]]
    return {"settings": settings, "points": keep(earlier["points"]) + run["points"],
            "probes": keep(earlier["probes"]) + run["probes"], "skipped": keep(earlier["skipped"]) + run["skipped"],
            "validation": keep(earlier.get("validation", [])) + run["validation"]}


def kernel_result(settings: dict, results: pd.DataFrame) -> dict:
    """A kernel benchmark's result object as `bench kernels --out x.json` writes it: its settings
    (device, torch, the fused kernel's launch settings) and one record per timed setting."""
    return stamp({"settings": settings, "results": results.to_dict(orient="records")})


def e2e_table(points: pd.DataFrame) -> pd.DataFrame:
    """Per cache: max batch, peak memory, throughput at max and at equal batch, and ratios against
    the transformers caches and the same-runtime FP16 baseline."""
    if "tokens_per_s" not in points:
        return pd.DataFrame()
    ok = points[points["tokens_per_s"].notna()]
    rows = []
    for cache, g in ok.groupby("cache", sort=False):
        at_max, at_eq = g[g["at"] == "max batch"], g[g["at"] == "equal batch"]
        # an equal batch that did not fit (an FP16 cache on a smaller GPU) has no figure: not the max
        # batch's, which stands in only where the equal batch is the max batch (measured once)
        failed = points[(points["cache"] == cache) & (points["at"] == "equal batch") & points["tokens_per_s"].isna()]
        if len(failed) and not len(at_eq):
            at_eq = failed
        rows.append({
            "cache": cache, "max_batch": int(g["max_batch"].iloc[0]),
            "peak_GiB": float(at_max["peak_bytes"].iloc[0]) / 2**30 if len(at_max) and at_max["peak_bytes"].notna().all() else None,
            "kv_bytes_per_token": float(at_max["kv_bytes_per_token"].iloc[0]) if len(at_max) else None,
            "tokens_per_s_max_batch": float(at_max["tokens_per_s"].iloc[0]) if len(at_max) else None,
            # a step that packs pages, beyond one that does not (presets; once every G steps)
            "packing_ms_max_batch": float(at_max["packing_ms"].iloc[0])
            if len(at_max) and "packing_ms" in at_max and at_max["packing_ms"].notna().all() else None,
            # the batch that throughput was measured at: below the max batch if the prefill needed room
            "measured_at_batch": int(at_max["batch"].iloc[0]) if len(at_max) else None,
            "equal_batch": int(at_eq["batch"].iloc[0]) if len(at_eq) else (int(at_max["batch"].iloc[0]) if len(at_max) else None),
            "tokens_per_s_equal_batch": at_eq["tokens_per_s"].astype(float).iloc[0] if len(at_eq) else (
                float(at_max["tokens_per_s"].iloc[0]) if len(at_max) else None),
        })
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    t = table.set_index("cache")
    for ref in ("dynamic", "static", "static-compiled", "fp16-prealloc"):
        if ref in t.index:
            t[f"batch_vs_{ref}"] = t["max_batch"] / t.loc[ref, "max_batch"]
            t[f"tput_vs_{ref}"] = t["tokens_per_s_max_batch"] / t.loc[ref, "tokens_per_s_max_batch"]
            t[f"equal_batch_vs_{ref}"] = t["tokens_per_s_equal_batch"] / t.loc[ref, "tokens_per_s_equal_batch"]
    return t.reset_index()


def real_table(checks: list[dict], points: pd.DataFrame) -> pd.DataFrame:
    """Real generations (`e2e --validate`), one row each: the time, the tokens per second (every
    sequence's generated tokens over the whole run, prefill included), the estimate's error and, on
    a GPU, the mean SM clock and power meanwhile (`telemetry`). A
    generation at its cache's max batch (from `points`) is compared with each baseline's real
    generation of the same length at the baseline's max batch: the throughput target measured
    instead of estimated."""
    if not checks:
        return pd.DataFrame()
    rows = pd.DataFrame(checks)
    rows["tokens_per_s"] = rows["batch"] * rows["generate"] / rows["measured_s"]
    best = points.groupby("cache")["max_batch"].first() if "max_batch" in points else pd.Series(dtype=int)
    rows["at_max_batch"] = [best.get(c) == b for c, b in zip(rows["cache"], rows["batch"])]
    for ref in ("dynamic", "static", "static-compiled", "fp16-prealloc"):
        base = rows[(rows["cache"] == ref) & rows["at_max_batch"]].groupby("generate")["tokens_per_s"].last()
        if len(base):
            rows[f"tput_vs_{ref}"] = [tps / base[g] if at and g in base else None
                                      for tps, g, at in zip(rows["tokens_per_s"], rows["generate"], rows["at_max_batch"])]
    shown = ["cache", "batch", "at_max_batch", "prompt", "generate", "prefill_chunk", "measured_s", "tokens_per_s",
             "estimated_s", "estimate_error", "sm_clock_mhz", "power_w"]
    return rows[[c for c in shown if c in rows] + [c for c in rows if c.startswith("tput_vs_")]]


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
    _numbers(df, ("batch", "length", "boost_rate"), path)
    return found["settings"], df


def _numbers(df: pd.DataFrame, columns, path: Path, positive: bool = False) -> None:
    """Every value of `columns` a number (above 0 with `positive`), or a ResultFileError that names them."""
    ok = all(pd.api.types.is_numeric_dtype(df[c]) and df[c].notna().all() for c in columns)
    if not ok or (positive and not (df[list(columns)] > 0).all().all()):
        raise ResultFileError(f"{Path(path).name} has {'non-positive, ' if positive else ''}non-numeric or missing "
                              f"values in {', '.join(columns)}")


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


def _csv(path: Path, columns) -> pd.DataFrame:
    """A CSV result table that has `columns`."""
    try:
        df = pd.read_csv(path)
    except (OSError, UnicodeDecodeError, ValueError) as err:  # pandas' ParserError and EmptyDataError are ValueErrors
        raise ResultFileError(f"{Path(path).name} cannot be read as CSV ({err})") from None
    missing = [c for c in columns if c not in df]
    if missing:
        raise ResultFileError(f"{Path(path).name} lacks the columns {', '.join(missing)}")
    return df


def read_passkey(path: Path) -> pd.DataFrame:
    """Passkey trials, one row each."""
    df = _csv(path, PASSKEY_COLUMNS)
    if df.empty or not pd.api.types.is_numeric_dtype(df["correct"]):
        raise ResultFileError(f"{Path(path).name} holds no trials with a numeric 'correct'")
    return df


def read_kernels_cuda(path: Path) -> pd.DataFrame:
    """One row per shape and boost rate of `bench kernels --cuda`: the fused step with the CUDA and with
    the Triton page kernel, and cuDNN's attention on FP16, in ms."""
    df = _csv(path, CUDA_KERNEL_COLUMNS)
    if df.empty:
        raise ResultFileError(f"{Path(path).name} holds no timed shapes")
    _numbers(df, ("batch", "length", "boost_rate"), path)
    _numbers(df, ("cuda_ms", "triton_ms", "cudnn_ms"), path, positive=True)
    return df
