"""Provenance of a training process: the git revision of a checkout (None for an installed copy) and host facts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import peagle
from peagle.pipeline.provenance import git_revision, host_facts, provenance


def test_a_checkout_reports_its_head():
    root = Path(peagle.__file__).parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:  # an installed copy (not a checkout): nothing to compare with
        assert git_revision() is None
        return
    assert git_revision().removesuffix("-dirty") == head.stdout.strip()


def test_an_installed_copy_has_no_revision(tmp_path):
    shutil.copytree(Path(peagle.__file__).parent, tmp_path / "peagle", ignore=shutil.ignore_patterns("__pycache__"))
    code = "from peagle.pipeline.provenance import git_revision; print(git_revision())"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_host_facts_and_the_whole_record():
    facts = host_facts()
    assert {"hostname", "platform", "python", "torch", "cuda"} <= set(facts)
    record = provenance()
    assert record["peagle_version"] == peagle.__version__ and record["host"]["torch"] == facts["torch"]
