"""Check a lab exercise: `python -m hplab.check NAME [FILE]`.

Each lab ends with an exercise in `labs/exercises/`. This command loads your file, runs it the
way hplab runs its own code — on several real processes when the idea is distributed — compares
it with the reference (measured bytes, sums computed independently, the gradient one process
computes on the whole batch) and says precisely what differs:

    python -m hplab.check memory            # lab 00: count training memory by hand
    python -m hplab.check ring_allreduce    # lab 01: ring all-reduce from send/recv (4 ranks)
    python -m hplab.check buckets           # lab 02: bucketed, overlapped gradient all-reduce
    python -m hplab.check zero1             # lab 03: the ZeRO-1 step (reduce-scatter, all-gather)
    python -m hplab.check tp_linear         # lab 04: column/row-parallel linear layers, f and g
    python -m hplab.check one_f_one_b       # lab 05: the 1F1B schedule, simulated
    python -m hplab.check mesh              # lab 06: ranks to (dp, tp, pp) coordinates, groups
    python -m hplab.check planning          # lab 07: ZeRO memory and the pipeline bubble
    python -m hplab.check buckets my_copy.py

Exit code 0 when every check passes, 1 when one fails, 2 for a wrong command line.
Reference solutions are in `labs/solutions/` (peek only after trying).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
EXERCISES_DIR = REPO_DIR / "labs" / "exercises"
SOLUTIONS_DIR = REPO_DIR / "labs" / "solutions"
RTOL, ATOL = 1e-5, 1e-6  # fp32 sums added in a different order agree to about this
COLLECTIVE_TIMEOUT_S = "20"  # a deadlocked exercise fails in seconds, not minutes


class CheckError(ValueError):
    """A wrong command line: unknown exercise or missing file."""


@dataclass
class Result:
    """One check on one file: passed or not, and what was seen."""

    name: str
    passed: bool
    message: str


def load_module(path: str | Path):
    """Import the learner's file by path (it need not be on sys.path)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _describe_exception(err: BaseException, path: str) -> str:
    if isinstance(err, NotImplementedError):
        return f"not implemented yet ({err})"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)]
    where = f" at line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
    return f"raised {type(err).__name__}: {err}{where}"


def _first_difference(got, expected) -> str:
    """'element [i, j]: got a, expected b' for the largest mismatch of two tensors."""
    import torch

    err = (got.double() - expected.double()).abs()
    index = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
    bad = int((err > ATOL + RTOL * expected.double().abs()).sum())
    return (f"{bad} of {expected.numel()} elements differ; worst at {list(index)}: got "
            f"{float(got[index]):.6g}, expected {float(expected[index]):.6g}")


# --- lab 00: memory by hand (one process: nothing is distributed yet) ------------------------

MEMORY_SHAPES = [dict(n_layer=4, n_embd=64, n_head=4, seq_len=64),
                 dict(n_layer=2, n_embd=32, n_head=2, seq_len=16),
                 dict(n_layer=3, n_embd=48, n_head=3, seq_len=40)]


def check_memory(path: str) -> list[Result]:
    """The learner's Ψ and model-state bytes against the model's parameters and what the
    MemoryLedger measures after one AdamW step, for three model shapes."""
    import torch

    from hplab.memory import MemoryLedger, model_state_tensors
    from hplab.models.gpt import build_model, config_from_preset
    from hplab.parallel import make_optimizer

    try:
        module = load_module(path)
    except Exception as err:
        return [Result("import", False, _describe_exception(err, path))]
    results = []
    for shape in MEMORY_SHAPES:
        config = config_from_preset("tiny", **shape)
        h, L, V, S = config.n_embd, config.n_layer, config.vocab_size, config.n_positions
        label = f"V={V} S={S} h={h} L={L}"
        model = build_model(config, seed=0)
        true_psi = sum(p.numel() for p in model.parameters())
        optimizer = make_optimizer(model.parameters(), lr=1e-3, weight_decay=0.0)
        x = torch.randint(0, V, (2, S))
        model(x, x)[1].backward()
        optimizer.step()
        measured = MemoryLedger().measure(model_state_tensors(model, optimizer))
        try:
            psi = module.num_params(config)
        except Exception as err:
            results.append(Result(f"num_params({label})", False, _describe_exception(err, path)))
            continue
        if psi == true_psi:
            results.append(Result(f"num_params({label})", True, f"Ψ = {psi:,}"))
        else:
            hints = {V * h: " — the LM head shares the token embedding: count it once",
                     -S * h: " — the position embeddings are parameters too",
                     -2 * h: " — the final layer norm ln_f has 2h parameters",
                     -L * 4 * h: " — each block has two layer norms of 2h parameters",
                     -L * 9 * h: " — every linear layer has a bias"}
            results.append(Result(f"num_params({label})", False,
                                  f"you count {psi:,}, the model has {true_psi:,} (you are off "
                                  f"by {psi - true_psi:+,}){hints.get(psi - true_psi, '')}"))
        try:
            claimed = module.model_state_bytes(config)
        except Exception as err:
            results.append(Result(f"model_state_bytes({label})", False,
                                  _describe_exception(err, path)))
            continue
        if not isinstance(claimed, dict):
            results.append(Result(f"model_state_bytes({label})", False,
                                  f"returned {type(claimed).__name__}, expected a dict "
                                  '{"params": ..., "grads": ..., "optim": ...}'))
            continue
        wrong = [f"{kind}: you say {claimed.get(kind)!r}, measured {measured[kind]:,} "
                 f"({measured[kind] / true_psi:g} bytes per parameter)"
                 for kind in ("params", "grads", "optim") if claimed.get(kind) != measured[kind]]
        results.append(Result(f"model_state_bytes({label})", not wrong,
                              "; ".join(wrong) or "params, grads and AdamW state match the "
                              f"MemoryLedger: {sum(measured.values()):,} bytes"))
    return results


