"""Acceptance of a running vLLM server: `peagle eval EXPORT --server URL` (mode ``server``).

README's last step is ``vllm serve EXPORT_DIR``; this mode checks what that server accepts. It sends
the prompts every other mode decodes (the target's chat template, ``--max-prompts``,
``--max-new-tokens``, the same stop tokens) to the server's OpenAI-compatible ``/v1/completions`` as
token ids, greedy, in one request, and reads vLLM's Prometheus counters from ``/metrics`` before and
after: ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos`` (the counters :mod:`.vllm_eval` reads in process), summed over
engines and differenced. Per-depth acceptance is ``accepted_per_pos[d-1] / num_drafts`` and AL
comes from :func:`.vllm_eval.counters_section`, as for the in-process engine. Only the standard library speaks HTTP.

What a server tells and what it does not (vLLM 0.32):

* K: the per-position counter has one series per draft position (``num_speculative_tokens`` of
  them), checked against the export's K (or ``--num-depths``) before anything is sent; after the
  run ``num_draft_tokens / num_drafts`` must not exceed it.
* That it drafts at all: a server started without a draft publishes no ``spec_decode`` counters.
* The model: ``/v1/models`` must list the export (``vllm serve EXPORT_DIR``) or its verifier (the
  ``speculative_config`` route), by path or by directory name.
* Parallel drafting: **not published**. ``SpeculativeConfig.__repr__`` (the config line vLLM logs)
  prints method, model and K only, and no metric carries it. So it is judged
  (:func:`judge_drafting`): depth 1 is drafted the same way either way, and depths >= 2 differ
  (P-EAGLE fills them from mask slots in one forward, sequential drafting feeds back its own
  drafts), so the server's per-depth acceptance must equal, within the tolerances the vLLM tests
  use, that of our own loop (``online``, which drafts as the export's method says) and/or of
  in-process vLLM (``vllm``, where the engine's flag is asserted). That is evidence, not a readout:
  it is as strong as the acceptance past depth 1 the reference shows (reported beside it), and
  without a reference mode it is "not judged".
* Other traffic: the counters are server-wide. Requests from anyone else between the two reads
  would mix into the differences, so the finished requests and generated tokens counted by
  ``vllm:request_success`` and ``vllm:generation_tokens`` must be exactly ours, else the run is
  refused. vLLM counts generated tokens every engine step, in the same record as the drafts, and
  every verified draft yields a token, so no other request's drafts can pass unseen.

A URL is not trusted to be a vLLM server (docs/reliability.md, "What peagle trusts"): each request
has one deadline for the whole of it, not per read (:func:`_http`; ``--server-timeout``), an answer
is at most :data:`MAX_ANSWER_BYTES`, and a banner instead of HTTP, JSON of another shape, a body cut
short or headers dripped past the deadline are each one line naming the URL.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle.schemas.errors import UserError, one_line
from peagle.schemas.secrets import redact_text
from peagle.stages.eval.vllm_eval import PER_POS_COUNTER, SPEC_COUNTERS, counters_section

GENERATION_COUNTER = "vllm:generation_tokens"
FINISHED_COUNTER = "vllm:request_success"
PROBE_TIMEOUT_S = 30.0
"""Seconds a GET of /v1/models or /metrics may take, the whole request (``--server-timeout``)."""
GENERATE_TIMEOUT_S = 1800.0
"""Seconds the one completion request (every prompt) may take before the server is given up on."""
MAX_ANSWER_BYTES = 64 * 2**20
"""The most bytes one answer may hold (the completion of every prompt as token ids, or /metrics, is far
less): a larger one is refused, never read into memory."""
READ_CHUNK = 64 * 1024
SETTLE_TIMEOUT_S = 10.0
"""Seconds to wait for the counters to count our last request (vLLM records them after answering)."""
AL_TOLERANCE = 0.05
"""Relative AL gap within which the server agrees with a reference mode (tests/stages/eval/test_vllm_eval.py)."""
PER_DEPTH_TOLERANCE = 0.08
"""Absolute per-depth acceptance gap within which the server agrees with a reference mode (the same tests)."""

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition (comments skipped)."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        samples.append((match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return samples


@dataclass(frozen=True)
class ServerCounters:
    """vLLM's cumulative counters of one /metrics read, summed over engines (or a difference of two)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    generation_tokens: int
    finished_requests: int

    def minus(self, before: "ServerCounters") -> "ServerCounters":
        return ServerCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_pos=tuple(a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)),
            generation_tokens=self.generation_tokens - before.generation_tokens,
            finished_requests=self.finished_requests - before.finished_requests)


