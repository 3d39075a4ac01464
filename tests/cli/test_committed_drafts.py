"""A committed draft's description: the K it is served at, and the one-line refusals of a bad one."""

from __future__ import annotations

import json

import pytest

from peagle.cli.committed_drafts import best_committed, read_committed
from peagle.schemas.errors import UserError

FACTS = {"target": "smollm2", "method": "peagle", "num_depths": 5, "acceptance_length": 1.65}


def _write(root, name, **facts):
    (root / name).mkdir(parents=True)
    (root / name / "draft.json").write_text(json.dumps({**FACTS, **facts}))
    return root / name


def test_serve_k_is_the_recommended_k_else_the_trained_one(tmp_path):
    assert read_committed(_write(tmp_path, "a", serve_k=3)).serve_k == 3
    assert read_committed(_write(tmp_path, "b")).serve_k == 5


@pytest.mark.parametrize("serve_k", [0, 6, 2.5, True, "3"])
def test_a_serve_k_outside_1_to_num_depths_is_refused_in_one_line(tmp_path, serve_k):
    with pytest.raises(UserError, match="serve_k must be a K from 1 to num_depths"):
        read_committed(_write(tmp_path, "a", serve_k=serve_k))


def test_the_best_is_the_highest_acceptance_for_the_target_and_method(tmp_path):
    _write(tmp_path, "low", acceptance_length=1.4)
    _write(tmp_path, "high", acceptance_length=1.9)
    _write(tmp_path, "other-method", method="eagle3", acceptance_length=2.5)
    _write(tmp_path, "other-target", target="tiny", acceptance_length=3.0)
    assert best_committed("smollm2", "peagle", root=tmp_path).path.name == "high"
    assert best_committed("qwen3", "peagle", root=tmp_path) is None


def test_the_committed_drafts_in_this_checkout_read():
    """Every draft committed here is one the demo can serve (its description reads, its K fits)."""
    from peagle.cli.committed_drafts import committed_drafts_dir

    drafts = sorted(committed_drafts_dir().glob("*/draft.json"))
    assert drafts, "no committed draft found"
    for file in drafts:
        draft = read_committed(file.parent)
        assert 1 <= draft.serve_k <= draft.num_depths and (file.parent / "model.safetensors").is_file()


def test_the_committed_drafts_name_no_machine_paths():
    """A committed draft travels: its files name WORK and TARGET, never the trainer's machine (no absolute
    path, host name or platform string in draft.json or the export's config.json)."""
    from peagle.cli.committed_drafts import committed_drafts_dir

    files = sorted(committed_drafts_dir().glob("*/*.json"))
    assert {f.name for f in files} >= {"draft.json", "config.json"}
    for file in files:
        text = file.read_text()
        for machine_fact in ("/work/", "/root/", "/home/", "/tmp/", '"hostname"', '"platform"'):
            assert machine_fact not in text, f"{file} names {machine_fact}"
