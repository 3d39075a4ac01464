"""`peagle store convert`: an fp8 store converted from bf16 is byte-identical to one extracted with
``--hidden-dtype fp8``; a killed conversion re-run ends identical; wrong requests are one line; the
converted store continues with `peagle extract`; mixed encodings are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from peagle.pipeline.store import list_commits, open_store
from peagle.pipeline.store_reader import iter_training_samples
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import ExtractConfig
from peagle.schemas.train_config import StoreSpec
from peagle.stages.store.convert import convert_store
from peagle.stages.extract.run import run_extract
from peagle.stages.train.loader import LoaderConfig
from peagle.stages.train.training_stores import open_training_stores
from peagle.testing.chat_data import write_chat_jsonl


def _config(data: Path, target: Path, out: Path, **kw) -> ExtractConfig:
    return ExtractConfig(data=(str(data),), target=str(target), out=str(out), backend="hf", topk=8,
                         samples_per_shard=3, device="cpu", max_seq_len=256, threads=1, **kw)


def _quiet(config: ExtractConfig) -> list[str]:
    lines: list[str] = []
    run_extract(config, echo=lines.append, progress=False)
    return lines


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("convert")
    data = write_chat_jsonl(root / "chats.jsonl", 10, seed=2)
    _quiet(_config(data, tiny_llama, root / "bf16"))
    _quiet(_config(data, tiny_llama, root / "fp8", hidden_dtype="fp8"))
    return {"data": data, "bf16": root / "bf16", "fp8": root / "fp8", "target": tiny_llama}


def files_of(store: Path) -> dict[str, bytes]:
    """Every file readers and writers rely on (no lock file, no temp files)."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*"))
            if p.is_file() and p.name != ".lock" and ".tmp-" not in p.name}


def test_converted_store_is_the_direct_fp8_extraction_byte_for_byte(extracted, tmp_path):
    lines = []
    summary = convert_store(extracted["bf16"], tmp_path / "c", "fp8", echo=lines.append, progress=False)
    assert summary.converted == [0, 1, 2, 3] and summary.already == 0
    assert files_of(tmp_path / "c") == files_of(extracted["fp8"])
    # A·(H+4) + k·6 over A·2H + k·6 bytes per token: 0.54x at H = 128, k = 8 (0.50x at H = 4096: docs/fp8.md)
    ratio = float(lines[-1].rsplit("(", 1)[1].rstrip("x)"))
    assert 0.53 < ratio < 0.56, lines[-1]
    stats = open_store(tmp_path / "c").shards[0].stats
    assert stats is not None and stats.zero_rows == 0 and stats.topk.mass_high_rows == 0


def test_fp8_back_to_bf16_holds_the_dequantised_states(extracted, tmp_path):
    convert_store(extracted["fp8"], tmp_path / "b", "bf16", echo=lambda _: None, progress=False)
    back = {s.sample_id: s for s in iter_training_samples(open_store(tmp_path / "b"))}
    for sample in iter_training_samples(open_store(extracted["fp8"])):
        assert torch.equal(back[sample.sample_id].aux_TAH, sample.aux_TAH)
        assert back[sample.sample_id].aux.scale_TA is None and sample.aux.scale_TA is not None


def test_a_killed_conversion_rerun_ends_identical(extracted, tmp_path, run_peagle):
    """Killed mid-write (a temp file left), then the re-run killed after a commit record (the manifest
    behind it): the third run ends with the direct fp8 extraction, and a fourth has nothing to do."""
    args = ("store", "convert", "--store", extracted["bf16"], "--hidden-dtype", "fp8", "--out", tmp_path / "c")
    for failpoint in ("extract.write:3", "extract.after_commit:2"):
        killed = run_peagle(*args, env={"PEAGLE_FAILPOINT": failpoint})
        assert killed.returncode == -9, (failpoint, killed.stderr)
        assert len(open_store(tmp_path / "c").shards) < 4
    again = run_peagle(*args)
    assert again.returncode == 0, again.stderr
    assert files_of(tmp_path / "c") == files_of(extracted["fp8"])
    assert not [p for p in (tmp_path / "c").rglob("*") if ".tmp-" in p.name]
    done = run_peagle(*args)
    assert done.returncode == 0 and "4 converted already, 0 to do" in done.stdout


