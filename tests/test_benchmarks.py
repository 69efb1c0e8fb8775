"""The benchmarks keep working: every script in benchmarks/ runs in its quick form (seconds, CPU)
and ends with its RESULT line, so a benchmark that breaks fails here rather than when someone
next measures. And the plain-PyTorch reference that train_throughput.py times against keeps
attention inside each document, as our model does.

A script runs as `__main__` in a process forked from the test worker's preloaded server
(`jobs.launch`), as `python benchmarks/SCRIPT --quick` runs it minus the interpreter's start;
the processes a script starts itself are fresh interpreters."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jobs import launch

from megatron_mlmclm.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
# The scripts (reference_encoder.py, _engine.py and _throughput_*.py are modules they import).
SCRIPTS = sorted(
    p.name
    for p in BENCHMARKS.glob("*.py")
    if not p.name.startswith("_") and 'if __name__ == "__main__":' in p.read_text()
)
RUNS = [(name, ["--quick"]) for name in SCRIPTS] + [
    ("train_throughput.py", ["--quick", "--profile"])
]

pytestmark = pytest.mark.slow  # 95 s in all on 2 quiet cores


def test_every_script_is_run():
    known = {
        "data_loader.py",
        "fault_monitor.py",
        "finetune_throughput.py",
        "layer_stack.py",
        "learning_curves.py",
        "mlm_vs_clm_step.py",
        "preprocess.py",
        "sample_index.py",
        "train_step.py",
        "train_throughput.py",
    }
    assert known <= set(SCRIPTS), SCRIPTS
    assert "reference_encoder.py" not in SCRIPTS


def run_script(script: str, *flags: str, **env: str):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return launch(("script", [str(BENCHMARKS / script), *flags]), env=env, cwd=REPO, timeout=600)


@pytest.mark.parametrize("script,flags", RUNS, ids=[" ".join([s, *f]) for s, f in RUNS])
def test_quick_form_runs_and_prints_its_result(script, flags, data_dir):
    proc = run_script(script, *flags, MLMCLM_DATA_DIR=str(data_dir))
    lines = proc.stdout.strip().splitlines()
    tail = (proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, tail
    assert lines and lines[-1].startswith("RESULT "), tail  # the headline is the last line
    if script == "train_throughput.py" and "--profile" not in flags:
        assert lines[-2].startswith("RESULT train_throughput_vs_reference ratio="), tail
        assert "n/a" not in lines[-2] and "n/a" not in lines[-1], tail
        assert "data.mock_doc_length=web" in proc.stdout, tail  # web-like documents by default
    if script == "train_throughput.py" and "--profile" in flags:
        # the reference's loop reads its loss once a step, and nothing else waits
        assert " ref_host_syncs_per_step=1" in lines[-1], tail


def run_quick(*flags: str) -> tuple[list[str], str]:
    proc = run_script("train_throughput.py", "--quick", *flags)
    tail = (proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, tail
    return proc.stdout.strip().splitlines(), tail


def test_one_size_runs_all_its_rows_one_contender_at_a_time():
    """`--size` in its quick form: two rows (two token counts), each with ours, the reference of
    the same parameter count (GQA and a head dim other than hidden / heads here, as the 610m and
    1b presets have GQA) and ours with the distributed optimizer's layout, timed back to back;
    a RESULT line per row for each ratio; the distributed optimizer's first loss is ours'."""
    lines, tail = run_quick(
        "--size", "1b", "--set", "model.kv_channels=48", "--set", "model.num_query_groups=1"
    )
    results = [line for line in lines if line.startswith("RESULT ")]
    for tokens, mb in (("256", 2), ("384", 3)):
        vs_ref = [
            r
            for r in results
            if r.startswith(f"RESULT train_throughput_vs_reference_tiny_{tokens}_s128 ")
        ]
        distopt = [
            r
            for r in results
            if r.startswith(f"RESULT train_throughput_distopt_tiny_{tokens}_s128 ")
        ]
        assert len(vs_ref) == 1 and len(distopt) == 1, tail
        assert "params_equal=yes" in vs_ref[0] and "timing=back_to_back" in vs_ref[0], tail
        assert float(distopt[0].split("ratio=")[1].split()[0]) > 0, tail
        row = next(
            line for line in lines if line.startswith(f"tiny s128 {tokens} mlm 40% fp32: mb {mb},")
        )
        assert "distopt / ours" in row, tail
        losses = next(line for line in lines if line.startswith(f"  tiny s128 {tokens} mlm"))
        step0 = dict(part.split() for part in losses.split(": ", 1)[1].split(", "))
        assert set(step0) == {"ours", "ref", "distopt"} and step0["ours"] == step0["distopt"], tail
    assert lines[-2].startswith("RESULT train_throughput_vs_reference ratio="), tail
    assert lines[-1] == "RESULT train_throughput ratio=n/a (hf not run)", tail


def test_the_reference_fetches_the_next_batch_before_it_reads_its_loss():
    """ReferenceLoop: step r queued, step r + 1's batch fetched, then step r's loss read; a step
    finds the batch fetched for it; a jump fetches its own; a fetch past the data is left."""
    sys.path.insert(0, str(BENCHMARKS))
    from reference_encoder import LossReading, ReferenceLoop

    events = []

    class Loss:
        def __init__(self, r):
            self.r = r

        def value(self):
            events.append(("read", self.r))
            return float(self.r)

    def fetch(r):
        events.append(("fetch", r))
        if r > 5:
            raise IndexError(r)
        return r

    def step(batch):
        events.append(("step", batch))
        return Loss(batch)

    loss = torch.tensor(2.5)
    reading = LossReading(loss)
    loss.add_(1.0)  # what the device does after the reading was taken is not in it
    assert reading.value() == 2.5

    loop = ReferenceLoop(step, fetch)
    assert [loop(0), loop(1), loop(3), loop(5)] == [0.0, 1.0, 3.0, 5.0]
    assert events == [
        ("fetch", 0), ("step", 0), ("fetch", 1), ("read", 0),
        ("step", 1), ("fetch", 2), ("read", 1),
        ("fetch", 3), ("step", 3), ("fetch", 4), ("read", 3),
        ("fetch", 5), ("step", 5), ("fetch", 6), ("read", 5),
    ]  # fmt: skip
    assert loop.ready is None


def test_document_lengths_are_the_runs_of_each_row():
    import itertools

    sys.path.insert(0, str(BENCHMARKS))
    from _throughput_rows import document_lengths

    rng = np.random.default_rng(0)
    docs = np.cumsum(rng.random((4, 50)) < 0.1, axis=1)
    docs[2] = 0  # one document the whole row
    want = [len(list(g)) for row in docs for _, g in itertools.groupby(row.tolist())]
    assert document_lengths(docs) == want and sum(want) == docs.size


def test_reference_attention_stays_inside_each_document():
    """The reference on a packed batch equals the same model run on each document alone (no mask,
    positions from 0), for MLM (bidirectional) and CLM (causal), in float64."""
    sys.path.insert(0, str(BENCHMARKS))
    from reference_encoder import ReferenceEncoder, make_batch

    from megatron_mlmclm.flops import TransformerShape

    shape = TransformerShape(2, 64, 96, 4, 2, 16)  # GQA: 4 heads, 2 KV heads
    vocab, seq = 50, 24
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, vocab, (2, seq))
    docs = np.array([[0] * 7 + [1] * 10 + [2] * 7, [0] * seq])
    labels = np.where(rng.random((2, seq)) < 0.5, inputs, -100)
    batch = make_batch(inputs, labels, docs, -100, torch.device("cpu"))
    assert batch.cu_seqlens.tolist() == [0, 7, 17, 24, 48]
    for causal in (False, True):
        torch.manual_seed(0)
        model = ReferenceEncoder(shape, vocab, seq, 10000.0, 1e-5, 0.02, "sdpa", causal).double()
        with torch.no_grad():
            packed = model(batch, model.document_mask(batch.document_ids))
            hidden = []
            for row in range(2):
                for d in np.unique(docs[row]):
                    tokens = torch.from_numpy(inputs[row, docs[row] == d])[None]
                    n = tokens.shape[1]
                    mask = torch.ones(n, n, dtype=torch.bool).tril() if causal else None
                    x = model.embedding(tokens)
                    for block in model.blocks:
                        x = block(x, model.cos[:n], model.sin[:n], mask, None)
                    hidden.append(model.final_norm(x)[0])
            flat = torch.from_numpy(labels.reshape(-1))
            keep = flat != -100
            alone = F.cross_entropy(model.head(torch.cat(hidden)[keep]).float(), flat[keep])
        torch.testing.assert_close(packed, alone, rtol=1e-6, atol=1e-6)


def test_device_work_counts_each_kernel_once():
    """The profile's device work sums the kernels, copies and fills, not the ranges torch marks on
    the device around them (`Optimizer.step#AdamW.step` spans the fused AdamW's kernels), nor the
    host's operators: a profile with both counts each kernel once."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    sys.path.insert(0, str(BENCHMARKS))
    from _throughput_profile import device_ms

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=device, device_time=us, is_user_annotation=annotation)

    events = [
        event(DeviceType.CUDA, 3000.0),  # the fused AdamW kernel
        event(DeviceType.CUDA, 3000.0, annotation=True),  # its Optimizer.step range
        event(DeviceType.CUDA, 500.0),  # a copy
        event(DeviceType.CPU, 9000.0),  # the host's operator
    ]
    assert device_ms(SimpleNamespace(events=lambda: events)) == 3.5


