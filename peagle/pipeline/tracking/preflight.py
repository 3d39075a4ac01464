"""Before any work: can every tracker asked for run? One line if not (docs/usage.md, "Watching a run").

A run that trains for an hour and then finds ``wandb`` missing, or its MLflow server down, has
wasted the hour. So :func:`plan_tracking` runs where a stage starts (train: before the target is
loaded; eval: before the first mode): it imports each backend's package (a missing one names the
extra to install), resolves W&B's mode (without a login ``auto`` is offline, and says so) and asks
each server it will talk to for an answer, naming the URL it tried when none comes. The resolved
settings are a :class:`TrackingPlan` that :mod:`.tracker` opens the backends from.
"""

from __future__ import annotations

import base64
import importlib
import netrc
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from peagle.schemas.errors import UserError, one_line
from peagle.schemas.secrets import Credentials, redact_text, split_credentials
from peagle.schemas.tracking_config import TrackingOptions

MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
"""What each backend imports: torch's SummaryWriter needs the ``tensorboard`` package."""
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny (or mlflow)", "trackio": "trackio"}
WANDB_BASE_URL = "https://api.wandb.ai"
TIMEOUT_S = 5.0
"""How long a server has to answer the pre-flight request."""


@dataclass(frozen=True)
class TrackingPlan:
    """The resolved settings of every backend of a run (the flags, their defaults and the environment)."""

    loggers: tuple[str, ...]
    run_name: str
    log_dir: Path
    """TensorBoard's event files go to ``log_dir/tensorboard``, W&B's to ``log_dir/wandb``, Trackio's
    database to ``log_dir/trackio``."""
    project: str
    wandb_entity: str | None = None
    wandb_mode: str | None = None
    """``online`` or ``offline`` (resolved from ``auto``)."""
    mlflow_uri: str | None = None
    notes: tuple[str, ...] = ()
    """Lines to tell the user (W&B going offline for want of a login)."""


def require(name: str) -> None:
    """Import backend ``name``'s package.

    Raises:
        UserError: it is not installed (or does not import), naming the extra that installs it.
    """
    try:
        importlib.import_module(MODULES[name])
    except ImportError as err:
        raise UserError(f"--logger {name} needs the {PACKAGES[name]} package, which does not import here "
                        f"({one_line(err, 120)}): pip install 'peagle[{name}]'") from None


def auth_headers(credentials: Credentials) -> dict[str, str]:
    """The ``Authorization`` header a URI's credentials stand for: Basic for ``user:pass@``, Bearer for a
    ``?token=`` (as MLflow's client sends MLFLOW_TRACKING_USERNAME/PASSWORD and MLFLOW_TRACKING_TOKEN)."""
    if credentials.username is not None or credentials.password is not None:
        pair = f"{credentials.username or ''}:{credentials.password or ''}".encode()
        return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
    if credentials.token is not None:
        return {"Authorization": f"Bearer {credentials.token}"}
    return {}


def check_reachable(url: str, *, what: str, hint: str, timeout: float = TIMEOUT_S,
                    credentials: Credentials | None = None) -> None:
    """Any HTTP answer from ``url`` will do (an error status is an answer); no answer is one line.
    Credentials (in ``url``, or ``credentials`` of the URI it was made from) are sent as a header,
    never in the request line, and never named.

    Raises:
        UserError: the connection failed or timed out, naming the URL (redacted) and the reason.
    """
    own = split_credentials(url)
    headers = auth_headers(own) or auth_headers(credentials or own)
    request = urllib.request.Request(own.uri, method="GET", headers=headers)
    try:
        urllib.request.urlopen(request, timeout=timeout).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise UserError(f"{what}: cannot reach {redact_text(url)} ({one_line(reason, 120, with_type=False)}); "
                        f"{hint}") from None


def wandb_base_url(environ: Mapping[str, str]) -> str:
    return environ.get("WANDB_BASE_URL") or WANDB_BASE_URL


