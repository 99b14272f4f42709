"""The engine tests' shared fixture: one run's fresh reference engines, kept by checkpoint."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def reference_cache(tmp_path_factory):
    """Every engine test trains the same tiny Qwen3 with the same seeds, so their checkpoints are
    the same bytes, and a fresh engine on one gives the same outputs each time: ``vllm_roles
    reference`` keeps them here by the checkpoint's hash, in this run's folder (shared by its
    xdist workers), so that each checkpoint's fresh engine starts once a run."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "reference-engines"
    folder.mkdir(exist_ok=True)
    before = os.environ.get("SPARROWD_TEST_REFERENCE_CACHE")
    os.environ["SPARROWD_TEST_REFERENCE_CACHE"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("SPARROWD_TEST_REFERENCE_CACHE", None)
    else:
        os.environ["SPARROWD_TEST_REFERENCE_CACHE"] = before