# --- lab 01: ring all-reduce from send/recv (4 processes) -----------------------------------

RING_CASES = [((1000,), "float32"), ((7, 13), "float32"), ((3,), "float32"),
              ((64, 64), "float32"), ((10,), "float64")]


def _ring_worker(paths: list[str]) -> list[list[tuple]]:
    """On every rank: run each file's ring_all_reduce on every case; return per file a list of
    (case, passed, message) as this rank saw it."""
    import torch
    import torch.distributed as dist

    from hplab.comm import CommTimeout
    from hplab.dist import Mesh

    mesh = Mesh.create(dp=dist.get_world_size())
    comm, n, r = mesh.world, mesh.world.size, mesh.world.rank
    per_file = []
    for path in paths:
        results = []
        try:
            module = load_module(path)
        except Exception as err:
            per_file.append([("import", False, _describe_exception(err, path))])
            continue
        for shape, dtype in RING_CASES:
            case = f"{'×'.join(map(str, shape))} {dtype}"
            inputs = [torch.randn(shape, dtype=getattr(torch, dtype),
                                  generator=torch.Generator().manual_seed(100 * k + len(shape)))
                      for k in range(n)]
            expected = sum(inputs[1:], inputs[0].clone())
            tensor = inputs[r].clone()
            mesh.ledger.reset()
            try:
                module.ring_all_reduce(tensor, comm)
            except CommTimeout as err:
                results.append((case, False, f"{err} — did a send wait for a receive that "
                                "never came? start sends with async_op=True"))
                break  # the process group is unusable after a timeout
            except Exception as err:
                results.append((case, False, _describe_exception(err, path)))
                break  # other ranks may be left waiting: stop this file here
            used = mesh.ledger.as_dict()
            others = sorted(op for op in used if op not in ("send", "recv"))
            sent = used.get("send", {}).get("bytes", 0)
            chunk = tensor.element_size() * tensor.numel() / n
            low = 2 * (n - 1) * math.floor(tensor.numel() / n) * tensor.element_size()
            high = 2 * (n - 1) * math.ceil(tensor.numel() / n) * tensor.element_size()
            if others:
                results.append((case, False, f"used {', '.join(others)}: build it from send "
                                "and recv only"))
            elif not torch.allclose(tensor, expected, rtol=RTOL, atol=ATOL):
                results.append((case, False, "the result is not the sum over the ranks: "
                                + _first_difference(tensor, expected)))
            elif not low <= sent <= high:
                results.append((case, False, f"sent {sent:,} bytes; a ring all-reduce sends "
                                f"2(n-1) chunks of S/n = {2 * (n - 1) * chunk:,.0f} bytes: one "
                                "chunk per step, not the whole tensor"))
            else:
                results.append((case, True, f"sum correct, {sent:,} bytes sent "
                                f"(2(n-1)/n·S = {2 * (n - 1) * chunk:,.0f})"))
        per_file.append(results)
    return per_file


# --- lab 02: bucketed gradient all-reduce (2 processes) -------------------------------------

def _expected_bucket_count(params, bucket_bytes) -> int:
    count, size = 0, 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if count == 0 or size + nbytes > bucket_bytes:
            count, size = count + 1, 0
        size += nbytes
    return count


