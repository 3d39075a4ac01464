"""The shard tensor file (pipeline/shard_tensors.py): its layout and size per token, bf16 and fp8; encoded
samples written back to back, loadable by safetensors itself."""

from __future__ import annotations

from dataclasses import replace

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from peagle.pipeline import fp8
from peagle.pipeline.safetensors_file import encode_header, map_tensors, read_header
from peagle.pipeline.shard_tensors import encode_sample, raw_bytes_per_token, stored_aux, tensor_layout, write_tensors
from peagle.schemas import store as S

A, H, K = 3, 16, 4
TARGET = S.TargetIdentity(path="/m", architecture="LlamaForCausalLM", num_hidden_layers=8, hidden_size=H,
                          vocab_size=64, dtype="float32", content_hash="c" * 64)
SETTINGS = S.StoreSettings(target=TARGET, tokenizer_fingerprint="t", chat_template_hash="h",
                           aux_layer_ids=(2, 4, 5), topk=K, max_seq_len=64, logprob_dtype="float16", loss_on="all")


def _rows(i: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sample's aux states and top-k, as a backend returns them."""
    g = torch.Generator().manual_seed(i)
    return (torch.randn(n, A, H, generator=g).to(torch.bfloat16),
            torch.randint(0, 64, (n, K), generator=g, dtype=torch.int32),
            -torch.rand(n, K, generator=g).sort(dim=-1).values * 5)


SAMPLES = [_rows(i, n) for i, n in enumerate((5, 3, 7))]


def _encoded(settings: S.StoreSettings = SETTINGS) -> list[dict[str, torch.Tensor]]:
    return [encode_sample(aux, ids, logprobs, settings) for aux, ids, logprobs in SAMPLES]


def test_tensor_layout_and_bytes_per_token():
    layout = tensor_layout(SETTINGS, 7)
    assert list(layout) == list(S.TENSOR_NAMES)
    assert layout[S.AUX_HIDDEN] == ((7, 3, 16), torch.bfloat16) and layout[S.TOPK_IDS] == ((7, 4), torch.int32)
    assert layout[S.TOPK_LOGPROBS][1] == torch.float16
    assert raw_bytes_per_token(SETTINGS) == 3 * 16 * 2 + 4 * (4 + 2)
    assert raw_bytes_per_token(replace(SETTINGS, logprob_dtype="float32")) == 3 * 16 * 2 + 4 * 8


def test_fp8_layout_scales_and_safetensors_compatibility(tmp_path):
    """An fp8 shard: codes in aux_hidden (F8_E4M3), one float32 scale per (token, layer) in aux_scale
    right after it, top-k unchanged; loadable by safetensors itself."""
    settings = replace(SETTINGS, hidden_dtype=S.HIDDEN_FP8)
    layout = tensor_layout(settings, 7)
    assert list(layout) == [S.AUX_HIDDEN, S.AUX_SCALE, S.TOPK_IDS, S.TOPK_LOGPROBS]
    assert layout[S.AUX_HIDDEN] == ((7, 3, 16), torch.float8_e4m3fn) and layout[S.AUX_SCALE] == ((7, 3), torch.float32)
    assert layout[S.TOPK_LOGPROBS] == tensor_layout(SETTINGS, 7)[S.TOPK_LOGPROBS]  # top-k keeps its dtype
    assert raw_bytes_per_token(settings) == 3 * (16 + 4) + 4 * (4 + 2)
    states = torch.randn(7, 3, 16).to(torch.bfloat16)
    codes, scale = fp8.quantize(states)
    tensors = {S.AUX_HIDDEN: codes, S.AUX_SCALE: scale, S.TOPK_IDS: torch.zeros(7, 4, dtype=torch.int32),
               S.TOPK_LOGPROBS: torch.zeros(7, 4, dtype=torch.float16)}
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        f.write(encode_header(layout))
        for t in tensors.values():
            f.write(t.view(torch.uint8).numpy().tobytes())
    loaded = load_file(str(path))
    assert loaded[S.AUX_HIDDEN].dtype == torch.float8_e4m3fn and torch.equal(loaded[S.AUX_SCALE], scale)
    mapped = map_tensors(path)
    assert torch.equal(mapped[S.AUX_HIDDEN].view(torch.uint8), codes.view(torch.uint8))
    assert read_header(path)[S.AUX_HIDDEN].row_bytes == 3 * 16
    assert torch.equal(stored_aux(mapped).states(), fp8.dequantize(codes, scale))


def test_tensors_are_the_samples_concatenated_in_sample_order(tmp_path):
    path = tmp_path / "x.safetensors"
    write_tensors(path, _encoded(), SETTINGS)
    loaded = load_file(str(path))
    assert set(loaded) == set(S.TENSOR_NAMES)
    assert loaded[S.AUX_HIDDEN].shape == (15, A, H) and loaded[S.AUX_HIDDEN].dtype == torch.bfloat16
    assert loaded[S.TOPK_IDS].shape == (15, K) and loaded[S.TOPK_IDS].dtype == torch.int32
    assert loaded[S.TOPK_LOGPROBS].dtype == torch.float16
    assert torch.equal(loaded[S.AUX_HIDDEN], torch.cat([aux for aux, _, _ in SAMPLES]))
    assert torch.equal(loaded[S.TOPK_IDS], torch.cat([ids for _, ids, _ in SAMPLES]))
    assert torch.equal(loaded[S.TOPK_LOGPROBS], torch.cat([logprobs for _, _, logprobs in SAMPLES]).half())
    with safe_open(str(path), "pt") as f:
        assert f.metadata() is None and sorted(f.keys()) == sorted(S.TENSOR_NAMES)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_float32_logprobs_and_an_empty_shard(tmp_path):
    f32 = replace(SETTINGS, logprob_dtype="float32")
    write_tensors(tmp_path / "f.safetensors", _encoded(f32), f32)
    assert load_file(str(tmp_path / "f.safetensors"))[S.TOPK_LOGPROBS].dtype == torch.float32
    write_tensors(tmp_path / "e.safetensors", [], SETTINGS)
    assert load_file(str(tmp_path / "e.safetensors"))[S.AUX_HIDDEN].shape == (0, A, H)
