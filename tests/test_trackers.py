"""MLflow and W&B as a user has them after `pip install 'mpp[trackers]'`: the real packages, no environment set for
them, a HOME of the test's own (no key from this machine's `wandb login`). A run without settings logs somewhere it
names; a store or server that cannot take the run, or a W&B told to go online without a key, is one line and exit 2
before training, in seconds."""

import importlib.util
import json
import os
import socket
import time
from unittest import mock

import pytest

import launch

from conftest import TINY, write_test_shards

pytest.importorskip("mlflow")
pytest.importorskip("wandb")


@pytest.fixture(autouse=True)
def users_environment(tmp_path):
    """No MLFLOW_* or WANDB_* variables and a fresh HOME; the process's environment as it was afterwards (a run opens
    MLflow's file-store gate in its own process)."""
    with mock.patch.dict(os.environ):
        for name in [name for name in os.environ if name.startswith(("MLFLOW_", "WANDB_"))]:
            del os.environ[name]
        os.environ["HOME"] = str(tmp_path / "home")
        yield


def pretraining(tmp_path, output_dir, *overrides) -> list[str]:
    shards = tmp_path / "shards"
    if not shards.is_dir():
        write_test_shards(shards, [16], size=16)
    return ["pretrain", *TINY, f"data.shards={shards}", f"output_dir={output_dir}", "train.steps=2",
            "train.warmup_steps=1", "train.batch_size=8", "log.every=1", *overrides]


def test_mlflow_without_a_tracking_uri_logs_under_each_run_and_says_where(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    for name in ("first", "second"):  # two stages of one process, as compare runs them: each in its own store
        assert launch.main(pretraining(tmp_path, tmp_path / name, "log.trackers=[mlflow]")) == 0
        uri = (tmp_path / name / "mlruns").as_uri()
        out = capsys.readouterr().out
        assert f"the run logs to {uri}; see it with `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}`" in out

        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # as the line says
        client = MlflowClient(uri)
        (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
        final = json.loads((tmp_path / name / "results.json").read_text())["final"]
        assert run.info.run_name == name and run.data.metrics["train/pretext_loss"] == pytest.approx(final["train/pretext_loss"])
        del os.environ["MLFLOW_ALLOW_FILE_STORE"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    return line


def stops_before_training(tmp_path, capsys, *overrides) -> tuple[str, float]:
    """The error line of a run with `overrides`, and how long the command took."""
    started = time.perf_counter()
    assert launch.main(pretraining(tmp_path, tmp_path / "run", *overrides)) == 2
    took = time.perf_counter() - started
    assert not (tmp_path / "run" / "checkpoints").exists()
    return one_line(capsys), took


@pytest.mark.parametrize("store", ["bogus://x", "sqlite:///{tmp_path}/mlflow.db"])
def test_an_mlflow_store_the_installed_mlflow_cannot_open_is_one_line(tmp_path, capsys, store):
    store = store.format(tmp_path=tmp_path)
    if store.startswith("sqlite") and importlib.util.find_spec("sqlalchemy"):
        pytest.skip("the full mlflow opens sqlite stores; mlflow-skinny does not")
    os.environ["MLFLOW_TRACKING_URI"] = store
    line, _ = stops_before_training(tmp_path, capsys, "log.trackers=[mlflow]")
    assert f"MLFLOW_TRACKING_URI={store} is not a store the installed MLflow can open" in line
    assert "or unset it to log under the run's output_dir/mlruns" in line


@pytest.fixture
def silent_server():
    """A port that takes connections and never answers: a server that hangs."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize("server", ["closed", "silent"])
def test_an_mlflow_server_that_does_not_answer_is_one_line_within_seconds(tmp_path, capsys, request, server):
    uri = "http://127.0.0.1:9" if server == "closed" else request.getfixturevalue("silent_server")  # 9: discard, closed
    os.environ["MLFLOW_TRACKING_URI"] = uri
    line, took = stops_before_training(tmp_path, capsys, "log.trackers=[mlflow]")
    assert f"no MLflow server answered at MLFLOW_TRACKING_URI={uri} within 5 s" in line and "mlflow server" in line
    assert took < 30  # MLflow's own retries took about 150 s; the probe waits 5 s at most


def test_wandb_told_to_go_online_without_a_key_is_one_line(tmp_path, capsys):
    os.environ["WANDB_MODE"] = "online"
    line, took = stops_before_training(tmp_path, capsys, "log.trackers=[wandb]")
    assert line == ("error: WANDB_MODE=online, but W&B has no API key: run `wandb login` (or set WANDB_API_KEY), or set "
                    "WANDB_MODE=offline to keep the run under its output_dir/wandb and `wandb sync` it later")
    assert took < 30 and not (tmp_path / "run" / "wandb").exists()


def test_wandb_without_a_key_or_mode_logs_offline_under_the_run_and_says_so(tmp_path, capsys):
    assert launch.main(pretraining(tmp_path, tmp_path / "run", "log.trackers=[wandb]")) == 0
    wandb_dir = tmp_path / "run" / "wandb"
    assert (f"W&B: no API key (`wandb login` or WANDB_API_KEY) and no WANDB_MODE, so the run logs offline under "
            f"{wandb_dir}; `wandb sync {wandb_dir}/offline-run-*` uploads it") in capsys.readouterr().out
    (record,) = wandb_dir.glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads
    assert record.stat().st_size > 0


def test_a_wandb_key_of_the_wrong_form_is_one_line(tmp_path, capsys):
    os.environ["WANDB_API_KEY"] = "abc"
    line, _ = stops_before_training(tmp_path, capsys, "log.trackers=[wandb]")
    assert line.startswith("error: W&B: WANDB_API_KEY invalid") and "`wandb login`" in line