def has_wandb_login(environ: Mapping[str, str]) -> bool:
    """Whether W&B would find credentials: an API key or identity token in the environment, or a
    ``machine`` entry for its server in the netrc file that ``wandb login`` writes."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urllib.parse.urlparse(wandb_base_url(environ)).hostname
    path = Path(environ.get("NETRC") or Path(environ.get("HOME") or Path.home()) / ".netrc")
    try:
        return bool(host) and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(asked: str, environ: Mapping[str, str], log_dir: Path) -> tuple[str, str | None]:
    """(``online`` or ``offline``, a note to print or None). ``auto`` takes ``WANDB_MODE`` when set, else
    online with a login and offline without one (the note says so and how to upload later).

    Raises:
        UserError: online without a login, or with a server that does not answer.
    """
    mode, note = asked, None
    if mode == "auto":
        env = environ.get("WANDB_MODE", "").strip().lower()
        if env in ("online", "offline", "dryrun"):
            mode = "offline" if env == "dryrun" else env
        elif has_wandb_login(environ):
            mode = "online"
        else:
            mode = "offline"
            note = (f"W&B: no login here (WANDB_API_KEY or `wandb login`), so the run is logged offline into "
                    f"{log_dir / 'wandb'}; `wandb sync {log_dir / 'wandb'}/offline-run-*` uploads it later")
    if mode == "online":
        if not has_wandb_login(environ):
            raise UserError("--logger wandb --wandb-mode online needs a W&B login: run `wandb login` or set "
                            "WANDB_API_KEY (or log offline: --wandb-mode offline, and `wandb sync` later)")
        url = wandb_base_url(environ)
        check_reachable(url, what="--logger wandb", hint="check the network or WANDB_BASE_URL, or log offline "
                                                          "(--wandb-mode offline) and `wandb sync` later")
    return mode, note


def resolve_mlflow_uri(asked: str | None, default: str, environ: Mapping[str, str]) -> str:
    """The tracking URI (``--mlflow-tracking-uri``, else ``MLFLOW_TRACKING_URI``, else ``default``),
    its server asked for an answer.

    Raises:
        UserError: a server that does not answer, or a database store without its packages.
    """
    uri = asked or environ.get("MLFLOW_TRACKING_URI") or default
    scheme = urllib.parse.urlparse(uri).scheme.split("+")[0]
    if scheme in ("http", "https"):
        credentials = split_credentials(uri)
        check_reachable(credentials.uri.rstrip("/") + "/health", what="--logger mlflow", credentials=credentials,
                        hint="start the tracking server or pass another --mlflow-tracking-uri "
                             "(file:PATH is a store on disk, no server)")
    elif scheme in ("sqlite", "postgresql", "mysql", "mssql"):
        for module in ("sqlalchemy", "alembic"):
            try:
                importlib.import_module(module)
            except ImportError:
                raise UserError(f"--mlflow-tracking-uri {redact_text(uri)} is a database store, which needs MLflow's full "
                                f"package ({module} does not import): pip install mlflow; or use file:PATH") from None
    return uri


def mlflow_client_uri(uri: str, environ: MutableMapping[str, str] | None = None) -> str:
    """The tracking URI to give MLflow's client: without its credentials, which go where the client
    reads them, this process's MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (``user:pass@``) or
    MLFLOW_TRACKING_TOKEN (``?token=``). So neither MLflow's requests nor its own records (a file
    store's ``meta.yaml`` keeps the URI it was given) hold them; a MLFLOW_TRACKING_URI with
    credentials is replaced by its clean form here too, for any MLflow code that reads it."""
    environ = os.environ if environ is None else environ
    credentials = split_credentials(uri)
    if credentials.username is not None:
        environ["MLFLOW_TRACKING_USERNAME"] = credentials.username
    if credentials.password is not None:
        environ["MLFLOW_TRACKING_PASSWORD"] = credentials.password
    if credentials.token is not None:
        environ["MLFLOW_TRACKING_TOKEN"] = credentials.token
    from_env = environ.get("MLFLOW_TRACKING_URI")
    if from_env and split_credentials(from_env).uri != from_env:
        environ["MLFLOW_TRACKING_URI"] = split_credentials(from_env).uri
    return credentials.uri


def plan_tracking(options: TrackingOptions, *, log_dir: Path, run_name: str, mlflow_default: str,
                  environ: Mapping[str, str] | None = None) -> TrackingPlan | None:
    """Check every backend of ``options`` (module docstring) and resolve its settings; None when no
    backend is asked for. ``log_dir``, ``run_name`` and ``mlflow_default`` are the stage's defaults.

    Raises:
        UserError: a backend cannot run, in one line that says what to do.
    """
    environ = os.environ if environ is None else environ
    loggers = options.loggers
    if not loggers:
        return None
    log_dir = Path(options.logger_dir) if options.logger_dir else log_dir
    if "trackio" in loggers:  # Trackio reads its directory once, at its first import (a user's setting wins)
        os.environ["TRACKIO_DIR"] = os.environ.get("TRACKIO_DIR") or str(log_dir / "trackio")
    for name in loggers:
        require(name)
    mode, notes, uri = None, [], None
    if "wandb" in loggers:
        mode, note = resolve_wandb_mode(options.wandb_mode, environ, log_dir)
        notes += [note] if note else []
    if "mlflow" in loggers:
        uri = resolve_mlflow_uri(options.mlflow_tracking_uri, mlflow_default, environ)
    return TrackingPlan(loggers=loggers, run_name=options.run_name or run_name, log_dir=log_dir,
                        project=options.logger_project, wandb_entity=options.wandb_entity, wandb_mode=mode,
                        mlflow_uri=uri, notes=tuple(notes))