def counters_from_metrics(text: str, url: str) -> ServerCounters:
    """The counters of :class:`ServerCounters` in a /metrics text (``_total`` is how counters are exposed).

    Raises:
        UserError: when the server publishes no vLLM counters, or none of speculative decoding.
    """
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for name, labels, value in parse_metrics(text):
        if not name.endswith("_total"):
            continue
        base = name[: -len("_total")]
        if base == PER_POS_COUNTER and labels.get("position", "").isdigit():
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
        else:
            totals[base] = totals.get(base, 0.0) + value
    if GENERATION_COUNTER not in totals:
        raise UserError(f"{url}/metrics publishes no vLLM counters (vllm:generation_tokens): is this a vLLM "
                        "server, started without --disable-log-stats?")
    if any(name not in totals for name in SPEC_COUNTERS) or not per_pos:
        raise UserError(f"the server at {url} does no speculative decoding (no vllm:spec_decode counters in its "
                        "/metrics): it was started without a draft; serve the export with `vllm serve EXPORT_DIR`")
    return ServerCounters(
        **{field: int(totals[name]) for name, field in SPEC_COUNTERS.items()},
        accepted_per_pos=tuple(int(per_pos.get(d, 0)) for d in range(max(per_pos) + 1)),
        generation_tokens=int(totals[GENERATION_COUNTER]), finished_requests=int(totals.get(FINISHED_COUNTER, 0)))


