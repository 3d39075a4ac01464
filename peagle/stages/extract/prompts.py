"""``peagle prompts``: training prompts written by the target itself (Magpie, Xu et al. 2024).

A chat model has learnt what its users ask. Rendered up to the start of a user turn (the template's
header, no user text), it continues with a plausible user message and closes it with its end-of-turn
token: sampled many times, that is a prompt set in the target's own distribution, for a user who has
none. ``peagle extract --regenerate`` then has the target answer them.

The steps: :func:`magpie_prefix` finds where a user's text starts in the chat template and which
tokens end the turn; :func:`sample_prompts` samples rounds of ``batch_size`` continuations, cuts each
at its end of turn and keeps those :func:`drop_reason` lets through (the rest counted by reason)
until ``num_prompts`` are kept; :func:`run_prompts` does it for a ``PromptsConfig`` and writes the
file whole (nothing half-written is ever visible).

Deterministic: round r samples with ``derived_seed(seed, r)`` and samples are judged in order, so the
same seed, backend and batch size keep the same prompts.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.model.target.backend import Generator
from peagle.model.target.backend_choice import open_backend
from peagle.model.target.directory import TargetDirectory, open_target, read_generation_config
from peagle.pipeline.atomic import atomic_write_bytes
from peagle.schemas.errors import UserError, one_line
from peagle.schemas.prompts_config import PromptsConfig
from peagle.stages.extract.conversation import SkipRecord, normalise_record
from peagle.stages.extract.readers import iter_file_records
from peagle.stages.extract.regenerate import SamplingSettings, derived_seed

PLACEHOLDER = "PeagleUserText7f3a9c"
"""The user text of the rendered probe conversation: letters and digits, so templates that trim or
escape content leave it as it is (one that rewrites it is refused), and no template's own text."""

# Drop reasons, in the order they are checked (a sample is counted under the first that applies).
TRUNCATED = "truncated"  # reached max_new_tokens without ending its turn
EMPTY = "empty"
TOO_SHORT = "too_short"
TOO_LONG = "too_long"
NOT_A_REQUEST = "not_a_request"
EXCLUDED_PHRASE = "excluded_phrase"
EXCLUDED_PROMPT = "excluded_prompt"
DUPLICATE = "duplicate"
DROP_REASONS = (TRUNCATED, EMPTY, TOO_SHORT, TOO_LONG, NOT_A_REQUEST, EXCLUDED_PHRASE, EXCLUDED_PROMPT, DUPLICATE)

REQUEST_WORDS = frozenset("""
    what why how who whom whose which when where whats hows
    can could would will should shall may might is are am was were do does did have has
    please write explain describe give list tell help create make generate summarize summarise translate
    compare suggest recommend provide find calculate solve show design draft compose rewrite edit fix
    implement convert classify identify analyze analyse name define outline plan imagine pretend act
    consider assume let lets i im ive id my we were our hi hello hey
""".split())
"""First words of a sample that ask or instruct (lower case, apostrophes removed): with a question
mark anywhere, the light heuristic of ``looks_like_request``."""

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")
"""A word: a run of letters and digits, or one CJK character (those scripts write no spaces)."""


@dataclass(frozen=True, kw_only=True)
class MagpiePrefix:
    """Where a user's text starts in the target's chat template, and what ends the user's turn.

    ``text`` is the template rendered up to the user's text (trailing spaces cut, so the target
    writes a word with its leading space as one token, as in real chats), ``token_ids`` its tokens.
    Sampling stops at ``stop_token_ids`` (the turn's end-of-turn token, then the target's EOS ids).
    ``end_text`` is set for a template that ends a user turn with plain text (``\\n\\n`` before
    ``Assistant:``): a sample is cut there.
    """

    text: str
    token_ids: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    end_text: str | None = None