def test_an_interrupted_conversion_leaves_no_half_shard(extracted, tmp_path, monkeypatch):
    """Ctrl-C while shard 1's tensor file is written, its Parquet copy already in place: neither file
    stays (convert cleaned up on Exception only), shard 0 stays whole, and the re-run ends identical."""
    import peagle.stages.store.convert as convert_module

    write_tensors, calls = convert_module.write_tensors, []

    def interrupted(path, encoded, settings):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        write_tensors(path, encoded, settings)

    out = tmp_path / "c"
    with monkeypatch.context() as m:
        m.setattr(convert_module, "write_tensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            convert_store(extracted["bf16"], out, "fp8", echo=lambda _: None, progress=False)
    assert [r.index for r in list_commits(out)] == [0]
    assert sorted(p.name for p in (out / S.SHARDS_DIR).iterdir()) == ["00000.parquet", "00000.safetensors"]
    convert_store(extracted["bf16"], out, "fp8", echo=lambda _: None, progress=False)
    assert files_of(out) == files_of(extracted["fp8"])


def test_wrong_requests_are_one_line(extracted, tmp_path):
    with pytest.raises(UserError, match="holds fp8 hidden states already; nothing to convert"):
        convert_store(extracted["fp8"], tmp_path / "x", "fp8", echo=lambda _: None)
    with pytest.raises(UserError, match="is the store itself"):
        convert_store(extracted["bf16"], extracted["bf16"], "fp8", echo=lambda _: None)
    with pytest.raises(UserError, match="--hidden-dtype must be one of bf16|fp8"):
        convert_store(extracted["bf16"], tmp_path / "x", "int8", echo=lambda _: None)
    convert_store(extracted["bf16"], tmp_path / "y", "fp8", echo=lambda _: None, progress=False)
    with pytest.raises(UserError, match=r"was made with hidden_dtype='fp8', this run asks for hidden_dtype='bf16'"):
        convert_store(extracted["fp8"], tmp_path / "y", "bf16", echo=lambda _: None)  # a store of other settings
    record = tmp_path / "y" / S.commit_name(2)  # a shard of another store with the same settings
    record.write_text(record.read_text().replace(open_store(tmp_path / "y").shard(2).parquet_sha256, "0" * 64))
    with pytest.raises(UserError, match="holds shard 00002 that is no conversion of"):
        convert_store(extracted["bf16"], tmp_path / "y", "fp8", echo=lambda _: None)


def test_extract_continues_a_converted_store_and_mixed_encodings_are_refused(extracted, tmp_path):
    convert_store(extracted["bf16"], tmp_path / "c", "fp8", echo=lambda _: None, progress=False)
    lines = _quiet(_config(extracted["data"], extracted["target"], tmp_path / "c", hidden_dtype="fp8"))
    assert lines[-1] == "nothing to do: every shard of this worker is committed"
    with pytest.raises(UserError, match=r"hidden_dtype='fp8', this run asks for hidden_dtype='bf16'.*"
                                        r"peagle store convert .* --hidden-dtype bf16 --out NEW"):
        _quiet(_config(extracted["data"], extracted["target"], tmp_path / "c"))
    with pytest.raises(UserError, match=r"holds fp8 hidden states but store .* holds bf16; one run reads one "
                                        r"encoding: `peagle store convert .* --hidden-dtype bf16 --out NEW`"):
        open_training_stores(LoaderConfig(stores=(StoreSpec(str(extracted["bf16"])), StoreSpec(str(tmp_path / "c")))))
    assert os.path.exists(tmp_path / "c" / S.MANIFEST_FILE)