def _buckets_worker(paths: list[str]) -> list[list[tuple]]:
    import torch
    import torch.distributed as dist

    from hplab.comm import CommTimeout
    from hplab.dist import Mesh
    from hplab.models.gpt import build_model, config_from_preset

    mesh = Mesh.create(dp=dist.get_world_size())
    comm, n, r = mesh.world, mesh.world.size, mesh.world.rank
    config = config_from_preset("tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    batches = [torch.randint(0, config.vocab_size, (2 * n, config.n_positions + 1),
                             generator=torch.Generator().manual_seed(step)) for step in range(2)]

    # the reference: one process, the whole global batch
    reference_model = build_model(config, seed=0)
    reference = []
    for batch in batches:
        reference_model.zero_grad()
        reference_model(batch[:, :-1], batch[:, 1:])[1].backward()
        reference.append([p.grad.clone() for p in reference_model.parameters()])

    # spy on all_reduce launches, to see whether they start while backward is still running
    launches = []
    real_all_reduce = comm.all_reduce

    def spying_all_reduce(tensor, *args, **kwargs):
        launches.append(time.perf_counter())
        return real_all_reduce(tensor, *args, **kwargs)

    comm.all_reduce = spying_all_reduce
    per_file = []
    for path in paths:
        results = []
        try:
            module = load_module(path)
        except Exception as err:
            per_file.append([("import", False, _describe_exception(err, path))])
            continue
        for bucket_bytes, label in ((math.inf, "bucket_bytes=inf"), (0, "bucket_bytes=0"),
                                    (20_000, "bucket_bytes=20000")):
            model = build_model(config, seed=0)
            params = list(model.parameters())
            grad_bytes = sum(p.numel() * p.element_size() for p in params)
            buckets = _expected_bucket_count(params, bucket_bytes)
            problem = None
            try:
                sync = module.BucketedAllReduce(params, comm, bucket_bytes)
                for step, batch in enumerate(batches):
                    mine = batch[r * 2:(r + 1) * 2]
                    model.zero_grad()
                    mesh.ledger.reset()
                    launches.clear()
                    model(mine[:, :-1], mine[:, 1:])[1].backward()
                    backward_done = time.perf_counter()
                    sync.wait()
                    stats = mesh.ledger.as_dict().get("all_reduce", {"calls": 0, "bytes": 0})
                    names = [name for name, _ in model.named_parameters()]
                    wrong = [(name, p.grad, ref) for name, p, ref in
                             zip(names, params, reference[step])
                             if p.grad is None or not torch.allclose(p.grad, ref, RTOL, ATOL)]
                    if wrong:
                        name, got, ref = wrong[0]
                        problem = (f"step {step + 1}: {len(wrong)} of {len(params)} gradients "
                                   f"are not the global-batch average; first {name}: " +
                                   ("its .grad is None" if got is None else
                                    _first_difference(got, ref)))
                    elif stats["calls"] != buckets:
                        problem = (f"step {step + 1}: {stats['calls']} all-reduce calls, but the "
                                   f"bucket rule gives {buckets} bucket(s) for {len(params)} "
                                   f"parameters of {grad_bytes:,} bytes")
                    elif stats["bytes"] != grad_bytes:
                        problem = (f"step {step + 1}: all-reduced {stats['bytes']:,} bytes, the "
                                   f"gradients are {grad_bytes:,}: send each gradient once")
                    elif buckets > 1 and not launches[0] < backward_done:
                        problem = (f"step {step + 1}: the first all-reduce started after "
                                   "backward returned: launch each bucket from a gradient "
                                   "hook as soon as it is complete")
                    if problem:
                        break
            except CommTimeout as err:
                results.append((label, False, f"{err} — are the buckets launched in the same "
                                "order on every rank?"))
                break
            except Exception as err:
                results.append((label, False, _describe_exception(err, path)))
                break
            results.append((label, problem is None, problem or
                            f"gradients equal one process's, {buckets} all-reduce(s) of "
                            f"{grad_bytes:,} bytes per step" +
                            (", first launched during backward" if buckets > 1 else "")))
        per_file.append(results)
    return per_file


# --- lab 03: the ZeRO-1 step (2 processes) ---------------------------------------------------

ZERO1_LR, ZERO1_STEPS = 1e-2, 3


