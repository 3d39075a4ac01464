"""The run config in parts (schemas/train_config.py): each part gets its flags, and the flat mapping every
run.json and config.pt holds, also one written before the parts existed, loads into them unchanged."""

from __future__ import annotations

import pytest

from peagle.schemas.checkpoint_settings import CheckpointSettings
from peagle.schemas.cod_settings import CodSettings
from peagle.schemas.data_settings import DataSettings
from peagle.schemas.errors import UserError
from peagle.schemas.optimizer_settings import OptimizerSettings
from peagle.schemas.train_config import TrainConfig
from peagle.schemas.train_resume import config_mismatch

BEFORE_THE_PARTS = {
    "activation_checkpointing": False, "allow_bad_aux_rows": False, "allow_incomplete": False, "attention": "auto",
    "aux_noise": 0.0, "compile": "auto", "compute_dtype": "auto", "down_sample_ratio": 0.7,
    "down_sample_ratio_min": 0.2, "draft_architecture": "llama", "draft_vocab_size": 2048, "epoch_shards": None,
    "epochs": None, "eval_every": 25, "eval_store": "/stores/heldout", "fc_norm": True, "flex_kernel": "auto",
    "follow": False, "follow_timeout": 3600.0, "fp8_matmuls": False, "fsdp": False, "grad_accum": 1,
    "grad_clip": 1.0, "heldout_fraction": 0.01, "init_from": None, "keep_checkpoints": 2, "log_every": 10,
    "logger": "none", "logger_dir": None, "logger_project": "peagle", "loss": "forward_kl", "lr": 0.003,
    "mask_token_id": None, "max_anchors": 1024, "max_bad_steps": 3, "max_steps": 2400, "method": "peagle",
    "mlflow_tracking_uri": None, "muon_lr": 0.02, "muon_ns_dtype": "float32", "norm_before_fc": True,
    "norm_before_residual": True, "num_depths": 8, "num_layers": 2, "num_workers": 1, "optimizer": "muon",
    "out": "/runs/peagle2-half-k8/run", "run_name": None, "save_every": 300, "seed": 0, "sequence_partitions": 1,
    "store": ["/stores/a:1238", "/stores/b:1238"], "target": "/targets/SmolLM2-135M-Instruct", "token_budget": 4096,
    "train_embeddings": False, "train_lm_head": False, "verify": False, "wandb_entity": None, "wandb_mode": "auto",
    "warmup_steps": 30, "weight_decay": 0.01,
}
"""The ``train_config`` of a run.json written before the parts (a long convergence run's, at e27380b,
its paths made generic): a later peagle resumes such runs."""


def test_a_saved_flat_config_from_before_the_parts_loads_into_them_unchanged():
    config = TrainConfig.from_dict(BEFORE_THE_PARTS)
    assert config.data == DataSettings(store=("/stores/a:1238", "/stores/b:1238"), eval_store="/stores/heldout",
                                       token_budget=4096, num_workers=1)
    assert config.cod == CodSettings(num_depths=8, max_anchors=1024)
    assert config.optim == OptimizerSettings(lr=0.003, warmup_steps=30)
    assert config.checkpoint == CheckpointSettings(save_every=300, keep_checkpoints=2)
    assert config.to_dict() == BEFORE_THE_PARTS  # what run.json and config.pt hold stays as it was
    assert config_mismatch(BEFORE_THE_PARTS, config) is None  # and the run resumes as itself
    changed = TrainConfig.from_flags(**{**BEFORE_THE_PARTS, "down_sample_ratio": 0.5})
    assert config_mismatch(BEFORE_THE_PARTS, changed).startswith("--down-sample-ratio was 0.7 in the checkpointed run")
    with pytest.raises(UserError, match="train config: unknown key 'cod'"):
        TrainConfig.from_dict({**BEFORE_THE_PARTS, "cod": {"num_depths": 8}})  # the saved form is flat


def test_each_part_checks_its_own_flags_in_one_line():
    base = dict(store=("s",), target="t", out="o")
    for flags, line in ((dict(num_depths=0), "--num-depths must be >= 1, got 0"),
                        (dict(down_sample_ratio=0.0), "--down-sample-ratio must be in (0, 1], got 0.0"),
                        (dict(lr=-1.0), "--lr must be > 0, got -1.0"),
                        (dict(keep_checkpoints=0), "--keep-checkpoints must be >= 1, got 0"),
                        (dict(token_budget=0), "--token-budget must be >= 1, got 0"),
                        (dict(store=()), "no training store: pass --store PATH")):
        with pytest.raises(UserError) as caught:
            TrainConfig.from_flags(**{**base, **flags})
        assert str(caught.value).startswith(line), (flags, str(caught.value))
