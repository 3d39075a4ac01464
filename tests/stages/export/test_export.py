"""`peagle export`: the newest valid checkpoint of a run written as a speculators 'peagle' directory
(the format itself: tests/model/test_speculators_format.py), atomically, through the real CLI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from peagle.model.draft import PEagleDraft
from peagle.pipeline.checkpoint_files import read_draft_checkpoint
from peagle.schemas.export_config import ExportConfig
from peagle.stages.export.run import run_export

sys.path.insert(0, str(Path(__file__).parents[2] / "model"))  # test helpers of the format, any import mode
from test_speculators_format import tiny_draft  # noqa: E402


def write_checkpoint(run_dir: Path, draft: PEagleDraft, target: Path, step: int, *, num_depths: int = 3,
                     train_embeddings: bool = True) -> Path:
    """A checkpoint exactly as the trainer commits it (its Checkpointer, its config part's keys)."""
    from peagle.stages.train import checkpoint as ckpt

    config_part = {"train_config": {"target": str(target), "num_depths": num_depths, "store": ["/data/store"],
                                    "train_embeddings": train_embeddings},
                   "draft_config": draft.config.to_dict(), "world_size": 1, "store_manifest_hash": "ab" * 32,
                   "provenance": {"peagle_version": "0.0.9", "git_revision": "0123abcd", "host": {"hostname": "trainer"}}}
    state = {ckpt.MODEL: draft.state_dict(), ckpt.OPTIMIZER: {}, ckpt.LR_SCHEDULER: {}, ckpt.TRAIN_STATE: {"step": step},
             ckpt.CONFIG: config_part, ckpt.DATALOADER: {}, ckpt.RNG: {}}
    return ckpt.Checkpointer(run_dir, keep=5).save(step, state)


def test_run_export_writes_the_newest_valid_checkpoint(tmp_path, tiny_llama):
    from peagle.model.speculators_format import load_export

    old, new = tiny_draft(tiny_llama, seed=1), tiny_draft(tiny_llama, seed=2)
    write_checkpoint(tmp_path / "run", old, tiny_llama, 10)
    damaged = write_checkpoint(tmp_path / "run", new, tiny_llama, 20)
    (damaged / "model.pt").write_bytes((damaged / "model.pt").read_bytes()[:-10] + b"0" * 10)  # same size, bad sha
    assert read_draft_checkpoint(tmp_path / "run").step == 10

    out = run_export(ExportConfig(source=str(tmp_path / "run"), out=str(tmp_path / "export")), echo=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # trained depths
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(Path(tiny_llama).resolve()),
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["peagle"]["step"] == 10 and config["peagle"]["store_manifest_hash"] == "ab" * 32
    # Provenance is what training recorded, not the exporting machine's.
    assert (config["peagle"]["git_revision"], config["peagle"]["peagle_version"]) == ("0123abcd", "0.0.9")
    # The section travels (export_provenance.py): no host name, paths relative to the export
    assert config["peagle"]["host"] == {} and config["peagle"]["path_base"] == "export"
    assert config["peagle"]["checkpoint"] == os.path.relpath(read_draft_checkpoint(tmp_path / "run").path, out)
    assert config["peagle"]["run_config"]["store"] == [os.path.relpath("/data/store", out)]
    loaded = load_export(out)  # eval's reader: the same tensors come back
    for name, tensor in old.state_dict().items():
        assert torch.equal(loaded.draft.state_dict()[name], tensor), name
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_cli_export_replaces_an_export_and_refuses_other_directories(tmp_path, tiny_llama, run_peagle):
    draft = tiny_draft(tiny_llama, draft_vocab_size=None)
    ckpt_dir = write_checkpoint(tmp_path / "run", draft, tiny_llama, 5)
    done = run_peagle("export", ckpt_dir, "--out", tmp_path / "export", "--speculative-tokens", "2",
                      "--verifier-name", "org/tiny-llama", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    from safetensors import safe_open

    with safe_open(tmp_path / "export" / "model.safetensors", framework="pt") as f:
        assert "d2t" not in f.keys() and f.get_tensor("fc.weight").dtype == torch.bfloat16

    again = run_peagle("export", tmp_path / "run", "--out", tmp_path / "export")  # replaces the export whole
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "export" / "config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"] == str(Path(tiny_llama).resolve())

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    refused = run_peagle("export", tmp_path / "run", "--out", tmp_path / "other")
    assert refused.returncode == 2 and "not a peagle export" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr


def test_a_checkpoint_with_non_finite_weights_is_refused_naming_a_finite_one(tmp_path, tiny_llama):
    """NaN or inf in the model part: nothing is written, one line names the tensors and the run's newest
    earlier checkpoint whose weights are recorded finite."""
    import pytest

    from peagle.schemas.errors import UserError

    write_checkpoint(tmp_path / "run", tiny_draft(tiny_llama, seed=1), tiny_llama, 10)
    bad = tiny_draft(tiny_llama, seed=2)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
        bad.layers[0].mlp.down_proj.weight[1, 2] = float("inf")
    newest = write_checkpoint(tmp_path / "run", bad, tiny_llama, 20)
    with pytest.raises(UserError) as refused:
        run_export(ExportConfig(source=str(tmp_path / "run"), out=str(tmp_path / "export")), echo=lambda _: None)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"checkpoint {newest} holds non-finite weights (NaN or inf) in 2 tensors")
    assert "fc.weight" in line and "layers.0.mlp.down_proj.weight" in line
    assert line.endswith(f"export {tmp_path / 'run' / 'checkpoints' / 'step-00000010'} instead")
    assert not (tmp_path / "export").exists()
    out = run_export(ExportConfig(source=str(tmp_path / "run" / "checkpoints" / "step-00000010"),
                                  out=str(tmp_path / "export")), echo=lambda _: None)
    assert (out / "model.safetensors").is_file()


def test_an_export_travels_without_the_target_embedding_and_comes_back_whole(tmp_path, tiny_llama, tiny_qwen3,
                                                                               run_peagle):
    """`--without-target-embedding` (a draft that kept the target's rows) -> the small form; `--target`
    puts them back: byte-equal to the whole export; another target, no --target, a draft that trained
    its embedding: one line each, nothing written."""
    from safetensors import safe_open

    draft = tiny_draft(tiny_llama)  # its embedding is the target's
    run = tmp_path / "run"
    write_checkpoint(run, draft, tiny_llama, 5, train_embeddings=False)
    assert run_peagle("export", run, "--out", tmp_path / "whole").returncode == 0
    done = run_peagle("export", run, "--out", tmp_path / "travel", "--without-target-embedding")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "travel").iterdir()) == ["config.json", "model.safetensors",
                                                                        "target_embedding.json"]
    with safe_open(tmp_path / "travel" / "model.safetensors", framework="pt") as f:
        assert "embed_tokens.weight" not in f.keys()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the whole copy it stripped is gone

    back = run_peagle("export", tmp_path / "travel", "--target", tiny_llama, "--out", tmp_path / "back")
    assert back.returncode == 0, back.stderr
    with safe_open(tmp_path / "whole" / "model.safetensors", framework="pt") as whole, \
            safe_open(tmp_path / "back" / "model.safetensors", framework="pt") as restored:
        assert sorted(whole.keys()) == sorted(restored.keys())
        for key in whole.keys():
            assert torch.equal(whole.get_tensor(key), restored.get_tensor(key)), key
    assert (tmp_path / "back" / "config.json").read_bytes() == (tmp_path / "whole" / "config.json").read_bytes()
    # an export already whole can be made to travel too, in shards (--max-file-mib: a draft git holds)
    assert run_peagle("export", tmp_path / "whole", "--out", tmp_path / "travel2", "--without-target-embedding",
                      "--max-file-mib", "0.05").returncode == 0
    assert (tmp_path / "travel2" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "travel2").glob("model-*-of-*.safetensors"))) >= 2
    assert run_peagle("export", tmp_path / "travel2", "--target", tiny_llama, "--out", tmp_path / "back2").returncode == 0
    assert (tmp_path / "back2" / "model.safetensors").read_bytes() == (tmp_path / "back" / "model.safetensors").read_bytes()

    for args, needle in ((("--target", tiny_qwen3), "not the one"), ((), "pass --target DIR")):
        refused = run_peagle("export", tmp_path / "travel", *args, "--out", tmp_path / "refused")
        assert refused.returncode == 2 and needle in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()
    write_checkpoint(tmp_path / "trained", draft, tiny_llama, 5)  # trained its embedding (the default)
    refused = run_peagle("export", tmp_path / "trained", "--out", tmp_path / "refused", "--without-target-embedding")
    assert refused.returncode == 2 and "trained its embedding" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()


