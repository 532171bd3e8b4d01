"""The public face: a narrow top level, every subpackage with a short ``__all__`` and a docstring
saying what it is for, old top-level names still working (and saying where they moved)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import twinpipe

SUBPACKAGES = ["schedule", "sim", "runtime", "overlap", "moe", "eplb", "train", "hf", "plan", "trace", "viz"]


def test_the_top_level_holds_what_users_start_from():
    assert len(twinpipe.__all__) <= 15, twinpipe.__all__
    for name in twinpipe.__all__:
        assert getattr(twinpipe, name) is not None, name
    assert {"Pipeline", "DualPipe", "DualPipeV", "WeightGradStore", "defer_weight_grads", "PipelineError",
            "simulate"} <= set(twinpipe.__all__)


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_subpackage_says_what_it_is_for_and_exports_a_short_list(name):
    module = importlib.import_module(f"twinpipe.{name}")
    assert module.__doc__ and len(module.__doc__.strip()) > 40, name
    assert 0 < len(module.__all__) <= 25, (name, len(module.__all__))
    for exported in module.__all__:
        assert getattr(module, exported) is not None, (name, exported)


@pytest.mark.parametrize("old, new", [("build_schedule", "twinpipe.schedule.build"), ("MoEBlock", "twinpipe.moe.MoEBlock"),
                                      ("PartedStage", "twinpipe.overlap.PartedStage"), ("split", "twinpipe.train.split"),
                                      ("run_backward", "twinpipe.runtime.run_backward"), ("Op", "twinpipe.schedule.Op")])
def test_old_top_level_names_still_work_and_say_where_they_moved(old, new):
    module, name = new.rsplit(".", 1)
    with pytest.warns(DeprecationWarning, match=f"use {new}"):
        value = getattr(twinpipe, old)
    assert value is getattr(importlib.import_module(module), name)


def test_every_error_is_a_pipeline_error_reachable_from_the_top_without_a_warning():
    from twinpipe import runtime

    errors = [n for n in runtime.__all__ if n.endswith("Error")]
    assert len(errors) >= 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in errors:
            cls = getattr(twinpipe, name)
            assert issubclass(cls, twinpipe.PipelineError) and issubclass(cls, RuntimeError), name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Pipelin'"):
        twinpipe.Pipelin  # noqa: B018


def test_importing_twinpipe_does_not_import_torch():
    code = "import sys, twinpipe, twinpipe.schedule, twinpipe.sim; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
