"""benchmarks/peer_ab.py: the configurations' flags, the store -> speculators conversion, and one tiny
step of each trainer (peagle's, and speculators' in both configurations) on a toy store.

The speculators parts run in ``.venv-speculators`` (scripts/speculators_venv.sh makes it from
locks/speculators.txt; scripts/test.sh does) and are skipped, with that reason, where it is absent.
They share one process of that environment (``speculators_jobs``): importing speculators costs seconds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from peagle.testing.chat_data import write_chat_jsonl

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SPECULATORS_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
DRAFT_VOCAB = 64

needs_speculators = pytest.mark.skipif(
    not SPECULATORS_PYTHON.exists(),
    reason="no .venv-speculators here: `bash scripts/speculators_venv.sh` makes it (scripts/test.sh does)")


@pytest.fixture(scope="module")
def bench(load_benchmark):
    with load_benchmark("peer_ab.py") as module:  # peer_ab imports quality, its neighbour
        yield module


def value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_peagle_settings_are_the_train_config_of_the_flags(bench) -> None:
    p = bench.peagle_settings(bench.train_flags("muon-all-norms", replace(bench.Budget(), max_anchors=None), seed=3))
    assert (p.optim.optimizer, p.optim.muon_lr, p.optim.lr, p.cod.num_depths, p.num_layers, p.seed) == \
        ("muon", 0.02, 3e-3, 5, 1, 3)
    assert p.norm_before_residual and p.norm_before_fc and p.fc_norm and p.cod.max_anchors is None
    base = bench.peagle_settings(bench.train_flags("baseline", bench.Budget(), seed=0))
    assert base.optim.optimizer == "adamw" and not (base.norm_before_residual or base.norm_before_fc or base.fc_norm)
    with pytest.raises(SystemExit, match="--no-such-flag"):
        bench.peagle_settings(["--no-such-flag", "1"])


def test_speculators_peagle_flags_carry_peagle_settings(bench) -> None:
    budget = replace(bench.Budget(), max_anchors=None)  # as peer_ab.py runs it
    flags = bench.speculators_peagle_flags(bench.train_flags("muon-all-norms", budget, seed=2), mask_token_id=7)
    assert value(flags, "--num-depths") == "5" and value(flags, "--num-layers") == "1"
    assert value(flags, "--draft-arch") == "llama" and value(flags, "--full-attention-indices") == "0"
    assert float(value(flags, "--lr")) == 3e-3 and float(value(flags, "--muon-lr")) == 0.02
    assert value(flags, "--muon-adjust-lr-fn") == "original" and value(flags, "--optimizer") == "muon"
    assert value(flags, "--total-seq-len") == str(budget.token_budget) and value(flags, "--mask-token-id") == "7"
    assert value(flags, "--draft-vocab-size") == str(budget.draft_vocab_size) and value(flags, "--seed") == "2"
    assert int(value(flags, "--max-anchors")) >= 2**31 - 1  # peagle's default: no cap
    # speculators takes one norm before fc, and vLLM serves its checkpoints with norm_before_fc only
    assert "--fc-norm" not in flags and "--norm-before-fc" in flags and "--norm-before-residual" in flags
    cycles = float(value(flags, "--scheduler-num-cosine-cycles"))
    assert 0.5 * (1 + math.cos(2 * math.pi * cycles)) == pytest.approx(0.1, abs=1e-6)  # ends where peagle's does
    assert int(value(flags, "--scheduler-warmup-steps")) == 30 and value(flags, "--loss-fn") == "kl_div"
    baseline = bench.speculators_peagle_flags(bench.train_flags("baseline", budget, seed=0), mask_token_id=7)
    assert value(baseline, "--optimizer") == "adamw"
    assert "--no-norm-before-residual" in baseline and "--no-norm-before-fc" in baseline
    assert value(bench.speculators_peagle_flags(bench.train_flags("anchors8", budget, 0), 7), "--max-anchors") == "8"
    assert value(bench.speculators_peagle_flags(bench.train_flags("tv", budget, 0), 7), "--loss-fn") == "tv"


def test_summary_compares_each_speculators_configuration_with_peagle(bench) -> None:
    def record(config: str, seed: int, al: float) -> dict:
        return {"config": config, "seed": seed, "al_vllm": al, "al_own": al, "al_offline": al + 0.5,
                "per_depth": [0.9, 0.5], "positions": 1000, "seconds": {"train": 10.0}, "cpu_seconds": {"train": 9.0},
                "greedy_output_matches_plain": True, "vllm_greedy_matches_target": True}

    records = ([record("peagle", s, 2.0 + 0.01 * s) for s in range(3)]
               + [record("speculators-defaults", s, 1.5 + 0.01 * s) for s in range(3)])
    summary = bench.summarise_peers(records)
    assert "vs_peagle" not in summary["peagle"] and summary["peagle"]["al_vllm"]["n"] == 3
    vs = summary["speculators-defaults"]["vs_peagle"]["al_vllm"]
    assert vs["diff"] == pytest.approx(-0.5) and vs["beyond_noise"]
    assert summary["speculators-defaults"]["greedy_equal_everywhere"]
    # --eval-modes without online: no AL of our own loop, compared on what was measured
    for rec in records:
        rec["al_own"], rec["greedy_output_matches_plain"] = None, None
    summary = bench.summarise_peers(records)
    assert summary["peagle"]["al_own"] is None and set(summary["speculators-defaults"]["vs_peagle"]) == {
        "al_vllm", "al_offline"}


# --------------------------------------------------------------------------------------------------
# On a toy store: the conversion and one step of each trainer


@pytest.fixture(scope="module")
def toy_store(tmp_path_factory, tiny_llama) -> Path:
    from peagle.schemas.extract_config import ExtractConfig
    from peagle.stages.extract.run import run_extract
    from peagle.stages.train.vocab import build_draft_vocab

    root = tmp_path_factory.mktemp("peer_ab")
    data = write_chat_jsonl(root / "chat.jsonl", 12, seed=5)
    run_extract(ExtractConfig(data=(str(data),), target=str(tiny_llama), out=str(root / "store"), backend="hf",
                              topk=8, samples_per_shard=6, device="cpu"), echo=lambda _: None, progress=False)
    build_draft_vocab(root / "store", DRAFT_VOCAB)
    return root / "store"


def speculators_run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(SPECULATORS_PYTHON), *args], capture_output=True, text=True, env=env, cwd=BENCHMARKS,
                          timeout=timeout)


SPECULATORS_JOBS = """
import json, runpy, sys
import torch
from safetensors.torch import save_file
from torch.optim import _muon
from speculators.models.eagle3.data import shift_batch
import peer_ab_data as data
import peer_ab_speculators as trainer
from peagle.stages.train.vocab import load_draft_vocab
jobs = json.loads(open(sys.argv[1]).read())