def _zero1_worker(paths: list[str]) -> list[list[tuple]]:
    """On every rank: train with the learner's ZeRO1 on this rank's half of each batch; compare
    with one process's AdamW on the whole batch (gradient = mean of the two halves' gradients,
    added in the same order as the reduce-scatter, so fp32 agrees to the last bits)."""
    import torch
    import torch.distributed as dist

    from hplab.comm import CommTimeout
    from hplab.dist import Mesh
    from hplab.models.gpt import build_model, config_from_preset

    mesh = Mesh.create(dp=dist.get_world_size())
    comm, n, r = mesh.world, mesh.world.size, mesh.world.rank
    config = config_from_preset("tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    batches = [torch.randint(0, config.vocab_size, (2 * n, config.n_positions + 1),
                             generator=torch.Generator().manual_seed(step))
               for step in range(ZERO1_STEPS)]

    # the reference: one process, the whole global batch, an ordinary AdamW
    reference_model = build_model(config, seed=0)
    names = [name for name, _ in reference_model.named_parameters()]
    reference_optimizer = torch.optim.AdamW(reference_model.parameters(), lr=ZERO1_LR,
                                            weight_decay=0.0, foreach=False)
    reference_params, reference_grads = [], []
    for batch in batches:
        grads = None
        for k in range(n):
            reference_model.zero_grad()
            part = batch[k * 2:(k + 1) * 2]
            reference_model(part[:, :-1], part[:, 1:])[1].backward()
            mine = [p.grad / n for p in reference_model.parameters()]
            grads = mine if grads is None else [g + m for g, m in zip(grads, mine)]
        for p, g in zip(reference_model.parameters(), grads):
            p.grad = g
        reference_grads.append(torch.cat([g.reshape(-1) for g in grads]))
        reference_optimizer.step()
        reference_params.append([p.detach().clone() for p in reference_model.parameters()])
    numel = reference_grads[0].numel()
    shard = math.ceil(numel / n)
    flat_bytes = 4 * shard * n

    per_file = []
    for path in paths:
        results = []
        try:
            module = load_module(path)
            model = build_model(config, seed=0)
            opt = module.ZeRO1(list(model.parameters()), comm, lr=ZERO1_LR)
        except Exception as err:
            per_file.append([("import", False, _describe_exception(err, path))])
            continue
        for step, batch in enumerate(batches):
            label = f"step {step + 1}"
            mine = batch[r * 2:(r + 1) * 2]
            model.zero_grad()
            model(mine[:, :-1], mine[:, 1:])[1].backward()
            mesh.ledger.reset()
            try:
                opt.step()
            except CommTimeout as err:
                results.append((label, False, f"{err} — do all ranks call the same collectives "
                                "in the same order?"))
                break
            except Exception as err:
                results.append((label, False, _describe_exception(err, path)))
                break
            used = mesh.ledger.as_dict()
            rs = used.get("reduce_scatter", {"calls": 0, "bytes": 0})
            ag = used.get("all_gather", {"calls": 0, "bytes": 0})
            others = sorted(op for op in used if op not in ("reduce_scatter", "all_gather"))
            expected_grad = torch.zeros(shard * n)
            expected_grad[:numel] = reference_grads[step]
            expected_grad = expected_grad[r * shard:(r + 1) * shard]
            master_grad = getattr(getattr(opt, "master", None), "grad", None)
            state = [t for s in opt.optimizer.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.dim() > 0]
            state_numel = sum(t.numel() for t in state)
            wrong = [(name, p, ref) for name, p, ref in
                     zip(names, model.parameters(), reference_params[step])
                     if not torch.allclose(p.detach(), ref, RTOL, ATOL)]
            if others:
                problem = (f"used {', '.join(others)}: ZeRO-1 needs only a reduce-scatter of the "
                           "gradients and an all-gather of the parameters")
            elif master_grad is None:
                problem = "self.master.grad is None: give my shard its gradient before stepping"
            elif master_grad.shape != expected_grad.shape or not torch.allclose(
                    master_grad, expected_grad, RTOL, ATOL):
                ratio = (float(master_grad.norm() / expected_grad.norm())
                         if master_grad.shape == expected_grad.shape else float("nan"))
                problem = ("self.master.grad is not my shard of the global-batch average "
                           "gradient: " + (f"shape {tuple(master_grad.shape)}, expected "
                                           f"{tuple(expected_grad.shape)}"
                                           if master_grad.shape != expected_grad.shape else
                                           _first_difference(master_grad, expected_grad)) +
                           (f" — it is {ratio:.3g}× too large: divide by n" if
                            abs(ratio - n) < 1e-3 else ""))
            elif wrong:
                name, got, ref = wrong[0]
                problem = (f"{len(wrong)} of {len(names)} parameters differ from one process's "
                           f"AdamW; first {name}: " + _first_difference(got.detach(), ref))
            elif state_numel != 2 * shard:
                problem = (f"the optimizer holds {state_numel:,} state elements; AdamW on my "
                           f"shard holds 2 × {shard:,}")
            elif (rs["calls"], rs["bytes"], ag["calls"], ag["bytes"]) != (1, flat_bytes, 1,
                                                                          flat_bytes):
                problem = (f"{rs['calls']} reduce-scatter(s) of {rs['bytes']:,} B and "
                           f"{ag['calls']} all-gather(s) of {ag['bytes']:,} B; expected one "
                           f"each of the padded flat buffer, {flat_bytes:,} B")
            else:
                problem = None
            results.append((label, problem is None, problem or
                            f"params equal one process's AdamW; one reduce-scatter + one "
                            f"all-gather of {flat_bytes:,} B; Adam state {2 * shard:,} elements "
                            f"= 2 × Ψ/{n}"))
            if problem:
                break
        per_file.append(results)
    return per_file


# --- lab 04: column- and row-parallel linear layers, f and g (2 processes) ---------------------

TP_CASES = [(2, 8, 16), (3, 5, 24)]  # (b, s, h): the MLP is h → 4h → h


