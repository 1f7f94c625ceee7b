"""Where a run's numbers go besides TensorBoard (`log.trackers`): Accelerate's MLflow and Weights & Biases
integrations, and log.txt in the run directory, one JSON line of scalars per logged step (as MAE and timm write).

Scalars reach every tracker through `accelerator.log`; images through `log_image`; the final metrics through
`log_final`; what TensorBoard shows of the run's config through pipelines/tracking.py.

MLflow and W&B are checked before a run starts (`check_trackers`: a store the installed MLflow cannot open or an
MLflow server that does not answer, a W&B told to go online without a key, each one line) and given their place
when it starts (`start_trackers`, through `external_tracker_settings`): MLflow its MLFLOW_TRACKING_URI, else a store
under the run; W&B online with a key, else offline under the run unless WANDB_MODE says otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from mpp.errors import UserError
from mpp.rundir import checkpoint_step, written_whole

# log.trackers name -> (the module it imports, what to install for it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny (or mlflow)"),
            "wandb": ("wandb", "wandb")}


def check_installed(trackers: list[str]) -> None:
    """One line naming the package to install for each tracker asked for whose package is missing."""
    missing = [name for name in trackers if importlib.util.find_spec(TRACKERS[name][0]) is None]
    if missing:
        packages = " ".join(TRACKERS[name][1].split(" ")[0] for name in missing)
        raise UserError(f"log.trackers names {', '.join(missing)}, whose package is not installed: pip install {packages} "
                        f"(or leave {'it' if len(missing) == 1 else 'them'} out of log.trackers)")


# How long a run waits for the MLflow server of an http(s) MLFLOW_TRACKING_URI to answer before it stops: MLflow's own
# retries would wait minutes on a server that is not there, before the run's first step.
SERVER_PROBE_TIMEOUT_S = 5.0

# Where a run's own MLflow store goes, under its output_dir, when MLFLOW_TRACKING_URI is not set.
RUN_MLFLOW_STORE = "mlruns"


def check_trackers(trackers: list[str]) -> None:
    """Before a run starts, one line for each tracker that could not log: its package missing (check_installed), an
    MLFLOW_TRACKING_URI the installed MLflow cannot open or whose server does not answer, a W&B key of the wrong form
    or WANDB_MODE=online without a key."""
    check_installed(trackers)
    if "mlflow" in trackers and (uri := os.environ.get("MLFLOW_TRACKING_URI")):
        check_mlflow_store(uri)
    mode = os.environ.get("WANDB_MODE")
    if "wandb" in trackers and mode in (None, "online"):  # W&B would log in: a key of the wrong form is one line here
        if not wandb_logged_in() and mode == "online":
            raise UserError("WANDB_MODE=online, but W&B has no API key: run `wandb login` (or set WANDB_API_KEY), or "
                            "set WANDB_MODE=offline to keep the run under its output_dir/wandb and `wandb sync` it later")


def check_mlflow_store(uri: str) -> None:
    """The user's MLFLOW_TRACKING_URI is a store the installed MLflow opens (MLflow's own client decides, so a
    plugin's scheme counts) and, for a server, one that answers within SERVER_PROBE_TIMEOUT_S."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    allow_file_store(uri)
    try:
        MlflowClient(uri)
    except MlflowException:
        raise UserError(f"MLFLOW_TRACKING_URI={shown(uri)} is not a store the installed MLflow can open: set it to an MLflow "
                        f"server (http://HOST:PORT) or a folder (file:///path/mlruns), or unset it to log under the "
                        f"run's output_dir/{RUN_MLFLOW_STORE} (a database store such as sqlite: needs the full "
                        f"`pip install mlflow`, not mlflow-skinny)") from None
    if urlsplit(uri).scheme in ("http", "https"):
        probe_server(uri)


