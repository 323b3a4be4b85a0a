"""hplab.lab: the α-β fit recovers known parameters, the flag translation, and a failing job
becomes one clear error line instead of a hang or a wall of output (one 1-process launch); from
a notebook, train.py and the collectives benchmark are forked from a preloaded process with the
results a fresh interpreter gives."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hplab import lab


@pytest.mark.parametrize(("op", "n"), [("all_reduce", 4), ("all_gather", 8), ("send_recv", 2)])
def test_alpha_beta_fit_recovers_the_model_it_was_given(op, n):
    alpha, beta = 250e-6, 3e9
    steps, factor = lab.alpha_beta_terms(op, n)
    sizes = 2.0 ** np.arange(10, 25)
    times = steps * alpha + factor * sizes / beta
    fit = lab.fit_alpha_beta(op, n, sizes, times)
    assert math.isclose(fit.alpha_s, alpha, rel_tol=1e-6)
    assert math.isclose(fit.beta_bytes_per_s, beta, rel_tol=1e-6)
    assert fit.max_relative_error < 1e-6


def test_ring_terms_follow_the_bus_factor_convention():
    from hplab.parallel.collectives import bus_factor

    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in (2, 4, 8):
            assert lab.alpha_beta_terms(op, n)[1] == bus_factor(op, n)
    assert lab.alpha_beta_terms("all_reduce", 4)[0] == 6  # 2(n-1) latency steps


def test_flags_translate_python_names_to_the_command_line():
    assert lab.as_flags(
        {"bucket_mb": 0.5, "recompute": True, "zero": None, "no_progress": False}
    ) == ["--bucket-mb", "0.5", "--recompute"]


def test_mfu_formula():
    metrics = {
        "world_size": 2,
        "tokens_per_s": 1000.0,
        "model": {"num_params": 100, "n_layer": 2, "n_embd": 4, "n_positions": 8},
    }
    run = lab.Run(metrics)
    per_token = 6 * 100 + 12 * 2 * 4 * 8
    assert lab.mfu(run, peak_flops_per_process=1e6) == pytest.approx(1000 * per_token / 2e6)


def test_a_failing_job_raises_its_one_line_error():
    with pytest.raises(lab.LaunchError) as err:
        lab.train(nproc=1, dp=3, steps=1, progress=False, timeout_s=120)
    message = str(err.value)
    assert message.startswith("hplab: error: layout dp=3") and "\n" not in message


@pytest.mark.parametrize("nproc", ["2", 0, -1, 1.5, True])
def test_a_bad_number_of_processes_is_one_line_before_any_job(nproc):
    with pytest.raises(ValueError, match="nproc must be a whole number of processes") as err:
        lab.train(nproc=nproc, steps=1, progress=False)
    assert "\n" not in str(err.value)


def test_metrics_go_where_asked_and_a_finished_run_says_so(tmp_path):
    """`metrics=PATH` keeps the metrics file (it wrote nothing there); running a finished
    `save=..., resume="auto"` cell again says in one line that nothing is left to train."""
    common = dict(nproc=1, steps=2, progress=False, save=str(tmp_path / "ckpt"), resume="auto")
    run = lab.train(metrics=str(tmp_path / "m.json"), **common)
    assert json.loads((tmp_path / "m.json").read_text())["steps"] == run.metrics["steps"]
    with pytest.raises(lab.LaunchError) as err:
        lab.train(**common)
    assert "already holds all 2 steps: nothing is left to train" in str(err.value)
    assert "\n" not in str(err.value)


# What a notebook runs (no main module file: jobs are forked from the preloaded forkserver).
IN_A_NOTEBOOK = """
import json, multiprocessing.forkserver as server, time
from hplab import lab
from hplab.course.jobs import LaunchError

out = {"losses": lab.train(nproc=2, dp=2, steps=2, progress=False).losses}
out["forkserver"] = server._forkserver._forkserver_pid is not None
out["sizes"] = len(lab.collectives(nproc=2, min_bytes=2**12, max_bytes=2**13, repeats=1,
                                   ops=["all_reduce"], progress=False).times("all_reduce"))
try:
    lab.train(nproc=1, dp=3, steps=1, progress=False)
except LaunchError as err:
    out["error"] = str(err)
start = time.monotonic()
try:
    lab.train(nproc=2, dp=2, steps=100000, progress=False, timeout_s=2)
except LaunchError as err:
    out["stopped"], out["stopped_after_s"] = str(err), time.monotonic() - start
print(json.dumps(out))
"""


def test_a_notebook_forks_its_jobs_and_gets_what_a_fresh_interpreter_gets():
    done = subprocess.run(
        [sys.executable, "-c", IN_A_NOTEBOOK],
        cwd=Path(lab.REPO_DIR),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    fresh = lab.train(nproc=2, dp=2, steps=2, progress=False)  # (pytest's __main__: a script)
    assert out["forkserver"] and out["losses"] == fresh.losses
    assert out["sizes"] == 2
    assert out["error"].startswith("hplab: error: layout dp=3") and "\n" not in out["error"]
    assert "did not finish in 2 s" in out["stopped"] and out["stopped_after_s"] < 30
    assert "leaked" not in done.stderr  # (tqdm's semaphore, when the ranks end)


def test_plots_draw_from_a_metrics_dict_without_a_notebook():
    import matplotlib

    matplotlib.use("Agg")
    from hplab import viz

    kinds = {
        "params_bytes": 4,
        "grads_bytes": 4,
        "optim_bytes": 8,
        "master_bytes": 0,
        "activation_bytes": 20,
        "peak_bytes": 36,
        "peak_rss_bytes": 1,
    }
    metrics = {
        "world_size": 1,
        "config": {"dp": 1, "tp": 1, "pp": 1, "zero": 0},
        "steps": [
            {"step": 0, "loss": 2.0, "time_s": 0.1, "tokens": 10},
            {"step": 1, "loss": 1.5, "time_s": 0.1, "tokens": 10},
        ],
        "tokens_per_s": 100.0,
        "memory": [kinds],
        "comm": [{}],
    }
    run = lab.Run(metrics)
    assert run.label() == "dp=1" and run.losses == [2.0, 1.5]
    ax = run.plot_loss()
    assert ax.get_title() and ax.get_ylabel().startswith("loss")
    ax = viz.plot_memory_breakdown(
        {f"measured ({run.label()})": run.memory_bytes()},
        predicted={"params": 4, "grads": 4, "optim": 8},
    )
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["measured (dp=1)", "formula"]
    sizes = [2**k for k in range(10, 16)]
    data = {
        "world_size": 4,
        "backend": "gloo",
        "repeats": 1,
        "ledger": {},
        "demo": [],
        "results": {"all_reduce": [{"bytes": s, "time_s": 1e-4 + s / 1e9} for s in sizes]},
    }
    ax = lab.Collectives(data).plot()
    assert "4 processes" in ax.get_title() and ax.get_xscale() == "log"
    viz.plot_bubble_fraction(4, highlight=8)
    viz.plot_zero_memory(1e9, highlight=(2, 8))
