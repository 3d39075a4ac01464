"""`peagle store check`: faults planted the way engine bugs put them in a store (checksums re-made, as a
buggy extractor writes them: peagle.testing.store_faults), each caught with a one-line explanation;
clean bf16 and fp8 stores pass, with and without --target."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle.pipeline.shard_parquet import read_shard_rows
from peagle.pipeline.store import init_store, open_store
from peagle.schemas import store as S
from peagle.schemas.check_config import CheckConfig
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig
from peagle.schemas.train_config import StoreSpec
from peagle.model.target.backend import TargetOutput
from peagle.stages.store.check import check_store, prefix_keys
from peagle.stages.store.check_report import format_report
from peagle.stages.store.convert import convert_store
from peagle.stages.store.info import verify_store
from peagle.stages.extract.run import run_extract
from peagle.stages.extract.template import TokenizedSample
from peagle.stages.extract.writer import ShardContent, write_and_commit
from peagle.stages.train.loader import LoaderConfig
from peagle.stages.train.training_stores import open_training_stores
from peagle.testing import store_faults as F
from peagle.testing.chat_data import write_chat_jsonl
from peagle.demo.tiny_target import TinyTargetSpec, build_tiny_target


def extract(data: Path, target: Path, out: Path) -> Path:
    run_extract(ExtractConfig(data=(str(data),), target=str(target), out=str(out), backend="hf", topk=8,
                              samples_per_shard=4, device="cpu", max_seq_len=256, threads=1),
                echo=lambda _: None, progress=False)
    return out


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    """A clean bf16 store of the tiny Llama (12 chats, 3 shards), its fp8 conversion, and the same chats
    extracted from a Llama of the same shape with other weights."""
    root = tmp_path_factory.mktemp("check")
    data = write_chat_jsonl(root / "chats.jsonl", 12, seed=5)
    other = build_tiny_target(root / "other-llama", TinyTargetSpec(arch="llama", seed=1))
    bf16 = extract(data, tiny_llama, root / "bf16")
    convert_store(bf16, root / "fp8", S.HIDDEN_FP8, echo=lambda _: None, progress=False)
    return {"bf16": bf16, "fp8": root / "fp8", "other": extract(data, other, root / "other"), "target": tiny_llama,
            "other_target": other}


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def sample_ids(store: Path, shard: int) -> list[str]:
    return read_shard_rows(open_store(store), shard, ["sample_id"]).column("sample_id").to_pylist()


def check(store: Path, **kw):
    return check_store(CheckConfig(store=str(store), device="cpu", **kw), progress=False, echo=lambda _: None)


def failed(report) -> dict[str, str]:
    """key -> explanation of every failed check (each must be one line)."""
    out = {f.key: f.explanation for f in report.failed}
    assert all("\n" not in line and line for line in out.values()), out
    return out


@pytest.mark.parametrize("encoding", ["bf16", "fp8"])
def test_clean_stores_pass_with_and_without_the_target(stores, encoding):
    plain = check(stores[encoding])
    assert failed(plain) == {} and "store check passed" in format_report(plain)
    assert plain.num_samples == 12 and plain.hidden_dtype == encoding
    recomputed = check(stores[encoding], target=str(stores["target"]), samples=12)
    assert failed(recomputed) == {}
    errors = recomputed.target["relative_error_per_layer"]
    bound = 0.06 if encoding == "fp8" else 0.01  # fp8's rounding; bf16 stores what the backend returns
    assert all(e["max"] < bound for e in errors.values()), errors
    assert recomputed.target["top1_agreement"]["min"] == 1.0 and recomputed.target["same_content_hash"]


@pytest.mark.parametrize("encoding", ["bf16", "fp8"])
def test_one_sample_zeroed_with_checksums_remade_is_caught_and_refused_by_train(stores, tmp_path, encoding):
    store = copy(stores[encoding], tmp_path / "s")
    victim = sample_ids(store, 1)[2]
    F.zero_sample_rows(store, 1, victim)
    assert verify_store(store)[1] == []  # every checksum matches: verify cannot see it
    report = check(store)
    assert set(failed(report)) == {"zero_rows"}
    finding = next(f for f in report.findings if f.key == "zero_rows")
    num_tokens = next(r for r in read_shard_rows(open_store(store), 1).to_pylist() if r["sample_id"] == victim)["num_tokens"]
    assert finding.count == num_tokens * 3 and [w.sample_id for w in finding.worst] == [victim]
    assert "all zero" in failed(report)["zero_rows"]

    loader_config = LoaderConfig(stores=(StoreSpec(str(store)),))
    with pytest.raises(UserError, match=r"shard 00001 holds broken rows .* --allow-bad-aux-rows trains anyway") as err:
        open_training_stores(loader_config)
    assert "\n" not in str(err.value)
    open_training_stores(replace(loader_config, allow_bad_aux_rows=True))  # the override


def test_zeroed_rows_under_old_statistics_or_none_are_still_caught(stores, tmp_path):
    tampered = copy(stores["bf16"], tmp_path / "tampered")
    F.zero_sample_rows(tampered, 0, sample_ids(tampered, 0)[0], keep_stats=True)  # rows changed after commit
    assert set(failed(check(tampered))) == {"zero_rows", "commit_stats"}

    old = copy(stores["bf16"], tmp_path / "old")  # records written before statistics existed
    F.zero_sample_rows(old, 0, sample_ids(old, 0)[0])
    for path in (old / S.COMMITS_DIR).glob("*.json"):
        record = json.loads(path.read_text())
        del record["stats"]
        path.write_text(json.dumps(record))
    assert open_store(old).shards[0].stats is None
    assert set(failed(check(old))) == {"zero_rows"}  # computed by reading
    open_training_stores(LoaderConfig(stores=(StoreSpec(str(old)),)))  # nothing recorded: train cannot know


def test_rows_shifted_by_one_are_caught_by_the_target_in_one_line(stores, tmp_path):
    store = copy(stores["bf16"], tmp_path / "s")
    F.shift_shard_rows(store, 1)
    report = check(store, target=str(stores["target"]), samples=12)
    line = failed(report)["target"]
    assert line.startswith("4 of 12 recomputed samples have their rows shifted by one position: stored row i holds "
                           "the target's state at position i+1"), line
    assert "duplicate_rows" in failed(report)  # the shifted rows equal rows of other positions, too


def test_states_copied_from_another_sample_are_caught(stores, tmp_path):
    store = copy(stores["fp8"], tmp_path / "s")
    source, victim = sample_ids(store, 2)[:2]
    F.copy_sample_states(store, 2, source, victim)
    report = check(store)
    assert set(failed(report)) == {"duplicate_rows"}
    finding = next(f for f in report.findings if f.key == "duplicate_rows")
    assert {w.sample_id for w in finding.worst} == {source, victim}
    assert "stale or copied states" in failed(report)["duplicate_rows"]
    line = failed(check(store, target=str(stores["target"]), samples=12))["target"]
    assert line.startswith("1 of 12 recomputed samples are not what --target computes for their tokens") and \
        f"02:{victim}" in line, line


def test_a_store_from_another_target_is_caught_in_one_line(stores, tmp_path):
    line = failed(check(stores["other"], target=str(stores["target"]), samples=4))["target"]
    assert line.startswith("none of 4 recomputed samples matches --target") and "another target" in line
    assert "its recorded target" in line and str(stores["other_target"].resolve()) in line

    liar = copy(stores["other"], tmp_path / "liar")  # says it comes from the tiny Llama; its rows do not
    F.claim_target(liar, open_store(stores["bf16"]).settings.target)
    line = failed(check(liar, target=str(stores["target"]), samples=4))["target"]
    assert "another target (although it records this target's content hash)" in line, line
    assert failed(check(liar)) == {}  # without the target its rows look healthy


def _agreeing_store(root: Path, num_samples: int = 12, agreement: float = 0.65, *,
                    wandering: frozenset[str] = frozenset()) -> Path:
    """Rows shaped like a real target's on its own kind of text: the stored top-1 is the next token for
    about ``agreement`` of the assistant tokens (real chat data with its own target: ~0.5-0.8); the tiny
    random targets predict nothing, so this store is written through the real writer from drawn rows.
    Where the top-1 misses, the next token still sits lower in the top-k 90% of the time (sampled
    text). ``wandering`` samples are text sampled where the target was unsure: top-1 agreement 0.1,
    yet their tokens too lie in the top-k."""
    settings = S.StoreSettings(
        target=S.TargetIdentity(path="/t", architecture="LlamaForCausalLM", num_hidden_layers=8, hidden_size=64,
                                vocab_size=512, dtype="bfloat16", content_hash="0" * 64),
        tokenizer_fingerprint="t", chat_template_hash="c", aux_layer_ids=(2, 4, 5), topk=8, max_seq_len=256,
        logprob_dtype="float16", loss_on="all")
    init_store(root, settings)
    g = torch.Generator().manual_seed(0)
    for shard in range(3):
        samples, outputs = [], []
        for i in range(num_samples // 3):
            n = int(torch.randint(60, 120, (1,), generator=g))
            ids = torch.randint(0, 512, (n,), generator=g)
            top_nk = torch.randint(0, 512, (n, 8), generator=g)
            rate = 0.1 if f"{shard}-{i}" in wandering else agreement
            hit = torch.rand(n - 1, generator=g) < rate
            lower = (torch.rand(n - 1, generator=g) < 0.9) & ~hit
            slot = torch.randint(1, 8, (n - 1,), generator=g)
            top_nk[torch.arange(n - 1)[lower], slot[lower]] = ids[1:][lower]
            top_nk[:-1, 0] = torch.where(hit, ids[1:], top_nk[:-1, 0])
            logits = torch.randn(n, 512, generator=g) * 2
            samples.append(TokenizedSample(sample_id=f"{shard}-{i}", source=f"x:{i}", input_ids=ids.tolist(),
                                           loss_mask=[0] * (n // 3) + [1] * (n - n // 3)))
            outputs.append(TargetOutput(aux_TAH=torch.randn(n, 3, 64, generator=g) * (1 + torch.rand(n, 3, 1, generator=g)),
                                        topk_ids_TK=top_nk.int(),
                                        topk_logprobs_TK=logits.log_softmax(-1).topk(8).values))
        write_and_commit(root, ShardContent(index=shard, input_name="x", first_record=0, end_record=len(samples),
                                            samples=samples, outputs=outputs), settings)
    return root


def test_a_sample_shifted_by_one_is_caught_without_the_target(tmp_path):
    store = _agreeing_store(tmp_path / "s")
    assert failed(check(store)) == {}
    F.shift_sample_rows(store, 1, "1-2")
    line = failed(check(store))["misaligned"]
    assert line.startswith("1 of 12 judged samples agree with the target's top-1 far less than the store's "
                           "median 0.6"), line
    assert "00001:1-2" in line and "rows look one position early" in line


def test_sampled_text_whose_top1_rarely_agrees_is_not_misaligned(tmp_path):
    """A clean ``--regenerate`` store of a trained target held samples whose top-1 agreed 0.12 (the
    sample wandered at temperature 0.7) while every token lay in the stored top-k: not misaligned."""
    store = _agreeing_store(tmp_path / "s", wandering=frozenset({"1-2", "2-0"}))
    assert failed(check(store)) == {}
    F.shift_sample_rows(store, 1, "1-1")
    line = failed(check(store))["misaligned"]
    assert line.startswith("1 of 12 judged samples") and "00001:1-1" in line, line


def test_misalignment_is_not_judged_where_the_target_predicts_nothing(stores):
    finding = next(f for f in check(stores["bf16"]).findings if f.key == "misaligned")
    assert not finding.judged and "not judged" in finding.explanation


def test_prefix_keys_make_shared_prefixes_and_leading_runs_legitimate_twins():
    a, b = prefix_keys(np.array([1, 2, 3, 4])), prefix_keys(np.array([1, 2, 5, 4]))
    assert a[1] == b[1] and a[2] != b[2] and a[3] != b[3]
    run = prefix_keys(np.array([7, 7, 7, 9]))
    assert run[0] == run[1] == run[2] != run[3]


def test_cli_exit_codes_json_and_one_line_usage_errors(stores, tmp_path, run_peagle):
    """Exit 1 and the JSON report on a failed check, exit 0 and "passed" once its threshold lets the same
    store pass (which stores pass is test_clean_stores_pass_with_and_without_the_target's), one-line
    usage errors."""
    bad = copy(stores["bf16"], tmp_path / "bad")
    F.zero_sample_rows(bad, 2, sample_ids(bad, 2)[0])
    out = run_peagle("store", "check", "--store", bad, "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert not report["ok"] and [f["key"] for f in report["findings"] if f["failed"]] == ["zero_rows"]
    tolerant = run_peagle("store", "check", "--store", bad, "--max-zero-rows", "100000")
    assert tolerant.returncode == 0 and "store check passed" in tolerant.stdout, tolerant.stdout
    for args, message in ((("--samples", "0"), "--samples must be >= 1"),
                          (("--agreement-ratio", "2"), "--agreement-ratio must be in [0, 1]")):
        usage = run_peagle("store", "check", "--store", stores["fp8"], *args)
        assert usage.returncode == 2 and usage.stderr.strip().count("\n") == 0 and message in usage.stderr
    missing = run_peagle("store", "check", "--store", tmp_path / "nothing")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
