"""``twinpipe simulate``, ``draw``, ``plan`` and ``export`` work where torch is not installed (their
shared options too: ``twinpipe.cli_options`` is pure Python)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory):
    """An environment in which ``import torch`` fails, as if torch were not installed."""
    blocker = tmp_path_factory.mktemp("no_torch") / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker.parent), SRC]))
    check = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'torch'" in check.stderr  # the blocker works
    return env


def twinpipe(env, *argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "twinpipe", *argv], env=env, capture_output=True, text=True, cwd=cwd, timeout=120)


def test_simulate_without_torch(no_torch_env):
    result = twinpipe(no_torch_env, "simulate", "--compare", "1f1b,dualpipev", "--ranks", "4", "--microbatches", "8", "--json")
    assert result.returncode == 0, result.stderr
    assert [row["schedule"] for row in json.loads(result.stdout)] == ["1f1b", "dualpipev"]


def test_draw_without_torch(no_torch_env, tmp_path):
    result = twinpipe(no_torch_env, "draw", "zb-h1", "--ranks", "2", "--microbatches", "4", "-o", "zb.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "zb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_and_export_without_torch(no_torch_env):
    result = twinpipe(no_torch_env, "plan", "--layers", "8", "--dim", "512", "--seq-len", "512", "--gpus", "8",
                      "--microbatches", "8", "--pp", "2", "--schedules", "1f1b", "--json")
    assert result.returncode == 0, result.stderr
    assert {row["schedule"] for row in json.loads(result.stdout)} == {"1f1b"}
    result = twinpipe(no_torch_env, "export", "1f1b", "--pp", "2", "--microbatches", "2")
    assert result.returncode == 0 and result.stdout.splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"], result.stderr
    result = twinpipe(no_torch_env, "export", "1f1b", "--ranks", "2", "-m", "2")  # the old spellings, hidden
    assert result.returncode == 0 and result.stdout.splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"], result.stderr


def test_help_lists_every_command_and_demo_says_what_it_needs(no_torch_env):
    result = twinpipe(no_torch_env, "--help")
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in ("demo", "simulate", "draw", "eplb", "train"))
    result = twinpipe(no_torch_env, "demo")
    assert result.returncode == 2
    assert "twinpipe demo: error: it needs the package 'torch', which is not installed" in result.stderr
    result = twinpipe(no_torch_env, "demo", "--moe")
    assert result.returncode == 2
    assert "twinpipe demo: error: it needs the package 'torch', which is not installed" in result.stderr
