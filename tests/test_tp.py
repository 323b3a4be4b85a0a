"""Tensor parallel (hplab/parallel/tp.py): every check against a single-process reference, in fp32.

Process start-up is expensive, so each world size runs ONE launch (`_checks_world2`,
`_checks_world4`) that performs every check and returns plain numbers; the test functions
below assert on them. Errors are relative: max|a − b| / max|b| per tensor, at most 1e-5.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hplab.models import gpt as gpt_model
from hplab.runtime.launch import run_distributed

REPO = Path(__file__).resolve().parent.parent
RTOL = 1e-5
STEPS = 3
# 101 words: padded to 102 on 2 ranks and to 104 on 4, so padding is always exercised.
CONFIG = dict(vocab_size=101, n_positions=16, n_embd=32, n_layer=2, n_head=4)
BATCH = 4  # sequences
# train.py's default. AdamW moves every element by about lr whatever its gradient's size, so
# elements whose gradient is ~0 turn rounding differences into moves proportional to lr.
LR = 1e-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def max_rel_err(ours: dict, ref: dict) -> tuple[float, str]:
    """The worst relative error over named tensors, and which tensor it is."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    return max((rel_err(ours[n], ref[n]), n) for n in ref)


def model_rel_err(ours: dict, ref: dict) -> float:
    """Parameters after AdamW steps, compared as one vector: max|a − b| / max|b| over all.

    Not tensor by tensor, because AdamW moves each element by about lr·g/(|g| + eps),
    whatever the size of g: an element whose gradient is rounding noise moves in a direction
    no two summation orders agree on. Measured here: the key bias (true gradient exactly 0,
    computed ~1e-12) ends 1.5e-6 apart, 5e-4 of its zero-initialised tensor's scale; and in
    the tp2 × dp2 layout one c_fc weight element whose first gradient is −3e-9 (its tensor's
    largest: 3e-3) ends 8.6e-6 apart — the largest error of all these checks, from the
    optimizer, not from tensor parallel. Gradients, which Adam has not yet normalised, are
    compared tensor by tensor."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    worst = max(float((ours[n].double() - ref[n].double()).abs().max()) for n in ref)
    return worst / max(float(t.abs().max()) for t in ref.values())


def make_optimizer(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW as train.py builds it; foreach=False keeps the update element-wise identical."""
    return torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, foreach=False
    )


@torch.no_grad()
def full_grads(model, comm) -> dict:
    """Every parameter's full gradient, by name (tp pieces glued back)."""
    from hplab.parallel import placement, tp

    return {
        name: tp.gather_full(p.grad, placement.of(p).split, comm)
        if tp.is_split(p)
        else p.grad.clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


@torch.no_grad()
def full_state_dict(model, comm) -> dict:
    """The single-device state dict (same names, full shapes), rebuilt on every rank."""
    from hplab.parallel import placement, tp

    return {
        name: tp.gather_full(p, placement.of(p).split, comm)
        if tp.is_split(p)
        else p.detach().clone()
        for name, p in model.named_parameters(remove_duplicate=False)
    }


@torch.no_grad()
def load_full_state_dict(model, state_dict: dict, comm) -> None:
    """A single-device checkpoint into a tensor-parallel model: each rank keeps its pieces."""
    from hplab.parallel import placement, tp

    for name, p in model.named_parameters():
        split = placement.of(p).split
        p.copy_(tp.piece_of(state_dict[name], split, comm) if tp.is_split(p) else state_dict[name])


def gather_vocab(logits, comm, vocab_size: int):
    """All the logits [..., V] from every rank's slice, padding removed."""
    from hplab.parallel import tp

    return tp._all_gather(logits.detach(), comm, -1)[..., :vocab_size]


def fake_comm(size: int, rank: int = 0):
    """A Communicator that only knows its size and rank: cutting a model needs no messages."""
    from hplab.parallel.collectives import Communicator

    comm = object.__new__(Communicator)
    comm.size, comm.rank = size, rank
    return comm


def _batch(vocab: int, batch: int = BATCH, seq: int = CONFIG["n_positions"], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, vocab, (batch, seq), generator=g),
        torch.randint(0, vocab, (batch, seq), generator=g),
    )


