"""The target directory (model/target/directory.py): config of plain and multimodal targets, weights by name and
suffix, the tokenizer and the transformers model, the content hash, and the one store-vs-target check."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from peagle.model.target import directory as T
from peagle.model.target.directory import SAMPLE_BYTES
from peagle.model.target.directory import content_hash as target_content_hash
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target


def test_a_copy_hashes_equal_and_other_weights_of_the_same_shape_do_not(tiny_llama, tmp_path):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    assert target_content_hash(copy) == target_content_hash(tiny_llama)
    other = build_tiny_target(tmp_path / "other", TinyTargetSpec(arch="llama", seed=7))
    assert sorted((p.name, p.stat().st_size) for p in other.glob("*.safetensors")) == \
        sorted((p.name, p.stat().st_size) for p in tiny_llama.glob("*.safetensors"))  # names and sizes agree
    assert target_content_hash(other) != target_content_hash(tiny_llama)


def test_config_weights_and_small_files_count(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"tiny")  # shorter than one sample
    (tmp_path / "README.md").write_text("not a weight file")
    first = target_content_hash(tmp_path)
    (tmp_path / "README.md").write_text("changed")
    assert target_content_hash(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"tinY")
    assert target_content_hash(tmp_path) != first
    (tmp_path / "model.safetensors").write_bytes(bytes(3 * SAMPLE_BYTES))
    zeros = target_content_hash(tmp_path)
    data = bytearray(3 * SAMPLE_BYTES)
    data[-1] = 1  # the last sample ends at the last byte
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    assert target_content_hash(tmp_path) != zeros
    (tmp_path / "config.json").write_text('{"hidden_size": 9}')
    assert target_content_hash(tmp_path) not in (zeros, first)


def test_config_and_weights_of_a_real_target(tiny_llama):
    config = T.load_config(tiny_llama)
    assert T.architecture(config) == "LlamaForCausalLM" and config.num_hidden_layers == 8
    assert T.text_config_dict(tiny_llama)["hidden_size"] == config.hidden_size == 128
    weights = T.TargetWeights(tiny_llama)
    key = weights.find("embed_tokens.weight")
    assert key == "model.embed_tokens.weight" and weights.read(key).shape == (config.vocab_size, 128)
    assert weights.find("input_layernorm.weight") is None  # one per layer: not unique
    assert weights.read_first(("nope", "model.norm.weight")).shape == (128,)
    with pytest.raises(UserError, match="none of the weights"):
        weights.read_first(("nope",))


def test_a_multimodal_config_gives_its_text_part_with_the_top_level_architecture(tiny_llama, tmp_path):
    target = shutil.copytree(tiny_llama, tmp_path / "vlm")
    text = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": {k: v for k, v in text.items() if k != "architectures"},
        "vision_config": {"model_type": "clip_vision_model"}}))
    config = T.load_config(target)
    assert config.hidden_size == 128 and T.architecture(config) == "LlavaForConditionalGeneration"
    assert T.text_config_dict(target)["num_hidden_layers"] == 8


def test_missing_directory_and_config_are_one_line(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        T.load_config(tmp_path / "nope")
    with pytest.raises(UserError, match="has no config.json"):
        T.load_config(tmp_path)
    with pytest.raises(UserError, match="has no model.safetensors"):
        T.TargetWeights(tmp_path)


def test_tokenizer_and_model_are_transformers_own_and_a_broken_directory_is_one_line(tiny_llama, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = T.open_target(tiny_llama)
    assert "tokenizer" not in vars(target)  # loaded when first asked for (training never asks)
    text = "Hello there, general target."
    assert target.tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(tiny_llama)(text)["input_ids"]
    assert target.tokenizer is target.tokenizer
    model = T.load_causal_lm(tiny_llama, torch.float32, "cpu")
    assert not model.training and next(model.parameters()).dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.tensor([target.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    broken = shutil.copytree(tiny_llama, tmp_path / "broken")
    for p in broken.glob("tokenizer*"):
        p.unlink()
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    for load in (lambda: T.open_target(broken).tokenizer, lambda: T.load_causal_lm(broken, torch.float32, "cpu")):
        with pytest.raises(UserError) as err:
            load()
        assert str(err.value).startswith("cannot load target") and "\n" not in str(err.value)


def settings_of(target: T.TargetDirectory, **changes) -> S.StoreSettings:
    identity = target.identity("float32")
    return S.StoreSettings(target=replace(identity, **changes), tokenizer_fingerprint="t", chat_template_hash="h",
                           aux_layer_ids=(2, 4, 5), topk=4, max_seq_len=64, logprob_dtype="float16", loss_on="all")


def test_store_vs_target_names_the_first_difference_in_one_line(tiny_llama, tmp_path):
    target = T.open_target(tiny_llama)
    T.check_store_matches_target(settings_of(target), target, store="s")  # its own store
    copy = T.open_target(shutil.copytree(tiny_llama, tmp_path / "copy"))
    T.check_store_matches_target(settings_of(target), copy, store="s")  # the same weights elsewhere
    for changes, named in (({"architecture": "Qwen3ForCausalLM"}, "architecture Qwen3ForCausalLM, --target has "
                            "architecture LlamaForCausalLM"),
                           ({"hidden_size": 64}, "hidden_size 64, --target has hidden_size 128"),
                           ({"num_hidden_layers": 4}, "num_hidden_layers 4, --target has num_hidden_layers 8"),
                           ({"vocab_size": 7}, "vocab_size 7"),
                           ({"content_hash": "0" * 64}, "has other weights")):
        with pytest.raises(UserError) as err:
            T.check_store_matches_target(settings_of(target, **changes), target, store="s")
        assert named in str(err.value) and "\n" not in str(err.value)


def test_the_full_weights_hash_sees_a_change_the_samples_miss_and_is_cached(tiny_llama, tmp_path, monkeypatch):
    """A byte flipped between the content hash's samples leaves ``content_hash`` as it was but not
    ``weights_sha256``; a store recording the full hash refuses such a target, one recording only the
    sampled hash (an older store) is matched by it alone. Each file's sha256 is read once per version
    of the file (by path, size, mtime and ctime): a second call takes it from the cache."""
    from peagle.model.target import weights_hash as W
    from peagle.testing.target_faults import flip_an_unsampled_byte

    monkeypatch.setenv("PEAGLE_CACHE_DIR", str(tmp_path / "cache"))
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    before = T.open_target(copy)
    sampled, full = before.content_hash, before.weights_sha256
    flip_an_unsampled_byte(copy / "model.safetensors")
    after = T.open_target(copy)
    assert after.content_hash == sampled and after.weights_sha256 != full
    identity = before.identity("float32")
    settings = S.StoreSettings(target=identity, tokenizer_fingerprint="t", chat_template_hash="c", aux_layer_ids=(1, 2, 3),
                               topk=4, max_seq_len=64, logprob_dtype="float32", loss_on="all")
    with pytest.raises(UserError, match="has other weights \\(weights sha256 .*a tensor differs"):
        T.check_store_matches_target(settings, after, store="s")
    old = replace(settings, target=replace(identity, weights_sha256=""))
    T.check_store_matches_target(old, after, store="s")  # an older store: by the sampled hash, as before
    assert "weights_sha256" not in old.to_dict()["target"]  # and its files stay byte-identical

    cache = json.loads((tmp_path / "cache" / W.CACHE_FILE).read_text())["files"]
    real = str((copy / "model.safetensors").resolve())
    assert cache[real]["sha256"] == W.file_sha256(copy / "model.safetensors")
    cache[real]["sha256"] = "0" * 64  # what the cache says is what a call with an unchanged file returns
    (tmp_path / "cache" / W.CACHE_FILE).write_text(json.dumps({"version": W.CACHE_VERSION, "files": cache}))
    assert W.files_sha256([copy / "model.safetensors"])[copy / "model.safetensors"] == "0" * 64
    (copy / "model.safetensors").write_bytes((copy / "model.safetensors").read_bytes())  # rewritten: read again
    assert W.files_sha256([copy / "model.safetensors"])[copy / "model.safetensors"] == W.file_sha256(copy / "model.safetensors")
