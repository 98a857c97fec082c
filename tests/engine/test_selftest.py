"""`python -m engine selftest` on CPU: the stand-ins run and pass, the CUDA-only checks say they
were not run, the report is written, and a broken path is reported as a failure (exit code 1)."""

from __future__ import annotations

import json

import torch

from engine.__main__ import main
from engine.kv.offload import OffloadCache


def test_selftest_runs_the_stand_ins_on_cpu_and_writes_a_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["selftest", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {"flash-attn vs SDPA": "skipped", "CUDA graphs vs eager": "pass", "offload vs on chip": "pass",
                      "tensor parallel vs one process": "pass", "planner vs measured peak": "skipped"}
    assert report["passed"] and report["environment"]["torch"] == torch.__version__
    printed = capsys.readouterr()
    assert "tensor parallel vs one process  pass" in printed.out
    assert "not checked here: flash-attn vs SDPA, planner vs measured peak" in printed.err


def test_selftest_reports_a_broken_path(tmp_path, monkeypatch):
    update = OffloadCache.update

    def off_by_a_bit(self, layer_idx, k, v):  # an offload bug: the streamed keys come back changed
        k_view, v_view = update(self, layer_idx, k, v)
        return k_view * 1.5, v_view

    monkeypatch.setattr(OffloadCache, "update", off_by_a_bit)
    out = tmp_path / "report.json"
    assert main(["selftest", "--device", "cpu", "--out", str(out), "--only", "offload vs on chip"]) == 1
    (check,) = json.loads(out.read_text())["checks"]
    assert check["status"] == "fail" and "tokens differ from position" in check["detail"]
