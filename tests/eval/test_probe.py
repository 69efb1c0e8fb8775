"""`mlmclm evaluate --probe`: the evaluation probe's file, on CPU at the tiny preset over the
shipped tasks (a few steps): its exact shape, every figure positive, the figures consistent with
one another and with the time the probe took. No timing is asserted."""

from __future__ import annotations

import json
import math
import time

import torch
import transformers

from megatron_mlmclm.cli import main
from megatron_mlmclm.eval.families import ir

TASKS = {"sst2": "sc", "conll2003": "tc", "squad": "qa", "scifact": "ir"}
COMMON = {"family", "batch", "steps", "startup_s", "step_s", "first_steps_s", "mean_tokens",
          "padded_tokens"}  # fmt: skip
KEYS = {
    "sc": COMMON | {"scored_per_s"},
    "tc": COMMON | {"scored_per_s"},
    "qa": COMMON | {"scored_per_s"},
    "ir": COMMON | {"documents_per_s", "queries_per_s"},
}


def test_the_probe_writes_the_planners_figures(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ir, "PROBE_DOCUMENTS", 64)
    monkeypatch.setattr(ir, "PROBE_QUERIES", 16)
    out = tmp_path / "probe.json"
    steps = 3  # under the ten warm-up steps: step_s is then the median of all three
    argv = ["evaluate", "--probe", "tiny", "--tokenizer", tiny_model, "--task", *TASKS,
            "--probe-steps", str(steps), "--max-train-examples", "400", "--max-eval-examples",
            "32", "--threads", "1", "--out", str(out)]  # fmt: skip
    start = time.perf_counter()
    assert main(argv) == 0
    took = time.perf_counter() - start
    rec = json.loads(out.read_text())
    assert set(rec) == {"kind", "schema", "size", "protocol", "device", "precision", "date",
                        "versions", "tasks"}  # fmt: skip
    assert (rec["kind"], rec["schema"], rec["size"], rec["protocol"]) == (
        "mlmclm-eval-probe",
        1,
        "tiny",
        "default",
    )
    assert (rec["device"], rec["precision"]) == ("cpu", "fp32")
    assert rec["versions"]["torch"] == torch.__version__
    assert rec["versions"]["transformers"] == transformers.__version__
    assert len(rec["date"]) == 10 and rec["date"][4] == rec["date"][7] == "-"
    assert list(rec["tasks"]) == list(TASKS)
    spent = 0.0
    for name, f in rec["tasks"].items():
        assert set(f) == KEYS[TASKS[name]] and f["family"] == TASKS[name], name
        assert (f["batch"], f["steps"]) == (32, steps), name
        for key in KEYS[TASKS[name]] - {"family", "batch", "steps"}:
            assert isinstance(f[key], float) and math.isfinite(f[key]) and f[key] > 0, (name, key)
        # padding never shortens an input; an IR input is a query and its document
        assert f["mean_tokens"] <= f["padded_tokens"] <= (2 if name == "scifact" else 1) * 126
        # first_steps_s: the first ten steps (here all three), step_s their median: at least
        # half of them took as long; the start-up and the steps, one task after the other, were
        # all spent within the probe
        assert math.ceil(steps / 2) * f["step_s"] <= f["first_steps_s"]
        spent += f["startup_s"] + f["first_steps_s"]
    assert spent <= took
    printed = capsys.readouterr().out
    assert f"probe tiny on cpu (fp32) -> {out}" in printed and "sst2: start-up" in printed
