"""Check a lab exercise: `python -m hplab.check NAME [FILE]`.

Each lab ends with an exercise in `labs/exercises/`. This command loads your file, runs it the
way hplab runs its own code — on several real processes when the idea is distributed — compares
it with the reference (measured bytes, sums computed independently, the gradient one process
computes on the whole batch) and says precisely what differs:

    python -m hplab.check memory              # lab 00: count training memory by hand
    python -m hplab.check buckets my_copy.py  # lab 02, your own copy of the exercise
    python -m hplab.check --help              # every exercise, and its lab

Exit code 0 when every check passes, 1 when one fails, 2 for a wrong command line. A file that
raises, exits or runs past the time limit fails with one line saying so.
Reference solutions are in `labs/solutions/` (peek only after trying).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import math
import os
import signal
import sys
import traceback
from collections import Counter, namedtuple
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hplab import formulas, schedule
from hplab.comm import CommTimeout, bucket_params
from hplab.dist import Mesh, coordinates, group_ranks, run_distributed
from hplab.memory import MemoryLedger, model_state_tensors
from hplab.models.gpt import build_model, config_from_preset

EXERCISES_DIR, SOLUTIONS_DIR = (Path(__file__).resolve().parent.parent / "labs" / folder
                                for folder in ("exercises", "solutions"))
RTOL, ATOL = 1e-5, 1e-6  # fp32 sums added in a different order agree to about this
FILE_LIMIT_S = 120.0  # for one file's whole check; the solutions need a few seconds


class CheckError(ValueError):
    """A wrong command line: unknown exercise or missing file."""


class CheckTimeout(BaseException):
    """A file ran past its time limit (not an Exception: a learner's `except` cannot eat it)."""


def _expire(*_):  # SIGALRM's handler while a file is checked
    raise CheckTimeout


Result = namedtuple("Result", "name passed message")  # one check on one file, and what was seen


def differs(got, expected) -> str | None:
    """None when tensor `got` equals `expected` up to fp32 rounding (RTOL, ATOL), else what
    differs: 'k of N elements differ; worst at [i, j]: got a, expected b'."""
    if got is None or got.shape != expected.shape:
        return "it is None" if got is None else (f"shape {tuple(got.shape)}, expected "
                                                 f"{tuple(expected.shape)}")
    got, expected = got.detach().double(), expected.detach().double()
    err = (got - expected).abs().nan_to_num(math.inf)
    bad = int((err > ATOL + RTOL * expected.abs()).sum())
    if not bad:
        return None
    index = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
    return (f"{bad} of {expected.numel()} elements differ; worst at {list(index)}: got "
            f"{float(got[index]):.6g}, expected {float(expected[index]):.6g}")


def first_wrong(names, tensors, expected, what: str) -> str | None:
    """'k of N {what}; first NAME: how it differs', or None when every tensor is right."""
    wrong = [(name, d) for name, t, e in zip(names, tensors, expected) if (d := differs(t, e))]
    return wrong and f"{len(wrong)} of {len(names)} {what}; first {wrong[0][0]}: {wrong[0][1]}"


def first(problems) -> str | None:
    """The first problem (a non-empty message) the iterable yields: a check stops there."""
    return next(filter(None, problems), None)


def ops_used(ledger) -> dict[str, tuple[int, int]]:
    """What the CommLedger counted since its last reset: {op: (calls, bytes)}."""
    return {op: (v["calls"], v["bytes"]) for op, v in ledger.as_dict().items()}


class Report:
    """One file's Results. `with report.case(label):` runs one case: an exception from the
    learner's code (SystemExit too) fails it, and the next case runs. On several processes the
    others could be left waiting: a distributed check only sets `report.label`, and an exception
    ends the file's check, failing that case (check_files)."""

    def __init__(self, path: str, hint: str = ""):  # hint: what a CommTimeout usually means
        self.path, self.hint, self.results, self.label = path, hint, [], "import"

    def add(self, label: str, problem: str | None, success: str) -> None:
        self.results.append(Result(label, not problem, problem or success))

    @contextmanager
    def case(self, label: str):
        self.label = label
        try:
            yield
        except (KeyboardInterrupt, CheckTimeout):
            raise
        except BaseException as err:  # self.label: the innermost case it came from
            self.add(self.label, self.describe(err), "")

    def describe(self, err: BaseException) -> str:
        """One line for an exception the learner's code raised."""
        if isinstance(err, NotImplementedError):
            return f"not implemented yet ({err})"
        if isinstance(err, SystemExit):
            return f"your file called sys.exit({err.code!r}): a checked file must not exit"
        if isinstance(err, CommTimeout):
            return f"{err} — {self.hint}" if self.hint else str(err)
        lines = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == self.path]
        where = f" at line {lines[-1].lineno}: {lines[-1].line}" if lines else ""
        return f"raised {type(err).__name__}: {err}{where}"


