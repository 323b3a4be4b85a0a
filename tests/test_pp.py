"""Pipeline parallel trains exactly the model one process trains, on every schedule.

Two kinds of checks:
* pure (no processes): the action lists of every schedule — order, matching sends and
  receives, no deadlock (simulated for p ≤ 8, m ≤ 16), bubble = formula with unit costs;
* distributed: one launch on 2 processes and one on 4 run every schedule for 3 steps and
  return losses, parameters, traces; the tests compare them with one process on the same
  global batch, and with torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B.

Relative error of a tensor is ||a - b|| / ||b||; the fp32 tolerance is 1e-5.
"""

import functools
import itertools

import pytest
import torch

from hplab.course.timeline import idle_between_actions
from hplab.models import gpt as gpt_model
from hplab.observe.observers import measured_bubble
from hplab.parallel import pp
from hplab.plan.simulate import DeadlockError, simulate
from hplab.runtime.launch import run_distributed

TOL = 1e-5
STEPS = 3
PER_MICROBATCH = 2  # sequences per microbatch (per data-parallel rank)
SEQ, VOCAB = 16, 256


def rel(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# =========================================================================================
# Action lists and the simulator (no processes)
# =========================================================================================


def all_schedules(max_p=8, max_m=16):
    for p in range(2, max_p + 1):
        for m in range(1, max_m + 1):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            yield "zb-h1", p, m, 1
            if m % p == 0:
                for v in (2, 3):
                    yield "interleaved", p, m, v


def test_every_compute_action_once_and_in_order():
    for name, p, m, v in all_schedules():
        plans = pp.build_schedule(name, p, m, v)
        for r, plan in enumerate(plans):
            position = {
                (a.kind, a.microbatch, a.chunk): i
                for i, a in enumerate(plan)
                if a.kind in pp.COMPUTE
            }
            kinds = ("F", "B", "W") if name == "zb-h1" else ("F", "B")
            chunks = range(r, p * v, p)
            assert len(position) == len(kinds) * m * len(chunks), (name, p, m, v, r)
            for mb, c in itertools.product(range(m), chunks):
                order = [position[(k, mb, c)] for k in kinds]
                assert order == sorted(order), f"{name} p={p} m={m}: rank {r} mb {mb}"


def test_every_send_has_its_receive_in_the_same_order():
    for name, p, m, v in all_schedules():
        plans = pp.build_schedule(name, p, m, v)
        sent, received = {}, {}
        for r, plan in enumerate(plans):
            for a in plan:
                if a.kind.startswith("send"):
                    sent.setdefault((r, a.peer), []).append(pp.message_key(a))
                elif a.kind.startswith("recv"):
                    received.setdefault((a.peer, r), []).append(pp.message_key(a))
        assert sent == received, (name, p, m, v)
        # every chunk boundary carries one activation and one gradient per microbatch
        assert sum(len(k) for k in sent.values()) == 2 * m * (p * v - 1)


def test_no_schedule_deadlocks():
    """Simulation finishes for p ≤ 8, m ≤ 16 (it raises DeadlockError otherwise), also with
    uneven costs and a message latency."""
    count = 0
    for name, p, m, v in all_schedules():
        plans = pp.build_schedule(name, p, m, v)
        for costs in ((1, 1, 1), (1, 3, 0.5)):
            sim = simulate(plans, *costs, latency=0.3)
            assert sim.makespan > 0
            count += 1
    assert count > 600


def test_simulator_detects_a_deadlock():
    # rank 1 runs microbatch 1 first; rank 0 sends it only after microbatch 0's backward,
    # which needs rank 1's gradient of microbatch 0: each waits for the other
    orders = [
        [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)],
        [("F", 1, 1), ("B", 1, 1), ("F", 0, 1), ("B", 0, 1)],
    ]
    with pytest.raises(DeadlockError, match="rank 0 waits at B0.*rank 1 waits at F1"):
        simulate(pp.add_communication(orders, 2, 1))
    bad = [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 1), ("F", 0, 1)]]
    with pytest.raises(DeadlockError, match="before its F"):
        simulate(pp.add_communication(bad, 2, 1))


def test_simulated_bubble_equals_the_formula():
    """Unit costs (F = B = W = 1): every rank's idle share of the step is the textbook
    bubble exactly — (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm) of the compute for
    interleaved, (p-1)/(3m) of the compute for ZB-H1 (for m ≥ p)."""
    for name, p, m, v in all_schedules():
        if name == "zb-h1" and m < p:
            continue
        sim = simulate(pp.build_schedule(name, p, m, v))
        expected = pp.bubble_formula(name, p, m, v)["of_step"]
        for r in range(p):
            assert sim.bubble_fraction(r) == pytest.approx(expected, abs=1e-12), (name, p, m, v)
    assert pp.bubble_formula("gpipe", 4, 4)["of_step"] == pytest.approx(3 / 7)
    zb, f1b = pp.bubble_formula("zb-h1", 4, 8), pp.bubble_formula("1f1b", 4, 8)
    assert zb["relative"] == pytest.approx(f1b["relative"] / 3)


def test_simulated_in_flight_microbatches():
    for p, m in ((2, 5), (4, 8), (8, 16)):
        gpipe = simulate(pp.build_schedule("gpipe", p, m))
        f1b = simulate(pp.build_schedule("1f1b", p, m))
        zb = simulate(pp.build_schedule("zb-h1", p, m))
        for r in range(p):
            assert gpipe.in_flight_max(r) == m
            assert f1b.in_flight_max(r) == min(p - r, m)
            assert zb.in_flight_max(r) <= p  # held until W; 1F1B's peak (rank 0)