# --- checks that run inside the processes --------------------------------------------------


def _operator_checks(comm) -> dict:
    """Each conjugate operator's forward and backward against what it should compute."""
    from hplab.parallel import tp

    T, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 4 * T, 6 * T, generator=g) for _ in range(T)]  # every rank's input
    ws = [torch.randn(2, 4 * T, 6 * T, generator=g) for _ in range(T)]  # every rank's "loss"
    out = {}

    x = xs[0].clone().requires_grad_()  # f: same x everywhere; grad = sum of every rank's
    (tp.CopyToTensorParallel.apply(x, comm) * ws[r]).sum().backward()
    out["f"] = rel_err(x.grad, sum(ws))

    x = xs[r].clone().requires_grad_()  # g: sum of everyone's x; grad passes unchanged
    y = tp.ReduceFromTensorParallel.apply(x, comm)
    (y * ws[0]).sum().backward()
    out["g"] = max(rel_err(y, sum(xs)), rel_err(x.grad, ws[0]))

    x = xs[r].clone().requires_grad_()  # all-gather along the sequence; backward reduce-scatter
    y = tp.GatherSequence.apply(x, comm)
    (y * ws[r].repeat(1, T, 1)).sum().backward()
    out["gather_sequence"] = max(
        rel_err(y, torch.cat(xs, 1)),
        rel_err(x.grad, sum(w.repeat(1, T, 1) for w in ws).chunk(T, 1)[r]),
    )

    x = xs[r].clone().requires_grad_()  # reduce-scatter along the sequence; backward all-gather
    y = tp.ReduceScatterSequence.apply(x, comm)
    w_slice = ws[0].chunk(T, 1)[r]
    (y * w_slice).sum().backward()
    out["reduce_scatter_sequence"] = max(rel_err(y, sum(xs).chunk(T, 1)[r]), rel_err(x.grad, ws[0]))
    return out


def _cross_entropy_checks(comm) -> dict:
    """vocab_parallel_cross_entropy against F.cross_entropy: values and gradients, for a
    vocabulary that splits evenly and one that needs padding; the same loss when the group is
    given as None or a torch ProcessGroup (here every rank is in it)."""
    import torch.distributed as dist

    from hplab.parallel import tp

    out = {}
    for vocab in (8 * comm.size, 8 * comm.size + 1):
        g = torch.Generator().manual_seed(vocab)
        logits = torch.randn(3, 5, vocab, generator=g) * 4
        targets = torch.randint(0, vocab, (3, 5), generator=g)
        targets[0, 0] = vocab - 1  # the last real word sits next to the padding
        ref_logits = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
        ref.backward()
        width = -(-vocab // comm.size)
        padded = F.pad(logits, (0, width * comm.size - vocab))
        mine = padded.chunk(comm.size, -1)[comm.rank].clone().requires_grad_()
        loss = tp.vocab_parallel_cross_entropy(mine, targets, comm, vocab)
        loss.backward()
        grad = gather_vocab(mine.grad, comm, vocab)
        pad_grad = tp._all_gather(mine.grad, comm, -1)[..., vocab:]
        whole_world = comm.size == dist.get_world_size()  # (then None and WORLD name it too)
        out[vocab] = {
            "loss": rel_err(loss, ref),
            "grad": rel_err(grad, ref_logits.grad),
            "padding_grad": float(pad_grad.abs().max()) if pad_grad.numel() else 0.0,
            "as a ProcessGroup or None": [
                float(tp.vocab_parallel_cross_entropy(mine.detach(), targets, group, vocab) - loss)
                for group in ((None, dist.group.WORLD) if whole_world else ())
            ],
        }
    return out


def _train_reference(model, steps, batches, forward):
    """Single process: `steps` AdamW steps; returns losses, first logits, first grads, params."""
    optimizer = make_optimizer(model.parameters(), lr=LR, weight_decay=0.1)
    losses, logits, grads = [], None, None
    for x, y in batches[:steps]:
        out_logits, loss = forward(model, x, y)
        loss.backward()
        if logits is None:
            logits = out_logits.detach()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, logits, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_tensor_parallel(model, comm, steps, batches, forward, sequence_parallel):

    optimizer = make_optimizer(model.parameters(), lr=LR, weight_decay=0.1)
    losses, logits, grads = [], None, None
    for x, y in batches[:steps]:
        out_logits, loss = forward(model, x, y)
        loss.backward()
        if logits is None:
            logits = gather_vocab(out_logits, comm, model.config.vocab_size)
            grads = full_grads(model, comm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, logits, grads, full_state_dict(model, comm)


def _hplab_forward(model, x, y):
    return model(x, y)


def _equivalence(ref_out, tp_out) -> dict:
    (ref_losses, ref_logits, ref_grads, ref_params) = ref_out
    (losses, logits, grads, params) = tp_out
    params = {n: params[n] for n in ref_params}  # (params also names the tied lm_head.weight)
    return {
        "losses": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "logits": rel_err(logits, ref_logits),
        "grads": max_rel_err(grads, ref_grads),
        "params": model_rel_err(params, ref_params),
    }


def _gpt_checks(comm, sequence_parallel: bool) -> dict:
    """The hplab GPT under TP trains exactly like one process, starts from and exports to the
    single-device checkpoint, and keeps its tied weights tied and its padding at zero."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel import tp

    config = GPTConfig(**CONFIG)
    batches = [_batch(config.vocab_size, seed=s) for s in range(STEPS)]
    reference = _train_reference(build_model(config, 0), STEPS, batches, _hplab_forward)
    model = tp.parallelize(build_model(config, 0), comm, gpt_model.TP_PLAN, sequence_parallel)
    start = full_state_dict(model, comm)
    out = _equivalence(
        reference,
        _train_tensor_parallel(model, comm, STEPS, batches, _hplab_forward, sequence_parallel),
    )
    initial = build_model(config, 0).state_dict()
    out["start_is_single_device"] = max(rel_err(start[n], initial[n]) for n in initial)
    out["tied"] = model.lm_head.weight is model.transformer.wte.weight
    rows = model.transformer.wte.weight.shape[0]
    padding = model.transformer.wte.weight[max(0, config.vocab_size - comm.rank * rows) :]
    out["padding_max"] = float(padding.abs().max()) if padding.numel() else 0.0
    # and back: load a single-device checkpoint into the TP model
    load_full_state_dict(model, initial, comm)
    out["reload"] = max(rel_err(t, initial[n]) for n, t in full_state_dict(model, comm).items())
    return out


def _hf_forward(model, x, y):
    """HF GPT-2 forward; the loss from whatever logits it returns (full or vocab slice).
    Under sequence parallel the model is given only this rank's s/T ids."""
    if getattr(model, "sequence_parallel", False):
        from hplab.parallel import tp

        x = tp.sequence_slice(x, model.tp_comm)
    logits = model(input_ids=x).logits
    if hasattr(model, "tp_comm"):
        from hplab.parallel import tp

        return logits, tp.vocab_parallel_cross_entropy(
            logits, y, model.tp_comm, model.config.vocab_size
        )
    return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _hf_checks(comm, sequence_parallel: bool) -> dict:
    """Hugging Face GPT2LMHeadModel cut in place: same logits, loss, grads and training."""
    from transformers import GPT2LMHeadModel

    from hplab.models.gpt import GPTConfig, to_hf_config
    from hplab.parallel import tp

    config = GPTConfig(**CONFIG)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(to_hf_config(config)).train()
    reference_model = copy.deepcopy(hf)
    batches = [_batch(config.vocab_size, seed=s) for s in range(STEPS)]
    reference = _train_reference(reference_model, STEPS, batches, _hf_forward)
    tp.parallelize(hf, comm, gpt_model.HF_TP_PLAN, sequence_parallel)
    hf.tp_comm, hf.sequence_parallel = comm, sequence_parallel
    out = _equivalence(
        reference, _train_tensor_parallel(hf, comm, STEPS, batches, _hf_forward, sequence_parallel)
    )
    out["conv1d_weight_shape"] = list(hf.transformer.h[0].attn.c_attn.weight.shape)
    return out


def _ledger_checks(comm, ledger, sequence_parallel: bool) -> dict:
    """Calls and bytes of every tp collective: for one block (forward, then backward) and for
    a whole forward + backward of the model."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel import tp

    config = GPTConfig(**CONFIG)
    model = tp.parallelize(build_model(config, 0), comm, gpt_model.TP_PLAN, sequence_parallel)
    x, y = _batch(config.vocab_size)
    s = x.shape[1] // comm.size if sequence_parallel else x.shape[1]
    hidden = torch.randn(BATCH, s, config.n_embd, requires_grad=True)

    def read():
        return {
            op: [d["calls"], d["bytes"]] for op, d in ledger.by_group_dict().get("tp", {}).items()
        }

    ledger.reset()
    out_block = model.transformer.h[0](hidden)
    block_forward = read()
    ledger.reset()
    out_block.sum().backward()
    block_backward = read()
    ledger.reset()
    _, loss = model(x, y)
    loss.backward()
    return {"block_forward": block_forward, "block_backward": block_backward, "model": read()}


def _activation_checks(comm) -> dict:
    """Bytes one block saves for backward: one process, TP, and TP + sequence parallel."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.observe.memory import MemoryLedger
    from hplab.parallel import tp

    config = GPTConfig(**{**CONFIG, "n_positions": 64, "n_embd": 64})
    out = {}
    for name in ("single", "tp", "tp_sp"):
        model = build_model(config, 0)
        if name != "single":
            tp.parallelize(model, comm, gpt_model.TP_PLAN, sequence_parallel=name == "tp_sp")
        s = 64 // comm.size if name == "tp_sp" else 64
        hidden = torch.randn(8, s, config.n_embd, requires_grad=True)
        memory = MemoryLedger()
        with memory.track_activations(exclude=list(model.parameters()) + [hidden]):
            y = model.transformer.h[0](hidden)
        y.sum().backward()
        out[name] = memory.activation_bytes
    return out


def _dtensor_checks(comm) -> dict:
    """hplab's column → row MLP against PyTorch's DTensor tensor parallel (ColwiseParallel /
    RowwiseParallel on nn.Linear) and against one process: outputs and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from hplab.parallel import tp

    torch.manual_seed(3)
    h = 16
    reference = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU("tanh"), nn.Linear(4 * h, h))
    theirs, ours = copy.deepcopy(reference), copy.deepcopy(reference)
    parallelize_module(
        theirs,
        init_device_mesh("cpu", (comm.size,)),
        {"0": ColwiseParallel(), "2": RowwiseParallel()},
    )
    ours[0] = tp.ColumnParallelLinear(ours[0], comm)
    ours[2] = tp.RowParallelLinear(ours[2], comm)
    x = torch.randn(4, 8, h, generator=torch.Generator().manual_seed(4))
    results = {}
    for name, model in (("reference", reference), ("dtensor", theirs), ("hplab", ours)):
        xi = x.clone().requires_grad_()
        y = model(xi)
        (y * torch.arange(h)).sum().backward()
        grads = {
            n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
            for n, p in model.named_parameters()
        }
        results[name] = (y.detach(), xi.grad, grads)
    ref_y, ref_dx, ref_g = results["reference"]
    dt_y, dt_dx, dt_g = results["dtensor"]
    y, dx, g = results["hplab"]
    split = {"0.weight": 0, "0.bias": 0, "2.weight": 1}
    ref_local = {
        n: (t.chunk(comm.size, split[n])[comm.rank] if n in split else t) for n, t in ref_g.items()
    }
    return {
        "vs_dtensor": max(rel_err(y, dt_y), rel_err(dx, dt_dx), max_rel_err(g, dt_g)[0]),
        "vs_reference": max(rel_err(y, ref_y), rel_err(dx, ref_dx), max_rel_err(g, ref_local)[0]),
        "dtensor_vs_reference": max(rel_err(dt_y, ref_y), rel_err(dt_dx, ref_dx)),
    }


def _layout_checks(mesh, sequence_parallel: bool, recompute: bool = False) -> dict:
    """tp × dp in a plain loop built from the placement records tp.parallelize leaves: 2
    microbatches, gradients averaged over dp (sequence parallel's partial sums over tp are the
    hooks' own, in backward: the loop does nothing for them), clipping by the
    global norm (tp pieces summed over tp, replicated parameters counted once), AdamW — and
    recompute (backward re-runs each block's forward, collectives included). Against one
    process training on the whole global batch with torch's own clip_grad_norm_."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel import tp

    config, micro, clip = GPTConfig(**CONFIG), 2, 0.5
    global_batch = 4 * mesh.dp_size
    batches = [_batch(config.vocab_size, batch=global_batch, seed=10 + s) for s in range(STEPS)]
    reference = build_model(config, 0)
    optimizer = make_optimizer(reference.parameters(), LR, 0.1)
    ref_losses, ref_norms = [], []
    for x, y in batches:
        _, loss = reference(x, y)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        ref_losses.append(float(loss.detach()))
    model = tp.parallelize(build_model(config, 0), mesh.tp, gpt_model.TP_PLAN, sequence_parallel)
    model.recompute = recompute
    optimizer = make_optimizer(model.parameters(), LR, 0.1)
    losses = []
    for x, y in batches:
        mine = slice(mesh.dp_rank * 4, (mesh.dp_rank + 1) * 4)
        step_loss = 0.0
        for xm, ym in zip(x[mine].chunk(micro), y[mine].chunk(micro)):
            _, loss = model(xm, ym)
            (loss / micro).backward()
            step_loss += float(loss.detach()) / micro
        for p in model.parameters():
            mesh.dp.all_reduce(p.grad)
            p.grad /= mesh.dp_size
        pieces = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if tp.is_split(p))
        whole = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if not tp.is_split(p))
        norm = mesh.tp.all_reduce_scalar(pieces + (whole if mesh.tp.rank == 0 else 0.0)) ** 0.5
        for p in model.parameters():
            p.grad *= min(1.0, clip / (norm + 1e-6))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mesh.dp.all_reduce_scalar(step_loss) / mesh.dp_size)
    params = full_state_dict(model, mesh.tp)
    ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    return {
        "losses": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "params": model_rel_err({n: params[n] for n in ref_params}, ref_params),
        "clipped": min(ref_norms) > clip,
    }


def _checks_world2() -> dict:
    from hplab.parallel.mesh import Mesh

    mesh = Mesh(dp=1, tp=2, pp=1)
    comm = mesh.tp
    return {
        "operators": _operator_checks(comm),
        "cross_entropy": _cross_entropy_checks(comm),
        "gpt": _gpt_checks(comm, False),
        "gpt_sp": _gpt_checks(comm, True),
        "ledger": _ledger_checks(comm, mesh.ledger, False),
        "ledger_sp": _ledger_checks(comm, mesh.ledger, True),
        "activations": _activation_checks(comm),
        "dtensor": _dtensor_checks(comm),
        "hf": _hf_checks(comm, False),
        "hf_sp": _hf_checks(comm, True),
    }


def _checks_world4() -> dict:
    from hplab.parallel.mesh import Mesh

    mesh = Mesh(dp=1, tp=4, pp=1)
    tp_by_dp = Mesh(dp=2, tp=2, pp=1)
    return {
        "operators": _operator_checks(mesh.tp),
        "cross_entropy": _cross_entropy_checks(mesh.tp),
        "gpt": _gpt_checks(mesh.tp, False),
        "gpt_sp": _gpt_checks(mesh.tp, True),
        "hf": _hf_checks(mesh.tp, False),
        "hf_sp": _hf_checks(mesh.tp, True),
        "layout_tp4": _layout_checks(mesh, False),
        "layout_tp2_dp2": _layout_checks(tp_by_dp, False),
        "layout_tp2_dp2_sp_recompute": _layout_checks(tp_by_dp, True, recompute=True),
    }


# --- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_checks_world2, 2)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_checks_world4, 4)


@pytest.fixture(scope="module", params=[2, 4])
def world(request, world2, world4):
    return {2: world2, 4: world4}[request.param]


def test_conjugate_operators(world):
    for rank in world:
        for name, err in rank["operators"].items():
            assert err <= RTOL, (name, err)


def test_vocab_parallel_cross_entropy_equals_torch(world):
    for rank in world:
        for vocab, errs in rank["cross_entropy"].items():
            assert errs["loss"] <= RTOL and errs["grad"] <= RTOL, (vocab, errs)
            assert errs["padding_grad"] == 0.0, (vocab, errs)
            assert errs["as a ProcessGroup or None"] == [0.0, 0.0], errs


@pytest.mark.parametrize("variant", ["gpt", "gpt_sp"])
def test_gpt_trains_like_one_process(world, variant):
    for rank in world:
        r = rank[variant]
        assert r["losses"] <= RTOL and r["logits"] <= RTOL, r
        assert r["grads"][0] <= RTOL, r["grads"]
        assert r["params"] <= RTOL, r["params"]
        assert r["start_is_single_device"] == 0.0 and r["reload"] == 0.0
        assert r["tied"] and r["padding_max"] == 0.0


@pytest.mark.parametrize("variant", ["hf", "hf_sp"])
def test_hf_gpt2_trains_like_one_process(world, variant):
    for rank in world:
        r = rank[variant]
        assert r["losses"] <= RTOL and r["logits"] <= RTOL, r
        assert r["grads"][0] <= RTOL and r["params"] <= RTOL, r
    T = len(world)
    assert world[0][variant]["conv1d_weight_shape"] == [CONFIG["n_embd"], 3 * CONFIG["n_embd"] // T]


def _bsh_bytes(s=CONFIG["n_positions"]):
    return BATCH * s * CONFIG["n_embd"] * 4


def test_ledger_tensor_parallel_block(world2):
    """Forward: one all-reduce in attention, one in the MLP, b·s·h each; backward the same."""
    for rank in world2:
        led = rank["ledger"]
        assert led["block_forward"] == {"all_reduce": [2, 2 * _bsh_bytes()]}
        assert led["block_backward"] == {"all_reduce": [2, 2 * _bsh_bytes()]}


def test_ledger_sequence_parallel_block(world2):
    """Sequence parallel: all-gather before, reduce-scatter after each TP region (b·s·h each);
    backward mirrors them, gathers each column layer's tokens once more, and sums the gradient
    of each of the block's 6 whole parameters (2 layer norms' gains and biases, 2 row-parallel
    biases: h numbers each) over the group, one hook's all-reduce each."""
    h = CONFIG["n_embd"]
    for rank in world2:
        led = rank["ledger_sp"]
        assert led["block_forward"] == {
            "all_gather": [2, 2 * _bsh_bytes()],
            "reduce_scatter": [2, 2 * _bsh_bytes()],
        }
        assert led["block_backward"] == {
            "all_gather": [4, 4 * _bsh_bytes()],
            "reduce_scatter": [2, 2 * _bsh_bytes()],
            "all_reduce": [6, 6 * h * 4],
        }


def test_ledger_whole_model(world2):
    """Forward + backward of the whole model: 4 all-reduces per block, 1 for the embedding,
    1 for the LM head's input gradient, 3 of b·s floats for the cross-entropy."""
    L = CONFIG["n_layer"]
    bs_floats = BATCH * CONFIG["n_positions"] * 4
    for rank in world2:
        assert rank["ledger"]["model"] == {
            "all_reduce": [4 * L + 2 + 3, (4 * L + 2) * _bsh_bytes() + 3 * bs_floats]
        }
        h, S = CONFIG["n_embd"], CONFIG["n_positions"]
        replicated = L * (4 * h + 2 * h) + 2 * h + S * h  # layer norms, row biases, ln_f, wpe
        whole = 6 * L + 3  # those parameters: each gradient summed by its hook, in backward
        assert rank["ledger_sp"]["model"] == {
            "all_gather": [6 * L + 3, (6 * L + 3) * _bsh_bytes()],
            "reduce_scatter": [4 * L + 2, (4 * L + 2) * _bsh_bytes()],
            "all_reduce": [3 + whole, 3 * bs_floats + replicated * 4],
        }


def test_sequence_parallel_divides_block_activations(world2):
    """Activation bytes one block saves for backward drop by about T with sequence parallel
    (TP alone leaves the layer norms' inputs and outputs replicated)."""
    a = world2[0]["activations"]
    assert a["tp_sp"] < a["tp"] < a["single"]
    assert a["single"] / a["tp_sp"] >= 0.9 * 2, a


def test_matches_pytorch_dtensor_tensor_parallel(world2):
    for rank in world2:
        d = rank["dtensor"]
        assert d["vs_dtensor"] <= RTOL and d["vs_reference"] <= RTOL, d


def test_tp_and_dp_layouts_train_like_one_process(world4):
    for rank in world4:
        for layout in ("layout_tp4", "layout_tp2_dp2", "layout_tp2_dp2_sp_recompute"):
            r = rank[layout]
            assert r["clipped"], "the test must really exercise clipping"
            assert r["losses"] <= RTOL and r["params"] <= RTOL, (layout, r)


def test_clear_errors_for_impossible_splits():
    from hplab.config import LayoutError, check_tensor_parallel
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel import tp

    with pytest.raises(
        ValueError,
        match="^4 attention heads do not split over 8 tensor-parallel "
        "ranks: use a tensor-parallel size that divides 4$",
    ):
        check_tensor_parallel(n_head=4, n_embd=64, tp=8)
    with pytest.raises(ValueError, match="12 attention heads do not split over 8 tensor-par"):
        check_tensor_parallel(n_head=12, n_embd=96, tp=8)
    with pytest.raises(ValueError, match="hidden size of 30 does not split over 4 tensor-par"):
        check_tensor_parallel(n_head=4, n_embd=30, tp=4)
    with pytest.raises(
        ValueError,
        match="30-token sequence over 4 tensor-parallel ranks: make "
        "the sequence length a multiple of 4",
    ):
        check_tensor_parallel(n_head=4, n_embd=64, tp=4, seq_len=30)
    # the check runs before any communication
    with pytest.raises(LayoutError, match="4 attention heads do not split over 3"):
        tp.parallelize(build_model(GPTConfig(**CONFIG)), fake_comm(3), gpt_model.TP_PLAN)
    from transformers import AutoModelForCausalLM

    from hplab.models.gpt import to_hf_config

    eager = AutoModelForCausalLM.from_config(
        to_hf_config(GPTConfig(**CONFIG)), attn_implementation="eager"
    )
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        tp.parallelize(eager, fake_comm(2), gpt_model.HF_TP_PLAN, sequence_parallel=True)


def test_plan_naming_a_missing_module_is_an_error():
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel import tp

    plan = {**gpt_model.TP_PLAN, "transformer.h.*.attn.q_proj": tp.ColumnParallelLinear}
    model = build_model(GPTConfig(**CONFIG))
    before = {name: p.shape for name, p in model.named_parameters()}
    with pytest.raises(
        tp.TensorParallelError,
        match=r"the plan names 'transformer\.h\.\*\.attn\.q_proj', but GPT has "
        "no module matching it",
    ):
        tp.parallelize(model, fake_comm(2), plan)
    assert {name: p.shape for name, p in model.named_parameters()} == before  # nothing cut


def _hf_gpt2():
    from transformers import GPT2LMHeadModel

    from hplab.models.gpt import GPTConfig, to_hf_config

    return GPT2LMHeadModel(to_hf_config(GPTConfig(**CONFIG)))


@pytest.mark.parametrize("model_plan", ["gpt", "hf_gpt2"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plans_cut_every_layer(model_plan, sequence_parallel):
    """After parallelize (cutting needs no messages: rank 0 of 2, in this process), no
    Linear, Conv1D or Embedding is left whole, every matrix is a piece except the position
    table (replicated by design), the head stays tied, and under sequence parallel every
    whole parameter is marked as a partial sum."""
    from hplab.models.gpt import GPTConfig, build_model
    from hplab.parallel import placement, tp

    model, plan = (
        (build_model(GPTConfig(**CONFIG)), gpt_model.TP_PLAN)
        if model_plan == "gpt"
        else (_hf_gpt2(), gpt_model.HF_TP_PLAN)
    )
    full = {n: p.shape for n, p in model.named_parameters()}
    tp.parallelize(model, fake_comm(2), plan, sequence_parallel)
    left = [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) or type(m).__name__ == "Conv1D"
    ]
    assert left == [], left
    params = dict(model.named_parameters())
    assert set(params) == set(full)  # names unchanged
    unsplit = [n for n, p in params.items() if p.dim() >= 2 and not tp.is_split(p)]
    assert unsplit == ["transformer.wpe.weight"], unsplit
    assert model.lm_head.weight is model.transformer.wte.weight
    for n, p in params.items():
        partial = "tp" in placement.of(p).partial_grad_over
        assert partial == (sequence_parallel and not tp.is_split(p)), n
    assert model.transformer.wte.weight.shape[0] == -(-CONFIG["vocab_size"] // 2)


def test_command_line_tp_with_sequence_parallel_matches_one_process(tmp_path):
    """`hplab/train.py --nproc 2 --tp 2 --sequence-parallel --recompute selective` (torchrun's
    command line, its ranks forked) logs the loss curve of the single-process run without
    recompute, and writes per-rank memory and comm to the metrics."""
    common = ["--steps", "2", "--batch-size", "4", "--n-layer", "2", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    single = subprocess.run(
        [
            sys.executable,
            str(REPO / "hplab/train.py"),
            *common,
            "--metrics",
            str(tmp_path / "one.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "hplab/train.py"),
            "--nproc",
            "2",
            *common,
            "--tp",
            "2",
            "--sequence-parallel",
            "--recompute",
            "selective",
            "--metrics",
            str(tmp_path / "tp.json"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "tp.json").read_text())
    for a, b in zip(two["steps"], one["steps"]):
        assert abs(a["loss"] - b["loss"]) <= RTOL * abs(b["loss"])
    assert two["memory"][0]["params_bytes"] < one["memory"][0]["params_bytes"]
    assert two["comm"][0]["reduce_scatter"]["calls"] > 0
    assert two["config"]["recompute"] == "selective"


def test_command_line_sequence_parallel_needs_tp():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "hplab/train.py"),
            "--steps",
            "1",
            "--sequence-parallel",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("hplab: error: --sequence-parallel")
