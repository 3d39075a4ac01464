"""The transformers backend against transformers itself: aux[i] = hidden_states[layer][i] and
topk[i] = the top of log_softmax(logits[i]) (the distribution of x_{i+1}), on both tiny archs."""

from __future__ import annotations

import pytest
import torch

from peagle.schemas.errors import UserError
from peagle.model.target.hf_backend import HFBackend, resolve_generation_dtype, topk_logprobs

AUX = (2, 4, 5)
TOPK = 16


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def backend(request, tiny_llama, tiny_qwen3):
    path = tiny_llama if request.param == "llama" else tiny_qwen3
    b = HFBackend(path, aux_layer_ids=AUX, topk=TOPK, dtype="float32", device="cpu", generation_dtype="float32")
    yield b
    b.close()


def _reference(model, ids: list[int]):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states, torch.log_softmax(out.logits[0].float(), dim=-1)


def test_single_sample_equals_hf_hidden_states_and_log_softmax_exactly(backend):
    ids = [5, 17, 99, 3, 250, 7, 7, 600, 12]
    (out,) = backend.run([ids])
    hidden, logprobs_TV = _reference(backend.model, ids)
    assert out.aux_TAH.shape == (len(ids), len(AUX), 128) and out.aux_TAH.dtype == torch.bfloat16
    for a, layer in enumerate(AUX):
        assert torch.equal(out.aux_TAH[:, a], hidden[layer][0].to(torch.bfloat16)), f"layer {layer}"
    values_TK, ids_TK = logprobs_TV.topk(TOPK, dim=-1)
    assert out.topk_ids_TK.dtype == torch.int32 and out.topk_logprobs_TK.dtype == torch.float32
    assert torch.equal(out.topk_ids_TK, ids_TK.to(torch.int32))
    torch.testing.assert_close(out.topk_logprobs_TK, values_TK, rtol=0, atol=2e-6)
    # row i is the distribution of x_{i+1}: the logits HF computes at position i score the next token
    assert (out.topk_logprobs_TK[:, :-1] >= out.topk_logprobs_TK[:, 1:]).all()  # descending


def test_right_padding_does_not_change_real_rows(backend):
    samples = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34]]
    batched = backend.run(samples)
    for ids, out in zip(samples, batched):
        (alone,) = backend.run([ids])
        assert out.aux_TAH.shape[0] == len(ids)
        torch.testing.assert_close(out.aux_TAH.float(), alone.aux_TAH.float(), rtol=0, atol=2e-2)
        torch.testing.assert_close(out.topk_logprobs_TK, alone.topk_logprobs_TK, rtol=0, atol=1e-4)
        assert (out.topk_ids_TK[:, 0] == alone.topk_ids_TK[:, 0]).all()


def test_same_batch_is_bit_identical_across_calls(backend):
    samples = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    first, second = backend.run(samples), backend.run(samples)
    for a, b in zip(first, second):
        assert torch.equal(a.aux_TAH, b.aux_TAH) and torch.equal(a.topk_ids_TK, b.topk_ids_TK)
        assert torch.equal(a.topk_logprobs_TK, b.topk_logprobs_TK)


def test_chunked_topk_equals_one_chunk():
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1000, bias=False)
    hidden_TH = torch.randn(37, 32)
    one_ids, one_lp = topk_logprobs(hidden_TH, head, 8, chunk_bytes=1 << 30)
    small_ids, small_lp = topk_logprobs(hidden_TH, head, 8, chunk_bytes=5 * 1000 * 4)  # 5 tokens a chunk
    assert torch.equal(one_ids, small_ids)
    torch.testing.assert_close(one_lp, small_lp, rtol=0, atol=1e-6)
    ref_lp, ref_ids = torch.log_softmax(head(hidden_TH), -1).topk(8)
    assert torch.equal(one_ids, ref_ids.int())
    torch.testing.assert_close(one_lp, ref_lp, rtol=0, atol=1e-5)
    capped_ids, _ = topk_logprobs(hidden_TH, head, 8, softcap=5.0)
    assert torch.equal(capped_ids, one_ids)  # tanh capping is monotone: same order