# --- lab 00: memory by hand (one process: nothing is distributed yet) ------------------------

MEMORY_SHAPES = [(4, 64, 4, 64), (2, 32, 2, 16), (3, 48, 3, 40)]  # n_layer, n_embd, n_head, S


def check_memory(module, report: Report, _=None) -> None:
    """The learner's Ψ and model-state bytes against the model's parameters and what the
    MemoryLedger measures after one AdamW step, for three model shapes."""
    for L, h, a, S in MEMORY_SHAPES:
        config = config_from_preset("tiny", n_layer=L, n_embd=h, n_head=a, seq_len=S)
        V, model = config.vocab_size, build_model(config, seed=0)
        x = torch.randint(0, V, (2, S))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        model(x, x)[1].backward()
        opt.step()
        psi, measured = (sum(p.numel() for p in model.parameters()),
                         MemoryLedger().measure(model_state_tensors(model, opt)))
        label = f"V={V} S={S} h={h} L={L}"
        with report.case(f"num_params({label})"):
            mine = module.num_params(config)
            hint = {V * h: "the LM head shares the token embedding: count it once",
                    -S * h: "the position embeddings are parameters too",
                    -2 * h: "the final layer norm ln_f has 2h parameters",
                    -L * 4 * h: "each block has two layer norms of 2h parameters",
                    -L * 9 * h: "every linear layer has a bias"}.get(mine - psi)
            report.add(report.label, mine != psi and f"you count {mine:,}, the model has {psi:,} "
                       f"(you are off by {mine - psi:+,})" + f" — {hint}" * bool(hint),
                       f"Ψ = {mine:,}")
        with report.case(f"model_state_bytes({label})"):
            claimed = module.model_state_bytes(config)
            wrong = [f"{kind}: you say {claimed.get(kind)!r}, measured {measured[kind]:,} "
                     f"({measured[kind] / psi:g} bytes per parameter)"
                     for kind in ("params", "grads", "optim") if claimed.get(kind) != measured[kind]
                     ] if isinstance(claimed, dict) else [
                f"returned {type(claimed).__name__}, expected a dict "
                '{"params": ..., "grads": ..., "optim": ...}']
            report.add(report.label, "; ".join(wrong), "params, grads and AdamW state match the "
                       f"MemoryLedger: {sum(measured.values()):,} bytes")


# --- lab 01: ring all-reduce from send/recv (4 processes) -----------------------------------

RING_CASES = [((1000,), "float32"), ((7, 13), "float32"), ((3,), "float32"),
              ((64, 64), "float32"), ((10,), "float64")]


