"""The installable package: what the wheel holds, the command lines' `--help` without torch, the
progress bar the command lines draw, and the README's Python example."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from kitty_core.cli import progress_bar

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"torch", "transformers", "pandas"}
COMMANDS = [["kitty_core.evaluate"], ["kitty_core.probe"], ["kitty_core.passkey"], ["kitty_core.bench", "kernels"],
            ["kitty_core.bench", "e2e"], ["kitty_core.bench", "generate"], ["kitty_core.compile"],
            ["kitty_core.calibrate"], ["kitty_core.generate"], ["kitty_core.attribution"], ["kitty_core.lm_eval"],
            ["kitty_core.lm_eval_tasks"]]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _imported(stderr: str) -> set[str]:
    """Top-level modules named in `python -X importtime` output."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_answers_without_importing_torch(command, tmp_path):
    module, *sub = command
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *sub, "--help"], capture_output=True,
                         text=True, cwd=tmp_path, env=_env(), timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "(default: " in run.stdout
    imported = _imported(run.stderr)
    assert "argparse" in imported  # the importtime listing was read
    assert not HEAVY & imported, f"--help imported {HEAVY & imported}"


def test_an_installed_command_parses_before_torch_loads(tmp_path):
    """What the `kitty-evaluate` script does: usage named after the command, no torch imported for
    --help or for a usage error."""
    code = ("import sys; from kitty_core.cli import evaluate; sys.argv = ['kitty-evaluate', *sys.argv[1:]]; "
            "evaluate()")
    for args, status in ((["--help"], 0), (["--context", "0"], 2)):
        run = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args], capture_output=True, text=True,
                             cwd=tmp_path, env=_env(), timeout=120)
        assert run.returncode == status, run.stderr[-2000:]
        assert "usage: kitty-evaluate" in run.stdout + run.stderr
        assert not HEAVY & _imported(run.stderr)


def test_the_wheel_holds_both_packages_the_text_and_the_commands(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("kitty_core", "kernels"):
        shutil.copytree(ROOT / package, src / package, ignore=ignore)
    (src / "data").mkdir()
    shutil.copy(ROOT / "data" / "genesis_kjv.txt", src / "data")
    (src / "data" / "results").mkdir()  # saved runs stay out of the package
    (src / "data" / "results" / "run.json").write_text("{}")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert {"kitty_core/__init__.py", "kitty_core/cache.py", "kernels/decode.py", "kernels/cuda/decode.cu",
            "kitty_core/data/genesis_kjv.txt"} <= names
    assert not [n for n in names if n.startswith(("kitty_core/data/results", "tests/", "pages/"))]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        assert f"{name} = {target}" in entry_points
    # every module with a command line has its installed command
    commands = {f"kitty_core.{p.stem}" for p in (ROOT / "kitty_core").glob("*.py")
                if re.search(r"^def main\(", p.read_text(), re.M)}
    import kitty_core.cli as cli
    assert commands == {getattr(cli, target.split(":")[1]).module for target in scripts.values()}


def test_the_pinned_versions_fall_in_the_packages_ranges():
    """`pip install -c requirements.txt .` (the README's command) installs what requirements.txt pins:
    every pin of a dependency of the package is inside pyproject.toml's range for it."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = {r.name.lower(): r.specifier for r in map(Requirement, [*project["dependencies"],
              *(d for extra in project["optional-dependencies"].values() for d in extra)])}
    pins = dict(line.split("#")[0].strip().lower().split("==") for line in (ROOT / "requirements.txt").read_text()
                .splitlines() if "==" in line.split("#")[0])
    assert {"torch", "numpy", "transformers", "lm-eval"} <= set(pins) & set(ranges)
    outside = {name: f"{pin} not in {ranges[name]}" for name, pin in pins.items()
               if name in ranges and not ranges[name].contains(pin)}
    assert not outside


def test_the_readme_names_every_installed_command():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`(kitty-[a-z-]+\*?)`", readme))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    missing = [s for s in scripts if s not in named and not any(n.endswith("*") and s.startswith(n[:-1])
                                                                  for n in named)]
    assert not missing, f"the README's list of commands lacks {missing}"


def test_progress_bar_is_the_librarys_progress_callable(capsys):
    with progress_bar("methods", "method") as progress:
        for i, name in enumerate(["fp16", "kivi-k2v2", "kitty-pro"]):
            progress(i, 3, name)
    err = capsys.readouterr().err
    assert "methods" in err and "kitty-pro" in err and "3/3" in err  # filled at the end
    with pytest.raises(RuntimeError), progress_bar("layers") as progress:
        progress(0, 4, "layer 0")
        progress(1, 4)  # no label: the library's two-argument calls (probe.sensitivity_all)
        raise RuntimeError("stopped")
    err = capsys.readouterr().err
    assert "1/4" in err and "4/4" not in err  # an interrupted run does not claim to be done


def test_the_readme_example_runs_outside_the_repository(tmp_path):
    """The first Python block of the README, run from another directory: the generated text, then a
    memory report in which the packed pages hold bytes."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "shipped_text" in code
    (tmp_path / "example.py").write_text(code)
    run = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, cwd=tmp_path,
                         env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text, _, report = run.stdout.partition("part")
    assert len(text.split()) >= 10  # words generated
    parts = {m.group(1).strip(): int(m.group(2)) for m in re.finditer(r"^\s*\d+\s+(.+?)\s+(\d+)\s+[\d.]+(?:\s+.*)?$", report, re.M)}
    assert {"key sink", "key dense plane", "key high plane", "value planes"} <= set(parts)
    assert parts["key dense plane"] > 0 and parts["key high plane"] > 0 and parts["value planes"] > 0