def test_generate_is_seeded_and_greedy_matches_transformers(backend):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    a = backend.generate(prompts, max_new_tokens=6, temperature=0.9, top_p=0.9, seed=3)
    b = backend.generate(prompts, max_new_tokens=6, temperature=0.9, top_p=0.9, seed=3)
    assert a == b and all(1 <= len(x) <= 6 for x in a)
    greedy = backend.generate([prompts[1]], max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)
    ref = backend.model.generate(torch.tensor([prompts[1]]), max_new_tokens=4, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    stops = set([backend.model.generation_config.eos_token_id])
    cut = next((j for j, t in enumerate(ref) if t in stops), len(ref))
    assert greedy == [ref[:cut]]


def test_bfloat16_compute_and_too_large_topk(tiny_llama):
    b = HFBackend(tiny_llama, aux_layer_ids=(2,), topk=4, dtype="bfloat16", device="cpu")
    (out,) = b.run([[5, 6, 7, 8]])
    assert out.aux_TAH.dtype == torch.bfloat16 and torch.isfinite(out.topk_logprobs_TK).all()
    b.close()
    with pytest.raises(UserError, match="larger than the target vocab"):
        HFBackend(tiny_llama, aux_layer_ids=(2,), topk=100000, dtype="float32", device="cpu")


def _compile_everywhere(backend: HFBackend, backend_name: str = "inductor") -> None:
    """transformers compiles generation's decode step on accelerators only; this lets the CPU test it."""
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(backend=backend_name, mode=None if backend_name != "inductor" else "reduce-overhead")
    config._compile_all_devices = True
    backend.generation_model().generation_config.compile_config = config
    backend.generation = "compiled"


def test_static_and_compiled_generation_equal_dynamic_and_never_capture(tiny_llama):
    """The GPU paths (a static cache; compiled: rows padded to a power of two, width to a multiple of
    64) give the dynamic cache's answers; the aux hooks are not live while generating."""
    backend = HFBackend(tiny_llama, aux_layer_ids=AUX, topk=TOPK, dtype="float32", device="cpu",
                        generation_dtype="float32")
    assert backend.generation == "dynamic"  # auto on CPU
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 70]  # 3 rows -> 4, width 70 -> 128
    eager = backend.generate(prompts, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)
    backend.generation = "static"
    assert backend.generate(prompts, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0) == eager
    _compile_everywhere(backend, "eager")  # dynamo's graph without inductor: the same path, seconds not minutes
    static = backend.generate(prompts, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)
    assert static == eager and backend.generation_notes == [] and backend.generation == "compiled"
    assert backend._captured == {}
    (out,) = backend.run([[5, 6, 7, 8]])  # extraction after generation still captures every aux layer
    assert out.aux_TAH.shape == (4, len(AUX), 128)


def test_a_failed_compile_falls_back_to_uncompiled_and_says_so_once(tiny_llama):
    backend = HFBackend(tiny_llama, aux_layer_ids=AUX, topk=TOPK, dtype="float32", device="cpu",
                        generation_dtype="float32")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    eager = backend.generate(prompts, max_new_tokens=5, temperature=0.0, top_p=1.0, seed=0)
    _compile_everywhere(backend, "no-such-backend")
    assert backend.generate(prompts, max_new_tokens=5, temperature=0.0, top_p=1.0, seed=0) == eager
    assert backend.generate(prompts, max_new_tokens=5, temperature=0.0, top_p=1.0, seed=0) == eager
    assert len(backend.generation_notes) == 1 and "compiled generation failed" in backend.generation_notes[0]
    assert backend.generation == "static"
    with pytest.raises(UserError, match="generation must be one of"):
        HFBackend(tiny_llama, aux_layer_ids=AUX, topk=TOPK, dtype="float32", device="cpu", generation="fast")


def test_answers_in_bf16_states_in_fp32(tiny_llama):
    """Asked for, a bf16 copy writes the answers (~1.6x faster on CPUs with native bf16 matmuls); the
    aux states and top-k still come from the fp32 model, as vLLM serves it."""
    backend = HFBackend(tiny_llama, aux_layer_ids=AUX, topk=TOPK, dtype="float32", device="cpu",
                        generation_dtype="bfloat16")
    assert backend.generation_dtype == torch.bfloat16 and backend.dtype == torch.float32
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    answers = backend.generate(prompts, max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    copy = backend.generation_model()
    assert copy is not backend.model and next(copy.parameters()).dtype == torch.bfloat16
    assert next(backend.model.parameters()).dtype == torch.float32
    ref = copy.generate(torch.tensor([prompts[1]]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, 5:].tolist()
    stops = {copy.generation_config.eos_token_id}
    assert answers[1] == ref[:next((j for j, t in enumerate(ref) if t in stops), len(ref))]
    (out,) = backend.run([[5, 6, 7, 8]])
    reference = backend.model(torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True).hidden_states
    assert torch.equal(out.aux_TAH[:, 0], reference[AUX[0]][0].to(torch.bfloat16))  # fp32 states, stored bf16
    plain = HFBackend(tiny_llama, aux_layer_ids=AUX, topk=TOPK, dtype="float32", device="cpu",
                      generation_dtype="float32")
    assert plain.generation_dtype == torch.float32 and plain.generation_model() is plain.model


def test_auto_writes_the_answers_in_bf16_only_on_a_cpu_that_has_it():
    """``auto``: bf16 for a float32 target on a CPU with native bf16 matmuls (~1.5x, the same
    acceptance); the compute dtype on other CPUs (bf16 emulated is slow), on a GPU and for a bf16
    target; an explicit dtype is kept."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_generation_dtype("auto", torch.float32, cpu, cpu_has_bf16=True) == torch.bfloat16
    assert resolve_generation_dtype("auto", torch.float32, cpu, cpu_has_bf16=False) == torch.float32
    assert resolve_generation_dtype("auto", torch.float32, cuda, cpu_has_bf16=True) == torch.float32
    assert resolve_generation_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_generation_dtype("float32", torch.float32, cpu, cpu_has_bf16=True) == torch.float32
    assert resolve_generation_dtype("bfloat16", torch.float32, cpu, cpu_has_bf16=False) == torch.bfloat16
