"""hplab.DDP trains exactly the model one process trains, and the model PyTorch's DDP trains.

One launch per world size (2 and 4 gloo ranks) runs every check and returns what it measured;
the tests below assert on it. Every rank also computes the single-process reference on the
whole global batch (same seed, same data), so each rank compares itself with it.

Tolerance (fp32): 1e-5 relative (atol 1e-6) element by element on the toy model. On hplab's GPT
the relative error of the whole parameter vector, ||θ_a - θ_b|| / ||θ_b|| < 1e-5: the gradient of
the attention *key* bias is mathematically zero (adding b to every key adds q·b to every score
of a row, and softmax ignores that), so autograd's value there is rounding noise ~1e-10 that
Adam turns into ±lr updates whose signs depend on the summation order — different in any two
layouts, PyTorch's DDP included. That tensor alone can differ at 1e-4 of its (tiny) norm while
the model as a whole agrees to 1e-6.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hplab.observe.memory import held_by
from hplab.runtime.launch import run_distributed

RTOL, ATOL = 1e-5, 1e-6
STEPS = 4
GLOBAL_BATCH = 8
VOCAB, DIM, SEQ = 16, 8, 6
SMALL_MB = 300 / 2**20  # 300 bytes: three buckets for the toy model
TOY_RUNS = [(set_to_none, mb) for set_to_none in (True, False) for mb in (0, SMALL_MB, 25)]


class Toy(nn.Module):
    """Every awkward kind of parameter: a frozen layer, a frozen bias, an embedding tied to the
    output head, a layer the forward never uses, and a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.hidden.bias.requires_grad_(False)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two uses
        self.unused = nn.Linear(DIM, DIM)
        self.register_buffer("scale", torch.ones(DIM))

    def forward(self, x, y):
        h = self.emb(x) * self.scale
        h = torch.tanh(self.hidden(h)) + self.frozen(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def toy(seed=0) -> Toy:
    torch.manual_seed(seed)
    return Toy()


def toy_batches():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def gpt_batches(steps=STEPS):
    """The same global batches on every rank, from the shipped corpus."""
    from hplab.data import TokenDataset, get_batch, global_batch_indices

    ds = TokenDataset("shakespeare", seq_len=64)
    return [
        get_batch(ds, global_batch_indices(len(ds), s, GLOBAL_BATCH, seed=0)) for s in range(steps)
    ]


def toy_loss(model, x, y):
    return model(x, y)


def gpt_loss(model, x, y):
    return model(x, y)[1]


def hf_loss(model, x, y):
    return model(input_ids=x, labels=x).loss


def my_slice(x, rank, n):
    b = x.shape[0] // n
    return x[rank * b : (rank + 1) * b]


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel(a: dict, b: dict) -> float:
    """||θ_a - θ_b|| / ||θ_b|| over every entry."""
    diff = sum(float((a[k] - b[k]).pow(2).sum()) for k in b) ** 0.5
    return diff / sum(float(v.pow(2).sum()) for v in b.values()) ** 0.5


def all_reduce_so_far(ledger):
    s = ledger.totals().get("all_reduce")
    return (s.calls, s.bytes) if s else (0, 0)


def tutorial_loop(
    model, data, loss_fn, set_to_none=True, ledger=None, finish_calls=None, optimizer=None
):
    """The PyTorch tutorial's loop. Distributed (a DDP model), each rank takes its slice of the
    global batch; returns the global-batch losses, and per step the all-reduce (calls, bytes)
    `ledger` saw. `finish_calls[s]`: how many times to call finish_gradient_sync at step s.
    `optimizer(params)`: the optimizer to build (AdamW by default)."""
    import torch.distributed as dist

    n, rank = (dist.get_world_size(), dist.get_rank()) if hasattr(model, "module") else (1, 0)
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, foreach=False)))(model.parameters())
    losses, per_step = [], []
    for s, (x, y) in enumerate(data):
        before = all_reduce_so_far(ledger) if ledger else None
        loss = loss_fn(model, my_slice(x, rank, n), my_slice(y, rank, n))
        loss.backward()
        for _ in range(finish_calls[s] if finish_calls else 0):
            model.finish_gradient_sync()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if ledger:
            after = all_reduce_so_far(ledger)
            per_step.append((after[0] - before[0], after[1] - before[1]))
        total = loss.detach().clone()
        if n > 1:
            dist.all_reduce(total)  # straight through torch: not in any ledger
        losses.append(float(total) / n)
    return losses, per_step


