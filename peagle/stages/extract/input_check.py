"""Bad input is loud: what extract says, and when it fails, about records it cannot use.

A record that cannot become a sample is skipped and counted by reason (``conversation.SKIP_REASONS``).
That keeps one odd line from stopping a long job, but a run whose input is mostly (or only) garbage
must not "succeed": it would leave a store with nothing to train on, found out only much later. So:

* ``--dry-run`` decodes and checks the structure of *every* record it counts (``scan_records``);
  ``--strict`` applies to it as to a real run (one line naming the first bad record);
* a dry or real run fails (``check_input``, exit 2) when it reads no usable record, when what it
  commits holds no supervised token, or when it skips more than ``--max-skipped-share`` of the
  records it read (blank lines are no records); the line names the first few bad records (file and
  line, or row) and why, in words, not as a Python dict. A real run judges every shard of its worker
  by their commit records, so a worker killed and re-run fails as the uninterrupted one would.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from peagle.schemas.errors import UserError
from peagle.schemas.extract_config import MAX_RECORD_BYTES
from peagle.stages.extract import conversation as C
from peagle.stages.extract.readers import SourceRecord, iter_file_records

NUM_EXAMPLES = 3  # bad records named in a failure

SKIP_WORDS = {
    C.MALFORMED_JSON: "not valid JSON",
    C.INVALID_UTF8: "not UTF-8 text",
    C.NOT_AN_OBJECT: "not a JSON object",
    C.BLANK_LINE: "a blank line",
    C.TOO_LARGE: "larger than --max-record-bytes",
    C.NO_MESSAGES: "no `messages` (or `conversations`) list",
    C.MESSAGES_NOT_A_LIST: "`messages` (or `conversations`) is not a list",
    C.EMPTY_CONVERSATION: "an empty conversation",
    C.MESSAGE_NOT_AN_OBJECT: "a message that is not a JSON object",
    C.MISSING_ROLE: "a message without a role",
    C.UNKNOWN_ROLE: "a message with an unknown role",
    C.MISSING_CONTENT: "a message without content",
    C.NON_STRING_CONTENT: "message content that is not text",
    C.EMPTY_ASSISTANT_TURN: "an empty assistant turn",
    C.BAD_TOOL_CALLS: "malformed tool_calls",
    C.BAD_TOOLS: "a malformed tools list",
    C.NO_ASSISTANT_TURN: "no assistant turn (nothing to supervise)",
    C.TEMPLATE_ERROR: "the chat template fails on it",
    C.TEMPLATE_PREFIX_MISMATCH: "the chat template renders its prefixes inconsistently",
    C.EMPTY_AFTER_TEMPLATE: "nothing left after the chat template",
    C.CONTAINS_MASK_TOKEN: "it contains the draft's mask token",
    C.TRUNCATED_NO_LOSS: "--max-seq-len cuts off every supervised token",
    "per_turn_truncated_no_loss": "per-turn samples that --max-seq-len cut to no supervised token",
    "non_finite_target": "samples whose target outputs hold NaN or inf",
}
"""Each skip reason in words (the manifest and `store info` keep the short names)."""


@dataclass(frozen=True)
class BadRecord:
    """Where one skipped record is and why, for people."""

    where: str  # "data.jsonl line 12" / "data.parquet row 11"
    reason: str
    detail: str | None = None

    def __str__(self) -> str:
        detail = f": {self.detail}" if self.detail not in (None, self.reason) else ""
        return f"{self.where}: {SKIP_WORDS.get(self.reason, self.reason)} ({self.reason}{detail})"


def words(skipped: dict[str, int]) -> str:
    """``{'malformed_json': 2}`` -> ``"2 not valid JSON"`` (largest first)."""
    return ", ".join(f"{n:,} {SKIP_WORDS.get(reason, reason)}" for reason, n in
                     sorted(skipped.items(), key=lambda kv: (-kv[1], kv[0])))


def record_skips(skipped: dict[str, int]) -> int:
    """Skipped records (the counts also hold samples dropped from kept records, which are not records),
    blank lines left out: they are no records a user meant, and count neither way."""
    return sum(n for reason, n in skipped.items() if reason in C.SKIP_REASONS and reason != C.BLANK_LINE)


@dataclass(kw_only=True)
class InputScan:
    """What a dry run found in the records of the shards it would extract."""

    num_records: int = 0
    skipped: Counter
    examples: list[BadRecord]


def structure_problem(record: SourceRecord, *, to_regenerate: bool = False) -> BadRecord | None:
    """Whether a record decodes and has the shape of a chat (what a dry run checks of every record);
    ``to_regenerate``: prompts only will do, the target writes the answers."""
    if record.error is not None:
        return BadRecord(record.where, record.error)
    try:
        C.normalise_record(record.raw, to_regenerate=to_regenerate)
    except C.SkipRecord as skip:
        return BadRecord(record.where, skip.reason, skip.detail or None)
    return None


def scan_records(ranges: Iterable[tuple[str, int, int]], *, strict: bool, to_regenerate: bool = False,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> InputScan:
    """Decode and check every record of ``(path, first, end)`` ranges (``to_regenerate``: as
    ``--regenerate`` reads them, prompts only allowed; records above ``max_record_bytes`` not decoded).

    Raises:
        UserError: ``strict`` and a record is unusable (naming it).
    """
    scan = InputScan(skipped=Counter(), examples=[])
    for path, first, end in ranges:
        for record in iter_file_records(path, first, end, max_record_bytes=max_record_bytes):
            scan.num_records += 1
            bad = structure_problem(record, to_regenerate=to_regenerate)
            if bad is None:
                continue
            if strict:
                raise UserError(f"{bad} [--strict]")
            scan.skipped[bad.reason] += 1
            if len(scan.examples) < NUM_EXAMPLES and bad.reason != C.BLANK_LINE:
                scan.examples.append(bad)
    return scan


def check_input(*, num_records: int, skipped: dict[str, int], examples: list[BadRecord],
                supervised_tokens: int | None, max_skipped_share: float, what: str) -> None:
    """Fail when ``what`` (this run, this dry run) read no usable record, committed no supervised token
    (``supervised_tokens`` 0; None: not known), or skipped more than ``max_skipped_share`` of its records.

    Raises:
        UserError: one line with the counts in words and the first bad records.
    """
    num_skipped = record_skips(skipped)
    num_records -= skipped.get(C.BLANK_LINE, 0)
    if num_records <= 0:
        return
    share, advice = num_skipped / num_records, "fix the input"
    if num_skipped == num_records:
        problem = f"{what} found no usable record: all {num_records:,} were skipped"
    elif supervised_tokens == 0:
        problem = f"{what} committed no supervised token ({num_skipped:,} of {num_records:,} records skipped)"
    elif share > max_skipped_share:
        problem = (f"{what} skipped {num_skipped:,} of {num_records:,} records ({share:.0%}, more than "
                   f"--max-skipped-share {max_skipped_share:g})")
        advice = "fix the input, or raise --max-skipped-share if that many are expected"
    else:
        return
    first = "; ".join(map(str, examples[:NUM_EXAMPLES]))
    raise UserError(f"{problem}: {words(skipped) or 'no record skipped'}" + (f"; first: {first}" if first else "")
                    + f"; {advice}")
