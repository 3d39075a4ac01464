"""Small random P-EAGLE drafts, flat COD rows and transformers configs of a draft for tests (tests/model,
tests/stages/train)."""

from __future__ import annotations

import torch

from peagle.model.draft import PEagleDraft
from peagle.schemas.draft_config import DraftConfig

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
"""Llama 3.1's RoPE scaling with a context short enough that a small config's frequencies fall in all
three of its bands."""


def small_config(**overrides) -> DraftConfig:
    fields = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  num_layers=3, target_hidden_size=64, num_aux=3, target_vocab_size=200,
                  draft_vocab_size=200, mask_token_id=199, max_position_embeddings=512,
                  aux_layer_ids=[2, 4, 5])
    fields.update(overrides)
    return DraftConfig(**fields)


def random_draft(config: DraftConfig, seed: int = 0, **kwargs) -> PEagleDraft:
    torch.manual_seed(seed)
    draft = PEagleDraft(config, **kwargs)
    with torch.no_grad():  # non-trivial norms (fc_norm.{j} too) so that a swapped or skipped norm would show
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return draft


def cod_row(lengths: list[int], num_depths: int):
    """A full-chain flat COD row (every anchor at every depth) of packed samples, in the COD layout."""
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    anchor_N = torch.cat([torch.cat([torch.arange(n) + o for n, o in zip(lengths, offsets)])
                          for _ in range(num_depths)])
    depth_N = torch.arange(num_depths).repeat_interleave(sum(lengths))
    sample_start_N = torch.cat([torch.full((n,), int(o)) for n, o in zip(lengths, offsets)]).repeat(num_depths)
    position_N = anchor_N - sample_start_N + depth_N
    return anchor_N, depth_N, position_N


def hf_llama_config(config: DraftConfig):
    """transformers' ``LlamaConfig`` of the draft's layers: what reference implementations are built from."""
    from transformers import LlamaConfig

    fields = config.llama_config_dict()
    return LlamaConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})


def tiny_eval_run(root, target, *, num_chats: int, samples_per_shard: int, max_seq_len: int, step: int):
    """ROOT/store (a tiny HF extraction on ``target``) and ROOT/run: a run directory with one checkpoint
    (at ``step``) of a random 1-layer draft over it, as `peagle eval RUN_DIR` reads one. Returns the run."""
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer

    from peagle.model.draft import build_draft_from_target
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.stages.train import checkpoint as ckpt
    from peagle.testing.chat_data import write_chat_jsonl

    root = Path(root)
    data = write_chat_jsonl(root / "chat.jsonl", num_chats, seed=9)
    run_extract(ExtractConfig(data=(str(data),), target=str(target), out=str(root / "store"), backend="hf",
                              topk=4, samples_per_shard=samples_per_shard, device="cpu", max_seq_len=max_seq_len),
                echo=lambda _: None, progress=False)
    config = DraftConfig.from_target_config(
        AutoConfig.from_pretrained(target), num_layers=1, draft_vocab_size=512,
        mask_token_id=AutoTokenizer.from_pretrained(target).convert_tokens_to_ids("<|mask|>"))
    torch.manual_seed(0)
    draft = build_draft_from_target(target, config, torch.arange(512))
    part = {"train_config": {"target": str(target), "num_depths": 3, "store": [str(root / "store")],
                             "heldout_fraction": 0.0, "eval_store": None},
            "draft_config": config.to_dict(), "world_size": 1, "store_manifest_hash": "0" * 64}
    ckpt.Checkpointer(root / "run", keep=1).save(step, {ckpt.MODEL: draft.state_dict(), ckpt.OPTIMIZER: {},
                                                        ckpt.LR_SCHEDULER: {}, ckpt.TRAIN_STATE: {}, ckpt.CONFIG: part,
                                                        ckpt.DATALOADER: {}, ckpt.RNG: {}})
    return root / "run"