def test_a_p_eagle_draft_serves_k_up_to_its_trained_depths_and_carries_a_k_per_batch_size(tmp_path, tiny_llama):
    """K = 8 for a draft trained at 8 depths, K = 9 refused in one line; the batch-size schedule of K is
    written into the export's peagle section, read back, and checked by every reader of the export."""
    from peagle.model.speculators_config import recorded_schedule
    from peagle.model.speculators_format import load_export, read_export_config
    from peagle.schemas.errors import UserError

    write_checkpoint(tmp_path / "run", tiny_draft(tiny_llama), tiny_llama, 5, num_depths=8)
    said: list[str] = []
    out = run_export(ExportConfig(source=str(tmp_path / "run"), out=str(tmp_path / "export"), speculative_tokens=8,
                                  speculative_schedule="1:8,2-8:0"), echo=said.append)
    exported = load_export(out)
    assert exported.speculative_tokens == 8 and recorded_schedule(exported.config_json) == [[1, 1, 8], [2, 8, 0]]
    assert """--speculative-config '{"num_speculative_tokens_per_batch_size":[[1,1,8],[2,8,0]]}'""" in said[0]

    with pytest.raises(UserError, match=r"--speculative-tokens 9: this P-EAGLE draft was trained at 8 depths, "
                                         r"so it serves K = 1 to 8"):
        run_export(ExportConfig(source=str(tmp_path / "run"), out=str(tmp_path / "k9"), speculative_tokens=9))
    with pytest.raises(UserError, match=r"takes K = 8 \(the served K\) or 0, not K = 4"):
        run_export(ExportConfig(source=str(tmp_path / "run"), out=str(tmp_path / "k4"),
                                speculative_schedule="1:8,2-8:4"))
    with pytest.raises(UserError, match="is an export: --speculative-schedule is written when a checkpoint"):
        run_export(ExportConfig(source=str(out), out=str(tmp_path / "again"), speculative_schedule="1:8"))
    assert not (tmp_path / "k9").exists() and not (tmp_path / "k4").exists()

    config = json.loads((out / "config.json").read_text())
    config["peagle"]["speculative_schedule"] = [[1, 1, 8], [1, 8, 0]]  # a hand edit that overlaps
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"config.json \(peagle.speculative_schedule\): the speculative schedule's "
                                         r"batch sizes must run in ascending ranges from 1"):
        read_export_config(out)


def test_an_eagle3_draft_is_served_past_the_steps_it_unrolled_with_a_warning(tmp_path, tiny_llama, capsys):
    """EAGLE-3 drafts depth d + 1 with the same forward it trained for depth d (peagle/model/sequential.py),
    so a K above its training-time-test steps is legitimate; any K of it may be scheduled per batch size."""
    import dataclasses

    from peagle.model.draft import build_draft_from_target

    config = dataclasses.replace(tiny_draft(tiny_llama).config, method="eagle3", mask_token_id=None)
    draft = build_draft_from_target(tiny_llama, config, torch.arange(0, 1024, 2))
    write_checkpoint(tmp_path / "run", draft, tiny_llama, 5, num_depths=3)
    out = run_export(ExportConfig(source=str(tmp_path / "run"), out=str(tmp_path / "export"), speculative_tokens=8,
                                  speculative_schedule="1:8,2-3:4,4:0"), echo=lambda _: None)
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 8
    assert config_json["peagle"]["speculative_schedule"] == [[1, 1, 8], [2, 3, 4], [4, 4, 0]]
    warned = capsys.readouterr().err
    assert "--speculative-tokens 8 exceeds the 3 steps this EAGLE-3 draft was trained to unroll" in warned
