"""Data parallel trains exactly the model one process trains.

One launch per world size runs every check and returns numbers; the tests assert on them.
The fp32 tolerance is 1e-5 relative: for losses |a - b| / |b|; for parameters the relative
error of the whole parameter vector, ||θ_a - θ_b|| / ||θ_b||.

Why the whole vector and not tensor by tensor: the gradient of the attention *key* bias is
mathematically zero (adding b to every key adds q·b to every score of a row, and softmax
ignores that), so what autograd computes there is pure rounding noise ~1e-10. Adam divides by
the running RMS of the gradient, turning that noise into ±lr updates whose signs depend on the
summation order — different in any two layouts, PyTorch's DDP included. That tensor alone can
differ at 1e-4 of its own (tiny) norm while the model as a whole agrees to 1e-6.
"""

import copy
import math

import pytest
import torch

from hplab.dist import run_distributed

TOL = 1e-5
STEPS = 5
GLOBAL_BATCH = 8


def make_args(*flags):
    from hplab.train import build_parser

    args = build_parser().parse_args(["--dp", "1", *flags])
    return args


def batches(seq_len=64):
    """The same global batches on every rank, from the shipped corpus."""
    from hplab.data import TokenDataset, get_batch, global_batch_indices

    ds = TokenDataset("shakespeare", seq_len=seq_len)
    return [get_batch(ds, global_batch_indices(len(ds), s, GLOBAL_BATCH, seed=0))
            for s in range(STEPS)]


def reference_run(model, data, accumulate=1):
    """One process, whole global batch: the run every layout must reproduce."""
    from hplab.parallel import make_optimizer

    opt = make_optimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for x, y in data:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def param_rel(model, reference) -> float:
    """||θ - θ_ref|| / ||θ_ref|| over all parameters, matched by name."""
    ref = dict(reference.named_parameters())
    pairs = [(p.detach(), ref[n].detach()) for n, p in model.named_parameters()]
    diff = sum(float((a - b).pow(2).sum()) for a, b in pairs) ** 0.5
    return diff / sum(float(b.pow(2).sum()) for _, b in pairs) ** 0.5


def my_slice(x, rank, n):
    b = x.shape[0] // n
    return x[rank * b:(rank + 1) * b]