def check_ring(module, report: Report, mesh: Mesh) -> None:
    """On every rank, for tensors of several shapes and dtypes: the result is the sum over the
    ranks, only send and recv were used, and each rank sent 2(n-1) chunks of S/n bytes."""
    comm, n, r = mesh.world, mesh.world.size, mesh.world.rank
    for shape, dtype in RING_CASES:
        report.label = case = f"{'×'.join(map(str, shape))} {dtype}"  # an exception ends the file
        inputs = [torch.randn(shape, dtype=getattr(torch, dtype),
                              generator=torch.Generator().manual_seed(100 * k + len(shape)))
                  for k in range(n)]
        expected, tensor = sum(inputs[1:], inputs[0].clone()), inputs[r].clone()
        mesh.ledger.reset()
        module.ring_all_reduce(tensor, comm)
        used = ops_used(mesh.ledger)
        others, sent = sorted(set(used) - {"send", "recv"}), used.get("send", (0, 0))[1]
        size, numel = tensor.element_size(), tensor.numel()
        low, high = (2 * (n - 1) * chunk * size for chunk in (numel // n, math.ceil(numel / n)))
        ideal = 2 * (n - 1) * size * numel / n
        report.add(case, first([
            others and f"used {', '.join(others)}: build it from send and recv only",
            (d := differs(tensor, expected)) and f"the result is not the sum over the ranks: {d}",
            not low <= sent <= high and f"sent {sent:,} bytes; a ring all-reduce sends 2(n-1) "
            f"chunks of S/n = {ideal:,.0f} bytes: one chunk per step, not the whole tensor"]),
            f"sum correct, {sent:,} bytes sent (2(n-1)/n·S = {ideal:,.0f})")


# --- labs 02 and 03: a tiny GPT trained on n ranks against one process -----------------------

ZERO1_LR, ZERO1_STEPS = 1e-2, 3


def gpt_reference(steps: int, lr: float = 0.0) -> SimpleNamespace:
    """A dp mesh, `steps` global batches of 2 sequences per rank (`rows`: this rank's) and one
    process's result on each: the global-batch gradient (the ranks' parts added in rank order like
    a reduce-scatter, so fp32 agrees to the last bits) and the params after AdamW with `lr`."""
    mesh = Mesh.create(dp=dist.get_world_size())
    n, r = mesh.world.size, mesh.world.rank
    config = config_from_preset("tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    batches = [torch.randint(0, config.vocab_size, (n, 2, config.n_positions + 1),
                             generator=torch.Generator().manual_seed(step))
               for step in range(steps)]  # [step][rank]: 2 sequences of inputs + next token
    model = build_model(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
    grads, params = [], []
    for batch in batches:
        parts = []
        for rows in batch:
            model.zero_grad()
            model(rows[:, :-1], rows[:, 1:])[1].backward()
            parts.append([p.grad / n for p in model.parameters()])
        grads.append([sum(g[1:], g[0]) for g in zip(*parts)])
        for p, g in zip(model.parameters(), grads[-1]):
            p.grad = g
        opt.step()  # lr = 0 (lab 02) leaves the parameters as they are
        params.append([p.detach().clone() for p in model.parameters()])
    return SimpleNamespace(mesh=mesh, config=config, grads=grads, params=params,
                           names=[name for name, _ in model.named_parameters()],
                           rows=[(b[r, :, :-1], b[r, :, 1:]) for b in batches])


def launch_problem(started: list, params: list, arrived: list, bucket_bytes: float) -> str | None:
    """Where the (all-reduces, bytes) started — as each gradient arrived, when backward returned,
    after wait() — first differ from hplab.ddp's: bucket j (parameters in reverse) starts in the
    hook of its last gradient, once buckets 0 ... j-1 have started."""
    ready = {id(p): k + 1 for k, p in enumerate(arrived)}  # hooks run once p's has
    buckets = bucket_params(params, bucket_bytes / 2**20)
    at = list(itertools.accumulate((max(ready[id(p)] for p in b) for b in buckets), max))
    for k, mine in enumerate(started):  # k: the learner's hooks that have run
        want = (sum(t <= k for t in at), sum(p.nbytes for b, t in zip(buckets, at) if t <= k
                                             for p in b))
        if mine != want:
            when = (f"when gradient {k + 1} of {len(params)} arrived" if k < len(params) else
                    ("when backward returned", "after wait()")[k - len(params)])
            return (f"{when}, {mine[0]} all-reduce(s) of {mine[1]:,} B had started, hplab.ddp's "
                    f"{want[0]} of {want[1]:,} B — its buckets take the parameters in reverse "
                    "(backward produces the last layers' gradients first), each started by the "
                    "hook that completes it")
    return None


def check_buckets(module, report: Report, ref: SimpleNamespace) -> None:
    """One bucket, one per parameter, a middle size: one process's gradients, and the
    all-reduces of hplab.ddp's rule (buckets in reverse parameter order), each started by the
    gradient hook that completes its bucket: the overlap with backward."""
    for bucket_bytes in (math.inf, 0, 20_000):
        report.label = label = f"bucket_bytes={bucket_bytes}"  # an exception ends the file
        params = list((model := build_model(ref.config, seed=0)).parameters())

        def observe(param):  # registered before the learner's hooks: runs before theirs
            started.append(ops_used(ref.mesh.ledger).get("all_reduce", (0, 0)))
            arrived.append(param)

        for p in params:
            p.register_post_accumulate_grad_hook(observe)
        sync = module.BucketedAllReduce(params, ref.mesh.world, bucket_bytes)
        for step, rows in enumerate(ref.rows):
            model.zero_grad()
            ref.mesh.ledger.reset()
            arrived, started = [], []  # per gradient hook: the (all-reduces, bytes) before it
            model(*rows)[1].backward()
            observe(None)  # when backward returned
            sync.wait()
            observe(None)  # after wait()
            grads, n = [p.grad for p in params], ref.mesh.world.size
            wrong = first_wrong(ref.names, grads, ref.grads[step], "gradients are not the "
                                "global-batch average")
            problem = wrong and wrong + f" — it is {n}× too large: divide by n" * all(
                not differs(g, n * e) for g, e in zip(grads, ref.grads[step])) or launch_problem(
                started, params, arrived[:len(params)], bucket_bytes)
            if problem:
                break
        report.add(label, problem and f"step {step + 1}: {problem}", f"gradients equal one "
                   f"process's; {started[-1][0]} all-reduce(s) of {started[-1][1]:,} B per step, "
                   "each started by the gradient hook that completes its bucket")


def check_zero1(module, report: Report, ref: SimpleNamespace) -> None:
    """ZeRO1 on this rank's rows against one process's AdamW on the whole batch: my shard's grad,
    the params, Adam state 2 × Ψ/n, one reduce-scatter and one all-gather of the padded buffer."""
    n, r, model = ref.mesh.world.size, ref.mesh.world.rank, build_model(ref.config, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    shard, flat_bytes = math.ceil(numel / n), 4 * n * math.ceil(numel / n)  # padded, fp32
    report.label = "ZeRO1(params, comm, lr)"  # an exception ends the file's check (see Report)
    opt = module.ZeRO1(list(model.parameters()), ref.mesh.world, lr=ZERO1_LR)
    for step, rows in enumerate(ref.rows):
        model.zero_grad()
        model(*rows)[1].backward()
        ref.mesh.ledger.reset()
        report.label = label = f"step {step + 1}"
        opt.step()
        used = ops_used(ref.mesh.ledger)
        others = sorted(set(used) - {"reduce_scatter", "all_gather"})
        want = F.pad(torch.cat([g.reshape(-1) for g in ref.grads[step]]),
                     (0, shard * n - numel)).view(n, shard)[r]
        got = getattr(getattr(opt, "master", None), "grad", None)
        state = sum(t.numel() for s in opt.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        problem = first([
            used != dict.fromkeys(("reduce_scatter", "all_gather"), (1, flat_bytes)) and (
                f"used {', '.join(others)}: ZeRO-1 needs only a reduce-scatter of the gradients "
                "and an all-gather of the parameters" if others else f"saw (calls, bytes) {used};"
                " expected one reduce-scatter and one all-gather of the padded flat buffer, "
                f"{flat_bytes:,} B"),
            (d := differs(got, want)) and "self.master.grad is not my shard of the global-batch "
            f"average gradient: {d}" + f" — it is {n}× too large: divide by n"
            * (not differs(got, n * want)),
            first_wrong(ref.names, list(model.parameters()), ref.params[step],
                        "parameters differ from one process's AdamW"),
            state != 2 * shard and f"the optimizer holds {state:,} state elements; AdamW on my "
            f"shard holds 2 × {shard:,}"])
        report.add(label, problem, f"params equal one process's AdamW; one reduce-scatter + one "
                   f"all-gather of {flat_bytes:,} B; Adam state {2 * shard:,} elements "
                   f"= 2 × Ψ/{n}")
        if problem:
            return


# --- lab 04: column- and row-parallel linear layers, f and g (2 processes) ---------------------

TP_CASES = [(2, 8, 16), (3, 5, 24)]  # (b, s, h): the MLP is h → 4h → h


def check_tp_linear(module, report: Report, mesh: Mesh) -> None:
    """Column → GeLU → row against the whole MLP in one process (same weights, same X): Z,
    X.grad (f's backward), this rank's slice of each gradient, one all-reduce of Z each way."""
    comm, n, r = mesh.tp, mesh.tp.size, mesh.tp.rank
    for b, s, h in TP_CASES:
        case, g = f"b={b} s={s} h={h}", torch.Generator().manual_seed(b * s * h)
        x, weights = torch.randn(b, s, h, generator=g), torch.randn(b, s, h, generator=g)
        torch.manual_seed(h)
        fc, proj = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)  # the whole MLP
        mine = copy.deepcopy((fc, proj))  # the learner's copies
        x_ref, x = x.clone().requires_grad_(), x.requires_grad_()
        z_ref = proj(F.gelu(fc(x_ref)))
        (z_ref * weights).sum().backward()
        z_ref, bias = z_ref.detach(), proj.bias.detach()
        rows = slice(r * 4 * h // n, (r + 1) * 4 * h // n)  # this rank's slice of the 4h
        mesh.ledger.reset()
        report.label = case  # an exception ends the file's check (see Report)
        column, row = (module.ColumnParallelLinear(mine[0], comm),
                       module.RowParallelLinear(mine[1], comm))
        z = row(F.gelu(column(x)))
        used = {"forward": ops_used(mesh.ledger)}
        mesh.ledger.reset()
        (z * weights).sum().backward()
        used["backward"] = ops_used(mesh.ledger)
        z_bytes = z_ref.numel() * 4
        talk = {phase: ops != {"all_reduce": (1, z_bytes)} and f"{phase}: saw (calls, bytes) "
                f"{ops or 'nothing'}, expected one all-reduce of b·s·h·4 = {z_bytes:,} B"
                for phase, ops in used.items()}
        wrong = differs(z, z_ref)
        report.add(f"{case}: forward", wrong and "Z differs from the whole MLP: " + wrong + (
            " — every rank returns the full output" if z.shape != z_ref.shape else
            " — the bias is added before the all-reduce, so it counts T times: add it once, "
            "after g" if not differs(z, z_ref + (n - 1) * bias) else
            " — only this rank's partial sum: g must all-reduce it"
            if abs(float((z.detach() - bias).norm() / (z_ref - bias).norm()) - 1) > 1e-3 else ""),
            "Z equals the whole MLP's output")
        wrong = differs(x.grad, x_ref.grad)
        report.add(f"{case}: X.grad", wrong and "X.grad is not the single-process gradient: "
                   f"{wrong} — " + (f"it is {n}× too large: only f's backward all-reduces, g's "
                   "passes the gradient through" if not differs(x.grad, n * x_ref.grad) else
                   "f's backward must all-reduce: each rank holds only its slice's contribution"),
                   "equals the single-process gradient (f summed the ranks' contributions)")
        report.add(f"{case}: parameter gradients", first_wrong(
            ["column.weight.grad", "column.bias.grad", "row.weight.grad", "row.bias.grad"],
            [getattr(p, "grad", None) for p in (column.weight, column.bias, row.weight, row.bias)],
            [fc.weight.grad[rows], fc.bias.grad[rows], proj.weight.grad[:, rows], proj.bias.grad],
            "gradients are not this rank's slice of the single-process gradient"),
            "each equals this rank's slice of the single-process gradient")
        z_bytes = z_ref.numel() * 4
        bad = [f"{phase}: {ops or 'nothing'}" for phase, ops in used.items()
               if ops != {"all_reduce": (1, z_bytes)}]
        report.add(f"{case}: communication", bad and "expected exactly one all-reduce of "
                   f"b·s·h·4 = {z_bytes:,} B in forward and one in backward; saw (calls, bytes) "
                   + "; ".join(bad), f"one all-reduce of {z_bytes:,} B in forward (g), one in "
                   "backward (f)")


# --- lab 05: the 1F1B action order (simulated: a schedule is data) ---------------------------

def _one_f_one_b_problem(module, p: int, m: int) -> str | None:
    where, mine = f"p={p}, m={m}", module.one_f_one_b(p, m)
    if not isinstance(mine, (list, tuple)) or len(mine) != p:
        return f"{where}: expected a list of {p} per-rank orders, got {mine!r:.80}"
    orders = [[tuple(a) for a in mine[r]] for r in range(p)]
    work = sorted((kind, i) for kind in ("F", "B") for i in range(m))
    for r, order in enumerate(orders):
        if sorted(order) != work:
            wrong = {"missing": Counter(work) - Counter(order), "extra": Counter(order) -
                     Counter(work)}  # repeated or unknown actions
            return (f"{where}, rank {r}: every rank runs F and B of each microbatch exactly "
                    "once;" + "".join(f" {k} {sorted(v)[:4]}" for k, v in wrong.items() if v))
    try:
        run = schedule.simulate(schedule.add_communication(
            [[(kind, i, r) for kind, i in order] for r, order in enumerate(orders)], p, 1),
            f=1, b=1, w=0)
    except schedule.DeadlockError as err:
        return f"{where}: {err}"
    best = schedule.simulate(schedule.build_schedule("1f1b", p, m), f=1, b=1, w=0)
    held, limit = [run.in_flight_max(r) for r in range(p)], [min(p - r, m) for r in range(p)]
    warm = [next((k for k, (kind, _) in enumerate(o) if kind == "B"), m) for o in orders]
    counts = (f" — forwards before the first backward: {warm}, 1F1B {limit} (p-1-r warm-up "
              "forwards and one more)") * (warm != limit)
    reference = [[(kind, i) for kind, i, _ in order] for order in schedule.one_f_one_b_order(p, m)]
    other_order = [f"{where}, rank {r}: action {k} is {a[0]}{a[1]}, 1F1B runs {b[0]}{b[1]} (same "
                   "step time and memory, another order)" for r in range(p)
                   for k, (a, b) in enumerate(zip(orders[r], reference[r])) if a != b]
    return first([
        run.makespan > best.makespan and f"{where}: the step takes {run.makespan:g} time units, "
        f"1F1B {best.makespan:g} (= 2(m+p-1)): too few forwards in flight" + counts,
        held != limit and f"{where}: ranks hold at most {held} microbatches' activations, 1F1B "
        f"{limit} (min(p-r, m)) — too many forwards before their backwards: warm up with p-1-r",
        *other_order])


def check_one_f_one_b(module, report: Report, _=None) -> None:
    """The orders, run by `hplab.schedule.simulate` with their sends and receives, against 1F1B
    over (p, m): the work once, no deadlock, step 2(m+p-1), min(p-r, m) held, 1F1B's order."""
    for name, ps in (("p=2", (2,)), ("p=3, 4", (3, 4)), ("p=8", (8,))):
        with report.case(name):
            report.add(name, first(_one_f_one_b_problem(module, p, m)
                                   for p in ps for m in (1, 2, 3, 4, 8, 12)),
                       "equal to 1F1B for m = 1 ... 12: no deadlock, step 2(m+p-1), rank r "
                       "holds min(p-r, m) microbatches")


# --- lab 06: the device mesh (no processes: numbering is arithmetic) ------------------------

MESH_LAYOUTS = [(dp, tp, pp) for dp in (1, 2, 3, 4) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4)]
MESH_RANKS = [(rank, lay) for lay in MESH_LAYOUTS for rank in range(math.prod(lay))]
FAMILIES = ("dp", "tp", "pp")


def _mesh_hint(mine: list) -> str:
    """Name the numbering (which family varies fastest) or the tuple order the learner's
    coordinates of MESH_RANKS follow, if they follow another one consistently."""
    def numbering(slots):  # hplab's (tp fastest, then dp, then pp) with the families renamed
        return [dict(zip(slots, coordinates(rank, *(lay[FAMILIES.index(f)] for f in slots))))
                for rank, lay in MESH_RANKS]

    megatron = numbering(FAMILIES)
    for order in itertools.permutations(FAMILIES):
        if order != FAMILIES and mine == [tuple(c[f] for f in FAMILIES) for c in numbering(order)]:
            return (f" — you number {order[1]} fastest, then {order[0]}, then {order[2]}; "
                    "Megatron's order is tp fastest, then dp, then pp")
        if order != FAMILIES and mine == [tuple(c[f] for f in order) for c in megatron]:
            return (f" — you return ({', '.join(order)}); return (dp_rank, tp_rank, pp_rank) in "
                    "that order")
    return ""


def _group_problem(layout: tuple, family: str, mine) -> str | None:
    where, want = "dp{}×tp{}×pp{}".format(*layout), group_ranks(*layout)[family]
    try:
        got = [list(g) for g in mine[family]]
    except (TypeError, KeyError, IndexError):
        return (f"{where}: groups()[{family!r}] should be a list of lists of ranks; groups() "
                f"returned {mine!r:.60}")
    for rank in range(math.prod(layout)):  # in exactly one group: the one hplab.dist builds
        holding, expected = [g for g in got if rank in g], next(g for g in want if rank in g)
        if holding != [expected]:
            shared = " and ".join(f for f in FAMILIES if f != family)
            return (f"{where}: rank {rank}'s {family} group is "
                    f"{' and '.join(map(str, holding)) or 'missing'}, expected {expected} "
                    f"(the ranks that share its {shared} coordinates, in increasing order)")
    return sorted(got) != sorted(want) and (
        f"{where}: {len(got)} {family} groups, expected {len(want)}: {want}")


def check_mesh(module, report: Report, _=None) -> None:
    """The learner's coordinates and groups against `hplab.dist` (which builds the real
    process groups) for every rank of 64 layouts, dp ≤ 4, tp ≤ 8, pp ≤ 4."""
    with report.case("coordinates"):
        mine = [module.coordinates(rank, *lay) for rank, lay in MESH_RANKS]
        mine = [tuple(m) if isinstance(m, (tuple, list)) else m for m in mine]
        bad = first(f"rank {rank} of dp{dp}×tp{tp}×pp{pp}: you say (dp, tp, pp) = {m!r:.60}, "
                    f"expected {want}" for m, (rank, (dp, tp, pp)) in zip(mine, MESH_RANKS)
                    if m != (want := coordinates(rank, dp, tp, pp)))
        report.add("coordinates", bad and bad + _mesh_hint(mine), f"every rank of "
                   f"{len(MESH_LAYOUTS)} layouts (1 to {max(map(math.prod, MESH_LAYOUTS))} ranks)")
    with report.case("groups"):
        mine = {lay: module.groups(*lay) for lay in MESH_LAYOUTS}
        for family in ("tp", "dp", "pp"):
            report.add(f"groups: {family}", first(_group_problem(lay, family, mine[lay])
                                                  for lay in MESH_LAYOUTS),
                       f"every {family} group of the {len(MESH_LAYOUTS)} layouts")


# --- lab 07: the planner's first formulas (no processes: these are formulas) ---------------

def check_planning(module, report: Report, _=None) -> None:
    """The learner's ZeRO memory and pipeline bubble fraction against `hplab.formulas` (the
    planner's) over a grid; each case reports its first difference."""
    def memory_problem(psi, dp, zero, precision):
        mine = module.model_state_bytes_per_gpu(psi, dp, zero, precision)
        ref = formulas.model_state_bytes(psi, dp, zero, precision)
        return not math.isclose(mine, ref["total_bytes"], rel_tol=1e-9) and (
            f"Ψ={psi:g}, dp={dp}: you say {mine:,.0f} bytes, the planner {ref['total_bytes']:,.0f}"
            " = " + " + ".join(f"{ref[f'{kind}_bytes'] / psi:.4g} ({kind})" for kind in (
                "params", "grads", "optim", "master")) + " bytes per parameter")

    def bubble_problem(p, m):
        mine, ref = module.bubble_fraction(p, m), formulas.bubble_fraction("1f1b", p, m)
        return not math.isclose(mine, ref, rel_tol=1e-9, abs_tol=1e-12) and (
            f"pp={p}, m={m}: you say {mine:.4g}, the bubble fraction (p−1)/(m+p−1) is {ref:.4g}"
            + " — that is the bubble ratio (p−1)/m, idle relative to the useful time; the "
            "fraction is the idle share of the whole step"
            * math.isclose(mine, formulas.bubble_ratio("1f1b", p, m)))

    for precision, zero in itertools.product(("fp32", "bf16"), range(4)):
        with report.case(label := f"model_state_bytes_per_gpu(zero={zero}, {precision})"):
            report.add(label, first(memory_problem(psi, dp, zero, precision) for psi, dp in
                                    itertools.product((1.5e9, 175e9, 335_232), (1, 3, 8, 64))),
                       "equal over Ψ and dp")
    with report.case("bubble_fraction"):
        report.add("bubble_fraction", first(itertools.starmap(bubble_problem, itertools.product(
            (1, 2, 4, 8), (1, 4, 8, 32)))), "equal for pp ≤ 8, m ≤ 32")


# --- running a check ------------------------------------------------------------------------

# file: the skeleton's (and the solution's) name; nproc: processes it runs on (0: this one);
# check(module, report, reference) adds a file's Results; reference() runs once per launch;
# hint: what a CommTimeout usually means in this exercise.
Exercise = namedtuple("Exercise", "lab file nproc check reference hint", defaults=(None, ""))


SAME_ORDER = "do all ranks call the same collectives in the same order?"
EXERCISES = {
    "memory": Exercise("00", "lab00_memory.py", 0, check_memory),
    "ring_allreduce": Exercise("01", "lab01_ring_allreduce.py", 4, check_ring,
                               lambda: Mesh.create(dp=dist.get_world_size()),
                               "did a send wait for a receive that never came? start sends "
                               "with async_op=True"),
    "buckets": Exercise("02", "lab02_buckets.py", 2, check_buckets,
                        lambda: gpt_reference(steps=2),
                        "are the buckets launched in the same order on every rank?"),
    "zero1": Exercise("03", "lab03_zero1.py", 2, check_zero1,
                      lambda: gpt_reference(ZERO1_STEPS, ZERO1_LR), SAME_ORDER),
    "tp_linear": Exercise("04", "lab04_tp_linear.py", 2, check_tp_linear,
                          lambda: Mesh.create(tp=dist.get_world_size()), SAME_ORDER),
    "one_f_one_b": Exercise("05", "lab05_1f1b.py", 0, check_one_f_one_b),
    "mesh": Exercise("06", "lab06_mesh.py", 0, check_mesh),
    "planning": Exercise("07", "lab07_planning.py", 0, check_planning),
}


def exercise(name: str) -> Exercise:
    if name not in EXERCISES:
        raise CheckError(f"unknown exercise {name!r}: choose one of {', '.join(EXERCISES)}")
    return EXERCISES[name]


def check_files(name: str, paths: list[str], limit_s: float) -> list[list[Result]]:
    """Per file, its Results as this process sees them; each file gets `limit_s` seconds."""
    exercise = EXERCISES[name]
    reference = exercise.reference() if exercise.reference else None
    out, previous = [], signal.signal(signal.SIGALRM, _expire)  # checks run in a main thread
    for path in paths:
        report = Report(path, exercise.hint)
        try:
            signal.setitimer(signal.ITIMER_REAL, limit_s)
            with report.case("import"):
                spec = importlib.util.spec_from_file_location(f"exercise_{Path(path).stem}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)  # the learner's file, by path
                exercise.check(module, report, reference)
        except CheckTimeout:
            report.add(report.label, f"did not finish in {limit_s:g} s — an endless loop, or a "
                       "rank waiting for the others?", "")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.append(report.results)
    signal.signal(signal.SIGALRM, previous)
    return out


def _merge(per_rank: list[list[Result]]) -> list[Result]:
    """Rank 0's cases, each failed when it failed on any rank (the first one's message)."""
    merged = []
    for c, result in enumerate(per_rank[0]):
        failing = [k for k, rows in enumerate(per_rank) if c < len(rows) and not rows[c].passed]
        merged.append(Result(result.name, False, f"{per_rank[failing[0]][c].message} (rank"
                             f"{'s' * (len(failing) > 1)} {', '.join(map(str, failing))})")
                      if failing else result)
    return merged


def run_check(name: str, paths: list[str | Path],
              limit_s: float = FILE_LIMIT_S) -> list[list[Result]]:
    """Check several files for one exercise in one launch; per file, its Results."""
    nproc, paths = exercise(name).nproc, [str(Path(p).resolve()) for p in paths]
    for p in paths:
        if not Path(p).is_file():
            raise CheckError(f"no such file: {p}")
    if nproc == 0:
        return check_files(name, paths, limit_s)
    try:
        by_rank = run_distributed(check_files, nproc, name, paths, limit_s,
                                  timeout_s=limit_s * len(paths) + 60)
    except (TimeoutError, RuntimeError) as err:  # a process died or hung outside the limit
        line = str(err).strip().splitlines()[-1]
        return [[Result("run", False, f"the {nproc}-process check ended early: {line}")]
                for _ in paths]
    return [_merge(per_rank) for per_rank in zip(*by_rank)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hplab.check", description="Check a lab exercise against the reference.",
        epilog="exercises: " + ", ".join(f"{n} (lab {v.lab})" for n, v in EXERCISES.items()))
    parser.add_argument("name", help="the exercise: " + ", ".join(EXERCISES))
    parser.add_argument("file", nargs="?", help="your file (default: labs/exercises/...)")
    args = parser.parse_args(argv)
    try:
        lab, file, nproc = exercise(args.name)[:3]
        path = args.file or str(EXERCISES_DIR / file)
        results = run_check(args.name, [path])[0]
    except CheckError as err:
        print(f"hplab: error: {err}", file=sys.stderr)
        return 2
    shown, failed = os.path.relpath(path), sum(not r.passed for r in results)
    where = f"on {nproc} processes" if nproc else "in this process"
    print(f"check {args.name} (lab {lab}) {where}: {path if shown.startswith('..') else shown}")
    for r in results:
        print(f"  {'✓' if r.passed else '✗'} {r.name}: {r.message}")
    print(f"FAIL: {failed} of {len(results)} checks failed" if failed else
          f"PASS: all {len(results)} checks passed")
    return int(failed > 0 or not results)


if __name__ == "__main__":
    sys.exit(main())
