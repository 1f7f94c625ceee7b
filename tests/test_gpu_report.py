"""benchmarks/gpu_report.py: every part runs (at a tiny size on the CPU here) and the report names what it found."""

import importlib.util
import json
import subprocess
import sys

from conftest import ROOT, cpu_env

REPORT = ROOT / "benchmarks" / "gpu_report.py"


def test_the_smoke_report_runs_every_part_and_writes_the_summary_last(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, str(REPORT), "--out", str(out), "--smoke"], cwd=ROOT, env=cpu_env(threads=None),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads((out / "gpu_report.json").read_text())["parts"]
    assert set(parts) == {"env", "gemm", "e2e", "step_b16", "profile", "gpu_tests", "suite"}
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(parts, "ok")
    assert parts["suite"]["tests"]["counts"] == {"PASSED": 1}
    assert parts["gpu_tests"]["tests"]["counts"]["SKIPPED"] >= 9  # collected, and skipped without CUDA
    assert parts["step_b16"]["data"]["rows"] and parts["profile"]["data"]["kernel_ms"] > 0
    assert parts["e2e"]["data"]["images_per_s_median"] > 0 and 0 <= parts["e2e"]["data"]["data_wait_median"] <= 1
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("written: ") and "gpu_report.md" in lines[-1]
    assert any(line.startswith("suite") and "1 passed" in line for line in lines[-12:])  # the table comes last
    assert "| pretraining from 100x75 JPEG shards" in (out / "gpu_report.md").read_text()


def test_a_missing_package_is_named_in_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    monkeypatch.setitem(report.REQUIRED, "no_such_module_here", "no-such-package")
    assert report.main(["--out", str(tmp_path / "report"), "--smoke"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: missing Python packages: no-such-package (")
    assert not (tmp_path / "report").exists()