def accumulate_loop(ddp, data, how, ledger):
    """Two microbatches per step, the first under no_sync(). The second: "sync", a synchronised
    backward (PyTorch's way); "explicit", also under no_sync(), then finish_gradient_sync();
    "by_hand", its gradients added to `.grad` by hand (no autograd hook sees them, as in a
    deferred weight-gradient pass), then finish_gradient_sync(). Returns the all-reduce calls
    made before the sync."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.AdamW(ddp.parameters(), foreach=False)
    calls_inside = 0
    for x, y in data:
        x, y = my_slice(x, rank, n), my_slice(y, rank, n)
        half = len(x) // 2
        before = all_reduce_so_far(ledger)[0]
        with ddp.no_sync():
            (toy_loss(ddp, x[:half], y[:half]) / 2).backward()
            if how == "explicit":
                (toy_loss(ddp, x[half:], y[half:]) / 2).backward()
        if how == "by_hand":
            params = [p for p in ddp.parameters() if p.requires_grad]
            grads = torch.autograd.grad(
                toy_loss(ddp, x[half:], y[half:]) / 2, params, allow_unused=True
            )
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if g is not None:
                        p.grad += g
        calls_inside += all_reduce_so_far(ledger)[0] - before
        if how == "sync":
            (toy_loss(ddp, x[half:], y[half:]) / 2).backward()
        else:
            ddp.finish_gradient_sync()
        opt.step()
        opt.zero_grad()
    return calls_inside


def _toy_checks(out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from hplab.parallel.collectives import CommLedger, Communicator
    from hplab.parallel.ddp import DDP

    data, world = toy_batches(), dist.group.WORLD
    for set_to_none in (True, False):
        ref = toy()
        out[f"toy_ref_{set_to_none}"] = (
            tutorial_loop(ref, data, toy_loss, set_to_none)[0],
            state(ref),
            ref.unused.weight.grad is None,
        )
        theirs = TorchDDP(toy(), find_unused_parameters=True)
        out[f"toy_torch_{set_to_none}"] = (
            tutorial_loop(theirs, data, toy_loss, set_to_none)[0],
            state(theirs.module),
        )
    for set_to_none, mb in TOY_RUNS:
        ledger = CommLedger()
        ours = DDP(toy(), Communicator(world, "dp", ledger), bucket_mb=mb)
        losses, per_step = tutorial_loop(ours, data, toy_loss, set_to_none, ledger)
        out[f"toy_{set_to_none}_{mb}"] = dict(
            losses=losses,
            state=state(ours.module),
            per_step=per_step,
            buckets=len(ours.buckets),
            unused_grad_none=ours.module.unused.weight.grad is None,
            grad_bytes=sum(p.numel() * p.element_size() for p in ours.params),
            memory={k: sum(t.numel() for t in v) for k, v in held_by(ours).items()},
        )

    # bug (c): the sync finishes by itself; calling finish_gradient_sync() again is harmless
    ledger = CommLedger()
    ours = DDP(toy(), Communicator(world, "dp", ledger), bucket_mb=SMALL_MB)
    losses, per_step = tutorial_loop(ours, data, toy_loss, True, ledger, [0, 2, 1, 0])
    out["finish_by_itself"] = dict(
        losses=losses, state=state(ours.module), per_step=per_step, buckets=len(ours.buckets)
    )

    # bug (b): every parameter (frozen too) and buffer is broadcast from rank 0 at wrap time
    different = toy(seed=dist.get_rank())
    different.scale.fill_(dist.get_rank() + 1.0)
    wrapped = DDP(different)
    out["broadcast"] = dict(
        state=state(wrapped.module),
        rank0=state(toy(seed=0)),
        is_module=wrapped.module is different,
        keys=sorted(wrapped.state_dict())[:2],
    )

    # no_sync accumulation: 2 microbatches equal the larger batch
    for how in ("sync", "explicit", "by_hand"):
        ledger = CommLedger()
        ours = DDP(toy(), Communicator(world, "dp", ledger), bucket_mb=SMALL_MB)
        calls_inside = accumulate_loop(ours, data, how, ledger)
        out[f"accumulate_{how}"] = dict(
            state=state(ours.module),
            calls_inside=calls_inside,
            calls=all_reduce_so_far(ledger)[0],
            buckets=len(ours.buckets),
        )


def _one_wrapper_checks(out):
    """DDP + ZeRO-1 trains as one process (ZeRO-1 reduces at step(), after DDP's average); a
    second wrapper that would reduce the same gradient in the same backward is refused when it
    is built, before any collective (so every rank refuses alike)."""
    from hplab.parallel.ddp import DDP
    from hplab.parallel.fsdp import fully_shard
    from hplab.parallel.sync import DoubleSyncError
    from hplab.parallel.zero import ZeroOptimizer

    data = toy_batches()

    def sgd(ps):
        return torch.optim.SGD(ps, lr=0.1)  # (unused parameters stay put)

    def zero(ps, stage=1):
        return ZeroOptimizer(ps, torch.optim.SGD, stage=stage, lr=0.1)

    ref = toy()
    out["ddp_zero1_ref"] = (tutorial_loop(ref, data, toy_loss, optimizer=sgd)[0], state(ref))
    ours = DDP(toy(), bucket_mb=SMALL_MB)
    losses = tutorial_loop(ours, data, toy_loss, optimizer=zero)[0]
    out["ddp_zero1"] = (losses, state(ours.module))

    def refusal(build):
        try:
            build()
        except DoubleSyncError as err:
            return str(err)

    refused = {}
    inner = DDP(toy())
    refused["zero2 inside DDP"] = refusal(lambda: zero(inner.parameters(), 2))
    bare = toy()
    zero(bare.parameters(), 2)
    refused["DDP around zero2"] = refusal(lambda: DDP(bare))
    refused["DDP twice"] = refusal(lambda: DDP(inner.module))
    sharded = fully_shard(nn.Linear(DIM, DIM))
    refused["DDP over shards"] = refusal(lambda: DDP(sharded))
    refused["zero1 over shards"] = refusal(lambda: zero(sharded.parameters(), 1))
    wrapped = DDP(nn.Linear(DIM, DIM))
    refused["fully_shard inside DDP"] = refusal(lambda: fully_shard(wrapped.module))
    out["double_sync"] = refused


def _gpt_checks(out):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from hplab.models.gpt import build_model, config_from_preset
    from hplab.parallel.collectives import DEFAULT_LEDGER
    from hplab.parallel.ddp import DDP

    data, config = gpt_batches(), config_from_preset("tiny")
    ref = build_model(config, 0)
    out["gpt_ref"] = (tutorial_loop(ref, data, gpt_loss)[0], state(ref))
    theirs = TorchDDP(build_model(config, 0))
    out["gpt_torch"] = (tutorial_loop(theirs, data, gpt_loss)[0], state(theirs.module))
    for mb in (25, 1 / 16):
        ours = DDP(build_model(config, 0), bucket_mb=mb)  # the world, counted in DEFAULT_LEDGER
        losses, per_step = tutorial_loop(ours, data, gpt_loss, ledger=DEFAULT_LEDGER)
        out[f"gpt_{mb}"] = dict(
            losses=losses,
            state=state(ours.module),
            per_step=per_step,
            buckets=len(ours.buckets),
            grad_bytes=sum(p.numel() * 4 for p in ours.params),
        )


def _hf_checks(out):
    from transformers import GPT2LMHeadModel

    from hplab.models.gpt import PRESETS, to_hf_config
    from hplab.parallel.ddp import DDP

    data = gpt_batches(3)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(to_hf_config(PRESETS["tiny"]))
    torch.manual_seed(0)
    ours = DDP(GPT2LMHeadModel(to_hf_config(PRESETS["tiny"])), bucket_mb=1)
    ref_losses = tutorial_loop(ref, data, hf_loss)[0]
    losses = tutorial_loop(ours, data, hf_loss)[0]
    m = ours.module
    out["hf"] = dict(
        losses=losses,
        ref_losses=ref_losses,
        param_rel=rel(state(m), state(ref)),
        tied=m.lm_head.weight is m.transformer.wte.weight,
    )


def convert(obj, fn):
    """Apply `fn` to every tensor or array inside dicts, lists and tuples."""
    if isinstance(obj, dict):
        return {k: convert(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(convert(v, fn) for v in obj)
    return fn(obj)


def _worker(with_hf):
    out = {}
    _toy_checks(out)
    _one_wrapper_checks(out)
    _gpt_checks(out)
    if with_hf:
        _hf_checks(out)
    # numpy crosses the process boundary by value (a tensor would travel as shared memory
    # that disappears with this process)
    return convert(out, lambda v: v.numpy() if isinstance(v, torch.Tensor) else v)


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    n = request.param
    per_rank = run_distributed(_worker, n, n == 2)  # Hugging Face only in the 2-rank launch
    return n, convert(per_rank, lambda v: torch.from_numpy(v) if hasattr(v, "dtype") else v)


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{msg}: {m}")


# --- 1. the tutorial loop on a toy model with frozen, tied and unused parameters ----------


@pytest.mark.parametrize(("set_to_none", "mb"), TOY_RUNS)
def test_tutorial_loop_equals_one_process(results, set_to_none, mb):
    n, per_rank = results
    for out in per_rank:
        ours, (ref_losses, ref_state, ref_unused_none) = (
            out[f"toy_{set_to_none}_{mb}"],
            out[f"toy_ref_{set_to_none}"],
        )
        close(torch.tensor(ours["losses"]), torch.tensor(ref_losses), f"losses, {n} ranks")
        close(ours["state"], ref_state, f"parameters, {n} ranks")
        assert ours["unused_grad_none"] and ref_unused_none  # unused: no gradient, like 1 process


@pytest.mark.parametrize(("set_to_none", "mb"), TOY_RUNS)
def test_tutorial_loop_equals_pytorch_ddp(results, set_to_none, mb):
    n, per_rank = results
    for out in per_rank:
        ours, (torch_losses, torch_state) = (
            out[f"toy_{set_to_none}_{mb}"],
            out[f"toy_torch_{set_to_none}"],
        )
        close(torch.tensor(ours["losses"]), torch.tensor(torch_losses), f"losses, {n} ranks")
        close(ours["state"], torch_state, f"parameters, {n} ranks")


def test_buckets_and_memory_of_the_toy(results):
    _, per_rank = results
    out = per_rank[0]
    assert [out[f"toy_True_{mb}"]["buckets"] for mb in (0, SMALL_MB, 25)] == [4, 3, 1]
    # emb (tied to head) 16·8, hidden.weight 8·8, unused 8·8 + 8: frozen ones have no slot
    assert out["toy_True_25"]["grad_bytes"] == 4 * (128 + 64 + 72)
    all_params = 128 + 64 + 8 + 64 + 8 + 64 + 8  # + frozen bias, frozen layer; tied once
    assert out["toy_True_25"]["memory"] == {"params": all_params, "grads": 128 + 64 + 72}


# --- 2. hplab's GPT -------------------------------------------------------------------------


@pytest.mark.parametrize("mb", [25, 1 / 16])
def test_gpt_equals_one_process_and_pytorch_ddp(results, mb):
    n, per_rank = results
    for out in per_rank:
        ours = out[f"gpt_{mb}"]
        for name, (losses, other) in (
            ("one process", out["gpt_ref"]),
            ("torch DDP", out["gpt_torch"]),
        ):
            close(torch.tensor(ours["losses"]), torch.tensor(losses), f"{name}, {n} ranks")
            assert rel(ours["state"], other) < RTOL, (name, n, rel(ours["state"], other))


# --- 3. the three old bugs, each caught -----------------------------------------------------


def test_zero_grad_set_to_none_keeps_replicas_identical(results):
    """Old bug (a): zero_grad() (set_to_none=True) made fresh gradients outside the buckets;
    each rank stepped its own and the replicas drifted apart."""
    n, per_rank = results
    for mb in (0, SMALL_MB, 25):
        first = per_rank[0][f"toy_True_{mb}"]["state"]
        for out in per_rank[1:]:
            close(out[f"toy_True_{mb}"]["state"], first, f"replicas, {n} ranks")
        close(first, per_rank[0]["toy_ref_True"][1], "one process")


def test_every_parameter_and_buffer_is_broadcast_at_wrap_time(results):
    """Old bug (b): frozen parameters were not broadcast, so replicas started different."""
    n, per_rank = results
    for out in per_rank:
        b = out["broadcast"]
        assert b["is_module"] and b["keys"][0].startswith("module.")
        torch.testing.assert_close(b["state"], b["rank0"], rtol=0, atol=0)


def test_sync_finishes_by_itself_and_finishing_again_is_harmless(results):
    """Old bug (c): forgetting finish_gradient_sync() once left the next backward sending
    nothing. Steps here call it 0, 2, 1, 0 times."""
    n, per_rank = results
    for out in per_rank:
        f = out["finish_by_itself"]
        close(torch.tensor(f["losses"]), torch.tensor(out["toy_ref_True"][0]), f"{n} ranks")
        close(f["state"], out["toy_ref_True"][1], f"{n} ranks")
        assert [calls for calls, _ in f["per_step"]] == [f["buckets"]] * STEPS


# --- 4. accumulation and what goes over the wire --------------------------------------------


@pytest.mark.parametrize("how", ["sync", "explicit", "by_hand"])
def test_no_sync_accumulation_equals_the_larger_batch(results, how):
    n, per_rank = results
    for out in per_rank:
        acc = out[f"accumulate_{how}"]
        assert acc["calls_inside"] == 0
        assert acc["calls"] == STEPS * acc["buckets"]
        close(acc["state"], out["toy_ref_True"][1], f"{n} ranks")


def test_allreduce_bytes_per_step_equal_gradient_bytes(results):
    _, per_rank = results
    for out in per_rank:
        for key in [f"toy_{s}_{mb}" for s, mb in TOY_RUNS] + ["gpt_25", f"gpt_{1 / 16}"]:
            r = out[key]
            assert r["per_step"] == [(r["buckets"], r["grad_bytes"])] * STEPS, key
        assert out["gpt_25"]["grad_bytes"] == 4 * 335232  # Ψ of the tiny preset, tied once
        assert out["gpt_25"]["buckets"] == 1 and out[f"gpt_{1 / 16}"]["buckets"] > 4


# --- 5. a Hugging Face model ----------------------------------------------------------------


def test_ddp_of_hugging_face_gpt2_equals_one_process(results):
    n, per_rank = results
    if n != 2:
        pytest.skip("run in the 2-rank launch only (importing transformers is slow)")
    for out in per_rank:
        assert out["hf"]["tied"]
        close(torch.tensor(out["hf"]["losses"]), torch.tensor(out["hf"]["ref_losses"]))
        assert out["hf"]["param_rel"] < RTOL, out["hf"]


# --- without processes ------------------------------------------------------------------------


def test_ddp_with_zero1_equals_one_process(results):
    n, per_rank = results
    for out in per_rank:
        (losses, params), (ref_losses, ref_params) = out["ddp_zero1"], out["ddp_zero1_ref"]
        close(torch.tensor(losses), torch.tensor(ref_losses), f"losses, DDP + ZeRO-1, {n} ranks")
        close(params, ref_params, f"parameters, DDP + ZeRO-1, {n} ranks")


REFUSALS = {  # the pair built → what the one line must say
    "zero2 inside DDP": ("hplab.ZeroOptimizer(stage=2): hplab.DDP already", "stage=1 inside DDP"),
    "DDP around zero2": ("hplab.DDP: hplab.ZeroOptimizer(stage=2) already", "on the bare model"),
    "DDP twice": ("hplab.DDP: hplab.DDP already", "wrap the model once"),
    "DDP over shards": ("hplab.DDP: hplab.fully_shard already", "fully_shard alone"),
    "zero1 over shards": ("ZeroOptimizer(stage=1): hplab.fully_shard", "fully_shard alone"),
    "fully_shard inside DDP": ("hplab.fully_shard: hplab.DDP already", "fully_shard alone"),
}


def test_a_second_wrapper_reducing_the_same_gradient_is_refused(results):
    """ZeRO-2's hooks inside DDP's read a half-reduced or already averaged gradient and average
    it again (0.5x the true gradient with 25 MiB buckets): refused in one line, either order."""
    for out in results[1]:
        assert set(out["double_sync"]) == set(REFUSALS)
        for pair, (who, fix) in REFUSALS.items():
            line = out["double_sync"][pair]
            assert line and who in line and fix in line and "\n" not in line, (pair, line)


def test_buckets_order_and_sizes():
    """DDP's buckets: the parameters in reverse (backward's order), a new bucket when the next
    parameter would overflow `bucket_mb` (here 20 bytes), a lone larger one on its own."""
    from hplab.parallel.buckets import bucket_params

    def ids(buckets):
        return [[id(p) for p in bucket] for bucket in buckets]

    params = [nn.Parameter(torch.zeros(k)) for k in (4, 2, 3)]
    assert ids(bucket_params(params, 0)) == [[id(params[2])], [id(params[1])], [id(params[0])]]
    assert ids(bucket_params(params, math.inf)) == [[id(p) for p in reversed(params)]]
    twenty_bytes = 20 / 2**20
    assert ids(bucket_params(params, twenty_bytes)) == [
        [id(params[2]), id(params[1])],
        [id(params[0])],
    ]


def test_bus_bytes_follow_nccl_tests_convention():
    from hplab.parallel.collectives import bus_factor

    for n in (2, 4):
        assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
        assert bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
        assert math.isclose(bus_factor("send", n), 1.0)