def test_replay_of_a_measured_step_uses_its_stage_costs_and_message_delay():
    """A hand-made GPipe trace, p=2, m=1, with unequal stages (F 1 and 2 time units) and
    messages that arrive 0.5 after their send: the costs read back from it are exactly those,
    and replaying them in the simulator gives back the trace's own bubbles (2/3 and 1/2)."""
    from hplab import viz

    def event(kind, start, end, chunk, mb=0):
        return dict(kind=kind, microbatch=mb, chunk=chunk, start_s=start, end_s=end)

    trace = [
        [event("F", 0, 1, 0), event("send", 1, 1, 0), event("recv", 1, 5, 0), event("B", 5, 6, 0)],
        [
            event("recv", 0, 1.5, 1),
            event("F", 1.5, 3.5, 1),
            event("B", 3.5, 4.5, 1),
            event("send", 4.5, 4.5, 1),
        ],
    ]
    run = {
        "pipeline": dict(schedule="gpipe", stages=2, microbatches=1, virtual_stages=1, trace=trace)
    }
    costs = viz.simulated_costs(run["pipeline"], per_chunk=True)
    assert costs == dict(f=[1, 2], b=[1, 1], w=[0.0, 0.0], latency=0.5)
    measured = [measured_bubble(events, 0.0, 6.0) for events in trace]
    assert viz.replayed_bubbles(run) == pytest.approx(measured) == [2 / 3, 1 / 2]
    assert viz.replayed_bubbles(run, each_action=True) == pytest.approx(measured)
    plans = pp.build_schedule("interleaved", 2, 4, 2)  # a list gives each of the 4 chunks' cost
    assert (
        simulate(plans, f=[0.5] * 4, b=[1] * 4, w=[0] * 4).makespan
        == simulate(plans, f=1, b=2, w=0).makespan
    )  # a number: a whole stage's, v chunks share it


def test_a_rendezvous_message_leaves_when_its_receive_is_posted():
    """GPipe, p = 2, m = 2, F = B = 1, latency 0.5: rank 1 posts the receive of microbatch 1
    after F0 ends (2.5), later than its send (2): that message arrives at 3.0, not 2.5."""
    plans = pp.build_schedule("gpipe", 2, 2)
    for rendezvous, arrives in ((False, 2.5), (True, 3.0)):
        sim = simulate(plans, f=1, b=1, w=0, latency=0.5, rendezvous=rendezvous)
        starts = {str(a): start for a, start, _ in sim.timeline[1] if a.kind == "F"}
        assert starts == {"F0.1": 1.5, "F1.1": arrives}


def test_a_link_replay_takes_each_messages_time_from_the_link():
    """Under an emulated link a message takes α + n/β (n: one send's bytes from the ledger);
    the replay takes that in place of the measured delay (also when each action takes its own
    measured time), and a plot's title names the link."""
    from hplab import viz

    def event(kind, start, end, chunk):
        return dict(kind=kind, microbatch=0, chunk=chunk, start_s=start, end_s=end)

    trace = [
        [event("F", 0, 1, 0), event("send", 1, 1, 0), event("recv", 1, 5, 0), event("B", 5, 6, 0)],
        [event("recv", 0, 1.5, 1), event("F", 1.5, 2.5, 1), event("B", 2.5, 3.5, 1)]
        + [event("send", 3.5, 3.5, 1)],
    ]
    pipeline = dict(schedule="gpipe", stages=2, microbatches=1, virtual_stages=1, trace=trace)
    run = {
        "config": {"link": "1MB/s,1ms"},
        "comm": [{"send": {"calls": 4, "bytes": 4000}}],  # 1,000 B a message
        "pipeline": pipeline,
    }
    assert viz.message_seconds(run) == pytest.approx(1e-3 + 1000 / 1e6)  # α + n/β = 2 ms
    assert viz.message_seconds({"config": {"link": None}}) == 0.0
    assert viz.under_the_link(run) == " (emulated link 1MB/s,1ms)"
    # F 1 + message + F 1 + B 1 + message + B 1: 4 + 2c, of which each rank computes 2
    c = 0.25

    def expected_at(c):
        return 1 - 2 / (4 + 2 * c)

    expected = expected_at(c)
    assert viz.replayed_bubbles(run, latency=c) == pytest.approx([expected, expected])
    assert viz.replayed_bubbles(run) == pytest.approx([2 / 3, 2 / 3])  # delays 0.5, 1.5: 1
    assert viz.replayed_bubbles(run, each_action=True, latency=c) == pytest.approx(
        [expected, expected]
    )  # (each action as long as it took: as long as the medians here)
    measured = run | {"pipeline": pipeline | {"bubble_fraction": [0.6, 0.5]}}
    ax = viz.plot_pipeline_bubbles({"gpipe": measured})
    heights = sorted(round(bar.get_height(), 6) for bar in ax.patches)
    want = [0.55, 2 / 3, expected_at(viz.message_seconds(run)), 0.5]  # measured, replays, formula
    assert heights == pytest.approx(sorted(want))
    assert ax.get_title().endswith("(emulated link 1MB/s,1ms)")


def test_idle_between_actions_is_what_no_replay_sees():
    """Rank 0 starts its step 0.5 after rank 1, pauses 0.5 before a wait of 3 for a message
    (left out: the message kept it idle anyway) and 0.5 after it: 1 of the step's 6.5 time
    units. Rank 1 pauses only before a message that was already there. Overlaps count once."""
    from hplab import viz

    def event(kind, start, end, chunk=0):
        return dict(kind=kind, microbatch=0, chunk=chunk, start_s=start, end_s=end)

    late = [
        event("F", 0.5, 1.5),
        event("send", 1.5, 1.5),
        event("recv", 2, 5),
        event("B", 5.5, 6.5),
    ]
    steady = [
        event("F", 0, 1.5, 1),
        event("recv", 2, 2 + 1e-5, 1),
        event("B", 2, 4, 1),
        event("send", 3.9, 4.5, 1),
    ]
    assert idle_between_actions(late, 0.0, 6.5) == pytest.approx(1 / 6.5)
    assert idle_between_actions(steady) == pytest.approx(0.5 / 4)  # ends at its last B
    assert viz.idle_shares({"pipeline": dict(trace=[late, steady])}) == pytest.approx(
        [1 / 6.5, 0.5 / 6.5]
    )


def test_replaying_each_action_gives_back_a_run_whose_microbatches_differ():
    """A trace written the way the executor writes one (a wait before the F or B it feeds),
    from a simulation where every action and message has a cost of its own: the median costs
    per chunk miss its bubbles, its own costs give them back exactly."""
    from hplab import viz
    from hplab.parallel.schedule import input_message

    plans = pp.build_schedule("1f1b", 2, 4)
    own = {a: 1.0 + 0.5 * a.microbatch**2 for plan in plans for a in plan if a.kind in "FB"}
    own |= {
        pp.message_key(a): 0.2 * (1 + a.microbatch)
        for plan in plans
        for a in plan
        if a.kind.startswith("send")
    }
    sim = simulate(plans, own=own)
    trace = []
    for lane in sim.timeline:
        events, clock = [], 0.0
        for a, start, end in lane:
            if a.kind.startswith("recv"):
                continue
            if a.kind in "FB" and input_message(a, 2) is not None:
                events.append(
                    dict(
                        kind="recv",
                        microbatch=a.microbatch,
                        chunk=a.chunk,
                        start_s=clock,
                        end_s=start,
                    )
                )
            events.append(
                dict(
                    kind="send" if a.kind.startswith("send") else a.kind,
                    microbatch=a.microbatch,
                    chunk=a.chunk,
                    start_s=start,
                    end_s=end,
                )
            )
            clock = end
        trace.append(events)
    run = {
        "pipeline": dict(schedule="1f1b", stages=2, microbatches=4, virtual_stages=1, trace=trace)
    }
    bubbles = [sim.bubble_fraction(r) for r in range(2)]
    assert viz.replayed_bubbles(run, each_action=True) == pytest.approx(bubbles)
    assert viz.replayed_bubbles(run) != pytest.approx(bubbles, abs=0.02)


def test_schedule_errors_are_clear():
    from hplab.config import LayoutError

    with pytest.raises(LayoutError, match="multiple of 4"):
        pp.build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(LayoutError, match="only 4 layers"):
        pp.split_layers(4, 8)
    with pytest.raises(LayoutError, match="needs --schedule interleaved"):
        pp.build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(LayoutError, match="at least 1"):
        pp.build_schedule("gpipe", 2, 0)
    assert [len(r) for r in pp.split_layers(10, 4)] == [3, 3, 2, 2]


def test_a_split_backward_under_the_memory_watch_frees_its_graph():
    """train.py counts each F's saved bytes (MemoryLedger.track_activations). A node that saves
    its own output (tanh, softmax) must not get that output back from the counting hook: it
    would hold itself, and a graph kept for W (retain_graph) would never be freed — ZB-H1's
    last stage grew by the whole graph every microbatch (about 100 MB a step at h = 256)."""
    import gc
    import weakref

    from hplab.observe.memory import MemoryLedger

    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    ledger = MemoryLedger()
    with ledger.track_activations(exclude=layer.parameters()) as counted:
        h = torch.tanh(layer(x))  # tanh saves h itself
        loss = (h * h).sum()
    assert counted[0] > 0
    grad_x, work = pp.backward_input(loss, None, x, list(layer.parameters()))
    pp.backward_weight(work)
    expected = torch.autograd.grad((torch.tanh(layer(x)) ** 2).sum(), [x, layer.weight])
    assert torch.allclose(grad_x, expected[0], rtol=TOL) and torch.allclose(
        layer.weight.grad, expected[1], rtol=TOL
    )
    kept = weakref.ref(h)
    del h, loss, work
    gc.collect()
    assert kept() is None, "the graph (and the activation it saved) outlived its backward"


# =========================================================================================
# The executor on its own (no hplab.parallel): split backward for any layer, grads None or
# accumulated — one launch on 4 processes (pp 2 × dp 2, then pp 2 × tp 2)
# =========================================================================================

EXEC_LAYERS, EXEC_M = 4, 4


