"""The texts shipped with the library, both from the King James Version (public domain): Genesis, what
the command lines score and probe by default and what the README's example prompts with, and the
Gospel of Luke, a second text to score on, one a calibration on Genesis has not seen
(`shipped_path(LUKE)`).

It is looked up in two places, in this order: `kitty_core/data/` inside the installed package
(`pip install .` copies the repository's `data/*.txt` there) and `data/` beside the package, where a
checkout (or `pip install -e .`) keeps it.
"""

from __future__ import annotations

from pathlib import Path

GENESIS = "genesis_kjv.txt"
LUKE = "luke_kjv.txt"
_PACKAGE = Path(__file__).resolve().parent


PLACES = (_PACKAGE / "data", _PACKAGE.parent / "data")


def shipped_path(name: str = GENESIS) -> Path:
    """Where the shipped text `name` is: the first of PLACES that holds it (the package's own if none
    does, so that reading it fails there)."""
    return next((place / name for place in PLACES if (place / name).is_file()), PLACES[0] / name)


def shipped_text(name: str = GENESIS) -> str:
    """The shipped text `name` (default: Genesis), read whole; FileNotFoundError naming both places
    if it is in neither."""
    path = shipped_path(name)
    if not path.is_file():
        raise FileNotFoundError(f"{name} is in neither {PLACES[0]} nor {PLACES[1]}: reinstall the package "
                                "(`pip install .` from the repository) or give a text of your own")
    return path.read_text(encoding="utf-8")
