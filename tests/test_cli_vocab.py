"""`peagle vocab` through the real console script, on a store from a real tiny extraction."""

from __future__ import annotations

import json

import pytest

from peagle.testing.chat_data import write_chat_jsonl


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_llama):
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract

    root = tmp_path_factory.mktemp("cli_vocab")
    data = write_chat_jsonl(root / "chat.jsonl", 8, seed=3)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), backend="hf",
                              topk=4, samples_per_shard=4, device="cpu"), echo=lambda _: None, progress=False)
    return root / "store"


def test_vocab_command_writes_the_vocab_and_reports_coverage(store, tmp_path, run_peagle):
    config = tmp_path / "vocab.toml"
    config.write_text("draft-vocab-size = 50\nquiet = true\n")  # keys are the flags
    result = run_peagle("vocab", "--store", store, "--config", config)
    assert result.returncode == 0 and result.stderr == "", result.stderr  # quiet: no progress lines
    info = json.loads((store / "vocab" / "draft-50.json").read_text())
    assert f"coverage {info['coverage']:.4f}" in result.stdout
    assert (store / "vocab" / "draft-50.safetensors").is_file()
    assert info["draft_vocab_size"] == 50 and info["target_vocab_size"] == 1024 and not info["identity"]


def test_vocab_command_refuses_a_size_above_the_target_vocab_in_one_line(store, run_peagle):
    result = run_peagle("vocab", "--store", store, "--draft-vocab-size", "5000")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "5000" in result.stderr and "1024" in result.stderr


def test_progress_into_a_pipe_is_plain_lines(store, run_peagle):
    """stderr is a pipe here, as in a log file: one line per 10% and no carriage-return frames."""
    result = run_peagle("vocab", "--store", store, "--draft-vocab-size", "60")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    assert [line.split(",")[0] for line in result.stderr.splitlines()] == [
        "counting tokens: 1/2 shard (50%)", "counting tokens: 2/2 shard (100%)"]
    # --quiet prints none: the flag in test_the_positional_store_still_works_for_a_release_with_a_deprecation_line
    # (stderr: the deprecation note alone), the config key in test_vocab_command_writes_the_vocab_and_reports_coverage


def test_the_positional_store_still_works_for_a_release_with_a_deprecation_line(store, run_peagle):
    result = run_peagle("vocab", store, "--draft-vocab-size", "62", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ("peagle: note: `peagle vocab STORE` is deprecated (it goes in the next release); write "
                             "`peagle vocab --store STORE`\n")
    info = run_peagle("store", "info", store)
    assert info.returncode == 0 and "shards       2 of 2 committed" in info.stdout
    assert "`peagle store info --store STORE`" in info.stderr
    both = run_peagle("vocab", store, "--store", store.parent, "--draft-vocab-size", "62")
    assert both.returncode == 2 and "name two values" in both.stderr
    neither = run_peagle("vocab", "--draft-vocab-size", "62")
    assert neither.returncode == 2 and neither.stderr.strip() == (
        "peagle: error: missing option --store STORE. See `peagle vocab --help`.")


def test_heldout_store_adds_its_coverage_by_size(store, tmp_path_factory, tiny_llama, run_peagle):
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract

    root = tmp_path_factory.mktemp("cli_vocab_heldout")
    data = write_chat_jsonl(root / "chat.jsonl", 4, seed=9)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "heldout"), backend="hf",
                              topk=4, samples_per_shard=4, device="cpu"), echo=lambda _: None, progress=False)
    result = run_peagle("vocab", "--store", store, "--draft-vocab-size", "64", "--heldout-store", root / "heldout",
                        "--quiet")
    assert result.returncode == 0, result.stderr
    heldout = json.loads((store / "vocab" / "draft-64.json").read_text())["heldout"]
    assert [n for n, _ in heldout["coverage_by_size"]] == [16, 32, 64, 128, 256, 512]
    assert f"held-out coverage {heldout['coverage']:.4f} of {heldout['num_supervised_tokens']:,}" in result.stdout
    assert "512: " in result.stdout
    missing = run_peagle("vocab", "--store", store, "--draft-vocab-size", "64", "--heldout-store", root / "none")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr
