"""A real machine's balance (hplab/runtime/balance.py, `--link h100-80g`): the data sheet's α
grows and its β shrinks by r, this machine's FLOP/s over the GPU's, so that a message's time
next to a step's compute is the machine's; r is measured on the run's model, the same on every
rank; a run on it trains bit for bit as without; a machine that is not one is refused in one
line before any process starts."""

from __future__ import annotations

import json
import re
import time

import pytest

from hplab.plan.presets import GB, GPU_PRESETS, Cluster, Efficiency
from hplab.runtime import balance, link
from hplab.runtime.wire import Link, Topology

H100 = GPU_PRESETS["h100-80g"]


def test_a_machine_is_read_with_its_nodes():
    assert balance.parse_machine("h100-80g") == balance.Machine(H100, 0)
    assert balance.parse_machine("h100-80g node=2") == balance.Machine(H100, 2)
    assert balance.parse_machine(" a100-80g;node=4 ").node == 4
    assert str(balance.parse_machine("h200  node=2")) == "h200 node=2"
    for numbers in ("20MB/s,200us", "node=2 inside=1GB/s between=1MB/s", "20 miles", "", None):
        assert balance.parse_machine(numbers) is None  # (link.parse_wire's to read)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("h100", "no machine 'h100': name one of a100-40g, a100-80g, h100-80g, h200, or give"),
        ("fast", "no machine 'fast'"),
        ("h100-80g node=0", "node=0 is not a number of ranks"),
        ("h100-80g node=-2", "node=-2 is not a number of ranks"),
        ("h100-80g node=two", "node=two is not a number of ranks"),
        ("h100-80g nodes=2", "after the machine only node=N"),
        ("h100-80g node=2 node=4", "after the machine only node=N"),
        ("h100-80g 2", "after the machine only node=N"),
    ],
)
def test_what_is_no_machine_is_one_line(text, says):
    with pytest.raises(link.LinkError, match=re.escape(says)) as caught:
        balance.parse_machine(text)
    assert "\n" not in str(caught.value)


def test_at_the_gpus_own_rate_the_network_is_the_data_sheets():
    eff, cluster = Efficiency(), Cluster(H100)
    gpu = H100.peak_tflops["fp32"] * 1e12 * eff.gemm
    one = balance.network(balance.Machine(H100), gpu, "fp32")
    nvlink = Link(H100.nvlink_gbps * GB * eff.comm, cluster.intra_latency_s)
    assert one.between is None
    assert one.inside.bandwidth == pytest.approx(nvlink.bandwidth, rel=1e-5)
    assert one.inside.latency == pytest.approx(nvlink.latency, rel=1e-5)
    two = balance.network(balance.Machine(H100, 2), gpu, "fp32")
    assert two.node == 2
    assert two.between.bandwidth == pytest.approx(H100.network_gbps * GB * eff.comm, rel=1e-5)
    assert two.between.latency == pytest.approx(cluster.inter_latency_s, rel=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_slower_machine_scales_alpha_up_and_beta_down_by_the_same_r(precision):
    gpu = balance.gpu_flops(balance.Machine(H100), precision)
    at_gpu = balance.network(balance.Machine(H100, 2), gpu, precision)
    r = 1e-3
    here = balance.network(balance.Machine(H100, 2), r * gpu, precision)
    for tier in ("inside", "between"):
        there, scaled = getattr(at_gpu, tier), getattr(here, tier)
        assert scaled.latency == pytest.approx(there.latency / r, rel=1e-5)
        assert scaled.bandwidth == pytest.approx(there.bandwidth * r, rel=1e-5)
        # every message's time is its time there over r: 1 MB, and 1 kB
        for nbytes in (1e6, 1e3):
            assert scaled.cost(nbytes) == pytest.approx(there.cost(nbytes) / r, rel=1e-5)


def test_a_machine_too_fast_for_this_one_is_refused_in_one_line():
    with pytest.raises(link.LinkError, match="outside what a link"):
        balance.network(balance.Machine(H100, 2), 1e6, "bf16")  # (1 MFLOP/s: α of hours)

    def work():  # 10 kFLOP in 10 ms: 1 MFLOP/s
        time.sleep(0.01)

    with pytest.raises(link.LinkError, match=r"at 0\.00\d+ GFLOP/s") as caught:
        balance.at_balance("h100-80g node=2", work, 1e4, "bf16")
    assert "latency would last over a second here" in str(caught.value)
    assert "\n" not in str(caught.value) and link.WIRE is None


def test_this_machines_rate_is_measured_on_the_work():
    def work():  # a stand-in of 1 GFLOP taking 20 ms
        time.sleep(0.02)

    rate = balance.measure_flops(work, 1e9, "cpu")
    assert 1e9 / 0.03 < rate <= 1e9 / 0.02


def test_a_plain_loop_with_a_machine_in_hplab_link_is_told_what_to_call(monkeypatch):
    from hplab.runtime.group import use_env_link

    monkeypatch.setenv("HPLAB_LINK", "h100-80g")
    with pytest.raises(link.LinkError, match="balance.at_balance after init_distributed"):
        use_env_link()
    with pytest.raises(link.LinkError, match="gives a link's numbers"):
        balance.at_balance("20MB/s", lambda: None, 1.0)


def test_a_bad_machine_is_one_line_before_any_process(capsys, monkeypatch):
    from hplab.train import main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "HPLAB_LINK"):
        monkeypatch.delenv(key, raising=False)
    assert main(["--nproc", "2", "--steps", "2", "--link", "h100 node=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hplab: error: --link 'h100 node=2': no machine 'h100'"), err
    assert err.count("\n") == 1, err


def test_a_run_on_a_machine_trains_as_without_and_records_its_balance(tmp_path):
    from test_link import train_cli

    done = train_cli(tmp_path, "--metrics", "plain.json", "--steps", "3")
    assert done.returncode == 0, done.stderr
    flags = ("--metrics", "h100.json", "--steps", "3", "--link", "h100-80g  node=1")
    done = train_cli(tmp_path, *flags)
    assert done.returncode == 0, done.stderr
    plain, h100 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "h100"))
    assert [s["loss"] for s in h100["steps"]] == [s["loss"] for s in plain["steps"]]
    assert plain["link_balance"] is None
    got = h100["link_balance"]
    assert h100["config"]["link"] == got["machine"] == "h100-80g node=1"
    assert got["scale"] == pytest.approx(got["here_flops_per_s"] / got["gpu_flops_per_s"])
    assert 0 < got["scale"] < 1e-2  # (a laptop's core: some tens of GFLOP/s, not TFLOP/s)
    wire = link.parse_wire(got["network"])
    machine = balance.parse_machine(got["machine"])
    assert wire == balance.network(machine, got["here_flops_per_s"], "fp32")
    assert isinstance(wire, Topology) and wire.node == 1 and wire.between is not None