def _tp_linear_worker(paths: list[str]) -> list[list[tuple]]:
    """On every rank: the learner's column → GeLU → row MLP against the whole MLP in one
    process (the same seed, the same X); compare output, gradients and collectives."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    from hplab.comm import CommTimeout
    from hplab.dist import Mesh

    mesh = Mesh.create(tp=dist.get_world_size())
    comm, n, r = mesh.tp, mesh.tp.size, mesh.tp.rank

    def full_layers(h):
        torch.manual_seed(h)
        return nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    per_file = []
    for path in paths:
        results = []
        try:
            module = load_module(path)
        except Exception as err:
            per_file.append([("import", False, _describe_exception(err, path))])
            continue
        for b, s, h in TP_CASES:
            case = f"b={b} s={s} h={h}"
            g = torch.Generator().manual_seed(b * s * h)
            x_full, weights_r = torch.randn(b, s, h, generator=g), torch.randn(b, s, h, generator=g)
            fc, proj = full_layers(h)  # the reference, one process
            x_ref = x_full.clone().requires_grad_()
            z_ref = proj(F.gelu(fc(x_ref)))
            (z_ref * weights_r).sum().backward()
            rows = slice(r * 4 * h // n, (r + 1) * 4 * h // n)
            expected = {"column.weight": fc.weight.grad[rows], "column.bias": fc.bias.grad[rows],
                        "row.weight": proj.weight.grad[:, rows], "row.bias": proj.bias.grad}
            fc, proj = full_layers(h)  # fresh copies for the learner
            x = x_full.clone().requires_grad_()
            mesh.ledger.reset()
            try:
                column = module.ColumnParallelLinear(fc, comm)
                row = module.RowParallelLinear(proj, comm)
                z = row(F.gelu(column(x)))
                forward_comm = mesh.ledger.as_dict()
                mesh.ledger.reset()
                (z * weights_r).sum().backward()
                backward_comm = mesh.ledger.as_dict()
            except CommTimeout as err:
                results.append((case, False, f"{err} — do all ranks call the same collectives "
                                "in the same order?"))
                break
            except Exception as err:
                results.append((case, False, _describe_exception(err, path)))
                break
            z_bytes = z_ref.numel() * 4
            # forward output
            if z.shape != z_ref.shape:
                results.append((f"{case}: forward", False, f"Z has shape {tuple(z.shape)}, "
                                f"expected the full output {tuple(z_ref.shape)} on every rank"))
            elif not torch.allclose(z, z_ref, RTOL, ATOL):
                ratio = float((z - proj.bias).norm() / (z_ref - proj.bias).norm())
                hint = (" — the bias is added before the all-reduce, so it counts T times: "
                        "add it once, after g") if torch.allclose(
                    z, z_ref + (n - 1) * proj.bias, RTOL, ATOL) else (
                    " — only this rank's partial sum: g must all-reduce it"
                    if abs(ratio - 1) > 1e-3 else "")
                results.append((f"{case}: forward", False, "Z differs from the whole MLP: "
                                + _first_difference(z.detach(), z_ref.detach()) + hint))
            else:
                results.append((f"{case}: forward", True, "Z equals the whole MLP's output"))
            # the input gradient: f's backward
            if x.grad is None or not torch.allclose(x.grad, x_ref.grad, RTOL, ATOL):
                results.append((f"{case}: X.grad", False, "X.grad is not the single-process "
                                "gradient: " + ("None" if x.grad is None else
                                                _first_difference(x.grad, x_ref.grad)) +
                                " — f's backward must all-reduce: each rank holds only its "
                                "slice's contribution"))
            else:
                results.append((f"{case}: X.grad", True, "equals the single-process gradient "
                                "(f summed the ranks' contributions)"))
            # the parameter gradients: each a slice of the single-process gradient
            got = {"column.weight": column.weight, "column.bias": column.bias,
                   "row.weight": row.weight, "row.bias": row.bias}
            wrong = []
            for name, ref in expected.items():
                p = got[name]
                if not isinstance(p, nn.Parameter) or p.grad is None:
                    wrong.append(f"{name} is not a Parameter with a gradient")
                elif p.shape != ref.shape:
                    wrong.append(f"{name} has shape {tuple(p.shape)}, expected this rank's "
                                 f"slice {tuple(ref.shape)}")
                elif not torch.allclose(p.grad, ref, RTOL, ATOL):
                    wrong.append(f"{name}.grad: " + _first_difference(p.grad, ref))
            results.append((f"{case}: parameter gradients", not wrong, "; ".join(wrong) or
                            "each equals this rank's slice of the single-process gradient"))
            # communication: one all-reduce of Z in forward, one of X.grad in backward
            seen = {phase: {op: (v["calls"], v["bytes"]) for op, v in used.items()}
                    for phase, used in (("forward", forward_comm), ("backward", backward_comm))}
            want = {"all_reduce": (1, z_bytes)}
            bad = [f"{phase}: {used or 'nothing'}" for phase, used in seen.items() if used != want]
            results.append((f"{case}: communication", not bad,
                            ("expected exactly one all-reduce of b·s·h·4 = "
                             f"{z_bytes:,} B in forward and one in backward; saw (calls, bytes) "
                             + "; ".join(bad)) if bad else
                            f"one all-reduce of {z_bytes:,} B in forward (g), one in backward (f)"))
        per_file.append(results)
    return per_file


# --- lab 05: the 1F1B action order (simulated: a schedule is data) ---------------------------

ONE_F_ONE_B_GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 12)]


def check_one_f_one_b(path: str) -> list[Result]:
    """The learner's per-rank orders, run by `hplab.pp.simulate` with their sends and receives,
    against the reference 1F1B schedule of `hplab.pp` over a grid of (p, m)."""
    from hplab import pp

    try:
        module = load_module(path)
    except Exception as err:
        return [Result("import", False, _describe_exception(err, path))]
    results = []
    for name, grid in (("p=2", [g for g in ONE_F_ONE_B_GRID if g[0] == 2]),
                       ("p=3, 4", [g for g in ONE_F_ONE_B_GRID if g[0] in (3, 4)]),
                       ("p=8", [g for g in ONE_F_ONE_B_GRID if g[0] == 8])):
        problem = None
        for p, m in grid:
            where = f"p={p}, m={m}"
            reference = pp.one_f_one_b_order(p, m)
            try:
                mine = module.one_f_one_b(p, m)
            except Exception as err:
                problem = _describe_exception(err, path)
                break
            if not isinstance(mine, (list, tuple)) or len(mine) != p:
                problem = f"{where}: expected a list of {p} per-rank orders, got {mine!r:.80}"
                break
            work = sorted((kind, i) for kind in ("F", "B") for i in range(m))
            for r in range(p):
                order = [tuple(a) for a in mine[r]]
                if sorted(order) != work:
                    extra = sorted(set(order) - set(work))
                    missing = sorted(set(work) - set(order))
                    repeated = sorted({a for a in order if order.count(a) > 1})
                    problem = (f"{where}, rank {r}: every rank runs F and B of each microbatch "
                               "exactly once;" + (f" missing {missing[:4]}" if missing else "")
                               + (f" repeated {repeated[:4]}" if repeated else "")
                               + (f" unexpected {extra[:4]}" if extra else ""))
                    break
            if problem:
                break
            orders = [[(kind, i, r) for kind, i in mine[r]] for r in range(p)]
            try:
                simulation = pp.simulate(pp.add_communication(orders, p, 1), f=1, b=1, w=0)
            except pp.DeadlockError as err:
                problem = f"{where}: {err}"
                break
            best = pp.simulate(pp.build_schedule("1f1b", p, m), f=1, b=1, w=0)
            held = [simulation.in_flight_max(r) for r in range(p)]
            limit = [min(p - r, m) for r in range(p)]
            if simulation.makespan > best.makespan:
                problem = (f"{where}: the step takes {simulation.makespan:g} time units, 1F1B "
                           f"{best.makespan:g} (= 2(m+p-1)): too few forwards in flight "
                           "before the first backward")
            elif held != limit:
                problem = (f"{where}: ranks hold at most {held} microbatches' activations, 1F1B "
                           f"{limit} (min(p-r, m)): " + ("more warm-up forwards than needed"
                                                         if any(h > l for h, l in
                                                                zip(held, limit)) else
                                                         "fewer than needed"))
            else:
                for r in range(p):
                    order = [tuple(a) for a in mine[r]]
                    want = [(kind, i) for kind, i, _ in reference[r]]
                    if order != want:
                        k = next(j for j, (a, b) in enumerate(zip(order, want)) if a != b)
                        problem = (f"{where}, rank {r}: action {k} is {order[k][0]}{order[k][1]}, "
                                   f"1F1B runs {want[k][0]}{want[k][1]} (same step time and "
                                   "memory, another order)")
                        break
            if problem:
                break
        results.append(Result(name, problem is None, problem or
                              f"equal to 1F1B for m = 1 ... 12: no deadlock, step 2(m+p-1), "
                              f"rank r holds min(p-r, m) microbatches"))
    return results


# --- lab 06: the device mesh (no processes: numbering is arithmetic) ------------------------

MESH_LAYOUTS = [(dp, tp, pp) for dp in (1, 2, 3, 4) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4)]
MESH_SHARED = {"tp": "dp and pp", "dp": "tp and pp", "pp": "dp and tp"}


def _numbering(order: tuple[str, ...]):
    """coordinates(rank, dp, tp, pp) of a numbering in which order[0] varies fastest: the
    reference is ("tp", "dp", "pp"); the others name a learner's mix-up."""
    def coordinates(rank, dp, tp, pp):
        sizes, coords, stride = {"dp": dp, "tp": tp, "pp": pp}, {}, 1
        for family in order:
            coords[family] = rank // stride % sizes[family]
            stride *= sizes[family]
        return coords["dp"], coords["tp"], coords["pp"]
    return coordinates