def magpie_prefix(tokenizer: Any, *, eos_token_ids: Iterable[int] = ()) -> MagpiePrefix:
    """The Magpie prefix of ``tokenizer``'s chat template.

    A conversation of one user message, ``PLACEHOLDER``, is rendered without a generation prompt and
    cut at the placeholder, so whatever the template puts before a first user turn (BOS, a default
    system turn, a date line) is in the prefix, as the target sees it in use. The end of the turn is
    what the template writes after the placeholder: its first token when that is a special token
    (``<|im_end|>``, ``<|eot_id|>``, ``[/INST]``), else its text.

    Raises:
        UserError: no chat template, one that cannot render a lone user message, or one that does
            not write the user's text as given (or writes nothing before it).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the target tokenizer has no chat template (tokenizer_config.json: chat_template); "
                        "peagle prompts samples the user turn of the template")
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False,
                                                 add_generation_prompt=False)
    except Exception as err:  # templates are user code
        raise UserError(f"the target's chat template cannot render one user message: {one_line(err)}") from err
    if rendered.count(PLACEHOLDER) != 1:
        raise UserError("the target's chat template does not render a user message's text as given, so where a "
                        "user turn starts cannot be found")
    start = rendered.index(PLACEHOLDER)
    text = rendered[:start].rstrip(" ")
    token_ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()
    if not token_ids:
        raise UserError("the target's chat template writes nothing before a user's text: there is no turn header "
                        "to sample a user message from")
    end_token, end_text = _turn_end(tokenizer, rendered[start + len(PLACEHOLDER):])
    stops = ([end_token] if end_token is not None else []) + [int(i) for i in eos_token_ids]
    return MagpiePrefix(text=text, token_ids=token_ids, stop_token_ids=tuple(dict.fromkeys(stops)),
                        end_text=end_text)


def _turn_end(tokenizer: Any, suffix: str) -> tuple[int | None, str | None]:
    """(end-of-turn token id, or the text that ends the turn) from what follows the user's text."""
    special = set(tokenizer.all_special_ids) | {
        int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
    first = next((i for i in ids if i in special), None)
    if first is not None:
        content = tokenizer.convert_ids_to_tokens(first)
        lead = suffix[:suffix.find(content)] if content in suffix else suffix
        if not lead.strip():
            return first, None
        return None, lead
    return None, suffix or None


@dataclass(frozen=True, kw_only=True)
class PromptFilters:
    """What a kept sample must be: ``min_words`` to ``max_words`` words, a request (when
    ``request_filter``), free of ``excluded_phrases`` and not one of ``excluded_prompts`` (keys)."""

    min_words: int = 3
    max_words: int = 150
    request_filter: bool = True
    excluded_phrases: re.Pattern[str] | None = None
    excluded_prompts: frozenset[str] = frozenset()


def prompt_key(text: str) -> str:
    """``text`` with case, punctuation and spacing gone: two prompts with one key are the same prompt."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[\W_]+", " ", folded).split())


def count_words(text: str) -> int:
    return len(_WORD.findall(text))


def looks_like_request(text: str) -> bool:
    """A question mark anywhere, or a first word that asks or instructs (``REQUEST_WORDS``)."""
    if "?" in text or "\uff1f" in text:
        return True
    words = text.split(maxsplit=1)
    first = re.sub(r"['\u2019]", "", words[0]).casefold() if words else ""
    return re.sub(r"^\W+|\W+$", "", first) in REQUEST_WORDS


def phrase_pattern(phrases: Iterable[str]) -> re.Pattern[str] | None:
    """One case-insensitive pattern matching any phrase as whole words (``Paris`` is not in
    ``Parisian``; any spacing between a phrase's words matches). None when there is no phrase."""
    parts = [r"\s+".join(map(re.escape, p.split())) for p in phrases if p.strip()]
    if not parts:
        return None
    return re.compile(r"(?<!\w)(?:" + "|".join(sorted(set(parts), key=len, reverse=True)) + r")(?!\w)", re.IGNORECASE)


def drop_reason(text: str, *, ended: bool, filters: PromptFilters, seen: set[str]) -> str | None:
    """Why ``text`` is not kept (one of ``DROP_REASONS``), or None; ``seen`` holds the kept prompts' keys."""
    if not ended:
        return TRUNCATED
    if not text.strip():
        return EMPTY
    words = count_words(text)
    if words < filters.min_words:
        return TOO_SHORT
    if words > filters.max_words:
        return TOO_LONG
    if filters.request_filter and not looks_like_request(text):
        return NOT_A_REQUEST
    if filters.excluded_phrases is not None and filters.excluded_phrases.search(text):
        return EXCLUDED_PHRASE
    key = prompt_key(text)
    if key in filters.excluded_prompts:
        return EXCLUDED_PROMPT
    if key in seen:
        return DUPLICATE
    return None


def read_phrases(path: str | Path) -> list[str]:
    """The phrases of an ``--exclude-phrases`` file, one per non-blank line.

    Raises:
        UserError: the file cannot be read or holds no phrase.
    """
    try:
        phrases = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read --exclude-phrases {path}: {one_line(err, with_type=False)}") from err
    if not phrases:
        raise UserError(f"--exclude-phrases {path} holds no phrase (one per line)")
    return phrases


def read_held_out_prompts(path: str | Path) -> frozenset[str]:
    """The keys (``prompt_key``) of the first user message of each chat record of ``path``.

    Records that are not chats are passed over: a held-out set is rarely clean, and what matters is
    what it asks.

    Raises:
        UserError: the file cannot be read, or no record of it has a user message.
    """
    try:
        records = list(iter_file_records(path))
    except UserError as err:
        raise UserError(f"--exclude-prompts: {err}") from err
    keys = set()
    for record in records:
        if record.error is not None:
            continue
        try:
            messages = normalise_record(record.raw, to_regenerate=True).messages
        except SkipRecord:
            continue
        first = next((m["content"] for m in messages if m["role"] == "user"), None)
        if first is not None and prompt_key(first):
            keys.add(prompt_key(first))
    if not keys:
        raise UserError(f"--exclude-prompts {path} has no chat record with a user message")
    return frozenset(keys)


@dataclass
class PromptsSummary:
    """What a run kept and dropped, and how fast the target wrote."""

    prompts: list[str]
    num_sampled: int = 0
    """Samples judged (kept + dropped); a last round's samples after the last prompt needed are not."""
    dropped: Counter = field(default_factory=Counter)
    num_tokens: int = 0
    """Tokens generated, all rounds."""
    seconds: float = 0.0
    """Time spent generating."""

    @property
    def num_kept(self) -> int:
        return len(self.prompts)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)

    def dropped_text(self) -> str:
        parts = [f"{reason} {self.dropped[reason]:,}" for reason in DROP_REASONS if self.dropped[reason]]
        return ", ".join(parts) or "none"


def completion_text(token_ids: list[int], tokenizer: Any, prefix: MagpiePrefix,
                    max_new_tokens: int) -> tuple[str, bool]:
    """(the user message a completion holds, whether it ended its turn).

    Cut at the first stop token: vLLM stops at the target's EOS ids only, so where the end-of-turn
    token is no EOS (Mistral's ``[/INST]``) its completion runs on into an answer. A completion
    shorter than ``max_new_tokens`` was stopped by the backend at one of those tokens.
    """
    stops = set(prefix.stop_token_ids)
    cut = next((j for j, t in enumerate(token_ids) if t in stops), None)
    ended = cut is not None or len(token_ids) < max_new_tokens
    text = tokenizer.decode(token_ids if cut is None else token_ids[:cut], skip_special_tokens=True)
    if prefix.end_text and prefix.end_text in text:
        text, ended = text.split(prefix.end_text, 1)[0], True
    return text.strip(), ended


def sample_prompts(backend: Generator, tokenizer: Any, prefix: MagpiePrefix, filters: PromptFilters, *,
                   num_prompts: int, batch_size: int, sampling: SamplingSettings, max_samples_factor: float = 10.0,
                   echo: Callable[[str], None] | None = None) -> PromptsSummary:
    """Sample user messages from ``prefix`` in rounds of ``batch_size`` until ``num_prompts`` are kept.

    ``echo`` gets one line per round (kept so far, tokens/s).

    Raises:
        UserError: ``num_prompts * max_samples_factor`` samples (in whole rounds) kept too few: the
            line names the drop reasons, so the user sees whether the target repeats itself or a
            filter rejects what it writes.
    """
    max_rounds = math.ceil(num_prompts * max_samples_factor / batch_size)
    summary, seen = PromptsSummary(prompts=[]), set()
    for round_index in range(max_rounds):
        started = time.monotonic()
        completions = _generate(backend, [list(prefix.token_ids)] * batch_size, max_new_tokens=sampling.max_new_tokens,
                                temperature=sampling.temperature, top_p=sampling.top_p,
                                seed=derived_seed(sampling.seed, round_index), stop_token_ids=prefix.stop_token_ids)
        seconds = time.monotonic() - started
        summary.seconds += seconds
        summary.num_tokens += sum(map(len, completions))
        for token_ids in completions:
            text, ended = completion_text(token_ids, tokenizer, prefix, sampling.max_new_tokens)
            summary.num_sampled += 1
            reason = drop_reason(text, ended=ended, filters=filters, seen=seen)
            if reason is not None:
                summary.dropped[reason] += 1
                continue
            seen.add(prompt_key(text))
            summary.prompts.append(text)
            if summary.num_kept == num_prompts:
                break
        notes = getattr(backend, "generation_notes", None) or []  # what hf generation gave up (a failed compile)
        while notes and echo is not None:
            echo(f"warning: {notes.pop(0)}")
        if echo is not None:
            round_tokens = sum(map(len, completions))
            echo(f"prompts: round {round_index + 1}: {summary.num_kept:,} of {num_prompts:,} kept, "
                 f"{summary.num_sampled:,} sampled ({round_tokens / max(seconds, 1e-9):.0f} tokens/s)")
        if summary.num_kept == num_prompts:
            return summary
    raise UserError(f"only {summary.num_kept:,} of {num_prompts:,} prompts were kept after {summary.num_sampled:,} "
                    f"samples ({max_rounds} rounds, --max-samples-factor {max_samples_factor:g}); dropped: "
                    f"{summary.dropped_text()}. Nothing was written: raise --temperature if most are duplicates, "
                    "loosen the filter that drops most, or ask for fewer --num-prompts")


def _generate(backend: Generator, prompts: list[list[int]], *, stop_token_ids: tuple[int, ...],
              **sampling: Any) -> list[list[int]]:
    """The backend's generate, told the stop ids where it takes them (hf; vLLM stops at EOS and
    ``completion_text`` cuts the rest)."""
    if "stop_token_ids" in inspect.signature(backend.generate).parameters:
        return backend.generate(prompts, stop_token_ids=list(stop_token_ids), **sampling)
    return backend.generate(prompts, **sampling)


def eos_token_ids(target: TargetDirectory) -> list[int]:
    """The ids decoding stops on: the generation config's, the model config's, the tokenizer's EOS."""
    ids: list[int] = []
    for value in (read_generation_config(target.path).get("eos_token_id"),
                  getattr(target.config, "eos_token_id", None), target.tokenizer.eos_token_id):
        ids += [value] if isinstance(value, int) else list(value or [])
    return list(dict.fromkeys(int(i) for i in ids))


def prompt_records(prompts: list[str]) -> bytes:
    """JSONL of prompt-only chat records, one per prompt."""
    return "".join(json.dumps({"messages": [{"role": "user", "content": p}]}, ensure_ascii=False) + "\n"
                   for p in prompts).encode("utf-8")


def run_prompts(config: PromptsConfig, *, echo: Callable[[str], None] = print) -> PromptsSummary:
    """Write ``config.num_prompts`` prompts of the target's own to ``config.out`` (module doc).

    The filter files are read and the chat template probed before the model loads, so a mistake in
    them costs no model load. ``echo`` gets a line per round and a summary line.

    Raises:
        UserError: a filter file or the target cannot be read, the chat template has no usable user
            turn, or too few samples pass the filters (:func:`sample_prompts`).
    """
    filters = PromptFilters(
        min_words=config.min_words, max_words=config.max_words, request_filter=config.request_filter,
        excluded_phrases=phrase_pattern(read_phrases(config.exclude_phrases)) if config.exclude_phrases else None,
        excluded_prompts=read_held_out_prompts(config.exclude_prompts) if config.exclude_prompts else frozenset())
    target = open_target(config.target)
    prefix = magpie_prefix(target.tokenizer, eos_token_ids=eos_token_ids(target))
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    sampling = SamplingSettings(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                top_p=config.top_p, seed=config.seed)
    # Loaded only to generate (no aux layers). `--dtype auto` samples from a bf16 copy on a CPU with
    # native bf16 (extract's --generation-dtype auto); a dtype asked for is the one that samples.
    backend = open_backend(config.backend, target, max_seq_len=len(prefix.token_ids) + config.max_new_tokens,
                           dtype=config.dtype, seed=config.seed, device=config.device)
    try:
        summary = sample_prompts(backend, target.tokenizer, prefix, filters, num_prompts=config.num_prompts,
                                 batch_size=config.batch_size, sampling=sampling,
                                 max_samples_factor=config.max_samples_factor, echo=echo)
    finally:
        backend.close()
    atomic_write_bytes(out, prompt_records(summary.prompts))
    echo(f"wrote {summary.num_kept:,} prompts to {out}: {summary.num_sampled:,} sampled, dropped "
         f"{summary.dropped_text()}; {summary.num_tokens:,} tokens in {summary.seconds:.1f} s "
         f"({summary.tokens_per_s:.0f} tokens/s, {backend.name})")
    return summary
