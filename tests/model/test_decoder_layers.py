"""The draft's decoder layers (peagle/model/decoder_layers.py): RoPE frequencies as transformers computes
them, and the one attention's three backends agreeing: flex under a BlockMask gives SDPA's outputs
under the dense mask, SDPA per document its outputs and gradients. The layers' forward against
transformers' Llama and Qwen3 layers is tested through the whole draft (test_draft.py)."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from peagle.model.decoder_layers import rope_inv_freq
from peagle.model.mask import dense_peagle_mask, document_ids, document_masks
from peagle.testing.cod_masks import cod_block_mask
from peagle.testing.tiny_draft import LLAMA3_ROPE, cod_row, hf_llama_config, random_draft, small_config


def test_rope_inv_freq_matches_transformers():
    for rope in ({"rope_type": "default", "rope_theta": 10000.0}, LLAMA3_ROPE,
                 {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}):
        cfg = small_config(rope_parameters=rope)
        hf = LlamaRotaryEmbedding(hf_llama_config(cfg))
        torch.testing.assert_close(rope_inv_freq(cfg), hf.inv_freq.float(), rtol=1e-6, atol=0)


def test_sdpa_and_flex_give_equal_outputs():
    draft = random_draft(small_config(num_layers=2))
    lengths = [70, 61]  # > one 128-block of elements, two documents
    anchor_N, depth_N, position_N = cod_row(lengths, num_depths=3)
    num_real, n = int((depth_N == 0).sum()), anchor_N.numel()
    token_ids_N = torch.randint(0, 199, (n,))
    token_ids_N[num_real:] = 199
    aux_RAH = torch.randn(num_real, 3, 64)
    dense = dense_peagle_mask(anchor_N, depth_N, torch.tensor(lengths), sum(lengths))
    block = cod_block_mask(anchor_N, depth_N, torch.tensor(lengths), sum(lengths))
    with torch.no_grad():
        torch.testing.assert_close(draft(token_ids_N, aux_RAH, position_N, block),
                                   draft(token_ids_N, aux_RAH, position_N, dense), atol=1e-5, rtol=1e-5)


def test_per_document_sdpa_equals_one_dense_mask_with_gradients():
    """The CPU path's DocumentMasks: the same outputs and gradients as one [N, N] mask, on a row of
    three documents whose elements interleave in the flat COD order (depth-major)."""
    lengths = [9, 4, 6]
    anchor_N, depth_N, position_N = cod_row(lengths, num_depths=3)
    num_real, n = sum(lengths), anchor_N.numel()
    doc_N = document_ids(anchor_N, torch.tensor(lengths), sum(lengths))
    token_ids_N = torch.randint(0, 199, (n,))
    token_ids_N[num_real:] = 199
    aux_RAH = torch.randn(num_real, 3, 64)
    per_doc = document_masks(anchor_N, depth_N, doc_N)
    assert [i.numel() for i in per_doc.index_per_doc] == [3 * n_d for n_d in lengths]
    outputs, grads = [], []
    for mask in (dense_peagle_mask(anchor_N, depth_N, torch.tensor(lengths), sum(lengths)), per_doc):
        draft = random_draft(small_config(num_layers=2, architecture="qwen3"))
        out = draft(token_ids_N, aux_RAH, position_N, mask)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append({name: p.grad for name, p in draft.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-4, rtol=1e-4, msg=name)