def _read_capped(response: http.client.HTTPResponse, shown: str) -> bytes:
    """The body of ``response``, at most :data:`MAX_ANSWER_BYTES` (more is refused, not read).

    Raises:
        UserError: the body is larger, or shorter than its Content-Length said (cut short).
    """
    length = response.getheader("Content-Length") or ""
    if length.strip().isdigit() and int(length) > MAX_ANSWER_BYTES:
        raise UserError(f"{shown} answered {int(length):,} bytes, more than the {MAX_ANSWER_BYTES:,} an answer of "
                        "a vLLM server may hold: is this the server?")
    chunks, total = [], 0
    while True:
        chunk = response.read(READ_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_ANSWER_BYTES:
            raise UserError(f"{shown} answered more than the {MAX_ANSWER_BYTES:,} bytes an answer of a vLLM server "
                            "may hold: is this the server?")
        chunks.append(chunk)
    if response.length:  # bytes the Content-Length promised that never came
        raise http.client.IncompleteRead(b"".join(chunks), response.length)
    return b"".join(chunks)


def _http(url: str, *, body: dict[str, Any] | None = None, timeout: float = PROBE_TIMEOUT_S) -> bytes:
    """GET (or POST ``body`` as JSON) and return the response body, within ``timeout`` seconds for the
    whole request (connecting, sending, every header and body byte: a timer closes the socket at the
    deadline, so a server that drips its answer a byte at a time is given up on too) and at most
    :data:`MAX_ANSWER_BYTES`.

    Raises:
        UserError: one line naming the URL (credentials redacted): unreachable, past the deadline, an
            answer that is not HTTP (a banner), cut short, too large, or an error status.
    """
    shown = redact_text(url)
    parts = urllib.parse.urlsplit(url)
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    try:
        connection = (http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection)(
            parts.hostname or "", parts.port, timeout=timeout)
    except (http.client.InvalidURL, ValueError) as err:
        raise UserError(f"--server {shown} is not a URL peagle can reach ({one_line(err, 120, with_type=False)})")
    past_deadline = threading.Event()

    def cut() -> None:
        past_deadline.set()
        with contextlib.suppress(OSError, AttributeError):
            connection.sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    late = (f"{shown} did not answer within {timeout:g} s (the whole request: --server-timeout): is the server "
            "busy, or is this not a vLLM server?")
    try:
        connection.request("POST" if data else "GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                           body=data, headers=headers)
        response = connection.getresponse()
        raw = _read_capped(response, shown)
    except http.client.IncompleteRead as err:
        raise UserError(late if past_deadline.is_set() else
                        f"{shown} answered a body cut short ({len(err.partial):,} bytes of "
                        f"{len(err.partial) + (err.expected or 0):,}): did the server stop?") from None
    except (http.client.HTTPException, UnicodeError) as err:  # a banner, a header line too long, too many
        raise UserError(late if past_deadline.is_set() else
                        f"{shown} did not answer in HTTP ({one_line(err, 120)}): is this a vLLM server?") from None
    except OSError as err:
        if past_deadline.is_set() or isinstance(err, TimeoutError):
            raise UserError(late) from None
        reason = getattr(err, "strerror", None) or one_line(err, 120, with_type=False)
        raise UserError(f"cannot reach the server at {shown} ({reason}): is `vllm serve EXPORT_DIR` running "
                        "there?") from None
    finally:
        timer.cancel()
        connection.close()
    if past_deadline.is_set():
        raise UserError(late)
    if response.status >= 400:
        detail = " ".join(raw[:2000].decode(errors="replace").split())[:300]
        raise UserError(f"{shown} answered HTTP {response.status}: {detail or response.reason}")
    return raw


def _json(url: str, **kwargs: Any) -> Any:
    raw = _http(url, **kwargs)
    try:
        return json.loads(raw)
    except ValueError:
        raise UserError(f"{redact_text(url)} answered something that is not JSON ({raw[:80]!r}): is this a vLLM "
                        "server?") from None


def _other_shape(url: str, what: str, answer: Any) -> UserError:
    shown = json.dumps(answer)[:80] if not isinstance(answer, (bytes, str)) else repr(answer[:80])
    return UserError(f"{redact_text(url)} answered JSON of another shape ({what} expected, got {shown}): is this "
                     "a vLLM server (its OpenAI-compatible API)?")


def read_counters(url: str, *, timeout: float = PROBE_TIMEOUT_S) -> ServerCounters:
    """The server's counters now (:func:`counters_from_metrics` of ``URL/metrics``)."""
    return counters_from_metrics(_http(f"{url}/metrics", timeout=timeout).decode(errors="replace"), url)


@dataclass(frozen=True)
class ServerProbe:
    """A server found fit to measure: its base URL, the model name to send, its K."""

    url: str
    model: str
    num_speculative_tokens: int
    timeout: float = PROBE_TIMEOUT_S
    """Seconds one request may take (--server-timeout); the completion request gets GENERATE_TIMEOUT_S or this."""


def _names_match(name: str, wanted: list[str]) -> bool:
    for want in wanted:
        if name == want or Path(name).name == Path(want).name:
            return True
        if Path(name).is_absolute() and Path(want).exists() and Path(name).exists():
            if Path(name).resolve() == Path(want).resolve():
                return True
    return False


def probe_server(url: str, *, export_dir: str | Path, verifiers: list[str], num_depths: int,
                 timeout: float = PROBE_TIMEOUT_S) -> ServerProbe:
    """Check, before anything is generated, that ``url`` serves this export with a draft of K tokens.

    Raises:
        UserError: the server is unreachable, answers what a vLLM server does not, serves another
            model, drafts nothing, or drafts another K.
    """
    url = url.rstrip("/")
    answer = _json(f"{url}/v1/models", timeout=timeout)
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        raise _other_shape(f"{url}/v1/models", '{"data": [model cards]}', answer)
    wanted = [str(export_dir), str(Path(export_dir).resolve()), *[v for v in verifiers if v]]
    served = next((c for c in cards
                   if _names_match(str(c.get("id")), wanted) or _names_match(str(c.get("root")), wanted)), None)
    if served is None:
        names = ", ".join(str(c.get("root") or c.get("id")) for c in cards) or "nothing"
        raise UserError(f"the server at {url} serves {names}, not {export_dir} (nor its verifier "
                        f"{' / '.join(v for v in verifiers if v)}): start it with `vllm serve {export_dir}`")
    counters = read_counters(url, timeout=timeout)
    K = len(counters.accepted_per_pos)
    if K != num_depths:
        raise UserError(f"the server at {url} drafts K = {K} tokens, this evaluation K = {num_depths} (the export's, "
                        f"or --num-depths): pass --num-depths {K}, or serve with --speculative-config "
                        f"'{{\"num_speculative_tokens\": {num_depths}}}'")
    return ServerProbe(url=url, model=str(served.get("id")), num_speculative_tokens=K, timeout=timeout)


def complete(probe: ServerProbe, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int],
             ignore_eos: bool) -> tuple[list[list[int]], float]:
    """Greedy completions of every prompt in one /v1/completions request: (token ids per prompt, seconds).

    Every sampling setting is sent, so the server's own defaults (from the model's generation config)
    change nothing: greedy, no penalties, the same stop tokens as the other modes.
    """
    body = {"model": probe.model, "prompt": [list(map(int, p)) for p in prompts], "max_tokens": max_new_tokens,
            "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "stop_token_ids": list(stop_ids),
            "ignore_eos": ignore_eos, "return_token_ids": True}
    start = time.perf_counter()
    answer = _json(f"{probe.url}/v1/completions", body=body, timeout=max(GENERATE_TIMEOUT_S, probe.timeout))
    seconds = time.perf_counter() - start
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not all(
            isinstance(c, dict) and isinstance(c.get("index", 0), int) and (c.get("token_ids") is None or (
                isinstance(c["token_ids"], list) and all(type(t) is int for t in c["token_ids"]))) for c in choices):
        raise _other_shape(f"{probe.url}/v1/completions", '{"choices": [{"index": N, "token_ids": [ids]}]}', answer)
    choices = sorted(choices, key=lambda c: c.get("index", 0))
    if len(choices) != len(prompts) or any(c.get("token_ids") is None for c in choices):
        raise UserError(f"{probe.url}/v1/completions answered {len(choices)} choices for {len(prompts)} prompts"
                        " or no token_ids (return_token_ids needs vLLM >= 0.10)")
    return [[int(t) for t in c["token_ids"]] for c in choices], seconds


def check_only_ours(delta: ServerCounters, *, num_prompts: int, num_tokens: int, num_depths: int, url: str) -> None:
    """The counter differences must be ours alone (module docstring).

    Raises:
        UserError: when other requests ran on the server meanwhile, or its drafts were longer than K.
    """
    if delta.finished_requests != num_prompts or delta.generation_tokens != num_tokens \
            or delta.num_drafts > num_tokens - num_prompts:
        raise UserError(f"the server at {url} served other requests while peagle eval measured it "
                        f"({delta.finished_requests} finished requests and {delta.generation_tokens} generated tokens "
                        f"counted, {num_prompts} and {num_tokens} ours): its counters mix them; measure a server "
                        "nobody else is using")
    if delta.num_draft_tokens > num_depths * delta.num_drafts:
        raise UserError(f"the server at {url} proposed {delta.num_draft_tokens} draft tokens in {delta.num_drafts} "
                        f"steps, more than K = {num_depths} per step")


def measure_server(probe: ServerProbe, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int],
                   ignore_eos: bool) -> tuple[dict[str, Any], list[list[int]]]:
    """Generate on the server and read its acceptance: (the report's ``server`` section, the outputs)."""
    before = read_counters(probe.url, timeout=probe.timeout)
    outputs, seconds = complete(probe, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, ignore_eos=ignore_eos)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    delta = read_counters(probe.url, timeout=probe.timeout).minus(before)
    while delta.finished_requests < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.2)
        delta = read_counters(probe.url, timeout=probe.timeout).minus(before)
    K = probe.num_speculative_tokens
    check_only_ours(delta, num_prompts=len(prompts), num_tokens=sum(len(o) for o in outputs), num_depths=K,
                    url=probe.url)
    section = {
        "url": probe.url,
        "model": probe.model,
        "num_prompts": len(prompts),
        "draft_tokens_per_step": delta.num_draft_tokens / delta.num_drafts if delta.num_drafts else float("nan"),
        **counters_section(num_depths=K, num_drafts=delta.num_drafts, num_draft_tokens=delta.num_draft_tokens,
                           num_accepted_tokens=delta.num_accepted_tokens, accepted_per_pos=delta.accepted_per_pos,
                           outputs=outputs, seconds=seconds),
    }
    return section, outputs


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _gap(server: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    a, b = _number(server.get("acceptance_length")), _number(reference.get("acceptance_length"))
    ours = [_number(v) for v in server.get("per_depth_acceptance") or []]
    theirs = [_number(v) for v in reference.get("per_depth_acceptance") or []]
    al_gap = abs(a - b) / b if a is not None and b else None
    depth_gap = max((abs(x - y) for x, y in zip(ours, theirs) if x is not None and y is not None), default=None)
    agrees = (al_gap is not None and depth_gap is not None and len(ours) == len(theirs)
              and al_gap <= AL_TOLERANCE and depth_gap <= PER_DEPTH_TOLERANCE)
    return {"acceptance_length_relative_difference": al_gap, "max_per_depth_difference": depth_gap,
            "agrees": agrees, "acceptance_past_depth_1": sum(v or 0.0 for v in theirs[1:])}


def judge_drafting(server: dict[str, Any], references: dict[str, dict[str, Any] | None], *,
                   parallel: bool) -> dict[str, Any]:
    """Whether the server drafts as the export says (parallel for P-EAGLE, sequential for EAGLE-3),
    judged by acceptance against the reference modes that ran (module docstring); never read off
    the server, which does not say."""
    expected = "parallel" if parallel else "sequential"
    how = (f"vLLM does not publish parallel_drafting (SpeculativeConfig.__repr__ omits it), so it is judged: depth 1 "
           f"is drafted the same either way and depths >= 2 are not, so the server's per-depth acceptance must equal "
           f"that of each reference mode that ran, our own loop (online, {expected} drafting) and/or in-process vLLM "
           f"(vllm, its flag asserted), within "
           f"{AL_TOLERANCE:.0%} in AL and {PER_DEPTH_TOLERANCE} per depth; the evidence is as strong as the "
           "reference's acceptance past depth 1")
    compared = {mode: _gap(server, section) for mode, section in references.items()
                if section and section.get("per_depth_acceptance")}
    if _number(server.get("acceptance_length")) is None:
        verdict = "not judged (the server verified no draft: raise --max-new-tokens)"
    elif not compared:
        verdict = "not judged (run --mode online or vllm beside server)"
    elif all(c["agrees"] for c in compared.values()):
        verdict = f"consistent with {expected} drafting"
    else:
        differing = ", ".join(m for m, c in compared.items() if not c["agrees"])
        verdict = (f"inconsistent with {expected} drafting (or another draft, or another dtype than --target-dtype): "
                   f"acceptance differs from {differing}")
    return {"expected": expected, "verdict": verdict, "judged_by": how, "compared_with": compared}


def greedy_matches(outputs: list[list[int]], others: dict[str, list[list[int]] | None]) -> dict[str, bool]:
    """``greedy_output_matches_<mode>`` for every mode whose greedy outputs of the same prompts are known."""
    return {f"greedy_output_matches_{mode}": outputs == theirs for mode, theirs in others.items() if theirs is not None}
