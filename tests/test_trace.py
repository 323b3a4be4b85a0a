"""`train.py --trace DIR`: a Chrome trace per rank of a real run, read back as a timeline, and the
overlap of communication with backward that it measures
(`hplab.course.timeline.hidden_fraction`)."""

import json

import pytest

from hplab.course.timeline import held_up, hidden_fraction, read_timeline, waits
from hplab.runtime.launch import run_distributed

FLAGS = ["--dp", "2", "--steps", "3", "--batch-size", "8", "--no-progress"]
# Each process converts its profiler's clock (the CPU's time-stamp counter) to wall time on its
# own, so two ranks' timestamps can disagree by a little: up to 1.5 µs measured here under load
# (a tiny all-reduce then seems to end just before the other rank began it). A wrong match of
# calls or a clock per process would be off by far more.
CLOCKS_AGREE_S = 20e-6


def _train_twice(folder):
    """Both runs in one 2-process launch: one bucket (sent when backward ends), then one bucket
    per parameter (sent as backward produces them)."""
    from hplab.train import parse_args, run

    for name, bucket_mb in (("one", "1000"), ("many", "0")):
        run(parse_args(FLAGS + ["--bucket-mb", bucket_mb, "--trace", f"{folder}/{name}"]))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    run_distributed(_train_twice, 2, str(folder))
    return folder


def test_a_chrome_trace_per_rank_with_hplab_and_gloo_events(traced):
    for rank in (0, 1):
        trace = json.loads((traced / "one" / f"rank{rank}.json").read_text())
        names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert {
            "step 1",
            "step 2",
            "forward model",
            "forward block 0",
            "forward head",
            "gloo:all_reduce",
            "wait all_reduce dp",
        } <= names  # step 0 is not traced
        assert "step 0" not in names and "step 3" not in names
        assert any(n.startswith("autograd::engine::evaluate_function:") for n in names)
        assert any(n.startswith("all_reduce dp ") and n.endswith(" B") for n in names)
        assert trace["distributedInfo"]["world_size"] == 2
    assert sorted(p.name for p in (traced / "many").iterdir()) == ["rank0.json", "rank1.json"]


def test_timeline_names_each_bucket_by_its_launch(traced):
    from hplab.models.gpt import build_model, config_from_preset

    model = build_model(config_from_preset("tiny"), 0)
    one, many = read_timeline(traced / "one"), read_timeline(traced / "many")
    for spans in one:  # one per traced step, of 4 × Ψ bytes (fp32 gradients)
        buckets = [s["name"] for s in spans if s["kind"] == "comm" and " B #" in s["name"]]
        assert buckets == [f"all_reduce dp {4 * model.config.num_params():,} B #1"] * 2
    for spans in many:  # a bucket per parameter tensor (the tied one once), two steps
        buckets = [s for s in spans if s["kind"] == "comm" and " B #" in s["name"]]
        assert len(buckets) == 2 * len(list(model.parameters()))
        assert all(s["end_s"] > s["start_s"] >= 0 for s in spans)


def test_one_bucket_hides_nothing_many_buckets_hide_some(traced):
    """One bucket starts when the last gradient is in: what remains of backward is the end of
    one hook, so ~0% (a few % of slack for a loaded machine). With a bucket per parameter the
    first ones run under the rest of backward on every rank."""
    one = [hidden_fraction(s, ops=("all_reduce",)) for s in read_timeline(traced / "one")]
    many = [hidden_fraction(s, ops=("all_reduce",)) for s in read_timeline(traced / "many")]
    assert max(one) < 0.1, one
    assert min(many) > 0.05 and min(many) > max(one), (one, many)


def test_plot_timeline_draws_each_rank_and_its_hidden_fraction(traced):
    import matplotlib

    matplotlib.use("Agg")
    from hplab import viz

    ax = viz.plot_timeline(traced / "many")
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute",
        "rank 0 comm",
        "rank 1 compute",
        "rank 1 comm",
    ]
    assert ax.get_title().startswith("hidden behind backward, per rank: ")
    assert ax.get_title().count("%") == 2


def test_hidden_fraction_on_hand_made_spans():
    def span(kind, a, b, name="all_reduce dp 4 B #1"):
        return dict(
            kind=kind,
            name=name,  # noqa
            start_s=a,
            end_s=b,
        )

    spans = [
        span("backward", 0, 10),
        span("wait", 8, 10),
        span("comm", 6, 12),
        span("comm", 7, 9),
        span("comm", 20, 22, "all_gather dp 4 B #1"),
    ]
    # all_reduce ran 6..12 (6 s); backward without waiting covers 6..8 (2 s)
    assert hidden_fraction(spans, ops=("all_reduce",)) == pytest.approx(2 / 6)
    assert hidden_fraction(spans) == pytest.approx(2 / 8)
    with pytest.raises(ValueError, match="no communication"):
        hidden_fraction(spans, ops=("send",))