# The conversion: sample 0 through peer_ab_data and speculators' own shift.
t2d = load_draft_vocab(jobs["store"], jobs["vocab"]).t2d_V
samples = data.StoreSamples(jobs["store"], data.target_to_draft_of(t2d, t2d.numel()), jobs["vocab"], 4096)
save_file({k: v.contiguous() for k, v in shift_batch(samples[0]).items()}, jobs["sample"])

# The CPU shim's Newton-Schulz against torch.optim.Muon's own, before a trainer run swaps the shim in.
errors = []
for shape in ((48, 96), (96, 48)):
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ours = trainer.fp32_newton_schulz(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    torch_bf16 = _muon._zeropower_via_newtonschulz(grad, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch_bf16.dtype == torch.bfloat16, torch_bf16.dtype  # torch's own iteration, not the shim
    assert ours.dtype == torch.float32 and ours.shape == torch_bf16.shape, (ours.shape, torch_bf16.shape)
    errors.append(float((ours - torch_bf16.float()).abs().max() / torch_bf16.float().abs().max()))
open(jobs["newton_schulz"], "w").write(json.dumps(errors))

# Each configuration's run: the trainer script as peer_ab.py runs it, one after the other.
for argv in jobs["runs"]:
    sys.argv = [trainer.__file__, *argv]
    runpy.run_path(trainer.__file__, run_name="__main__")
"""


@pytest.fixture(scope="module")
def speculators_jobs(bench, toy_store, tiny_llama, tmp_path_factory, run_peagle) -> dict:
    """One process of the speculators environment does every speculators part of these tests (its imports
    cost seconds each time): sample 0 converted, the Newton-Schulz check, and one speculators run of each
    configuration on the toy store, as long as the one-step ``peagle train`` run that precedes it."""
    from peagle.pipeline.store import read_settings

    root = tmp_path_factory.mktemp("speculators_jobs")
    budget = replace(bench.Budget(), train_steps=1, token_budget=256, draft_vocab_size=DRAFT_VOCAB)
    peagle_flags = bench.train_flags("muon-all-norms", budget, seed=0)
    peagle = run_peagle("train", "--store", toy_store, "--target", tiny_llama, "--out", root / "peagle",
                        "--num-workers", "0", *peagle_flags)
    assert peagle.returncode == 0, peagle.stderr[-3000:]
    rows = [json.loads(line) for line in (root / "peagle" / "metrics.jsonl").read_text().splitlines()]
    positions = [r for r in rows if r.get("kind") == "train"][-1]["tokens_seen"]
    mask_token = read_settings(toy_store).mask_token_id
    configs = {"speculators-defaults": (bench.speculators_defaults_flags(budget, 0), [], 8, "qwen3"),
               "speculators-peagle": (bench.speculators_peagle_flags(peagle_flags, mask_token), ["--store-vocab"], 5,
                                      "llama")}
    runs = [["--store", str(toy_store), "--target", str(tiny_llama), "--out", str(root / config), "--tokens",
             str(positions), *extra, "--", *flags] for config, (flags, extra, _, _) in configs.items()]
    jobs = {"store": str(toy_store), "vocab": DRAFT_VOCAB, "sample": str(root / "sample.safetensors"),
            "newton_schulz": str(root / "newton_schulz.json"), "runs": runs}
    (root / "jobs.json").write_text(json.dumps(jobs))
    proc = speculators_run(["-c", SPECULATORS_JOBS, str(root / "jobs.json")])
    return {"proc": proc, "root": root, "positions": positions, "mask_token": mask_token,
            "configs": {config: (depths, arch) for config, (_, _, depths, arch) in configs.items()}}


def finished(jobs: dict, path: str) -> Path:
    """``path`` of the speculators process's output, once that process ended well."""
    proc = jobs["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return jobs["root"] / path


@needs_speculators
def test_conversion_gives_speculators_peagle_samples_and_targets(toy_store, speculators_jobs) -> None:
    """Sample 0 through the conversion and speculators' own shift equals peagle's training sample:
    same input tokens and aux rows at every position, the same target distribution (the stored top-k
    renormalised over the draft vocab), and speculators' loss mask one position earlier than peagle's."""
    from safetensors.torch import load_file

    from peagle.pipeline.store import open_store
    from peagle.pipeline.store_reader import iter_training_samples
    from peagle.stages.train.vocab import load_draft_vocab

    got = load_file(str(finished(speculators_jobs, "sample.safetensors")))
    sample = next(iter_training_samples(open_store(toy_store)))
    T = sample.num_positions
    assert got["input_ids"].tolist() == sample.tokens_T.tolist()
    assert torch.equal(got["hidden_states"], sample.aux_TAH.reshape(T, -1))
    draft_of = load_draft_vocab(toy_store, DRAFT_VOCAB).target_to_draft()
    ids = draft_of[sample.topk_ids_Tk.long()]
    probs = torch.where(ids >= 0, sample.topk_logprobs_Tk.float().exp(), 0.0)
    expected = torch.zeros(T, DRAFT_VOCAB).scatter_add_(1, ids.clamp(min=0), probs)
    covered = expected.sum(1) > 0
    expected = expected / expected.sum(1, keepdim=True).clamp(min=1e-30)
    spec_probs = torch.softmax(got["verifier_last_hidden_states"], dim=-1)
    assert torch.allclose(spec_probs[covered], expected[covered], atol=1e-6)
    mask = got["loss_mask"].bool()
    assert not mask[~covered].any()
    # speculators charges position p by loss_mask[p+1], peagle by loss_mask[p+2] (docs/indexing.md)
    assert mask[1:].tolist() == (sample.supervised_T[:-1] & covered[1:]).tolist()
    assert mask.sum() > 0


@needs_speculators
def test_one_step_of_each_trainer_and_exports_peagle_reads(toy_store, tiny_llama, speculators_jobs) -> None:
    from peagle.model.speculators_format import load_export

    positions = speculators_jobs["positions"]
    for config, (depths, arch) in speculators_jobs["configs"].items():
        out = finished(speculators_jobs, config)
        run = json.loads((out / "run.json").read_text())
        assert run["global_step"] == run["steps"] >= 1 and run["positions"] >= positions
        assert run["draft_arch"] == arch and run["draft_vocab_size"] == DRAFT_VOCAB
        losses = [json.loads(line)["train"]["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(losses) == run["steps"] and all(math.isfinite(loss) for loss in losses)
        exported = load_export(out / "export")  # as `peagle eval` reads it
        assert exported.speculative_tokens == depths and exported.draft.config.architecture == arch
        assert exported.verifier == str(tiny_llama) and exported.draft.config.draft_vocab_size == DRAFT_VOCAB
        assert not (out / "checkpoints").exists() and "speculator_type: peagle" in (out / "speculators_run.yaml").read_text()
    mask_token = json.loads((finished(speculators_jobs, "speculators-peagle") / "run.json").read_text())["mask_token_id"]
    assert mask_token == speculators_jobs["mask_token"]


@needs_speculators
def test_fp32_newton_schulz_is_torch_muons_iteration(speculators_jobs) -> None:
    """The CPU shim computes torch.optim.Muon's orthogonalisation, in fp32: equal to torch's own up to
    bf16 rounding."""
    errors = json.loads(finished(speculators_jobs, "newton_schulz.json").read_text())
    assert len(errors) == 2 and all(0 < error < 0.05 for error in errors), errors  # bf16 rounding apart
