"""hplab.fully_shard trains exactly the model one process trains, in an ordinary PyTorch loop.

One launch per world size runs every check and returns numbers; the tests assert on them.
Each rank feeds its own slice of the global batch; the reference is one process on the whole
batch, and PyTorch's own `torch.distributed.fsdp.fully_shard` runs in the same launch.

fp32 tolerance 1e-5 relative: for losses |a - b| / |b|; for parameters the relative error of
the whole parameter vector, ||θ_a - θ_b|| / ||θ_b|| (why the whole vector: see test_ddp.py —
the attention key bias has a mathematically zero gradient made of rounding noise, which Adam
turns into ±lr steps whose signs depend on the summation order).

fp16 (`mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)`) is compared with the
matching single-process mixed precision run (an fp16 copy of the model computes, fp32 master
weights step, loss not scaled): both round in fp16, in different orders (a local batch then a
reduce-scatter of grads / N in fp16, against the whole batch), so they agree to fp16's rounding
(FP16_*_TOL below, with the measured values), not to 1e-5. The fp16 run also equals torch's
fully_shard with the same `MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float16)`
to 1e-5 (in fact bitwise).

Gradient accumulation with `set_requires_gradient_sync(False)` on every microbatch but the last
(FSDP2's, DDP's `no_sync`) equals the one-process run and reduce-scatters once per step, not
once per microbatch; `reshard_after_forward=False` gathers once per step, not twice.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hplab.runtime.launch import run_distributed

TOL = 1e-5
FP16_LOSS_TOL = 1e-4  # measured ≤ 3e-6
FP16_GRAD_TOL = 3e-3  # the first step's whole gradient; measured ~1e-3, as far as fp32's is
FP16_PARAM_TOL = 5e-3  # after 3 AdamW steps; measured ~2e-3 (Adam amplifies rounding noise)
STEPS = 3
GLOBAL_BATCH = 8
SEQ = 32


class Toy(nn.Module):
    """Every awkward case at once: a frozen parameter, a frozen bias, a parameter no forward
    uses, a weight tied between two modules, and dims that need padding (11 and 10 rows)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(11, 10)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 10), requires_grad=False)
        self.blocks = nn.ModuleList(nn.Linear(10, 10) for _ in range(2))
        self.blocks[0].bias.requires_grad_(False)
        self.blocks[1].unused = nn.Parameter(torch.randn(3, 5))
        self.head = nn.Linear(10, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        h = self.emb(x) * self.scale
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        logits = self.head(h)
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def data(vocab):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def mine(t, rank, n):
    b = t.shape[0] // n
    return t[rank * b : (rank + 1) * b]


def blocks_of(model):
    return model.transformer.h if hasattr(model, "transformer") else model.blocks


def rel(params: dict, reference: dict) -> float:
    diff = (
        sum(
            float((params[k].detach().float() - v.detach().float()).pow(2).sum())
            for k, v in reference.items()
        )
        ** 0.5
    )
    return diff / sum(float(v.detach().float().pow(2).sum()) for v in reference.values()) ** 0.5


def reference_run(model, batches, mixed=False):
    """One process on the global batch. `mixed`: an fp16 copy computes, fp32 masters step."""
    masters = dict(model.named_parameters())
    compute = copy.deepcopy(model).half() if mixed else model
    opt = torch.optim.AdamW([p for p in masters.values() if p.requires_grad], foreach=False)
    losses, first_grads = [], {}
    for x, y in batches:
        loss = compute(x, y)[1]
        loss.backward()
        if not first_grads:
            first_grads = {
                k: p.grad.float().clone()
                for k, p in compute.named_parameters()
                if p.grad is not None
            }
        if mixed:
            for name, p in compute.named_parameters():
                masters[name].grad = None if p.grad is None else p.grad.float()
                p.grad = None
        opt.step()
        opt.zero_grad()
        if mixed:
            with torch.no_grad():
                for name, p in compute.named_parameters():
                    p.copy_(masters[name])
        losses.append(loss.item())
    return losses, opt, first_grads


def plain_loop(model, batches, rank, n, accumulate=1, set_to_none=True, probe=None, no_sync=False):
    """The PyTorch tutorial loop on this rank's slice; losses averaged over the ranks.
    `no_sync`: gradients reduced only in the last microbatch's backward (FSDP2's way)."""
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    losses = []
    for step, (x, y) in enumerate(batches):
        x, y, total = mine(x, rank, n), mine(y, rank, n), 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            if no_sync:
                model.set_requires_gradient_sync(i == accumulate - 1)
            loss = model(xs, ys)[1] / accumulate
            loss.backward()
            total += loss.detach()
        if probe and step == 0:
            probe(model)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        t = torch.as_tensor(total, dtype=torch.float32).clone()
        dist.all_reduce(t)
        losses.append(float(t) / n)
    return losses, opt


def shard_model(model, mesh=None, **kwargs):
    from hplab.parallel.fsdp import fully_shard

    for block in blocks_of(model):
        fully_shard(block, mesh, **kwargs)
    return fully_shard(model, mesh, **kwargs)


def torch_fsdp_run(make, batches, rank, n, **kwargs):
    """PyTorch's FSDP2 on the same model, the same wrapping, the same loop."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (n,))
    model = make()
    for block in blocks_of(model):
        torch_fully_shard(block, mesh=mesh, **kwargs)
    torch_fully_shard(model, mesh=mesh, **kwargs)
    losses, _ = plain_loop(model, batches, rank, n)
    return losses, {k: p.full_tensor().detach() for k, p in model.named_parameters()}


def _worker(n):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from hplab.models.gpt import build_model, config_from_preset
    from hplab.observe.memory import held_by, storage_bytes
    from hplab.parallel.collectives import CommLedger, Communicator
    from hplab.parallel.fsdp import FSDPModule, is_shard
    from hplab.sharded_state import full_parameters, gather_full, local_shard

    rank, out = dist.get_rank(), {}
    config = config_from_preset("tiny", seq_len=SEQ)
    makers = {"gpt": lambda: build_model(config, 0), "toy": Toy}
    for name, make in makers.items():
        batches = data(11 if name == "toy" else config.vocab_size)
        reference = make()
        out[f"{name}_ref_losses"], ref_opt, _ = reference_run(reference, batches)
        ref = dict(reference.named_parameters())
        torch_losses, torch_params = torch_fsdp_run(make, batches, rank, n)
        out[f"{name}_torch_losses"] = torch_losses

        seen = {}

        def probe(model):  # after the first backward, before the step
            grads = [(p.grad, p) for p in model.parameters() if p.requires_grad]
            seen["grads_fp32_shard_shaped"] = all(
                g is None or (g.dtype == torch.float32 and g.shape == p.shape) for g, p in grads
            )
            seen["unused_grad_none"] = name != "toy" or model.blocks[1].unused.grad is None
            seen["all_shards"] = all(is_shard(p) for p in model.parameters())
            seen["fsdp_modules"] = all(  # FSDP2's way: the class now mixes in FSDPModule
                isinstance(m, FSDPModule) for m in [model, *blocks_of(model)]
            )
            mem = held_by(model)
            seen["param_bytes"] = storage_bytes(mem["params"])
            seen["grad_bytes"] = storage_bytes(mem["grads"])
            grad_probe(model, "fp32_grads")
            ledger.reset()  # count the steps after this one: forward, backward and nothing else

        def grad_probe(model, key="fp16_grads"):  # the first step's whole averaged gradient
            seen[key] = {
                k: gather_full(p, p.grad) for k, p in model.named_parameters() if p.grad is not None
            }

        ledger = CommLedger()
        model = shard_model(make(), Communicator(dist.group.WORLD, "dp", ledger))
        out[f"{name}_losses"], opt = plain_loop(model, batches, rank, n, probe=probe)
        out[f"{name}_ledger"] = {
            op: (s.calls / (STEPS - 1), s.bus_bytes / (STEPS - 1))
            for op, s in ledger.totals().items()
        }
        full = full_parameters(model)
        out[f"{name}_names"] = sorted(full) == sorted(ref)
        out[f"{name}_rel"] = rel(full, ref)
        out[f"{name}_torch_rel"] = rel(full, torch_params)
        out[f"{name}_units"] = len(blocks_of(model)) + 1

        # checkpoint helpers: the shard round-trips, AdamW's state is the one-process state
        by_name = dict(model.named_parameters())
        out[f"{name}_roundtrip"] = all(
            torch.equal(local_shard(p, gather_full(p, p)), p.detach()) for p in by_name.values()
        )
        out[f"{name}_exp_avg_rel"] = rel(
            {
                k: gather_full(p, opt.state[p]["exp_avg"])
                for k, p in by_name.items()
                if p in opt.state
            },
            {k: ref_opt.state[p]["exp_avg"] for k, p in ref.items() if p in ref_opt.state},
        )
        out[f"{name}_exp_avg_sq_rel"] = rel(
            {
                k: gather_full(p, opt.state[p]["exp_avg_sq"])
                for k, p in by_name.items()
                if p in opt.state
            },
            {k: ref_opt.state[p]["exp_avg_sq"] for k, p in ref.items() if p in ref_opt.state},
        )

        # the same loop with other options: each must reproduce the reference
        variants = {
            "set_to_none_false": ({}, dict(set_to_none=False)),
            "accumulate": ({}, dict(accumulate=2)),
            "accumulate_no_sync": ({}, dict(accumulate=2, no_sync=True)),
            "keep_gathered": (dict(reshard_after_forward=False), {}),
            "device_mesh": (dict(mesh=init_device_mesh("cpu", (n,))), {}),
            "offload": (dict(offload_policy=CPUOffloadPolicy()), {}),
        }
        if name == "gpt":
            variants["recompute"] = ({}, {})
        for variant, (shard_kwargs, loop_kwargs) in variants.items():
            model = make()
            model.recompute = variant == "recompute"
            ledger = CommLedger()
            shard_kwargs = dict(mesh=Communicator(dist.group.WORLD, "dp", ledger)) | shard_kwargs
            shard_model(model, **shard_kwargs)
            out[f"{name}_{variant}_losses"], _ = plain_loop(model, batches, rank, n, **loop_kwargs)
            out[f"{name}_{variant}_calls"] = {  # per step, over all the units
                op: s.calls / STEPS for op, s in ledger.totals().items()
            }
            out[f"{name}_{variant}_rel"] = rel(full_parameters(model), ref)
        out[f"{name}_offload_device"] = str(next(iter(model.parameters())).device)

        # fp16 compute, fp32 masters, against the single-process mixed-precision run
        out[f"{name}_mixed_ref_losses"], _, mixed_grads = reference_run(
            mixed_ref := make(), batches, mixed=True
        )
        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
        model = shard_model(make(), mp_policy=policy)
        out[f"{name}_fp16_losses"], _ = plain_loop(model, batches, rank, n, probe=grad_probe)
        fp16_full = full_parameters(model)
        out[f"{name}_fp16_rel"] = rel(fp16_full, dict(mixed_ref.named_parameters()))
        out[f"{name}_fp16_grad_rel"] = rel(seen["fp16_grads"], mixed_grads)
        out[f"{name}_fp32_vs_mixed_grad_rel"] = rel(seen.pop("fp32_grads"), mixed_grads)
        seen.pop("fp16_grads")
        out[f"{name}_probe"] = seen
        out[f"{name}_fp16_torch_losses"], torch_params = torch_fsdp_run(
            make, batches, rank, n, mp_policy=policy
        )
        out[f"{name}_fp16_torch_rel"] = rel(fp16_full, torch_params)
        out[f"{name}_fp16_master_dtype"] = {p.dtype for p in model.parameters()} == {torch.float32}
    out["psi"] = config.num_params()
    return out


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_distributed(_worker, request.param, request.param)


def close(a, b, tol=TOL):
    return all(abs(x - y) <= tol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_equals_one_process_and_torch_fsdp(results, name):
    n, per_rank = results
    for out in per_rank:
        assert out[f"{name}_names"]
        assert close(out[f"{name}_losses"], out[f"{name}_ref_losses"]), (n, out[f"{name}_losses"])
        assert close(out[f"{name}_torch_losses"], out[f"{name}_ref_losses"])
        assert out[f"{name}_rel"] < TOL, (n, out[f"{name}_rel"])
        assert out[f"{name}_torch_rel"] < TOL, (n, out[f"{name}_torch_rel"])


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_grads_are_fp32_shards_and_unused_stay_none(results, name):
    _, per_rank = results
    for out in per_rank:
        probe = out[f"{name}_probe"]
        assert (
            probe["all_shards"] and probe["grads_fp32_shard_shaped"] and probe["unused_grad_none"]
        )
        assert probe["fsdp_modules"]


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        (name, variant)
        for name in ("gpt", "toy")
        for variant in ("set_to_none_false", "accumulate", "offload")
    ]
    + [
        (name, variant)
        for name in ("gpt", "toy")
        for variant in ("accumulate_no_sync", "keep_gathered", "device_mesh")
    ]
    + [("gpt", "recompute")],
)
def test_loop_variants_equal_one_process(results, name, variant):
    _, per_rank = results
    for out in per_rank:
        assert close(out[f"{name}_{variant}_losses"], out[f"{name}_ref_losses"])
        assert out[f"{name}_{variant}_rel"] < TOL, out[f"{name}_{variant}_rel"]


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_no_gradient_sync_reduce_scatters_once_per_step(results, name):
    """2 microbatches: each unit reduce-scatters after both backwards, or, with
    `set_requires_gradient_sync(False)` on the first, once: after the last."""
    _, per_rank = results
    for out in per_rank:
        units = out["gpt_units"] if name == "gpt" else 3
        assert out[f"{name}_accumulate_calls"]["reduce_scatter"] == 2 * units
        assert out[f"{name}_accumulate_no_sync_calls"]["reduce_scatter"] == units
        assert out[f"{name}_accumulate_no_sync_calls"]["all_gather"] == 4 * units


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_keeping_gathered_parameters_gathers_once_per_step(results, name):
    """`reshard_after_forward=False`: each unit's forward gather serves its backward too."""
    _, per_rank = results
    for out in per_rank:
        units = out["gpt_units"] if name == "gpt" else 3
        assert out[f"{name}_set_to_none_false_calls"]["all_gather"] == 2 * units
        assert out[f"{name}_keep_gathered_calls"] == {"all_gather": units, "reduce_scatter": units}


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_offload_equals_on_device(results, name):
    _, per_rank = results
    for out in per_rank:
        assert out[f"{name}_offload_device"] == "cpu"
        assert close(out[f"{name}_offload_losses"], out[f"{name}_losses"], tol=0.0)


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_fp16_tracks_single_process_mixed_precision(results, name):
    n, per_rank = results
    # torch's fully_shard with MixedPrecisionPolicy(fp16, fp16): the same algorithm, but for
    # half-precision reductions torch divides by 2 before the reduce-scatter and by N/2 after
    # (less underflow); hplab divides by N before. Equal when N = 2, within fp16's rounding else.
    torch_tol = TOL if n == 2 else FP16_PARAM_TOL
    for out in per_rank:
        assert out[f"{name}_fp16_master_dtype"]
        assert close(out[f"{name}_fp16_losses"], out[f"{name}_fp16_torch_losses"], torch_tol)
        assert out[f"{name}_fp16_torch_rel"] < torch_tol, out[f"{name}_fp16_torch_rel"]
        # and the single-process mixed-precision run, to fp16's rounding
        assert close(out[f"{name}_fp16_losses"], out[f"{name}_mixed_ref_losses"], FP16_LOSS_TOL)
        assert out[f"{name}_fp16_grad_rel"] < FP16_GRAD_TOL, out[f"{name}_fp16_grad_rel"]
        assert out[f"{name}_fp16_rel"] < FP16_PARAM_TOL, out[f"{name}_fp16_rel"]


def test_bus_bytes_are_two_gathers_and_one_reduce_scatter(results):
    """Per step: all-gather every unit in forward and again in backward, reduce-scatter the
    gradients once: 3(n-1)/n · 4Ψ bytes in fp32 (tiny GPT's dims divide by 2 and 4: no padding)."""
    n, per_rank = results
    for out in per_rank:
        psi, units, ledger = out["psi"], out["gpt_units"], out["gpt_ledger"]
        assert ledger["all_gather"] == (2 * units, pytest.approx(2 * (n - 1) / n * 4 * psi))
        assert ledger["reduce_scatter"] == (units, pytest.approx((n - 1) / n * 4 * psi))
        assert set(ledger) == {"all_gather", "reduce_scatter"}


def test_memory_is_one_nth(results):
    n, per_rank = results
    for out in per_rank:
        probe = out["gpt_probe"]
        assert probe["param_bytes"] == 4 * out["psi"] // n  # nothing gathered between steps
        assert probe["grad_bytes"] == 4 * out["psi"] // n


@pytest.mark.parametrize("name", ["gpt", "toy"])
def test_checkpoint_helpers_recover_one_process_adam_state(results, name):
    _, per_rank = results
    for out in per_rank:
        assert out[f"{name}_roundtrip"]
        assert out[f"{name}_exp_avg_rel"] < TOL, out[f"{name}_exp_avg_rel"]
        assert out[f"{name}_exp_avg_sq_rel"] < 1e-4, out[f"{name}_exp_avg_sq_rel"]


# --- prefetch: FSDP2's explicit lists, and the order of the gathers they give -----------------
PREFETCH = {  # (prefetch in forward, in backward): by default both, `[]` turns one off
    "both": (True, True),
    "forward": (True, False),
    "backward": (False, True),
    "none": (False, False),
}


def shard_with_prefetch(model, forward: bool, backward: bool, mesh=None):
    """Shard as `shard_model`; a pass without prefetch gets FSDP2's empty list on every unit."""
    shard_model(model, mesh)
    for unit in [*blocks_of(model), model]:
        if not forward:
            unit.set_modules_to_forward_prefetch([])
        if not backward:
            unit.set_modules_to_backward_prefetch([])
    return model


def _prefetch_worker(n):
    """Per setting: the losses and parameters of 3 steps, and in the second step the order in
    which the gathers were launched (G), the blocks began forward (F0...) and the blocks' first
    gradients appeared (B3...): with the default order or `[]` (`_order`), and with the explicit
    lists train.py's `--prefetch` sets (`_flag_order`, compose.set_prefetch)."""
    import torch.distributed as dist

    from hplab.models.gpt import build_model, config_from_preset
    from hplab.parallel.compose import set_prefetch
    from hplab.sharded_state import full_parameters

    rank, out = dist.get_rank(), {}
    config = config_from_preset("tiny", seq_len=SEQ)
    batches, reference = data(config.vocab_size), {}
    for name, (forward, backward) in PREFETCH.items():

        def by_default(comm):
            return shard_with_prefetch(build_model(config, 0), forward, backward, comm)

        def by_flag(comm):
            model = shard_model(build_model(config, 0), comm)
            set_prefetch(model, name)
            return model

        out[f"{name}_order"] = second_step_order(by_default, batches, rank, n)
        out[f"{name}_flag_order"] = second_step_order(by_flag, batches, rank, n)
        model = shard_with_prefetch(build_model(config, 0), forward, backward)
        out[f"{name}_losses"], _ = plain_loop(model, batches, rank, n)
        params = full_parameters(model)
        reference = reference or params  # ("both" comes first)
        out[f"{name}_same_params"] = all(torch.equal(params[k], reference[k]) for k in reference)
    return out


def second_step_order(shard, batches, rank, n) -> str:
    """Two steps of the plain loop on `shard(comm)`'s model; the gathers (G), forwards (F) and
    first gradients (B) of the second, in the order they happened."""
    import torch.distributed as dist

    from hplab.parallel.collectives import CommLedger, Communicator

    log, graded = [], set()
    comm = Communicator(dist.group.WORLD, "dp", CommLedger())
    gather = comm.all_gather
    comm.all_gather = lambda *args, **kw: log.append("G") or gather(*args, **kw)
    model = shard(comm)

    def forward_began(block, args, i):
        log.append(f"F{i}")
        if not getattr(block, "watched", False):  # its full-size parameters, swapped in
            block.watched = True
            for p in block.parameters():
                p.register_post_accumulate_grad_hook(lambda p, i=i: first_grad(i))

    def first_grad(i):
        if i not in graded:
            graded.add(i)
            log.append(f"B{i}")

    for i, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(lambda m, a, i=i: forward_began(m, a, i))

    def probe(model):  # after the first step's backward: log the second step only
        log.clear()
        graded.clear()

    plain_loop(model, batches[:2], rank, n, probe=probe)
    return " ".join(log)


@pytest.fixture(scope="module")
def prefetched():
    return run_distributed(_prefetch_worker, 2, 2)


@pytest.mark.parametrize("name", ["forward", "backward", "none"])
def test_prefetch_off_trains_bit_for_bit_the_same(prefetched, name):
    for out in prefetched:
        assert out[f"{name}_losses"] == out["both_losses"]
        assert out[f"{name}_same_params"]


def test_prefetch_gathers_the_next_block_while_this_one_computes(prefetched):
    """With prefetch, block i+1's gather is launched before block i computes (forward) and block
    i−1's before block i's gradients (backward); without, each block's only when it starts.
    The root (embeddings, head) is gathered first in each pass; forward prefetch starts in the
    second step, once the first has shown the order (`_order`); train.py's `--prefetch` lists
    (`_flag_order`) give the same second step."""
    ahead_forward = "G G G F0 G F1 G F2 F3"
    in_time_forward = "G G F0 G F1 G F2 G F3"
    ahead_backward = "G G G B3 G B2 G B1 B0"
    in_time_backward = "G G B3 G B2 G B1 G B0"
    expected = {
        "both": (ahead_forward, ahead_backward),
        "forward": (ahead_forward, in_time_backward),
        "backward": (in_time_forward, ahead_backward),
        "none": (in_time_forward, in_time_backward),
    }
    for out in prefetched:
        for name, passes in expected.items():
            assert out[f"{name}_order"] == " ".join(passes), name
            assert out[f"{name}_flag_order"] == " ".join(passes), name


def test_a_reference_to_a_parameter_taken_before_fully_shard_stays_readable():
    """fully_shard computes with a full-size parameter of its own (whose storage is freed
    between uses), never with the user's original, which keeps its values: reading it is no
    crash (it was a segmentation fault when the original itself was made the stand-in)."""
    code = """
import os, torch, torch.nn as nn, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
import hplab
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
kept = model[0].weight
before = kept.detach().clone()
hplab.fully_shard(model)
model(torch.randn(3, 4)).sum().backward()
print(torch.equal(kept.detach(), before))
"""
    port = str(29500 + os.getpid() % 400)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PORT": port},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]