class _HandWrittenLinear(torch.autograd.Function):
    """y = x Wᵀ + b with a hand-written backward: a custom autograd layer, as tensor
    parallel's are — nothing the old nn.Linear patch would have recognised."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        return dy @ weight, dy2.t() @ x2, dy2.sum(0)


class _NotALinear(torch.nn.Module):
    """The same weight and bias (same names), applied through F.linear (like tp's
    Column/RowParallelLinear) or through `_HandWrittenLinear`."""

    def __init__(self, linear, how):
        super().__init__()
        self.weight, self.bias, self.how = linear.weight, linear.bias, how

    def forward(self, x):
        if self.how == "function":
            return _HandWrittenLinear.apply(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def exec_model(layers):
    """hplab's GPT whose blocks' Linear layers are replaced as `layers` says ("nn.Linear",
    "F.linear", "function"); "+recompute" adds activation recomputation."""
    from hplab.models.gpt import build_model

    model = build_model(config(EXEC_LAYERS), seed=0)
    how = layers.split("+")[0]
    if how != "nn.Linear":
        for name, module in list(model.transformer.h.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent, _, child = name.rpartition(".")
                setattr(
                    model.transformer.h.get_submodule(parent),
                    child,
                    _NotALinear(module, "function" if how == "function" else "F.linear"),
                )
    model.recompute = layers.endswith("+recompute")
    return model


def exec_batch():
    x, y = global_batches(PER_MICROBATCH * EXEC_M)[0]
    return list(x.chunk(EXEC_M)), list(y.chunk(EXEC_M))


@functools.cache
def exec_reference(layers):
    """One process: the same microbatches, loss / m each, gradients accumulated."""
    model = exec_model(layers)
    for x, y in zip(*exec_batch(), strict=True):
        (model(x, y)[1] / EXEC_M).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def exec_run(mesh, schedule, layers, tp_plan=False, ahead=0):
    """Run one step with the executor alone (grads None before), record during which kind of
    action (F, B, W) each weight gradient was accumulated, then a second step on top (grads
    must double: the executor accumulates, it never zeroes)."""
    from hplab.observe.observers import PipelineTrace
    from hplab.parallel import tp

    model = exec_model(layers)
    if tp_plan:
        tp.parallelize(model, mesh.tp, gpt_model.TP_PLAN)
    stages = pp.build_stages(model, mesh.pp_rank, mesh.pp_size)
    pp.free_unowned_parameters(model, stages)
    params = {n: p for n, p in model.named_parameters() if p.numel() > 0}
    assert all(p.grad is None for p in params.values())
    plans = pp.build_schedule(schedule, mesh.pp_size, EXEC_M)
    plan = plans[mesh.pp_rank]
    links = pp.message_links(mesh, plans)
    tied = pp.tied_embedding_group(mesh)
    executor = pp.PipelineExecutor(
        stages, plan, mesh.pp, links, post_receives_ahead=ahead, tied=tied
    )
    watched = PipelineTrace(executor)
    compute = [a.kind for a in plan if a.kind in pp.COMPUTE]
    during = {}

    def now():  # the compute action running: the next one the trace has not finished
        return compute[sum(e["kind"] in pp.COMPUTE for e in watched.actions)]

    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: during.setdefault(n, set()).add(now()))
        for n, p in params.items()
    ]
    executor.run(*exec_batch())
    for h in hooks:
        h.remove()
    once = {n: p.grad.clone() for n, p in params.items()}
    executor.run(*exec_batch())
    twice = max(rel(p.grad, 2 * once[n]) for n, p in params.items())
    return {
        "grads": {n: g.numpy() for n, g in once.items()},
        "during": during,
        "twice": twice,
        "first": mesh.pp_rank == 0,
    }


def plain_loop_run(mesh, wrapper: str, m: int = EXEC_M) -> dict:
    """The stages, the executor and a data-parallel wrapper in an ordinary loop, as a user
    writes it without hplab's trainer: `run`, `step`, `zero_grad`, nothing in between (the
    executor sums the tied embedding's two copies; DDP, or ZeRO-2, averages over dp)."""
    import hplab
    from hplab.models.gpt import build_model
    from hplab.training import ADAMW

    model = build_model(config(EXEC_LAYERS), seed=0)
    stages = pp.build_stages(model, mesh.pp_rank, mesh.pp_size)
    pp.free_unowned_parameters(model, stages)
    params = pp.stage_parameters(stages)
    settings = dict(lr=1e-3, weight_decay=0.1, **ADAMW)
    if wrapper == "DDP":
        hplab.DDP(torch.nn.ModuleList(stages), mesh.dp)
        opt = torch.optim.AdamW(params, **settings)
    else:  # ZeRO-2 frees gradients in backward, but keeps the tied one for the executor's sum
        opt = hplab.ZeroOptimizer(params, torch.optim.AdamW, mesh.dp, stage=2, **settings)
    plans = pp.build_schedule("1f1b", mesh.pp_size, m)
    links = pp.message_links(mesh, plans)
    executor = pp.PipelineExecutor(
        stages, plans[mesh.pp_rank], mesh.pp, links, tied=pp.tied_embedding_group(mesh)
    )
    for x, y in global_batches(PER_MICROBATCH * m * mesh.dp_size):
        half = slice(mesh.dp_rank * PER_MICROBATCH * m, (mesh.dp_rank + 1) * PER_MICROBATCH * m)
        executor.run(list(x[half].chunk(m)), list(y[half].chunk(m)))
        opt.step()
        opt.zero_grad()
    return own_params(model)


def pipeline_refusals(mesh) -> dict[str, str]:
    """What refuses a stage holding a copy of the tied embedding, in one line each."""
    import hplab
    from hplab.models.gpt import build_model

    refusals = {}
    stages = pp.build_stages(build_model(config(EXEC_LAYERS), seed=0), mesh.pp_rank, 2)
    plan = pp.build_schedule("1f1b", 2, EXEC_M)[mesh.pp_rank]
    for name, make in (
        ("executor without tied", lambda: pp.PipelineExecutor(stages, plan, mesh.pp, {})),
        ("fully_shard", lambda: hplab.fully_shard(stages[0], mesh.dp)),
    ):
        try:
            make()
        except ValueError as refusal:
            refusals[name] = str(refusal)
    return refusals


def _executor_worker():
    import torch.distributed as dist

    from hplab.parallel.mesh import Mesh

    torch.set_num_threads(1)
    out = {}
    mesh = Mesh(dp=2, pp=2)  # the two dp replicas run the same data: twice the check
    for wrapper in ("DDP", "ZeRO-2"):
        out[("plain loop", wrapper)] = plain_loop_run(mesh, wrapper)
    out["refusals"] = pipeline_refusals(mesh)
    for layers in ("nn.Linear", "F.linear", "function", "function+recompute"):
        for schedule in ("1f1b", "zb-h1"):
            out[(schedule, layers)] = exec_run(mesh, schedule, layers)
    for schedule in ("gpipe", "1f1b", "zb-h1"):  # receives posted ahead: the same numbers
        for ahead in (0, 2):
            out[(schedule, "ahead", ahead)] = exec_run(mesh, schedule, "nn.Linear", ahead=ahead)
    mesh = Mesh(tp=2, pp=2)
    for schedule in ("1f1b", "zb-h1"):
        out[(schedule, "tp")] = exec_run(mesh, schedule, "nn.Linear", tp_plan=True)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def executor_runs():
    return run_distributed(_executor_worker, 4)


EXEC_LAYER_KINDS = ("nn.Linear", "F.linear", "function", "function+recompute", "tp")


def test_zb_h1_defers_every_weight_gradient_to_w(executor_runs):
    """ZB-H1's B computes only the input gradient, for any layer — nn.Linear, F.linear in
    another module, a hand-written autograd.Function, under recomputation, and tensor
    parallel's column/row layers: every weight gradient is accumulated during a W (on the
    first stage, whose B has no input gradient to compute, W runs the whole backward). 1F1B
    accumulates them during B."""
    for layers in EXEC_LAYER_KINDS:
        for r, res in enumerate(executor_runs):
            zb, f1b = res[("zb-h1", layers)], res[("1f1b", layers)]
            assert zb["during"] and all(k == {"W"} for k in zb["during"].values()), (
                layers,
                r,
                zb["during"],
            )
            assert all(k == {"B"} for k in f1b["during"].values()), (layers, r)
            assert zb["during"].keys() == f1b["during"].keys()


def test_executor_gradients_equal_one_process(executor_runs):
    """After one step (grads None before), each rank's gradients are one process's, the tied
    embedding's on both of its copies (first and last stage: the executor summed their parts).
    ZB-H1 equals 1F1B; under tensor parallel (slices: compared with 1F1B on the same rank) too."""
    for layers in EXEC_LAYER_KINDS:
        for res in executor_runs:
            zb, f1b = res[("zb-h1", layers)]["grads"], res[("1f1b", layers)]["grads"]
            assert zb.keys() == f1b.keys()
            for n in zb:
                assert rel(zb[n], f1b[n]) < TOL, (layers, n)
        if layers == "tp":
            continue
        ref = exec_reference(layers)
        for schedule in ("1f1b", "zb-h1"):
            for stage0, stage1 in ((0, 2), (1, 3)):  # ranks of one pipeline (dp 0, dp 1)
                first = executor_runs[stage0][(schedule, layers)]["grads"]
                last = executor_runs[stage1][(schedule, layers)]["grads"]
                for n, g in ref.items():
                    copies = [torch.as_tensor(grads[n]) for grads in (first, last) if n in grads]
                    assert copies and all(rel(got, g) < TOL for got in copies), (schedule, n)


def test_receives_posted_ahead_change_when_messages_cross_not_what_they_carry(executor_runs):
    """`post_receives_ahead=2`: each receive posted two computations before it is needed (the
    message crosses while the rank computes); the gradients are bit for bit the same."""
    for res in executor_runs:
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            early, late = (res[(schedule, "ahead", a)]["grads"] for a in (2, 0))
            assert early.keys() == late.keys()
            assert all((early[n] == late[n]).all() for n in late), schedule


def test_receives_ahead_moves_each_receive_past_computations_keeping_their_order():
    plan = pp.build_schedule("1f1b", 2, 4)[1]
    for ahead in (0, 1, 3):
        moved = pp.receives_ahead(plan, ahead)
        assert sorted(map(str, moved)) == sorted(map(str, plan))  # the same actions
        assert [a for a in moved if a.kind[:4] != "recv"] == [
            a for a in plan if a.kind[:4] != "recv"
        ]
        assert [a for a in moved if a.kind[:4] == "recv"] == [
            a for a in plan if a.kind[:4] == "recv"
        ]
        for a in (a for a in plan if a.kind.startswith("recv")):  # computations it moved past
            before = [x for x in plan[: plan.index(a)] if x.kind in pp.COMPUTE]
            now = [x for x in moved[: moved.index(a)] if x.kind in pp.COMPUTE]
            assert len(before) - len(now) <= ahead
        assert (moved != plan) == (ahead > 0)  # (some receive did move)
    assert pp.receives_ahead(plan, 0) == plan
    first_needed = next(a for a in plan if a.kind.startswith("recv"))
    assert pp.receives_ahead(plan, 1)[0] == first_needed  # (nothing to compute before it)


def test_executor_accumulates_into_existing_gradients(executor_runs):
    for res in executor_runs:
        for key, run in res.items():
            if "twice" in run:
                assert run["twice"] < TOL, key


def test_an_ordinary_loop_around_the_executor_trains_one_processs_model(executor_runs):
    """pp 2 × dp 2, 1F1B, AdamW for 3 steps with hplab.DDP or ZeroOptimizer(stage=2) and no
    call between `run` and `step`: each rank's weights (the tied embedding's two copies
    included) are one process's on the whole batch."""
    _, ref = reference_run(EXEC_LAYERS, PER_MICROBATCH * EXEC_M * 2, EXEC_M * 2)
    for wrapper in ("DDP", "ZeRO-2"):
        for first, last in ((0, 2), (1, 3)):  # the ranks of one pipeline (dp 0, dp 1)
            a, b = (executor_runs[r][("plain loop", wrapper)] for r in (first, last))
            tied = set(a) & set(b)
            assert tied == {"transformer.wte.weight"}, tied  # (the LM head's, by its first name)
            assert all((a[n] == b[n]).all() for n in tied), wrapper  # the copies agree
            assert worst_param_error(a | b, ref) < TOL, wrapper


def test_a_stage_with_a_tied_copy_is_refused_without_its_group(executor_runs):
    """The executor needs the first and last stage's group to sum the tied gradient, and
    fully_shard would keep only a shard of that gradient: each refuses in one line."""
    for res in executor_runs:
        refusals = res["refusals"]
        assert set(refusals) == {"executor without tied", "fully_shard"}, refusals
        assert all("\n" not in line and "tied" in line for line in refusals.values())
        assert "tied_embedding_group" in refusals["executor without tied"]


# =========================================================================================
# Real runs on 2 and 4 processes
# =========================================================================================


def make_args(*flags):
    from hplab.cli import build_parser

    return build_parser().parse_args(["--weight-decay", "0.1", *flags])


def config(n_layer):
    from hplab.models.gpt import GPTConfig

    return GPTConfig(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=n_layer, n_head=2)


def global_batches(batch):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (STEPS, batch, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@functools.cache  # the same for every schedule: compute it once
def reference_run(n_layer, batch, microbatches=1, clip=0.0):
    """One process, the whole global batch, cut into the same microbatches as the pipeline
    (gradient accumulation of loss / microbatches); also checked against one backward on the
    whole batch (`whole_batch_loss`)."""
    from hplab.models.gpt import build_model
    from hplab.training import make_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only fight the busy machine
    model = build_model(config(n_layer), seed=0)
    opt = make_optimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for x, y in global_batches(batch):
        total = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            _, loss = model(xm, ym)
            (loss / microbatches).backward()
            total += float(loss.detach()) / microbatches
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    torch.set_num_threads(threads)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def whole_batch_loss(n_layer, batch):
    """The first step's loss as one forward over the whole batch."""
    from hplab.models.gpt import build_model

    model = build_model(config(n_layer), seed=0)
    x, y = global_batches(batch)[0]
    with torch.no_grad():
        return float(model(x, y)[1])


def worst_param_error(got: dict, ref: dict) -> float:
    """Largest per-tensor relative error, and the whole model's (all tensors as one vector).

    One slice is left out of the per-tensor check: the key part of each attention c_attn
    bias. Softmax ignores a shift shared by all keys, so its true gradient is exactly 0 and
    the computed one is float noise (~1e-10); Adam divides by sqrt(v), which turns that noise
    into lr-sized steps of random sign. Two runs whose gradients differ only in summation
    order (a pipeline and one process; also torch.distributed.pipelining and one process)
    then differ there by ~1e-4 relative. It is still inside the whole-model check."""
    n_embd = config(1).n_embd
    worst, diff, norm = 0.0, 0.0, 0.0
    for name, r in ref.items():
        g, r = torch.as_tensor(got[name]), torch.as_tensor(r).detach()
        diff, norm = diff + float((g - r).pow(2).sum()), norm + float(r.pow(2).sum())
        if name.endswith("attn.c_attn.bias"):
            keep = torch.ones_like(r, dtype=torch.bool)
            keep[n_embd : 2 * n_embd] = False
            g, r = g[keep], r[keep]
        worst = max(worst, rel(g, r))
    return max(worst, (diff / norm) ** 0.5)


def own_params(model):
    """The parameters this rank kept, as numpy arrays (tensors do not cross the result queue
    of a finished process)."""
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters() if p.numel() > 0}


def run_hplab(n_layer, pp_size, dp, schedule, m, v=1, extra=()):
    from hplab.cli import layout_of, optim_of
    from hplab.models.gpt import build_model
    from hplab.observe.observers import MemoryWatch, PipelineTrace
    from hplab.parallel.compose import parallelize
    from hplab.parallel.mesh import Mesh
    from hplab.training import (
        TrainState,
        build_lr_scheduler,
        build_optimizer,
        mark_no_decay,
        train_step,
    )

    mesh = Mesh(dp=dp, pp=pp_size)
    args = make_args(
        "--pp",
        str(pp_size),
        "--dp",
        str(dp),
        "--schedule",
        schedule,
        "--microbatches",
        str(m),
        "--virtual-stages",
        str(v),
        "--batch-size",
        str(PER_MICROBATCH * m * dp),
        *extra,
    )
    model = build_model(config(n_layer), seed=0)
    layout = layout_of(args)
    optim = optim_of(args)
    if optim.no_decay_bias_norm:  # by role, while the model is whole
        mark_no_decay(model)
    stages = parallelize(model, mesh, layout)
    optimizer = build_optimizer(stages, mesh, layout, optim)
    scheduler = build_lr_scheduler(optimizer, optim)
    engine = TrainState(stages, optimizer, scheduler, mesh, layout, optim)
    trace, memory = PipelineTrace(engine.pipeline), MemoryWatch(engine)  # (the trace outside)
    losses = []
    for x, y in global_batches(PER_MICROBATCH * m * dp):
        share = x.shape[0] // dp
        sl = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
        losses.append(train_step(engine, x[sl], y[sl]))
    return {
        "losses": losses,
        "params": own_params(model),
        "report": trace.report(mesh.pp, memory),
        "memory": memory.ledger.as_dict(),
    }