def _mesh_hint(coordinates) -> str:
    """Name the numbering or the tuple order the learner's coordinates follow, if they follow
    another one consistently."""
    from hplab.dist import coordinates as reference

    layouts = [(r, lay) for lay in MESH_LAYOUTS for r in range(math.prod(lay))]
    try:
        mine = [tuple(coordinates(r, *lay)) for r, lay in layouts]
    except Exception:
        return ""
    for order in itertools.permutations(("tp", "dp", "pp")):
        theirs = _numbering(order)
        if order != ("tp", "dp", "pp") and mine == [theirs(r, *lay) for r, lay in layouts]:
            return (f" — you number {order[0]} fastest, then {order[1]}, then {order[2]}; "
                    "Megatron's order is tp fastest, then dp, then pp")
    wanted = [reference(r, *lay) for r, lay in layouts]
    for perm in itertools.permutations(range(3)):
        if perm != (0, 1, 2) and mine == [tuple(c[i] for i in perm) for c in wanted]:
            names = ", ".join(("dp", "tp", "pp")[i] for i in perm)
            return f" — you return ({names}); return (dp_rank, tp_rank, pp_rank) in that order"
    return ""


def check_mesh(path: str) -> list[Result]:
    """The learner's coordinates and groups against `hplab.dist` (which builds the real
    process groups) for every rank of 64 layouts, dp ≤ 4, tp ≤ 8, pp ≤ 4."""
    from hplab.dist import coordinates, group_ranks

    try:
        module = load_module(path)
    except Exception as err:
        return [Result("import", False, _describe_exception(err, path))]
    biggest = max(math.prod(lay) for lay in MESH_LAYOUTS)
    problem = None
    try:
        for dp, tp, pp in MESH_LAYOUTS:
            for rank in range(dp * tp * pp):
                mine = module.coordinates(rank, dp, tp, pp)
                want = coordinates(rank, dp, tp, pp)
                if not isinstance(mine, (tuple, list)) or tuple(mine) != want:
                    problem = (f"rank {rank} of dp{dp}×tp{tp}×pp{pp}: you say (dp, tp, pp) = "
                               f"{mine!r:.60}, expected {want}" + _mesh_hint(module.coordinates))
                    break
            if problem:
                break
    except Exception as err:
        problem = _describe_exception(err, path)
    results = [Result("coordinates", problem is None, problem or
                      f"every rank of {len(MESH_LAYOUTS)} layouts (1 to {biggest} ranks)")]
    try:
        mine_by_layout = {lay: module.groups(*lay) for lay in MESH_LAYOUTS}
    except Exception as err:
        return results + [Result("groups", False, _describe_exception(err, path))]
    for family in ("tp", "dp", "pp"):
        problem = None
        for lay in MESH_LAYOUTS:
            where, n = "dp{}×tp{}×pp{}".format(*lay), math.prod(lay)
            want = group_ranks(*lay)[family]
            mine = mine_by_layout[lay]
            if not isinstance(mine, dict) or family not in mine:
                problem = (f"{where}: groups() returned {mine!r:.60}, expected a dict with keys "
                           "'tp', 'dp' and 'pp'")
                break
            try:
                got = [list(g) for g in mine[family]]
            except TypeError:
                problem = (f"{where}: {family} should be a list of lists of ranks, got "
                           f"{mine[family]!r:.60}")
                break
            unsorted = [g for g in got if g != sorted(g)]
            if unsorted:
                problem = (f"{where}: {family} group {unsorted[0]} is not in increasing order "
                           "(a group's rank 0 is its smallest global rank)")
                break
            for rank in range(n):
                holding = [g for g in got if rank in g]
                expected = next(g for g in want if rank in g)
                if len(holding) != 1:
                    problem = (f"{where}: rank {rank} is in {len(holding)} {family} groups, "
                               f"expected exactly one: {expected}")
                elif holding[0] != expected:
                    problem = (f"{where}: rank {rank}'s {family} group is {holding[0]}, expected "
                               f"{expected} (the ranks that share its {MESH_SHARED[family]} "
                               "coordinates)")
                if problem:
                    break
            if not problem and sorted(got) != sorted(want):
                problem = f"{where}: {len(got)} {family} groups, expected {len(want)}: {want}"
            if problem:
                break
        results.append(Result(f"groups: {family}", problem is None, problem or
                              f"every {family} group of the {len(MESH_LAYOUTS)} layouts"))
    return results