def probe_server(uri: str) -> None:
    """One request to the MLflow server at `uri`: any HTTP answer will do (the run's own calls then say what the
    server thinks of them); none within SERVER_PROBE_TIMEOUT_S is one line. Goes through the proxies the environment
    names, as MLflow's requests do; the certificate is MLflow's to check (MLFLOW_TRACKING_INSECURE_TLS)."""
    parts = urlsplit(uri)
    root = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/"  # without user:password@, which urllib cannot take
    unchecked = ssl.create_default_context()
    unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
    try:
        urllib.request.urlopen(root, timeout=SERVER_PROBE_TIMEOUT_S, context=unchecked).close()
    except urllib.error.HTTPError:
        pass  # the server answered
    except (OSError, ValueError) as error:  # URLError, refused, timed out; ValueError: no host in the URI
        reason = getattr(error, "reason", error)
        raise UserError(f"no MLflow server answered at MLFLOW_TRACKING_URI={shown(uri)} within {SERVER_PROBE_TIMEOUT_S:g} s "
                        f"({reason}): start it (`mlflow server --host HOST --port PORT`) or fix the URI, or unset it "
                        f"to log under the run's output_dir/{RUN_MLFLOW_STORE}") from None


def shown(uri: str) -> str:
    """`uri` as a message shows it: a password in it as ***."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return parts._replace(netloc=f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}").geturl()


def allow_file_store(uri: str) -> None:
    """MLflow 3 refuses a folder store (`file:` or a bare path) unless MLFLOW_ALLOW_FILE_STORE=true, and
    mlflow-skinny has no other local store: a run asked for one (the user's URI) or chose it (none set), so this
    process opens the gate, before MLflow reads it."""
    if urlsplit(uri).scheme in ("", "file"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"


def wandb_logged_in() -> bool:
    """Whether W&B has an API key (WANDB_API_KEY, `wandb login`'s netrc), asking no one: no prompt, no server."""
    import wandb

    try:
        return wandb.login(verify=False, prompt=False)
    except wandb.errors.Error as error:
        raise UserError(f"W&B: {error} Run `wandb login` (or fix WANDB_API_KEY), or set WANDB_MODE=offline") from None


def external_tracker_settings(accelerator: Accelerator, trackers: list[str], output_dir: str | Path) -> dict[str, dict]:
    """The MLflow and W&B settings of a run starting in `output_dir` (Accelerate's init_kwargs), saying where it logs
    when the environment did not say:

    MLflow logs to MLFLOW_TRACKING_URI, else to a folder store at output_dir/mlruns (the one store mlflow-skinny
    opens); the store is this process's tracking URI from here on. W&B logs as its environment says, and with no API
    key and no WANDB_MODE offline under output_dir/wandb (what `wandb sync` uploads), rather than stopping a run
    over where its copy of the numbers goes: the run keeps every number either way.
    """
    out = Path(output_dir).resolve()
    settings = {"wandb": {"name": out.name, "dir": str(out)}, "mlflow": {"run_name": out.name}}
    if "mlflow" in trackers:
        import mlflow

        chosen = os.environ.get("MLFLOW_TRACKING_URI")
        uri = chosen or (out / RUN_MLFLOW_STORE).as_uri()
        allow_file_store(uri)
        mlflow.set_tracking_uri(uri)
        if not chosen:
            # set_tracking_uri exports MLFLOW_TRACKING_URI to child processes: the next stage of this process (compare)
            # must not take this run's store for the user's.
            del os.environ["MLFLOW_TRACKING_URI"]
            accelerator.print(f"MLflow: MLFLOW_TRACKING_URI is not set, so the run logs to {uri}; see it with "
                              f"`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}` (the full mlflow "
                              f"package has the UI)")
    if "wandb" in trackers and "WANDB_MODE" not in os.environ and not wandb_logged_in():
        settings["wandb"]["mode"] = "offline"
        accelerator.print(f"W&B: no API key (`wandb login` or WANDB_API_KEY) and no WANDB_MODE, so the run logs offline "
                          f"under {out / 'wandb'}; `wandb sync {out / 'wandb'}/offline-run-*` uploads it")
    return settings


class JsonLines(GeneralTracker):
    """log.txt: each logged step's scalars (the loop's and the evaluations' of that step together) as one JSON line.

    Written as each step is logged, not held for a later one: a run killed, or ending on its own error, leaves every
    step it logged, the step of its last checkpoint included. Scalars logged later at the same step (its evaluations,
    run after the step's checkpoint) join that step's line, rewritten in place. A resume (`resume_at`) first drops
    the lines of the steps after its checkpoint, which it trains again, as TensorBoard's purge_step hides them, so
    the file holds each step once."""

    name = "log.txt"
    requires_logging_directory = False

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        self.last: dict | None = None  # the file's last line, which a later log of its step rewrites
        self.last_at, self.last_size = 0, 0  # where that line starts in the file, and its bytes

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        pass  # config.yaml beside it holds the settings

    def resume_at(self, step: int) -> None:
        """Keep the lines of the steps up to `step` (a resume's checkpoint; 0: a run started again from nothing) and
        continue after them; a line cut short by a kill is dropped with the rest."""
        kept, size = [], 0
        if self.path.is_file():
            for line in self.path.read_text().splitlines(keepends=True):
                try:
                    row = json.loads(line)
                except ValueError:
                    break
                if not line.endswith("\n") or row.get("step", 0) > step:
                    break
                kept.append((size, len(line.encode()), row))
                size += len(line.encode())
            whole = self.path.read_bytes()[:size]
            written_whole(self.path, lambda temporary: temporary.write_bytes(whole))
        self.last_at, self.last_size, self.last = kept[-1] if kept else (0, 0, None)

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        scalars = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("r+b" if self.path.is_file() else "wb") as file:
            if self.last is not None and self.last["step"] == step:
                # One write over the old line, padded to its length where shorter (JSON allows the spaces): no kill
                # can leave the step without the scalars it had, nor a tail of the old line.
                self.last = {**self.last, **scalars}
                line = (json.dumps(self.last).ljust(self.last_size - 1) + "\n").encode()
                file.seek(self.last_at)
            else:
                self.last_at = file.seek(0, os.SEEK_END)
                self.last = {"step": step, **scalars}
                line = (json.dumps(self.last) + "\n").encode()
            file.write(line)
            self.last_size = len(line)


def start_trackers(accelerator: Accelerator, run_name: str, trackers: list[str], output_dir: str | Path, settings: dict,
                   resumed_from: Path | None) -> None:
    """Start the run's trackers (`trackers`, log.trackers, and log.txt) as `run_name`, each continuing after
    `resumed_from`, the checkpoint the run resumes from (None: a run that starts from nothing): TensorBoard hides, and
    log.txt drops, what the run logged after it, the steps it trains again, so each holds every step once. MLflow
    and W&B log where external_tracker_settings says, each given the run's `settings` (its config as dotted keys)."""
    step = checkpoint_step(resumed_from) if resumed_from else 0
    # Without config=: Accelerate's own hparams call writes them to a timestamped sub-run, listing every run twice.
    accelerator.init_trackers(run_name, init_kwargs={
        "tensorboard": {"purge_step": step + 1} if resumed_from else {},
        **external_tracker_settings(accelerator, trackers, output_dir)})
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name in ("mlflow", "wandb"):  # TensorBoard's are HParams, pipelines/tracking.py's
            tracker.store_init_configuration({k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
                                              for k, v in settings.items()})
        elif isinstance(tracker, JsonLines):
            tracker.resume_at(step)


def log_image(accelerator: Accelerator, tag: str, image: np.ndarray, step: int) -> None:
    """An (H, W, 3) uint8 image under `tag` at `step`, in every tracker that takes images (main process only)."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_image(tag, image, global_step=step, dataformats="HWC")
        elif tracker.name == "wandb":
            tracker.log_images({tag: [image]}, step=step)
        elif tracker.name == "mlflow":
            import mlflow

            mlflow.log_image(image, key=tag.replace("/", "_"), step=step)


def log_final(accelerator: Accelerator, final: dict[str, float], step: int) -> None:
    """The run's final metrics (what results.json's `final` holds) in MLflow (as the metrics' values at the last
    step) and W&B (its run summary); TensorBoard has them as the last logged values already."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            tracker.run.summary.update(final)
        elif tracker.name == "mlflow":
            tracker.log(final, step=step)