@pytest.mark.parametrize(
    ("link_text", "says"),
    [
        ("h100", "--link 'h100': no machine 'h100'"),
        ("auto,5parsecs", "--link 'auto,5parsecs': give a bandwidth"),
        ("20 miles", "--link '20 miles': give a bandwidth"),
    ],
)
def test_the_bucket_sweep_refuses_a_bad_link_before_any_process(capsys, link_text, says):
    from hplab.course.bucket_sweep import link_problem, main

    assert link_problem("none") is None and link_problem("h100-80g node=1") is None
    assert main(["--nproc", "2", "--link", link_text, "--out", "never.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hplab: error: {says}") and err.count("\n") == 1, err


def test_the_collectives_benchmark_has_no_model_to_balance_on(capsys):
    from hplab.course.collectives_bench import main

    assert main(["--nproc", "2", "--link", "h100-80g"]) == 2
    err = capsys.readouterr().err
    assert "collectives have none; give a link's numbers" in err and err.count("\n") == 1, err


def test_plots_name_the_machine_and_time_messages_on_the_wire_it_gave():
    from hplab.course import viz

    comm = [{"send": {"bytes": 2e6, "calls": 2}}]  # 1 MB a message
    balance = {"machine": "h100-80g", "network": "250MB/s,6ms"}
    metrics = {"config": {"link": "h100-80g"}, "link_balance": balance, "world_size": 2}
    assert viz.under_the_link(metrics | {"comm": comm}) == " (at the h100-80g's balance)"
    assert viz.wire_of(metrics) == "250MB/s,6ms"
    assert viz.message_seconds(metrics | {"comm": comm}) == pytest.approx(6e-3 + 1e6 / 250e6)
    plain = {"config": {"link": "20MB/s,1ms"}, "link_balance": None, "world_size": 2}
    assert viz.under_the_link(plain) == " (emulated link 20MB/s,1ms)"
    assert viz.message_seconds(plain | {"comm": comm}) == pytest.approx(1e-3 + 1e6 / 20e6)
    assert viz.message_seconds({"config": {"link": None}}) == 0.0
    two = {"machine": "h100-80g node=1", "network": "node=1 inside=1GB/s between=1MB/s"}
    with pytest.raises(ValueError, match="span nodes"):
        viz.message_seconds(metrics | {"link_balance": two, "comm": comm})