# --- lab 07: the planner's first formulas (no processes: these are formulas) ---------------

def check_planning(path: str) -> list[Result]:
    """The learner's ZeRO memory and pipeline bubble against `hplab.plan` over a grid."""
    from hplab import plan

    try:
        module = load_module(path)
    except Exception as err:
        return [Result("import", False, _describe_exception(err, path))]
    results = []
    for precision in ("fp32", "bf16"):
        for zero in range(4):
            label = f"model_state_bytes_per_gpu(zero={zero}, {precision})"
            wrong = None
            try:
                for psi in (1.5e9, 175e9, 335_232):
                    for dp in (1, 3, 8, 64):
                        mine = module.model_state_bytes_per_gpu(psi, dp, zero, precision)
                        ref = plan.model_state_bytes(psi, dp, zero, precision)["total_bytes"]
                        if not math.isclose(mine, ref, rel_tol=1e-9):
                            wrong = (f"Ψ={psi:g}, dp={dp}: you say {mine:,.0f} bytes, the "
                                     f"planner {ref:,.0f} ({ref / psi:g} bytes per parameter)")
                            break
                    if wrong:
                        break
            except Exception as err:
                wrong = _describe_exception(err, path)
            results.append(Result(label, wrong is None, wrong or "equal over Ψ and dp"))
    wrong = None
    try:
        for pp in (1, 2, 4, 8):
            for m in (1, 4, 8, 32):
                mine = module.bubble_fraction(pp, m)
                ref = plan.bubble_fraction("1f1b", pp, m)
                if not math.isclose(mine, ref, rel_tol=1e-9, abs_tol=1e-12):
                    wrong = f"pp={pp}, m={m}: you say {mine:.4g}, the planner {ref:.4g}"
                    break
            if wrong:
                break
    except Exception as err:
        wrong = _describe_exception(err, path)
    results.append(Result("bubble_fraction", wrong is None, wrong or "equal for pp ≤ 8, m ≤ 32"))
    return results


