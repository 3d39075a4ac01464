"""The plan of one `peagle extract` run, read-only: which shards (all of the inputs, this worker's, the
ones still to do), the estimated tokens and store size, the free disk, and, for ``--dry-run``, every
record decoded and checked (``input_check``). Nothing is created, so a dry run or a refused start
leaves no trace."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.model.target.directory import TargetDirectory
from peagle.pipeline import plan as P
from peagle.pipeline.store import list_commits, read_settings, settings_difference, sha256_file
from peagle.pipeline.shard_tensors import raw_bytes_per_token
from peagle.schemas import store as S
from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import MAX_RECORD_BYTES, ExtractConfig
from peagle.stages.extract.conversation import CONTAINS_MASK_TOKEN, SkipRecord, normalise_record
from peagle.stages.extract.input_check import InputScan, scan_records, words
from peagle.stages.extract.readers import count_records, iter_file_records
from peagle.stages.extract.template import prepare_record

ESTIMATE_RECORDS = 256  # records tokenized to estimate the token count of a large plan


@dataclass(kw_only=True)
class ExtractPlan:
    settings: S.StoreSettings
    files: list[P.InputFile]
    shards: list[P.PlannedShard]  # every shard of the inputs
    mine: list[P.PlannedShard]  # this worker's
    pending: list[P.PlannedShard]  # this worker's, not yet committed
    estimated_tokens: int
    estimated_from_records: int
    estimated_mask_skips: int  # records of the estimate that contain the mask token
    estimated_supervised: int  # supervised tokens, estimated as ``estimated_tokens``
    free_bytes: int
    notes: list[str] = field(default_factory=list)  # things the user should know before it starts
    scan: InputScan | None = None  # --dry-run: every pending record decoded and checked
    restart: bool = False  # no commit record with a usable sample, and other settings or inputs: start it afresh
    registrations: list[P.InputRegistration] = field(default_factory=list)  # the plan of the inputs in the store
    dropped: list[P.InputRegistration] = field(default_factory=list)  # --replace-changed-inputs: old versions

    @property
    def estimated_bytes(self) -> int:
        return self.estimated_tokens * raw_bytes_per_token(self.settings)



def check_fits(plan: "ExtractPlan", root: Path) -> None:
    """Refuse to start when the estimated store does not fit on the disk (docs/store.md)."""
    if plan.estimated_bytes > plan.free_bytes:
        raise UserError(f"not enough disk for {root}: the plan needs ~{_human(plan.estimated_bytes)}, "
                        f"{_human(plan.free_bytes)} is free")


def input_files(paths: tuple[str, ...]) -> list[P.InputFile]:
    counts = count_records(paths)  # also checks every path (one-line errors)
    files = []
    for path, n in zip(paths, counts):
        try:
            digest = sha256_file(path)
        except OSError as err:
            raise UserError(f"cannot read data file {path}: {err.strerror or err}") from err
        files.append(P.InputFile(path=str(path), sha256=digest, num_records=n))
    return files


def make_plan(config: ExtractConfig, target: TargetDirectory, settings: S.StoreSettings) -> ExtractPlan:
    """The plan, read-only: nothing is created, so ``--dry-run`` and a refused start leave no trace."""
    root = Path(config.out)
    files = input_files(config.data)
    exists = (root / S.STORE_SETTINGS_FILE).exists()
    registrations = P.read_registrations(root) if exists else []
    committed = list_commits(root) if exists else []
    difference = None
    if exists:
        existing = read_settings(root)
        difference = settings_difference(existing, settings, root)
        if existing.mask_token_source is None:
            difference = (f"store {root} was written by an older peagle that recorded no mask token choice; "
                          "extract into a new --out (the old store still trains: `peagle train --mask-token-id N`)")
    changed = P.changed_inputs(registrations, files)
    notes: list[str] = []
    restart = exists and not any(r.usable for r in committed) and bool(difference or changed)
    dropped: list[P.InputRegistration] = []
    if restart:  # its first run stopped before its first commit, or committed nothing usable: nothing to keep
        held = (f"{len(committed)} committed {P.plural(len(committed), 'shard')} without a usable sample" if committed
                else "no committed shard")
        notes.append(f"note: store {root} holds {held} (its first run stopped or failed); it is started afresh "
                     "with this run's settings and inputs")
        registrations = []
    elif difference:
        raise UserError(difference)
    elif changed and not config.replace_changed_inputs:
        raise UserError(P.changed_refusal(root, changed))
    elif changed:
        dropped = [r for _, old in changed for r in old]
        registrations = [r for r in registrations if r not in dropped]
        for f, old in changed:
            old_shards = [s for r in old for s in range(r.first_shard, r.end_shard)]
            notes.append(f"note: data file {f.path} changed since the store registered it: {len(old_shards)} old "
                         f"{P.plural(len(old_shards), 'shard')} ({P.format_ranges(old_shards) or 'none'}) dropped, the file "
                         "extracted again (--replace-changed-inputs)")
    registrations += P.assign_registrations(registrations, files, config.samples_per_shard)
    shards = P.plan_shards(files, registrations)
    mine = P.shards_of_worker(shards, config.shard_index, config.num_shards)
    gone = {s for r in dropped for s in range(r.first_shard, r.end_shard)}  # their indices may be reused
    done = set() if restart else {r.index for r in committed if r.index not in gone}
    pending = [s for s in mine if s.index not in done]
    answer_tokens = config.max_new_tokens if config.regenerate else None
    tokens, sampled, mask_skips, supervised = estimate_tokens(pending, target.tokenizer, settings, config.loss_on,
                                                              answer_tokens=answer_tokens,
                                                              max_record_bytes=config.max_record_bytes)
    if mask_skips:
        notes.append(f"note: {mask_skips} of the {sampled} records read for the estimate contain the mask token "
                     f"{settings.mask_token_id}: such records are skipped (contains_mask_token); pass another "
                     "--mask-token-id if that is too many")
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), Path("."))
    scan = (scan_records([(s.input_path, s.first_record, s.end_record) for s in pending], strict=False,
                         to_regenerate=config.regenerate, max_record_bytes=config.max_record_bytes)
            if config.dry_run else None)
    return ExtractPlan(settings=settings, files=files, shards=shards, mine=mine, pending=pending,
                       estimated_tokens=tokens, estimated_from_records=sampled, estimated_mask_skips=mask_skips,
                       estimated_supervised=supervised, free_bytes=shutil.disk_usage(probe).free, notes=notes,
                       scan=scan, restart=restart, dropped=dropped, registrations=registrations)


def estimate_tokens(pending: list[P.PlannedShard], tokenizer: Any, settings: S.StoreSettings, loss_on: str,
                    max_records: int = ESTIMATE_RECORDS, *, answer_tokens: int | None = None,
                    max_record_bytes: int = MAX_RECORD_BYTES) -> tuple[int, int, int, int]:
    """(estimated tokens of the pending shards, records tokenized for it, how many of those contain
    the mask token, estimated supervised tokens): every record when there are at most ``max_records``,
    else the first records of up to 16 evenly spread shards, scaled.

    ``answer_tokens`` (``--regenerate``'s ``--max-new-tokens``): the answers are not written yet, so
    each record counts its prompts plus that many tokens per assistant turn, capped at the longest
    sample: an upper bound, which is what a disk check needs."""
    total_records = sum(s.num_records for s in pending)
    if not total_records:
        return 0, 0, 0, 0
    picks = pending if len(pending) <= 16 else [pending[i * len(pending) // 16] for i in range(16)]
    per_shard = max(1, max_records // len(picks))
    tokens = sampled = mask_skips = supervised = 0
    for shard in picks:
        stop = shard.end_record if total_records <= max_records else min(shard.end_record, shard.first_record + per_shard)
        for record in iter_file_records(shard.input_path, shard.first_record, stop, max_record_bytes=max_record_bytes):
            if answer_tokens is not None:
                prompt, answers = _prompt_tokens(record, tokenizer)
                tokens += min(settings.max_seq_len, prompt + answers * answer_tokens)
                supervised += min(settings.max_seq_len - min(prompt, settings.max_seq_len), answers * answer_tokens)
                sampled += 1
                continue
            prepared = prepare_record(record, tokenizer, loss_on=loss_on, max_seq_len=settings.max_seq_len,
                                      mask_token_id=settings.mask_token_id)
            tokens += sum(len(s.input_ids) for s in prepared.samples)
            supervised += sum(sum(s.loss_mask) for s in prepared.samples)
            mask_skips += prepared.skip_reason == CONTAINS_MASK_TOKEN
            sampled += 1
    scale = total_records / max(sampled, 1)
    return round(tokens * scale), sampled, mask_skips, round(supervised * scale)


def _prompt_tokens(record: Any, tokenizer: Any) -> tuple[int, int]:
    """(tokens of a record's non-assistant turns as the chat template renders them, assistant turns the
    target will write); (0, 0) for a record extraction will skip anyway."""
    if record.error is not None:
        return 0, 0
    try:
        conversation = normalise_record(record.raw, to_regenerate=True)
    except SkipRecord:
        return 0, 0
    prompts = [m for m in conversation.messages if m["role"] != "assistant"]
    answers = sum(m["role"] == "assistant" for m in conversation.messages)
    text = tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]), answers


def format_plan(plan: ExtractPlan, config: ExtractConfig, store: Path) -> str:
    s, t = plan.settings, plan.settings.target
    num_records = sum(f.num_records for f in plan.files)
    pending_records = sum(p.num_records for p in plan.pending)
    how = "exact" if plan.estimated_from_records >= pending_records else f"from {plan.estimated_from_records} records"
    if config.regenerate:
        how = f"at most: answers not written yet, up to {config.max_new_tokens} tokens each; " + how.replace("exact", "all records read")
    lines = [
        f"peagle extract plan -> {store}",
        f"  target     {t.path} ({t.architecture}, {t.num_hidden_layers} layers, hidden {t.hidden_size}, "
        f"vocab {t.vocab_size}, {t.dtype})",
        f"  inputs     {len(plan.files)} file(s), {num_records} records -> {len(plan.shards)} shards "
        f"({config.samples_per_shard} records per shard)",
        f"  worker     {config.shard_index} of {config.num_shards}: {len(plan.mine)} shards, "
        f"{len(plan.mine) - len(plan.pending)} already committed, {len(plan.pending)} to do ({pending_records} records)",
        f"  settings   aux layers {','.join(map(str, s.aux_layer_ids))}, top-k {s.topk} ({s.logprob_dtype}), "
        f"max len {s.max_seq_len}, loss on {s.loss_on}, hidden states {s.hidden_dtype}"
        + ("" if s.supervise_reasoning else " (reasoning not supervised)"),
        f"  mask token {S.describe_mask_token(s.mask_token_id, s.mask_token, s.mask_token_source)}",
        *([f"  answers    {describe_regeneration(s.regenerate, t.dtype)}"] if s.regenerate else []),
        f"  tokens     ~{plan.estimated_tokens:,} ({how}), ~{plan.estimated_supervised:,} supervised",
        *([f"  checked    {plan.scan.num_records:,} records decoded: "
           + (f"{sum(plan.scan.skipped.values()):,} unusable ({words(plan.scan.skipped)})" if plan.scan.skipped
              else "all usable")] if plan.scan is not None else []),
        f"  size       ~{_human(plan.estimated_bytes)} at {raw_bytes_per_token(s):,} bytes/token; "
        f"free disk {_human(plan.free_bytes)}",
        *plan.notes,
    ]
    return "\n".join(lines)


def describe_regeneration(regenerate: dict, states_dtype: str) -> str:
    """How ``--regenerate`` writes the answers: sampling, length and the dtype that writes them (on a
    CPU with native bf16 it is bf16 by default while the states stay float32: worth a line)."""
    temperature = regenerate.get("temperature", 0.0)
    sampling = "greedy" if temperature == 0 else f"sampled at T {temperature}, top-p {regenerate.get('top_p')}"
    written = regenerate.get("generation_dtype", states_dtype)
    return (f"written by the target, {sampling}, up to {regenerate.get('max_new_tokens')} tokens, in {written}"
            + (f" (states in {states_dtype}; --generation-dtype)" if written != states_dtype else ""))


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError
