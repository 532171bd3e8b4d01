"""Every command README.md and docs/*.md show runs, as a user types it, in a fresh folder.

The list, with what CI runs instead where it must differ and why: ``tests/documented_commands.py``.
A command in the docs that the list does not have, or an entry the docs no longer show, fails here.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from documented_commands import COMMANDS, Command
from typed import run_typed, run_typed_once

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"", "bash", "sh", "console", "shell"}  # fenced blocks whose lines are commands
COMMAND_STARTS = ("twinpipe", "python", "torchrun", "pip")
INLINE_STARTS = ("twinpipe ", "torchrun ", "python examples/", "python bench/", "python -m twinpipe")
LIMIT_S = 300  # one command; the slowest here takes about 10 s on 2 idle cores


def normalise(command: str) -> str:
    """A shown command as the list spells it: no prompt, no trailing comment, single spaces."""
    command = command.strip().removeprefix("$ ")
    return " ".join(re.sub(r"(^|\s)#.*$", "", command).split())


def documented() -> dict[str, list[str]]:
    """Every command the docs show -> where (file:line)."""
    found: dict[str, list[str]] = {}
    for path in DOCS:
        name = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        prose = list(lines)
        fence, pending, start = None, "", 0
        for number, line in enumerate(lines, 1):
            opening = re.match(r"^```\s*([\w+-]*)\s*$", line)
            if fence is None and opening:
                fence = opening[1].lower()
                prose[number - 1] = ""
                continue
            if fence is not None:
                prose[number - 1] = ""
                if line.strip() == "```":
                    fence = None
                elif fence in SHELL_BLOCKS:
                    text = line.strip()
                    if not pending and not (text.startswith("$ ") or text.startswith(COMMAND_STARTS)):
                        continue
                    start = start if pending else number
                    if text.endswith("\\"):
                        pending += text[:-1] + " "
                        continue
                    found.setdefault(normalise(pending + text), []).append(f"{name}:{start}")
                    pending = ""
        text = "\n".join(prose)
        for match in re.finditer(r"`([^`]+)`", text):
            span = match[1]
            if "\n\n" in span:
                continue
            command = " ".join(span.split())
            if command.startswith(INLINE_STARTS):
                found.setdefault(normalise(command), []).append(f"{name}:{text.count(chr(10), 0, match.start()) + 1}")
    return found


def test_every_command_the_docs_show_is_in_the_list():
    listed = {c.shown for c in COMMANDS}
    missing = {command: where for command, where in documented().items() if command not in listed}
    assert not missing, ("add these to tests/documented_commands.py (what CI runs, and why it differs); a block of "
                         "output, not commands, is fenced as ```text:\n") + "\n".join(
        f"  {command!r}  ({', '.join(where)})" for command, where in sorted(missing.items()))


def test_every_entry_of_the_list_is_still_in_the_docs():
    shown = documented()
    stale = [c.shown for c in COMMANDS if c.shown not in shown]
    assert not stale, f"the docs no longer show these; remove them from tests/documented_commands.py: {stale}"


def test_every_entry_says_why_it_runs_differently_or_not_at_all():
    assert len({c.shown for c in COMMANDS}) == len(COMMANDS), "one entry per shown command"
    for c in COMMANDS:
        if c.not_run:
            assert c.run is None and not c.files and not c.folder, c
        elif c.run is not None and c.run != c.shown:
            assert c.why, f"{c.shown!r}: CI runs {c.run!r}; say why"
        for name in c.files:
            assert not Path(name).is_absolute() and ".." not in Path(name).parts, name


def _scenarios() -> dict[str, list[tuple[str, list[Command]]]]:
    """Folder -> the distinct lines run in it, in list order, each with the entries it stands for."""
    scenarios: dict[str, list[tuple[str, list[Command]]]] = {}
    for c in COMMANDS:
        if c.not_run:
            continue
        steps = scenarios.setdefault(c.place, [])
        for line, entries in steps:
            if line == c.line:
                entries.append(c)
                break
        else:
            steps.append((c.line, [c]))
    return scenarios


SCENARIOS = _scenarios()
WORKERS = 2  # folders run side by side: a command of a few processes leaves part of 2 cores idle while they start


@pytest.fixture(scope="module")
def running(request, tmp_path_factory):
    """Every selected folder's commands, started in list order on WORKERS threads; place -> future."""
    places = [item.callspec.params["place"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_documented_command_runs" and item.module is request.module]
    # The folders of several lines first: the longest chains start at once and the one-line folders fill
    # the other worker's time (in list order, `train-data`'s 6 lines in series started three quarters of the way in).
    places.sort(key=lambda place: -len(SCENARIOS[place]))
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    futures = {place: pool.submit(_run_folder, place, tmp_path_factory.mktemp("typed")) for place in places}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("place", list(SCENARIOS))
def test_documented_command_runs(place, running):
    running[place].result()  # its assertion, if one failed


def _run_folder(place: str, folder: Path) -> None:
    """Run a folder's lines one after another; AssertionError at the first that fails its checks."""
    steps = SCENARIOS[place]
    copies = tuple(sorted({name for _, entries in steps for c in entries for name in c.copy}))
    if len(steps) == 1:  # one line: run once per session in a fresh folder (test_examples checks the same runs)
        line, entries = steps[0]
        _check_step(line, entries, *run_typed_once(line, copies, timeout=LIMIT_S))
        return
    for name in copies:
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    for line, entries in steps:
        _check_step(line, entries, run_typed(line, folder, timeout=LIMIT_S), folder)


def _check_step(line: str, entries: list[Command], done, folder: Path) -> None:
    """One line's exit code, output and files (in ``folder``) against its entries."""
    shown = " | ".join(c.shown for c in entries)
    assert done.returncode == 0, f"`{line}` (docs: `{shown}`) exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    out = " ".join(done.stdout.split())
    for c in entries:
        for text in c.stdout:
            assert " ".join(text.split()) in out, f"`{line}`: no {text!r} in its output\n{done.stdout[-3000:]}"
        if line.endswith(" --help"):  # the options the docs name exist
            for option in _options(c.shown):
                assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", done.stdout), f"{c.shown!r}: {option} is not in `{line}`"
        for name in c.files:
            _check_file(folder / name, name.endswith("/"), line)


def _options(shown: str) -> list[str]:
    """The options a shown command gives its program (not python's own ``-m``)."""
    rest = re.sub(r"^(python( -m)? \S+|twinpipe \S+|torchrun)", "", shown)
    return re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest)


def _check_file(path: Path, checkpoint: bool, line: str) -> None:
    """The file a command says it writes is there and reads as its kind."""
    assert path.exists(), f"`{line}` did not write {path.name}"
    if checkpoint:
        from twinpipe.train.checkpoint import read_checkpoint_info

        info = read_checkpoint_info(str(path), verify_data=True)  # complete: marker, files, digests
        assert info.parameters, f"{path}: no model in the checkpoint"
    elif path.suffix == ".json":
        json.loads(path.read_text())
    elif path.suffix == ".png":
        from matplotlib.image import imread

        picture = imread(path)
        assert picture.shape[0] > 10 and picture.shape[1] > 10, (path, picture.shape)
    elif path.suffix == ".csv":
        assert list(csv.reader(path.read_text().splitlines())), path
    else:
        assert path.stat().st_size > 0, path


def test_the_readme_says_what_ci_checks():
    readme = (ROOT / "README.md").read_text()
    tests = readme.split("Run the tests:", 1)[1].split("\n## ", 1)[0]
    paragraph = " ".join(tests.split())
    for claim in ("tests/documented_commands.py", "fresh folder", "exit code", "benchmark", "--help"):
        assert claim in paragraph, claim
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install --quiet "torch==2.13.0" -e ".[test]" && python3 -m pytest -q' in ci
