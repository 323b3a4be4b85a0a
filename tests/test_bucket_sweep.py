"""hplab/course/bucket_sweep.py: lab 02's and bench_link's DDP step time against bucket size."""

import pytest

from hplab.course.bucket_sweep import calibrated_link, job_view, sweep
from hplab.models.gpt import build_model, config_from_preset
from hplab.runtime.link import parse


def test_job_view_takes_the_last_rank_to_finish_backward():
    """The job's step is its slowest rank's; its exposed communication is measured on the rank
    that finished backward last (the other also waited for that rank)."""
    early = {"0.0": [dict(step_s=1.0, window_s=0.2, exposed_s=0.5)]}
    late = {"0.0": [dict(step_s=0.9, window_s=0.3, exposed_s=0.1)]}
    (step,) = job_view([early, late])["0.0"]
    assert step == dict(step_s=1.0, window_s=0.3, exposed_s=0.1, compute_s=pytest.approx(0.9))


def test_calibrated_link_lets_the_window_carry_all_but_the_tied_embedding():
    config = config_from_preset("tiny")
    params = list(build_model(config, seed=0).parameters())
    steady = sum(p.nbytes for p in params) - params[0].nbytes  # wte = lm_head, sent last
    no_link = {"0.0": [dict(window_s=9.0)], "25.0": [dict(window_s=w) for w in (0.1, 0.2, 0.3)]}
    link = parse(calibrated_link(no_link, config, "auto,500us"))
    assert link.latency == pytest.approx(500e-6)
    assert link.cost(steady) - link.latency == pytest.approx(0.2, rel=1e-3)  # the median window


def test_a_real_sweep_exposes_one_buckets_whole_transfer():
    """Two sizes, with and without a link: one bucket leaves when backward ends, so at least
    α + S/β of it is exposed (the link counts from the last rank's launch)."""
    run = sweep(
        link="100MB/s,1ms", bucket_mb=[0, 25], steps=2, warmup=1, no_link_too=True, progress=False
    )
    assert set(run.data["runs"]) == {"none", "100MB/s,1ms"}
    assert [len(run.buckets(mb)) for mb in (0, 25)] == [52, 1]
    assert sum(run.buckets(25)) == run.data["gradient_bytes"] == 1_340_928
    for key in ("step_s", "window_s", "exposed_s", "compute_s"):
        assert all(t > 0 for t in run.median(key) + run.median(key, "none")), key
    one_bucket = parse("100MB/s,1ms").cost(run.data["gradient_bytes"])
    assert run.median("exposed_s")[1] >= 0.95 * one_bucket