def run_torch_pipelining(n_layer, p, schedule, m):
    """The same model split the same way, run by torch.distributed.pipelining."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from hplab.config import Layout, OptimConfig
    from hplab.models.gpt import build_model
    from hplab.parallel.mesh import Mesh
    from hplab.parallel.precision import MixedPrecision
    from hplab.training import make_sharded_optimizer

    mesh = Mesh(pp=p)
    model = build_model(config(n_layer), seed=0)
    (stage,) = pp.build_stages(model, mesh.pp_rank, p)
    pp.free_unowned_parameters(model, [stage])
    tied = pp.tied_embedding_group(mesh)
    pipe_stage = PipelineStage(stage, mesh.pp_rank, p, mesh.device, group=mesh.pp.group)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = kind(pipe_stage, m, loss_fn=pp.loss_fn)
    optim = OptimConfig(lr=1e-3, weight_decay=0.1)  # grouped as hplab's: the tied weight apart
    opt = make_sharded_optimizer(model, stage, [stage], mesh, Layout(pp=p), optim, MixedPrecision())
    losses = []
    for x, y in global_batches(PER_MICROBATCH * m):
        mb_losses = []
        if mesh.pp_rank == 0:
            runner.step(x)
        elif mesh.pp_rank == p - 1:
            runner.step(target=y, losses=mb_losses)
        else:
            runner.step()
        pp.sum_tied_gradient([stage], tied)  # the embedding's two copies: one gradient
        opt.step()
        opt.zero_grad()
        local = float(torch.stack(mb_losses).mean()) if mb_losses else 0.0
        losses.append(mesh.pp.all_reduce_scalar(local))
    dist.barrier()
    return {"losses": losses, "params": own_params(model)}


def cases(p):
    odd = {2: 3, 4: 5}[p]
    out = [(s, m, 1) for s in ("gpipe", "1f1b", "zb-h1") for m in (p, 2 * p, odd)]
    return out + [("interleaved", m, 2) for m in (p, 2 * p)]


def _worker(world_size):
    import torch.distributed as dist

    p = world_size
    n_layer = 2 * p  # room for the interleaved schedule's 2 chunks per rank
    out = {"hplab": {}, "torch": {}, "errors": {}}
    for schedule, m, v in cases(p):
        out["hplab"][(schedule, m, v)] = run_hplab(n_layer, p, 1, schedule, m, v)
    for schedule in ("gpipe", "1f1b"):
        out["torch"][schedule] = run_torch_pipelining(n_layer, p, schedule, p)
    if world_size == 4:  # pp × dp: 2 stages × 2 data-parallel replicas, with clipping
        for schedule in ("1f1b", "zb-h1"):
            out["hplab"][("dp2", schedule, 4)] = run_hplab(
                n_layer, 2, 2, schedule, 4, extra=("--grad-clip", "0.05")
            )
    # clear errors, raised the same on every rank before any communication
    for name, call in (
        ("layers", lambda: run_hplab(p - 1, p, 1, "1f1b", p)),
        ("interleaved_m", lambda: run_hplab(n_layer, p, 1, "interleaved", p + 1, 2)),
    ):
        try:
            call()
        except ValueError as err:
            out["errors"][name] = str(err)
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    world = request.param
    results = run_distributed(_worker, world, world)
    return world, results


def merged_params(results, key, kind="hplab"):
    """Each rank returns the parameters it owns; the tied embedding appears on the first and
    the last stage — both copies must be equal."""
    merged = {}
    for r in results:
        for name, t in r[kind][key]["params"].items():
            if name in merged:
                assert rel(t, merged[name]) == 0, f"copies of {name} differ"
            merged[name] = t
    return merged


def test_every_schedule_equals_one_process(runs):
    world, results = runs
    for schedule, m, v in cases(world):
        ref_losses, ref_params = reference_run(2 * world, PER_MICROBATCH * m, m)
        whole = whole_batch_loss(2 * world, PER_MICROBATCH * m)
        assert abs(ref_losses[0] - whole) / whole < TOL
        for r in results:
            got = r["hplab"][(schedule, m, v)]["losses"]
            assert max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses)) < TOL, (
                schedule,
                m,
                got,
                ref_losses,
            )
        params = merged_params(results, (schedule, m, v))
        assert params.keys() == ref_params.keys()
        worst = worst_param_error(params, ref_params)
        assert worst < TOL, (schedule, m, v, worst)


def test_pipeline_times_data_parallel_equals_one_process(runs):
    """pp = 2 × dp = 2, 4 microbatches per replica, gradient clipping on."""
    world, results = runs
    if world != 4:
        pytest.skip("pp × dp is in the 4-process launch")
    # one process: the global batch of 16 as the same 8 microbatches of 2
    ref_losses, ref_params = reference_run(8, PER_MICROBATCH * 4 * 2, 8, clip=0.05)
    for schedule in ("1f1b", "zb-h1"):
        key = ("dp2", schedule, 4)
        for r in results:
            got = r["hplab"][key]["losses"]
            assert max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses)) < TOL
        # ranks 0, 1 are stage 0 (dp 0, 1); ranks 2, 3 stage 1: replicas must agree exactly
        for a, b in ((0, 1), (2, 3)):
            for n, t in results[a]["hplab"][key]["params"].items():
                assert rel(t, results[b]["hplab"][key]["params"][n]) == 0
        worst = worst_param_error(merged_params(results, key), ref_params)
        assert worst < TOL, (schedule, worst)


def test_equals_torch_pipelining(runs):
    world, results = runs
    for schedule in ("gpipe", "1f1b"):
        ours = merged_params(results, (schedule, world, 1))
        theirs = merged_params(results, schedule, kind="torch")
        worst = max(rel(ours[n], theirs[n]) for n in theirs)  # every tensor, all of it
        assert worst < TOL, (schedule, worst)
        last = results[-1]
        ours_loss, theirs_loss = (
            last["hplab"][(schedule, world, 1)]["losses"],
            last["torch"][schedule]["losses"],
        )
        assert max(abs(a - b) / abs(b) for a, b in zip(ours_loss, theirs_loss)) < TOL


def test_measured_in_flight_microbatches(runs):
    world, results = runs
    p = world
    for r, res in enumerate(results):
        for m in (p, 2 * p):
            gpipe = res["hplab"][("gpipe", m, 1)]["report"]
            f1b = res["hplab"][("1f1b", m, 1)]["report"]
            assert gpipe["in_flight_max"] == m
            assert f1b["in_flight_max"] == p - r
            # activation bytes held: m microbatches vs p - r, each the same size
            per_mb = gpipe["activation_bytes_in_flight_max"] / m
            assert per_mb > 0
            assert f1b["activation_bytes_in_flight_max"] == pytest.approx(per_mb * (p - r))


def test_trace_has_every_action(runs):
    world, results = runs
    p = world
    for r, res in enumerate(results):
        for schedule, m, v in cases(p):
            trace = res["hplab"][(schedule, m, v)]["report"]["trace"]
            plan = pp.build_schedule(schedule, p, m, v)[r]
            compute = [
                (e["kind"], e["microbatch"], e["chunk"]) for e in trace if e["kind"] in pp.COMPUTE
            ]
            assert compute == [
                (a.kind, a.microbatch, a.chunk) for a in plan if a.kind in pp.COMPUTE
            ]
            sends = sum(a.kind.startswith("send") for a in plan)
            assert sum(e["kind"] == "send" for e in trace) == sends
            assert sum(e["kind"] == "recv" for e in trace) == sum(
                a.kind.startswith("recv") for a in plan
            )
            assert all(0 <= e["start_s"] <= e["end_s"] for e in trace)
            report = res["hplab"][(schedule, m, v)]["report"]
            assert 0 < report["bubble_fraction"] < 1
            per_step = report["bubble_fraction_per_step"]  # every step's, the last one's last
            assert len(per_step) == STEPS and per_step[-1] == report["bubble_fraction"]
            assert all(0 < b < 1 for b in per_step)


def test_clear_errors(runs):
    world, results = runs
    for r in results:
        assert "layers" in r["errors"]["layers"] and "--n-layer" in r["errors"]["layers"]
        assert f"multiple of {world}" in r["errors"]["interleaved_m"]


# =========================================================================================
# The command line: torchrun hplab/train.py --pp ... writes the trace into the metrics file
# =========================================================================================


def test_train_py_writes_the_pipeline_trace(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    metrics = tmp_path / "pp.json"
    command = [
        sys.executable,
        str(repo / "hplab" / "train.py"),
        "--nproc",
        "4",
        "--pp",
        "2",
        "--dp",
        "2",
        "--schedule",
        "zb-h1",
        "--microbatches",
        "4",
        "--batch-size",
        "8",
        "--steps",
        "2",
        "--n-layer",
        "2",
        "--n-embd",
        "32",
        "--seq-len",
        "16",
        "--no-progress",
        "--metrics",
        str(metrics),
    ]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    pipeline = json.loads(metrics.read_text())["pipeline"]
    assert (pipeline["schedule"], pipeline["stages"], pipeline["microbatches"]) == ("zb-h1", 2, 4)
    assert len(pipeline["trace"]) == 4  # one list per rank
    for events in pipeline["trace"]:
        kinds = [e["kind"] for e in events]
        assert kinds.count("F") == kinds.count("B") == kinds.count("W") == 4
        # 2 stages: the first sends 4 activations, the second 4 gradients; each receives 4
        assert kinds.count("send") == kinds.count("recv") == 4
        assert set(events[0]) == {"kind", "microbatch", "chunk", "start_s", "end_s"}
    assert pipeline["in_flight_max"] == [2, 2, 2, 2]
    assert all(0 < b < 1 for b in pipeline["bubble_fraction"])
    assert pipeline["receives_ahead"] == 1  # (the default: each receive a computation early)
    for per_step, last in zip(pipeline["bubble_fraction_per_step"], pipeline["bubble_fraction"]):
        assert len(per_step) == 2 and per_step[-1] == last  # (--steps 2)


def test_the_replay_posts_receives_as_the_run_did_and_the_bubble_is_the_median_of_steps():
    """The lab compares a run with its own schedule: receives posted as far ahead as the run
    posted them (older metrics files, without the key: just before), and the measured bubble
    as the median over the steps after the first, not one noisy step."""
    from hplab.course.timeline_plots import measured_bubbles, schedule_as_run

    run = {"schedule": "1f1b", "stages": 2, "microbatches": 4, "virtual_stages": 1}
    plans = pp.build_schedule("1f1b", 2, 4)
    assert schedule_as_run(run) == plans
    assert schedule_as_run(run | {"receives_ahead": 1}) == [pp.receives_ahead(p, 1) for p in plans]
    assert schedule_as_run(run | {"receives_ahead": 1}) != plans
    per_step = [[0.9, 0.2, 0.3, 0.25], [0.5, 0.1, 0.1, 0.4]]  # per rank; the first step warms up
    metrics = {"pipeline": {"bubble_fraction": [0.25, 0.4], "bubble_fraction_per_step": per_step}}
    assert measured_bubbles(metrics) == [0.25, 0.1]
    assert measured_bubbles({"pipeline": {"bubble_fraction": [0.3, 0.2]}}) == [0.3, 0.2]