# --- running a check ------------------------------------------------------------------------

EXERCISES = {
    # name: (lab, default file, processes or 0 for in-process, worker)
    "memory": ("00", "lab00_memory.py", 0, None),
    "ring_allreduce": ("01", "lab01_ring_allreduce.py", 4, _ring_worker),
    "buckets": ("02", "lab02_buckets.py", 2, _buckets_worker),
    "zero1": ("03", "lab03_zero1.py", 2, _zero1_worker),
    "tp_linear": ("04", "lab04_tp_linear.py", 2, _tp_linear_worker),
    "one_f_one_b": ("05", "lab05_1f1b.py", 0, None),
    "mesh": ("06", "lab06_mesh.py", 0, None),
    "planning": ("07", "lab07_planning.py", 0, None),
}


def run_check(name: str, paths: list[str | Path]) -> list[list[Result]]:
    """Check several files for one exercise in one launch; per file, its Results."""
    from hplab.dist import run_distributed

    if name not in EXERCISES:
        raise CheckError(f"unknown exercise {name!r}: choose one of {', '.join(EXERCISES)}")
    paths = [str(Path(p).resolve()) for p in paths]
    for p in paths:
        if not Path(p).is_file():
            raise CheckError(f"no such file: {p}")
    _, _, nproc, worker = EXERCISES[name]
    if nproc == 0:
        check = {"memory": check_memory, "one_f_one_b": check_one_f_one_b,
                 "mesh": check_mesh, "planning": check_planning}[name]
        return [check(p) for p in paths]
    previous = os.environ.get("HPLAB_TIMEOUT_S")
    os.environ["HPLAB_TIMEOUT_S"] = COLLECTIVE_TIMEOUT_S  # read by the spawned processes
    try:
        by_rank = run_distributed(worker, nproc, paths, timeout_s=120)
    finally:
        if previous is None:
            os.environ.pop("HPLAB_TIMEOUT_S", None)
        else:
            os.environ["HPLAB_TIMEOUT_S"] = previous
    merged = []
    for f in range(len(paths)):
        results = []
        for c, (case, _, message) in enumerate(by_rank[0][f]):
            failing = [(rank, rows[f][c]) for rank, rows in enumerate(by_rank)
                       if c < len(rows[f]) and not rows[f][c][1]]
            if failing:
                _, (_, _, why) = failing[0]
                ranks = ", ".join(str(k) for k, _ in failing)
                results.append(Result(case, False, f"{why} (rank{'s' * (len(failing) > 1)} "
                                      f"{ranks})"))
            else:
                results.append(Result(case, True, message))
        merged.append(results)
    return merged


def report(name: str, path: str, results: list[Result]) -> str:
    lab, _, nproc, _ = EXERCISES[name]
    where = f"on {nproc} processes" if nproc else "in this process"
    lines = [f"check {name} (lab {lab}) {where}: {path}"]
    lines += [f"  {'✓' if r.passed else '✗'} {r.name}: {r.message}" for r in results]
    failed = sum(not r.passed for r in results)
    lines.append(f"PASS: all {len(results)} checks passed" if not failed else
                 f"FAIL: {failed} of {len(results)} checks failed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hplab.check", description="Check a lab exercise against the reference.",
        epilog="exercises: " + ", ".join(f"{n} (lab {v[0]})" for n, v in EXERCISES.items()))
    parser.add_argument("name", help="the exercise: " + ", ".join(EXERCISES))
    parser.add_argument("file", nargs="?", help="your file (default: labs/exercises/...)")
    args = parser.parse_args(argv)
    try:
        if args.name not in EXERCISES:
            raise CheckError(f"unknown exercise {args.name!r}: choose one of "
                             f"{', '.join(EXERCISES)}")
        path = args.file or str(EXERCISES_DIR / EXERCISES[args.name][1])
        results = run_check(args.name, [path])[0]
    except CheckError as err:
        print(f"hplab: error: {err}", file=sys.stderr)
        return 2
    shown = os.path.relpath(path)
    print(report(args.name, shown if not shown.startswith("..") else path, results))
    return 0 if all(r.passed for r in results) and results else 1


if __name__ == "__main__":
    sys.exit(main())
