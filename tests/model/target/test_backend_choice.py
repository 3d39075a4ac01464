"""The one open_backend (model/target/backend_choice.py): what extract and prompts each pass reaches the
hf backend as they meant it, and no other module of peagle chooses between the backends itself."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from peagle.model.target.backend import TargetOutput
from peagle.model.target.backend_choice import open_backend
from peagle.model.target.directory import open_target
from peagle.model.target.hf_backend import HFBackend

PACKAGE = Path(__file__).resolve().parents[3] / "peagle"


def test_a_generate_only_backend_samples_in_its_compute_dtype(tiny_llama):
    """prompts' call: no aux layers, and no generation dtype means the compute dtype (a float32 target
    on a CPU with native bf16 would sample from a bf16 copy under ``auto``)."""
    target = open_target(tiny_llama)
    backend = open_backend("hf", target, max_seq_len=64, dtype="float32", device="cpu")
    try:
        assert isinstance(backend, HFBackend) and backend.aux_layer_ids == ()
        assert backend.dtype == backend.generation_dtype == torch.float32
        pad = target.tokenizer.pad_token_id
        assert backend.pad_token_id == (pad if pad is not None else 0)
        (out,) = backend.generate([[5, 6, 7]], max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)
        assert 0 < len(out) <= 4
    finally:
        backend.close()


def test_an_extraction_backend_gets_its_layers_topk_and_answer_dtype(tiny_llama):
    """extract's call: aux layers and top-k for ``run``, answers in the dtype the store records."""
    backend = open_backend("hf", open_target(tiny_llama), max_seq_len=64, aux_layer_ids=[2, 4], topk=3,
                           dtype="float32", generation_dtype="bfloat16", device="cpu", generation="dynamic")
    try:
        assert backend.aux_layer_ids == (2, 4) and backend.generation_dtype == torch.bfloat16
        assert backend.generation == "dynamic"
        (out,) = backend.run([[5, 6, 7, 8]])
        assert isinstance(out, TargetOutput)
        assert out.aux_TAH.shape == (4, 2, 128) and out.topk_ids_TK.shape == (4, 3)
    finally:
        backend.close()


def test_only_open_backend_constructs_a_backend_by_choice():
    """The choice between hf and vllm is written once: no module but backend_choice imports the vLLM
    backend, and the only other module that builds the HF backend is store check, which always
    recomputes with hf."""
    vllm_importers, hf_importers = set(), set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                name = path.relative_to(PACKAGE.parent).as_posix()
                if node.module == "peagle.model.target.vllm_backend":
                    vllm_importers.add(name)
                if node.module == "peagle.model.target.hf_backend" and "HFBackend" in {a.name for a in node.names}:
                    hf_importers.add(name)
    assert vllm_importers == {"peagle/model/target/backend_choice.py"}
    assert hf_importers == {"peagle/model/target/backend_choice.py", "peagle/stages/store/check_target.py"}
