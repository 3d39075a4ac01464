"""``peagle eval``: flags generated from ``EvalConfig``, then the eval stage (which exports a run first,
measures, writes the report and prints its summary)."""

from __future__ import annotations

import typer

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas.eval_config import ALL_EVAL_MODES, DEVICES, TARGET_DTYPES, EvalConfig
from peagle.schemas.tracking_config import TRACKING_METAVARS

_HELP = """Measure acceptance length: teacher-forced chains on held-out shards (offline), speculative decoding
with our own loop and the HF target (online: real acceptance, tokens per target forward, speedup over
plain decoding), and the exported draft in vLLM (its own metrics). A P-EAGLE draft proposes its K tokens
in one forward (vLLM: parallel drafting), an EAGLE-3 draft in K forwards (vLLM: sequential drafting).
--server URL checks a running `vllm serve EXPORT_DIR` on the same prompts (mode server; greedy; its
/metrics counters are server-wide, so measure a server nobody else is using). What it measured also goes to
the run's experiment trackers, when SOURCE is a run that logged to some (or to --logger's)."""


def _run(config: EvalConfig) -> None:
    from peagle.stages.eval.run import run_eval

    run_eval(config, echo=typer.echo)


COMMAND = ConfigCommand(
    name="eval", config_class=EvalConfig, run=_run, help=_HELP, arguments=("source",),
    comma_lists=frozenset({"mode", "concurrency"}),
    metavars={"source": "SOURCE", "target": "MODEL_DIR", "store": "STORE", "prompts": "FILE", "out": "DIR",
              "mode": ",".join(ALL_EVAL_MODES), "concurrency": "COUNTS", "server": "URL", "target_dtype": "|".join(TARGET_DTYPES), "device": "|".join(DEVICES),
              **TRACKING_METAVARS})
COMMAND.register(app)