def _worker(world_size):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from hplab.ddp import DataParallel
    from hplab.dist import Mesh
    from hplab.models.gpt import PRESETS, build_model
    from hplab.parallel import build_engine, make_optimizer

    rank = dist.get_rank()
    data = batches()
    out = {}

    reference = build_model(PRESETS["tiny"], seed=0)
    out["ref_losses"] = reference_run(reference, data)

    # hplab's engine, as train.py builds it (default 25 MiB buckets, and 64 KiB buckets)
    for name, bucket_mb in (("hplab", 25.0), ("hplab_small_buckets", 1 / 16)):
        mesh = Mesh.create(dp=world_size)
        args = make_args("--weight-decay", "0.1", "--bucket-mb", str(bucket_mb))
        args.dp = world_size
        engine = build_engine(build_model(PRESETS["tiny"], seed=0), mesh, args)
        losses = []
        for step, (x, y) in enumerate(data):
            before = mesh.ledger.totals().get("all_reduce")
            before = before.bytes if before else 0
            losses.append(engine.train_step(my_slice(x, rank, world_size),
                                            my_slice(y, rank, world_size)))
            if step == 0:
                out[f"{name}_allreduce_bytes_step"] = mesh.ledger.totals()["all_reduce"].bytes - before
        out[f"{name}_losses"] = losses
        out[f"{name}_param_rel"] = param_rel(engine.model, reference)
        out[f"{name}_buckets"] = len(engine.ddp.buckets)
        out[f"{name}_allreduce_calls"] = mesh.ledger.totals()["all_reduce"].calls
        out["grad_bytes"] = sum(p.numel() * p.element_size() for p in engine.ddp.params)

    # PyTorch's own DDP on the same model and data
    model = build_model(PRESETS["tiny"], seed=0)
    torch_ddp = TorchDDP(model)
    opt = make_optimizer(torch_ddp.parameters(), lr=1e-3, weight_decay=0.1)
    torch_losses = []
    for x, y in data:
        _, loss = torch_ddp(my_slice(x, rank, world_size), my_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        torch_losses.append(float(t) / world_size)
    out["torch_losses"] = torch_losses
    out["torch_vs_hplab_param_rel"] = param_rel(model, engine.model)

    # no_sync: two half-batches accumulated locally, then one synchronised step,
    # equals one step on the whole batch
    mesh = Mesh.create(dp=world_size)
    accumulated = build_model(PRESETS["tiny"], seed=0)
    ddp = DataParallel(accumulated, mesh.dp)
    opt = make_optimizer(ddp.params, lr=1e-3, weight_decay=0.1)
    x, y = my_slice(data[0][0], rank, world_size), my_slice(data[0][1], rank, world_size)
    with ddp.no_sync():
        _, loss = ddp(x[: len(x) // 2], y[: len(y) // 2])
        (loss / 2).backward()
    calls_inside_no_sync = mesh.ledger.totals().get("all_reduce")
    _, loss = ddp(x[len(x) // 2:], y[len(y) // 2:])
    (loss / 2).backward()
    ddp.finish_gradient_sync()
    opt.step()
    one_step = build_model(PRESETS["tiny"], seed=0)
    reference_run(one_step, data[:1])
    out["no_sync_calls_inside"] = calls_inside_no_sync.calls if calls_inside_no_sync else 0
    out["no_sync_param_rel"] = param_rel(accumulated, one_step)

    # an unused parameter still takes part (its gradient stays zero) and nothing hangs
    mesh = Mesh.create(dp=world_size)
    with_unused = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4),
                                       "unused": torch.nn.Linear(4, 4)})
    ddp = DataParallel(with_unused, mesh.dp, bucket_bytes=0)
    ddp.module["used"](torch.ones(2, 4) * (rank + 1)).sum().backward()
    ddp.finish_gradient_sync()
    out["unused_grad_norm"] = float(with_unused["unused"].weight.grad.norm())
    out["used_bias_grad"] = with_unused["used"].bias.grad.tolist()
    return out


def _hf_worker(world_size):
    """DDP of a transformers GPT2LMHeadModel (tied wte / lm_head) equals one process."""
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    from hplab.ddp import DataParallel
    from hplab.dist import Mesh
    from hplab.models.gpt import PRESETS, to_hf_config
    from hplab.parallel import make_optimizer

    rank, data = dist.get_rank(), batches()[:3]
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(to_hf_config(PRESETS["tiny"]))
    model = copy.deepcopy(reference)
    ref_opt = make_optimizer(reference.parameters(), lr=1e-3, weight_decay=0.0)
    ddp = DataParallel(model, Mesh.create(dp=world_size).dp)
    opt = make_optimizer(ddp.params, lr=1e-3, weight_decay=0.0)
    for x, y in data:
        reference(input_ids=x, labels=x).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xs = my_slice(x, rank, world_size)
        ddp(input_ids=xs, labels=xs).loss.backward()
        ddp.finish_gradient_sync()
        opt.step()
        ddp.zero_grad()
    return {"param_rel": param_rel(model, reference),
            "tied": model.lm_head.weight is model.transformer.wte.weight}


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, run_distributed(_worker, request.param, request.param)


def test_hplab_ddp_equals_one_process(results):
    n, per_rank = results
    for out in per_rank:
        for key in ("hplab", "hplab_small_buckets"):
            for a, b in zip(out[f"{key}_losses"], out["ref_losses"]):
                assert abs(a - b) / abs(b) < TOL, (n, key, out[f"{key}_losses"], out["ref_losses"])
            assert out[f"{key}_param_rel"] < TOL, (n, key, out[f"{key}_param_rel"])


def test_bucketed_and_single_bucket_agree(results):
    n, per_rank = results
    out = per_rank[0]
    assert out["hplab_buckets"] == 1  # 25 MiB holds the whole tiny model: one bucket
    assert out["hplab_small_buckets_buckets"] > 4
    for a, b in zip(out["hplab_losses"], out["hplab_small_buckets_losses"]):
        assert abs(a - b) / abs(b) < TOL


def test_equals_pytorch_ddp(results):
    n, per_rank = results
    for out in per_rank:
        for a, b in zip(out["torch_losses"], out["hplab_losses"]):
            assert abs(a - b) / abs(b) < TOL
        assert out["torch_vs_hplab_param_rel"] < TOL


def test_allreduce_bytes_per_step_equal_gradient_bytes(results):
    n, per_rank = results
    for out in per_rank:
        assert out["grad_bytes"] == 4 * 335232  # Ψ fp32 gradients of the tiny preset
        assert out["hplab_allreduce_bytes_step"] == out["grad_bytes"]
        assert out["hplab_small_buckets_allreduce_bytes_step"] == out["grad_bytes"]
        assert out["hplab_small_buckets_allreduce_calls"] == STEPS * out["hplab_small_buckets_buckets"]


def test_no_sync_accumulation_equals_larger_batch(results):
    n, per_rank = results
    for out in per_rank:
        assert out["no_sync_calls_inside"] == 0
        assert out["no_sync_param_rel"] < TOL


def test_unused_parameters_are_handled(results):
    n, per_rank = results
    for out in per_rank:
        assert out["unused_grad_norm"] == 0.0
        # d(sum)/d(bias) = batch 2 per rank; averaged over ranks stays 2
        assert out["used_bias_grad"] == pytest.approx([2.0] * 4)


def test_ddp_of_hugging_face_gpt2_equals_one_process():
    for out in run_distributed(_hf_worker, 2, 2):
        assert out["tied"]
        assert out["param_rel"] < TOL, out


def test_bus_bytes_follow_nccl_tests_convention(results):
    from hplab.comm import bus_factor

    n, _ = results
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bus_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert math.isclose(bus_factor("send", n), 1.0)