def test_held_up_counts_the_blocked_time_a_later_rank_delayed_a_transfer():
    """Launched at 1 and waited for until it was through; the other rank launched it at 3, so
    the link ran it 3..5: blocked 1..5, held up 1..3. A reduce-scatter launched at 4 and the
    next gather, launched at 6, wait for this rank's own link (busy until 7), not another rank."""
    spans = [
        dict(kind="launch", name="all_gather dp 4 B", start_s=1.0, end_s=1.5),
        dict(kind="wait", name="wait all_gather dp", start_s=1.5, end_s=5.0),
        dict(kind="comm", name="all_gather dp 4 B #1", start_s=3.0, end_s=5.0, launched_s=1.0),
        dict(kind="comm", name="reduce_scatter dp 4 B #1", start_s=5.0, end_s=7.0, launched_s=4.0),
        dict(kind="comm", name="all_gather dp 4 B #2", start_s=7.0, end_s=8.0, launched_s=6.0),
        dict(kind="wait", name="wait all_gather dp", start_s=6.0, end_s=8.0),
    ]
    assert held_up(spans) == dict(blocked_s=pytest.approx(6.0), held_s=pytest.approx(2.0))
    assert held_up(spans, ops=("reduce_scatter",)) == dict(blocked_s=0.0, held_s=0.0)


def test_waits_of_a_real_run_on_one_clock(traced):
    """Both ranks' traces count from one clock: no rank's collective completes before the last
    rank launched it, to within CLOCKS_AGREE_S. The waits are parts of the blocked time; gloo's
    core wait is recorded."""
    for name in ("one", "many"):
        timeline = read_timeline(traced / name)
        comm = [
            [s for s in spans if s["kind"] == "comm" and " B #" in s["name"]] for spans in timeline
        ]
        early = [
            (c["name"], c["end_s"], max(o[i]["start_s"] for o in comm))
            for calls in comm
            for i, c in enumerate(calls)
            if c["end_s"] < max(o[i]["start_s"] for o in comm) - CLOCKS_AGREE_S
        ]
        assert not early, f"{name}: (call, its end, the last rank's start) {early}"
        for rank, w in enumerate(waits(traced / name, ops=("all_reduce",))):
            parts = ("launching_s", "other_rank_s", "running_s", "waking_s")
            assert w["blocked_s"] > 0 and all(w[p] >= 0 for p in parts) and w["running_s"] > 0
            assert sum(w[p] for p in parts) <= w["blocked_s"] + 1e-9, w
            recorded = json.loads((traced / name / f"rank{rank}.json").read_text())
            assert w["core_s"] == recorded["gloo_queued_s"] >= 0


def test_waits_on_hand_made_traces(tmp_path):
    """Each rank's launch takes 1 µs, gloo's thread begins the call 0.5 µs into it, and the
    caller returns 0.5 µs after the call is done. Rank 0 launches at 0 and waits at once: 0.5
    launching, 6 for rank 1 (whose gloo begins at 6.5), 3.5 running, 0.5 waking up. Rank 1
    launches at 6 and computes from 7 to 8 before it waits: that 1 µs of the call is hidden."""

    def trace(start, waited, queued, op="all_reduce"):
        def x(name, a, b, cat="cpu_op"):
            return dict(
                ph="X",
                name=name,
                ts=a,
                dur=b - a,  # noqa
                cat=cat,
            )

        return dict(
            distributedInfo=dict(world_size=2),
            gloo_queued_s=queued,
            traceEvents=[
                x(f"{op} dp 4 B", start, start + 1, "user_annotation"),
                x(f"gloo:{op}", start + 0.5, 10),
                x(f"wait {op} dp", waited, 10.5),
            ],
        )

    for rank, args in enumerate([(0, 1, 0.5), (6, 8, 0.25)]):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(trace(*args)))
    (r0, r1) = waits(tmp_path)
    assert r0 == pytest.approx(
        dict(
            blocked_s=10.5e-6,
            launching_s=0.5e-6,
            other_rank_s=6e-6,
            running_s=3.5e-6,
            waking_s=0.5e-6,
            hidden_s=0,
            core_s=0.5,
        )
    )
    assert r1 == pytest.approx(
        dict(
            blocked_s=3.5e-6,
            launching_s=0.5e-6,
            other_rank_s=0,
            running_s=2.5e-6,
            waking_s=0.5e-6,
            hidden_s=1e-6,
            core_s=0.25,
        )
    )
    (tmp_path / "rank1.json").write_text(json.dumps(trace(6, 8, 0, "all_gather")))
    with pytest.raises(ValueError, match="launched different collectives"):
        waits(tmp_path)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: d.write_text("mine"), "holds other files than hplab's traces"),
        (lambda d: (d.mkdir(), (d / "notes.txt").write_text("mine")), "holds other files"),
    ],
)
def test_a_trace_target_holding_other_files_is_refused_before_launch(
    tmp_path, capsys, monkeypatch, make, says
):
    from hplab.train import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    target = tmp_path / "trace"
    make(target)
    before = sorted(p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    assert main(["--nproc", "2", "--steps", "1", "--trace", str(target)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hplab: error: --trace") and says in lines[0]
    assert sorted(p.read_text() for p in tmp_path.rglob("*") if p.is_file()) == before