def test_the_probe_form_writes_figures_the_plan_prices_from(tmp_path, data_dir):
    """`finetune_throughput.py --probe SIZE` (the GPU form's planner figures, run here at the
    tiny preset for a few steps on CPU) writes a file `mlmclm plan --eval-probe` reads: the
    probed task at that size is priced as measured."""
    probe = tmp_path / "probe.json"
    flags = ["--probe", "tiny", "--tasks", "sst2", "--probe-steps", "3", "--device", "cpu"]
    proc = run_script("finetune_throughput.py", *flags, "--out", str(probe),
                      MLMCLM_DATA_DIR=str(data_dir))  # fmt: skip
    tail = (proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, tail
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT finetune_probe size=tiny"), tail
    out = tmp_path / "plan"
    argv = ["plan", "--out", str(out), "--sizes", "tiny", "--budgets", "4000", "--objectives",
            "mlm", "--mask-ratios", "0.4", "--clm-shares", "--cpt-steps", "--eval-tasks", "sst2",
            "--eval-data-dir", str(data_dir), "--eval-probe", str(probe)]  # fmt: skip
    assert cli_main(argv) == 0
    with open(out / "SUMMARY_EVAL.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert (row["task"], row["size"], row["priced_from"]) == ("sst2", "tiny", "measured"), row
