"""What every command line here needs: counts checked as they are parsed, help that shows the
defaults, output paths checked before the work that fills them, result files written whole or not at
all, progress bars on stderr, and the installed commands (`kitty-evaluate` ...).

A result is written to a temporary file in its folder and renamed over the old one (`os.replace`,
atomic on one filesystem), so a run that fails while writing (a full disk, an interrupt) leaves the
previous file as it was.

Nothing here imports torch: a command module builds its parser from these before its own imports
load torch, so `--help` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

Progress = Callable[..., None]  # progress(done, total, label): `done` of `total` finished, `label` next


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default, except where there is none to show (None, a flag's False)
    or the help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, "") or "default" in text:
            return text
        return super()._get_help_string(action)


def command_name(module: str) -> str:
    """The command as it was started: `kitty-evaluate` (installed) or `python -m kitty_core.evaluate`."""
    name = Path(sys.argv[0]).name
    return name if name.startswith("kitty-") else f"python -m {module}"


def parser(module: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser named as it was started (`command_name`), with the defaults in its help."""
    return argparse.ArgumentParser(prog=command_name(module), description=description, formatter_class=HelpFormatter,
                                   **kwargs)


def require(module: str, package: str, extra: str, command: str) -> None:
    """Exit with status 2 and one line that says how to install `package` (the package's extra `extra`)
    when the module `command` imports, `module`, is not installed."""
    if importlib.util.find_spec(module) is None:
        print(f"error: {command_name(command)} needs {package}: pip install -c requirements.txt '.[{extra}]'",
              file=sys.stderr)
        raise SystemExit(2)


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


def numbers(text: str, kind: type, what: str, example: str) -> list:
    """A comma-separated list of numbers (`kind` int or float), or ValueError naming `what` and the item
    that is not one, with an example of the form wanted. Empty items are skipped; an empty list is an
    error."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{what} is empty: give numbers separated by commas, e.g. {example}")
    found = []
    for x in items:
        try:
            found.append(kind(x))
        except ValueError:
            word = "a whole number" if kind is int else "a number"
            raise ValueError(f"{what}: {x!r} is not {word}; give numbers separated by commas, e.g. {example}") from None
    return found


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


@contextmanager
def progress_bar(description: str, unit: str = "step") -> Iterator[Progress]:
    """A tqdm bar on stderr as the library's `progress(done, total, label)` callable: `done` of `total`
    are finished (`total` None: unknown, the bar counts) and `label` runs next. The bar starts at the
    first call, so that its rate and time left count the work alone, and fills when the block ends
    without an error. `TQDM_DISABLE=1` hides it."""
    from tqdm import tqdm

    bar = None

    def progress(done: int, total: int | None = None, label: str | None = None) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(desc=description, unit=unit, total=total, initial=done, file=sys.stderr, dynamic_ncols=True)
        bar.total = total
        bar.update(done - bar.n)  # the rate and the time left from the steps so far
        if label is not None:
            bar.set_postfix_str(str(label))  # redraws
    try:
        yield progress
        if bar is not None and bar.total is not None:
            bar.update(bar.total - bar.n)
    finally:
        if bar is not None:
            bar.close()


def _command(module: str) -> Callable[[], None]:
    """An installed command that runs `module` as `python -m module` does, so it parses its arguments
    before torch loads as well."""
    def run() -> None:
        runpy.run_module(module, run_name="__main__")
    run.__doc__ = f"`python -m {module}`"
    run.module = module
    return run


evaluate = _command("kitty_core.evaluate")
probe = _command("kitty_core.probe")
passkey = _command("kitty_core.passkey")
bench = _command("kitty_core.bench")
calibrate = _command("kitty_core.calibrate")
generate = _command("kitty_core.generate")
attribution = _command("kitty_core.attribution")
lm_eval = _command("kitty_core.lm_eval")
lm_eval_tasks = _command("kitty_core.lm_eval_tasks")
lm_eval_harness = _command("kitty_core.lm_eval_harness")
compile_kernels = _command("kitty_core.compile")
