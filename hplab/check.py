"""Check a lab exercise: `python -m hplab.check NAME [FILE]`.

Each lab ends with an exercise in `labs/exercises/`. This command loads your file, runs it the
way hplab runs its own code — on several real processes when the idea is distributed — compares
it with the reference (measured bytes, sums computed independently, the gradient one process
computes on the whole batch) and says precisely what differs:

    python -m hplab.check memory              # lab 00: count training memory by hand
    python -m hplab.check buckets my_copy.py  # lab 02, your own copy of the exercise
    python -m hplab.check --help              # every exercise, and its lab

Exit code 0 when every check passes, 1 when one fails, 2 for a wrong command line; a file that
raises, exits or runs too long fails with one line. Solutions: `labs/solutions/` (try first).
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import math
import os
import runpy
import signal
import sys
import traceback
from collections import Counter, namedtuple
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from hplab import formulas, schedule
from hplab.comm import CommTimeout, bucket_params
from hplab.dist import Mesh, coordinates, group_ranks
from hplab.launch import run_distributed
from hplab.memory import MemoryLedger, model_state_tensors
from hplab.models.gpt import build_model, config_from_preset

EXERCISES_DIR, SOLUTIONS_DIR = (
    Path(__file__).resolve().parent.parent / "labs" / folder
    for folder in ("exercises", "solutions")
)
RTOL, ATOL = 1e-5, 1e-6  # fp32 sums added in a different order agree to about this
FILE_LIMIT_S = 120.0  # for one file's whole check; the solutions need a few seconds
Result = namedtuple("Result", "name passed message")  # one check on one file, and what was seen


class CheckTimeout(BaseException):
    """A file ran past its time limit (not an Exception: a learner's `except` cannot eat it)."""


def differs(got, expected, n: int = 1) -> str | None:
    """None when tensor `got` equals `expected` up to fp32 rounding (RTOL, ATOL), else what
    differs: 'k of N elements differ; worst at [i, j]: got a, expected b' (or: n × too large)."""
    if got is None or got.shape != expected.shape:
        return "it is None" if got is None else f"shape {[*got.shape]}, not {[*expected.shape]}"
    got, expected = got.detach().double(), expected.detach().double()
    if not (bad := int((~torch.isclose(got, expected, RTOL, ATOL)).sum())):
        return None
    err = (got - expected).abs().nan_to_num(math.inf)
    index = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return (
        f"{bad} of {expected.numel()} elements differ; worst at {list(index)}: got "
        f"{float(got[index]):.6g}, expected {float(expected[index]):.6g}" + f" — it is {n}× "
        "too large: divide by n" * (n > 1 and not differs(got, n * expected))
    )


def first_wrong(named: dict, expected: list, what: str, n: int = 1) -> str | None:
    """'k of N {what}; first NAME: how it differs', or None when every tensor is right."""
    wrong = [(k, d) for (k, t), e in zip(named.items(), expected) if (d := differs(t, e, n))]
    return wrong and f"{len(wrong)} of {len(named)} {what}; first {wrong[0][0]}: {wrong[0][1]}"


def first(problems) -> str | None:
    """The first problem (a non-empty message) the iterable yields: a check stops there."""
    return next(filter(None, problems), None)


def collectives(mesh: Mesh, run, *args) -> tuple:
    """`run(*args)`'s result and the collectives it launched on this rank: {op: (calls, bytes)}."""
    mesh.ledger.reset()
    out = run(*args)
    return out, {op: (s.calls, s.bytes) for op, s in mesh.ledger.totals().items()}


class Report:
    """One file's Results. `with report.case(label):` runs a case: an exception from the learner's
    code (SystemExit too) fails it, and the next case runs. A distributed check (other ranks could
    be left waiting) only sets `report.label`: an exception ends the file's check (check_files)."""

    def __init__(self, path: str, hint: str):  # hint: what a CommTimeout usually means
        self.path, self.hint, self.results, self.label = path, hint, [], "import"

    def add(self, problem: str | None, success: str, label: str | None = None) -> None:
        self.results.append(Result(label or self.label, not problem, problem or success))

    @contextmanager
    def case(self, label: str):
        self.label = label
        try:
            yield
        except (KeyboardInterrupt, CheckTimeout):
            raise
        except NotImplementedError as err:
            self.add(f"not implemented yet ({err})", "")
        except SystemExit as err:
            self.add(f"your file called sys.exit({err.code!r}): a checked file must not exit", "")
        except CommTimeout as err:  # only distributed exercises, each with a hint
            self.add(f"{err} — {self.hint}", "")
        except BaseException as err:  # self.label: the innermost case it came from
            lines = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == self.path]
            where = f" at line {lines[-1].lineno}: {lines[-1].line}" if lines else ""
            self.add(f"raised {type(err).__name__}: {err}{where}", "")

    def check(self, label: str, problems, success: str) -> None:
        """A case that fails with the first of `problems` (computed lazily, in order)."""
        with self.case(label):
            self.add(first(problems), success)


# --- lab 00: memory by hand (one process: nothing is distributed yet) ------------------------
def check_memory(module, report: Report) -> None:
    """The learner's Ψ and model-state bytes against the model's parameters and what the
    MemoryLedger measures after one AdamW step, for three model shapes."""
    for L, h, a, S in [(4, 64, 4, 64), (2, 32, 2, 16), (3, 48, 3, 40)]:  # n_head a, seq_len S
        config = config_from_preset("tiny", n_layer=L, n_embd=h, n_head=a, seq_len=S)
        V, model = config.vocab_size, build_model(config, seed=0)
        x = torch.randint(0, V, (2, S))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        model(x, x)[1].backward()
        opt.step()
        psi, measured = (
            sum(p.numel() for p in model.parameters()),
            MemoryLedger().measure(model_state_tensors(model, opt)),
        )
        with report.case(f"num_params(V={V} S={S} h={h} L={L})"):
            mine = module.num_params(config)
            hint = {
                V * h: "the LM head shares the token embedding: count it once",
                -S * h: "the position embeddings are parameters too",
                -2 * h: "the final layer norm ln_f has 2h parameters",
                -L * 4 * h: "each block has two layer norms of 2h parameters",
                -L * 9 * h: "every linear layer has a bias",
            }.get(mine - psi)
            report.add(
                mine != psi
                and f"you count {mine:,}, the model has {psi:,} (you are off by {mine - psi:+,})"
                + f" — {hint}" * bool(hint),
                f"Ψ = {mine:,}",
            )
        with report.case(f"model_state_bytes(V={V} S={S} h={h} L={L})"):
            claimed = module.model_state_bytes(config)
            wrong = (
                [
                    f"{kind}: you say {claimed.get(kind)!r}, measured {measured[kind]:,} "
                    f"({measured[kind] / psi:g} bytes per parameter)"
                    for kind in ("params", "grads", "optim")
                    if claimed.get(kind) != measured[kind]
                ]
                if isinstance(claimed, dict)
                else [
                    f"returned {type(claimed).__name__}, expected a dict {{params, grads, optim}}"
                ]
            )
            report.add(
                "; ".join(wrong),
                "params, grads and AdamW state match the MemoryLedger: "
                f"{sum(measured.values()):,} bytes",
            )


# --- lab 01: ring all-reduce from send/recv (4 processes) -----------------------------------
def check_ring(module, report: Report, mesh: Mesh) -> None:
    """On every rank, for tensors of several shapes and dtypes: the result is the sum over the
    ranks, only send and recv were used, and each rank sent 2(n-1) chunks of S/n bytes."""
    n, r = mesh.world.size, mesh.world.rank
    for shape, dtype in [
        ((1000,), "float32"),
        ((7, 13), "float32"),
        ((3,), "float32"),
        ((64, 64), "float32"),
        ((10,), "float64"),
    ]:
        report.label = f"{'×'.join(map(str, shape))} {dtype}"  # an exception ends the file
        inputs = torch.randn(
            (n, *shape),
            dtype=getattr(torch, dtype),
            generator=torch.Generator().manual_seed(len(shape)),
        )  # [rank]
        expected, tensor = inputs.sum(0), inputs[r].clone()
        _, used = collectives(mesh, module.ring_all_reduce, tensor, mesh.world)
        others, sent = sorted(set(used) - {"send", "recv"}), used.get("send", (0, 0))[1]
        ideal = formulas.bus_factor("all_reduce", n) * tensor.nbytes  # 2(n-1)/n·S
        per_element = 2 * (n - 1) * tensor.element_size()  # chunks: ⌊S/n⌋ to ⌈S/n⌉ numbers
        report.add(
            first(
                [
                    others and f"used {', '.join(others)}: build it from send and recv only",
                    (d := differs(tensor, expected))
                    and f"the result is not the sum over the ranks: {d}",
                    not tensor.numel() // n <= sent / per_element <= -(-tensor.numel() // n)
                    and (
                        f"sent {sent:,} bytes; a ring all-reduce sends 2(n-1) chunks of S/n = "
                        f"{ideal:,.0f} bytes: one chunk per step, not the whole tensor"
                    ),
                ]
            ),
            f"sum correct, {sent:,} bytes sent (2(n-1)/n·S = {ideal:,.0f})",
        )


# --- labs 02 and 03: a tiny GPT trained on n ranks against one process -----------------------
def gpt_reference(mesh: Mesh, steps: int, lr: float = 0.0) -> SimpleNamespace:
    """`steps` batches of 2 sequences per rank (`rows`: this rank's) and one process's result on
    each: the global-batch gradient (each rank's loss / n, in rank order) and params after AdamW."""
    n, r = mesh.world.size, mesh.world.rank
    config = config_from_preset("tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    batches = torch.randint(
        0,
        config.vocab_size,
        (steps, n, 2, config.n_positions + 1),
        generator=torch.Generator().manual_seed(0),
    )  # + the next token
    model = build_model(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
    grads, params = [], []
    for batch in batches:
        model.zero_grad()
        for rows in batch:
            (model(rows[:, :-1], rows[:, 1:])[1] / n).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()  # lr = 0 (lab 02) leaves the parameters as they are
        params.append([p.detach().clone() for p in model.parameters()])
    return SimpleNamespace(
        config=config,
        grads=grads,
        params=params,
        rows=[(b[r, :, :-1], b[r, :, 1:]) for b in batches],
    )


def launch_problem(started: list, params: list, arrived: list, bucket_bytes: float) -> str | None:
    """Where the (all-reduces, bytes) started — as each gradient arrived, when backward returned,
    after wait() — first differ from hplab.ddp's: bucket j (parameters in reverse) starts in the
    hook of its last gradient, once buckets 0 ... j-1 have started."""
    ready = {id(p): k + 1 for k, p in enumerate(arrived)}  # hooks run once p's has
    buckets = bucket_params(params, bucket_bytes / 2**20)
    at = list(itertools.accumulate((max(ready[id(p)] for p in b) for b in buckets), max))
    for k, mine in enumerate(started):  # k: the learner's hooks that have run
        want = (
            sum(t <= k for t in at),
            sum(p.nbytes for b, t in zip(buckets, at) if t <= k for p in b),
        )
        if mine != want:
            when = (
                f"when gradient {k + 1} of {len(params)} arrived"
                if k < len(params)
                else ("when backward returned", "after wait()")[k - len(params)]
            )
            return (
                f"{when}, {mine[0]} all-reduce(s) of {mine[1]:,} B had started, hplab.ddp's "
                f"{want[0]} of {want[1]:,} B — it takes the parameters in reverse (backward's"
                " order) and starts each bucket from the hook that completes it"
            )


def check_buckets(module, report: Report, mesh: Mesh) -> None:
    """One bucket, one per parameter, a middle size: one process's gradients, hplab.ddp's starts."""
    ref = gpt_reference(mesh, steps=2)
    for bucket_bytes in (math.inf, 0, 20_000):
        report.label = f"bucket_bytes={bucket_bytes}"  # an exception ends the file
        params = list((model := build_model(ref.config, seed=0)).parameters())

        def observe(param):  # registered before the learner's hooks: runs before theirs
            started.append(  # noqa: B023 (this step's lists: the hooks run inside the step)
                (s.calls, s.bytes) if (s := mesh.ledger.totals().get("all_reduce")) else (0, 0)
            )
            arrived.append(param)  # noqa: B023

        for p in params:
            p.register_post_accumulate_grad_hook(observe)
        sync = module.BucketedAllReduce(params, mesh.world, bucket_bytes)
        for step, rows in enumerate(ref.rows):
            model.zero_grad()
            mesh.ledger.reset()
            arrived, started = [], []  # per gradient hook: the (all-reduces, bytes) before it
            model(*rows)[1].backward()
            observe(None)  # when backward returned
            sync.wait()
            observe(None)  # after wait()
            if problem := first_wrong(
                {k: p.grad for k, p in model.named_parameters()},
                ref.grads[step],
                "gradients are not the global-batch average",
                mesh.world.size,
            ) or launch_problem(started, params, arrived[: len(params)], bucket_bytes):
                break
        report.add(
            problem and f"step {step + 1}: {problem}",
            "gradients equal one process's; "
            f"{started[-1][0]} bucket(s), {started[-1][1]:,} B, each sent by its last hook",
        )


def check_zero1(module, report: Report, mesh: Mesh) -> None:
    """ZeRO1 on this rank's rows against one process's AdamW on the whole batch: my shard's grad,
    the params, Adam state 2 × Ψ/n, one reduce-scatter and one all-gather of the padded buffer."""
    lr, n, r = 1e-2, mesh.world.size, mesh.world.rank
    ref = gpt_reference(mesh, steps=3, lr=lr)
    model, numel = build_model(ref.config, seed=0), sum(g.numel() for g in ref.grads[0])
    shard, flat_bytes = math.ceil(numel / n), 4 * n * math.ceil(numel / n)  # padded, fp32
    report.label = "ZeRO1(params, comm, lr)"  # an exception ends the file's check (see Report)
    opt = module.ZeRO1(list(model.parameters()), mesh.world, lr=lr)
    for step, rows in enumerate(ref.rows):
        model.zero_grad()
        model(*rows)[1].backward()
        report.label = f"step {step + 1}"
        _, used = collectives(mesh, opt.step)
        others = sorted(set(used) - {"reduce_scatter", "all_gather"})
        want = F.pad(
            torch.cat([g.reshape(-1) for g in ref.grads[step]]), (0, shard * n - numel)
        ).view(n, shard)[r]
        got = getattr(getattr(opt, "master", None), "grad", None)
        state = sum(
            t.numel()
            for s in opt.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        problem = first(
            [
                used != dict.fromkeys(("reduce_scatter", "all_gather"), (1, flat_bytes))
                and (
                    f"used {', '.join(others) or used}: ZeRO-1 needs only a reduce-scatter of the "
                    f"gradients and an all-gather of the parameters, one each of {flat_bytes:,} B"
                ),
                (d := differs(got, want, n))
                and f"self.master.grad is not my shard of the global-batch average gradient: {d}",
                first_wrong(
                    dict(model.named_parameters()),
                    ref.params[step],
                    "parameters differ from one process's AdamW",
                ),
                state != 2 * shard
                and f"Adam keeps {state:,} numbers, not 2 × {shard:,} (my shard)",
            ]
        )
        report.add(
            problem,
            f"params equal one process's AdamW; one reduce-scatter + one all-"
            f"gather of {flat_bytes:,} B; Adam state 2 × Ψ/{n} = {2 * shard:,} numbers",
        )
        if problem:
            return


# --- lab 04: column- and row-parallel linear layers, f and g (2 processes) ---------------------
def check_tp_linear(module, report: Report, mesh: Mesh) -> None:
    """Column → GeLU → row against the whole MLP in one process (same weights, same X): Z,
    X.grad (f's backward), this rank's slice of each gradient, one all-reduce of Z each way."""
    n, r = mesh.world.size, mesh.world.rank
    for b, s, h in [(2, 8, 16), (3, 5, 24)]:  # the MLP is h → 4h → h
        case, g = f"b={b} s={s} h={h}", torch.Generator().manual_seed(b * s * h)
        x = torch.randn(b, s, h, generator=g, requires_grad=True)
        weights = torch.randn(b, s, h, generator=g)  # the loss: this weighted sum of Z
        torch.manual_seed(h)
        fc, proj = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)  # the whole MLP
        mine = copy.deepcopy((fc, proj))  # the learner's copies, before any gradient
        z_ref = proj(F.gelu(fc(x)))
        (z_ref * weights).sum().backward()
        z_ref, bias, x_grad, x.grad = z_ref.detach(), proj.bias.detach(), x.grad, None
        rows = slice(r * 4 * h // n, (r + 1) * 4 * h // n)  # this rank's slice of the 4h
        report.label = case  # an exception ends the file's check (see Report)
        column, row = (
            module.ColumnParallelLinear(mine[0], mesh.world),
            module.RowParallelLinear(mine[1], mesh.world),
        )
        z, forward = collectives(mesh, lambda: row(F.gelu(column(x))))  # noqa: B023 (called here)
        used = {"forward": forward, "backward": collectives(mesh, (z * weights).sum().backward)[1]}
        wrong, z_bytes = differs(z, z_ref), z_ref.numel() * 4
        report.add(
            wrong
            and "Z differs from the whole MLP: "
            + wrong
            + (
                " — every rank returns the full output"
                if z.shape != z_ref.shape
                else " — the bias, added before g's all-reduce, counts T times: add it once, "
                "after g"
                if not differs(z, z_ref + (n - 1) * bias)
                else " — only this rank's partial sum: g must all-reduce it"
                if abs(float((z.detach() - bias).norm() / (z_ref - bias).norm()) - 1) > 1e-3
                else ""
            ),
            "Z equals the whole MLP's output",
            f"{case}: forward",
        )
        wrong = differs(x.grad, x_grad)
        report.add(
            wrong
            and f"X.grad is not the single-process gradient: {wrong} — "
            + (
                f"it is {n}× too large: only f's backward all-reduces, g's passes it through"
                if not differs(x.grad, n * x_grad)
                else "f's backward must all-reduce: each rank holds only its slice's contribution"
            ),
            "equals one process's",
            f"{case}: X.grad",
        )
        report.add(
            first_wrong(
                {
                    "column.weight.grad": column.weight.grad,
                    "column.bias.grad": column.bias.grad,
                    "row.weight.grad": row.weight.grad,
                    "row.bias.grad": row.bias.grad,
                },
                [
                    fc.weight.grad[rows],
                    fc.bias.grad[rows],
                    proj.weight.grad[:, rows],
                    proj.bias.grad,
                ],
                "gradients are not this rank's slice of the single-process gradient",
            ),
            "this rank's slices of the single-process gradients",
            f"{case}: parameter gradients",
        )
        bad = "; ".join(
            f"{phase}: {ops or 'nothing'}"
            for phase, ops in used.items()
            if ops != {"all_reduce": (1, z_bytes)}
        )
        report.add(
            bad
            and f"expected one all-reduce of b·s·h·4 = {z_bytes:,} B in forward (g) "
            f"and one in backward (f); saw (calls, bytes) {bad}",
            f"one all-reduce of {z_bytes:,} B each way",
            f"{case}: communication",
        )


# --- lab 05: the 1F1B action order (simulated: a schedule is data) ---------------------------
def _one_f_one_b_problem(module, p: int, m: int) -> str | None:
    where, mine = f"p={p}, m={m}", module.one_f_one_b(p, m)
    if not isinstance(mine, (list, tuple)) or len(mine) != p:
        return f"{where}: expected a list of {p} per-rank orders, got {mine!r:.80}"
    orders = [[(*a, r) for a in mine[r]] for r in range(p)]  # (kind, microbatch, chunk r)
    reference = schedule.one_f_one_b_order(p, m)
    for r, (order, work) in enumerate(zip(orders, map(Counter, reference))):
        wrong = {"missing": work - Counter(order), "extra": Counter(order) - work}  # or unknown
        if any(wrong.values()):
            return (
                f"{where}, rank {r}: every rank runs F and B of each microbatch exactly "
                "once;"
                + "".join(f" {k} {sorted(a[:2] for a in v)[:4]}" for k, v in wrong.items() if v)
            )
    try:
        run = schedule.simulate(schedule.add_communication(orders, p, 1), f=1, b=1, w=0)
    except schedule.DeadlockError as err:
        return f"{where}: {err}"
    best = schedule.simulate(schedule.add_communication(reference, p, 1), f=1, b=1, w=0)
    held, limit = [run.in_flight_max(r) for r in range(p)], [min(p - r, m) for r in range(p)]
    warm = [next((k for k, a in enumerate(o) if a[0] == "B"), m) for o in orders]
    counts = (
        f" — forwards before the first backward: {warm}, 1F1B {limit} (p-1-r warm-up "
        "forwards and one more)"
    ) * (warm != limit)
    return first(
        [
            run.makespan > best.makespan
            and f"{where}: the step takes {run.makespan:g} time units, "
            f"1F1B {best.makespan:g} (= 2(m+p-1)): too few forwards in flight"
            + counts,
            held != limit
            and f"{where}: ranks hold at most {held} microbatches' activations, 1F1B "
            f"{limit} (min(p-r, m)) — too many forwards before their backwards: warm up with p-1-r",
            *(
                f"{where}, rank {r}: action {k} is {a[0]}{a[1]}, 1F1B runs {b[0]}{b[1]} (same step "
                "time and memory, another order)"
                for r in range(p)
                for k, (a, b) in enumerate(zip(orders[r], reference[r]))
                if a != b
            ),
        ]
    )


def check_one_f_one_b(module, report: Report) -> None:
    """The orders, run by `hplab.schedule.simulate` with their sends and receives, against 1F1B
    over (p, m): the work once, no deadlock, step 2(m+p-1), min(p-r, m) held, 1F1B's order."""
    for name, ps in (("p=2", (2,)), ("p=3, 4", (3, 4)), ("p=8", (8,))):
        report.check(
            name,
            (_one_f_one_b_problem(module, p, m) for p in ps for m in (1, 2, 3, 4, 8, 12)),
            "as 1F1B for m ≤ 12: step 2(m+p-1), rank r holds min(p-r, m)",
        )


# --- lab 06: the device mesh (no processes: numbering is arithmetic) ------------------------
MESH_LAYOUTS = [(dp, tp, pp) for dp in (1, 2, 3, 4) for tp in (1, 2, 4, 8) for pp in (1, 2, 3, 4)]
MESH_RANKS = [(rank, lay) for lay in MESH_LAYOUTS for rank in range(math.prod(lay))]
FAMILIES = ("dp", "tp", "pp")


def _mesh_hint(mine: list) -> str:
    """Name the numbering (which family varies fastest) or the tuple order the learner's
    coordinates of MESH_RANKS follow, if they follow another one consistently."""

    def numbering(slots):  # hplab's (tp fastest, then dp, then pp) with the families renamed
        return [
            dict(zip(slots, coordinates(rank, *(lay[FAMILIES.index(f)] for f in slots))))
            for rank, lay in MESH_RANKS
        ]

    for order in list(itertools.permutations(FAMILIES))[1:]:  # every order but hplab's
        if mine == [tuple(c[f] for f in FAMILIES) for c in numbering(order)]:
            return (
                f" — you number {order[1]} fastest, then {order[0]}, then {order[2]}; "
                "Megatron's order is tp fastest, then dp, then pp"
            )
        if mine == [tuple(c[f] for f in order) for c in numbering(FAMILIES)]:
            return f" — you return ({', '.join(order)}): return (dp_rank, tp_rank, pp_rank)"
    return ""


def check_mesh(module, report: Report) -> None:
    """The learner's coordinates and groups against `hplab.dist` (which builds the real
    process groups) for every rank of 64 layouts, dp ≤ 4, tp ≤ 8, pp ≤ 4."""

    def group_problem(layout: tuple, family: str) -> str | None:
        where, want = "dp{}×tp{}×pp{}".format(*layout), group_ranks(*layout)[family]
        mine = module.groups(*layout)
        try:
            got = [list(g) for g in mine[family]]
        except (TypeError, KeyError, IndexError):
            return f"{where}: groups()[{family!r}] should be lists of ranks; got {mine!r:.60}"
        for rank in range(math.prod(layout)):  # in exactly one group: the one hplab.dist makes
            holding, expected = [g for g in got if rank in g], next(g for g in want if rank in g)
            if holding != [expected]:
                shared = " and ".join(f for f in FAMILIES if f != family)
                return (
                    f"{where}: rank {rank}'s {family} group is "
                    f"{' and '.join(map(str, holding)) or 'missing'}, expected {expected} "
                    f"(the ranks that share its {shared} coordinates, in increasing order)"
                )
        return sorted(got) != sorted(want) and f"{where}: {family} groups {got}, expected {want}"

    with report.case("coordinates"):
        mine = [module.coordinates(rank, *lay) for rank, lay in MESH_RANKS]
        mine = [tuple(m) if isinstance(m, (tuple, list)) else m for m in mine]
        bad = first(
            f"rank {rank} of dp{dp}×tp{tp}×pp{pp}: you say (dp, tp, pp) = {m!r:.60}, "
            f"expected {want}"
            for m, (rank, (dp, tp, pp)) in zip(mine, MESH_RANKS)
            if m != (want := coordinates(rank, dp, tp, pp))
        )
        report.add(
            bad and bad + _mesh_hint(mine),
            f"every rank of {len(MESH_LAYOUTS)} layouts "
            f"(1 to {max(map(math.prod, MESH_LAYOUTS))} ranks)",
        )
    for family in ("tp", "dp", "pp"):
        report.check(
            f"groups: {family}",
            (group_problem(lay, family) for lay in MESH_LAYOUTS),
            f"every {family} group of the {len(MESH_LAYOUTS)} layouts",
        )


# --- lab 07: the planner's first formulas (no processes: these are formulas) ---------------
def check_planning(module, report: Report) -> None:
    """The learner's ZeRO memory and bubble fraction against the planner's `hplab.formulas`."""

    def memory_problem(psi, dp, zero, precision):
        mine = module.model_state_bytes_per_gpu(psi, dp, zero, precision)
        ref = formulas.model_state_bytes(psi, dp, zero, precision)
        return not math.isclose(mine, ref["total_bytes"], rel_tol=1e-9) and (
            f"Ψ={psi:g}, dp={dp}: you say {mine:,.0f} bytes, the planner {ref['total_bytes']:,.0f}"
            " = "
            + " + ".join(
                f"{ref[f'{kind}_bytes'] / psi:.4g} ({kind})"
                for kind in ("params", "grads", "optim", "master")
            )
            + " bytes per parameter"
        )

    def bubble_problem(p, m):
        mine, ref = module.bubble_fraction(p, m), formulas.bubble_fraction("1f1b", p, m)
        return not math.isclose(mine, ref, rel_tol=1e-9, abs_tol=1e-12) and (
            f"pp={p}, m={m}: you say {mine:.4g}, the bubble fraction (p−1)/(m+p−1) is {ref:.4g}"
            + " — that is the bubble ratio (p−1)/m, idle relative to the useful time; the "
            "fraction is the idle share of the whole step"
            * math.isclose(mine, formulas.bubble_ratio("1f1b", p, m))
        )

    for precision, zero in itertools.product(("fp32", "bf16"), range(4)):
        report.check(
            f"model_state_bytes_per_gpu(zero={zero}, {precision})",
            (
                memory_problem(psi, dp, zero, precision)
                for psi, dp in itertools.product((1.5e9, 175e9, 335_232), (1, 3, 8, 64))
            ),
            "equal over Ψ and dp",
        )
    report.check(
        "bubble_fraction",
        itertools.starmap(bubble_problem, itertools.product((1, 2, 4, 8), (1, 4, 8, 32))),
        "equal for pp ≤ 8, m ≤ 32",
    )


# --- lab 08: the log-sum-exp merge of ring attention (one process: it is arithmetic) ----------
def partial_attention(q, k, v, visible) -> tuple:
    """(out, lse) of q's attention over one block of keys; `visible` [Tq, Tk] masks the rest. A
    query that sees no key of the block gets out 0 and lse −inf, as a ring step passes on."""
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v, torch.logsumexp(scores, -1)


def _merge_problem(module, scale: float, blocks: int, causal: bool) -> str | None:
    """Merge the blocks' partials one by one (the last block first, as a ring step may deliver
    it) and compare with attention over every key at once."""
    g = torch.Generator().manual_seed(blocks)
    q, k, v = (
        torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64) * c for c in (scale, 1, 1)
    )
    visible = torch.ones(16, 16, dtype=torch.bool).tril_(0 if causal else 16)
    out, lse = functools.reduce(
        lambda merged, part: module.merge(*merged, *part),
        (
            partial_attention(q, k[..., cols, :], v[..., cols, :], visible[:, cols])
            for cols in reversed(torch.arange(16).chunk(blocks))
        ),
    )
    if out is not None and not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        return "NaN or inf in out or lse: " + (
            "exp(lse) overflowed — factor out the larger lse first"
            if scale > 1
            else "a block no query saw (lse −inf on both "
            "sides) must add nothing: −inf − (−inf) is NaN"
        )
    if d := differs(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal)):
        return f"out: {d} — each partial weighs exp(its lse − the merged lse)"
    return (d := differs(lse, partial_attention(q, k, v, visible)[1])) and f"lse: {d}"


def check_lse_merge(module, report: Report) -> None:
    """`merge` against attention over all keys, for 2 and 4 blocks, causal, and large scores."""
    for label, *case in (
        ("two blocks", 1.0, 2, False),
        ("a ring of four blocks, causal", 1.0, 4, True),
        ("scores past exp's range (~1000)", 400.0, 2, False),
    ):
        report.check(
            label,
            (_merge_problem(module, *case) for _ in "x"),  # lazily: in the case
            "equals attention over every key at once (out and lse)",
        )


# --- lab 09: expert-parallel dispatch (one process: bookkeeping before the all-to-all) -------
DISPATCH_CASES = [(16, 2, 4, 2), (37, 1, 8, 4), (20, 2, 8, 8), (9, 2, 4, 1), (6, 2, 8, 2)]


def _routing(T: int, k: int, E: int) -> tuple:
    """Expert indices [T, k] (k distinct experts a token, ties across tokens; with T·k < E some
    experts get nothing) and gates [T, k]."""
    g = torch.Generator().manual_seed(T * E + k)
    index = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    return index, torch.rand(T, k, generator=g, dtype=torch.float64)


def _order_problem(module, T, k, E, ep) -> str | None:
    index = _routing(T, k, E)[0]
    order, expected = module.dispatch_order(index, E), index.flatten().sort(stable=True).indices
    if order is None or sorted(order.tolist()) != list(range(T * k)):
        return f"T={T}, k={k}: not a permutation of the {T * k} (token, slot) positions"
    if not torch.equal(index.flatten()[order], index.flatten()[expected]):
        return f"T={T}, k={k}, E={E}: the positions are not grouped by expert, 0 first"
    return not torch.equal(order, expected) and (
        f"T={T}, k={k}, E={E}: within an expert keep token order (sort stably)"
    )


def _counts_problem(module, T, k, E, ep) -> str | None:
    index = _routing(T, k, E)[0]
    counts = module.send_counts(index, E, ep)
    got = None if counts is None else counts.tolist()
    per_expert = torch.bincount(index.flatten(), minlength=E)
    expected = per_expert.view(ep, E // ep).sum(dim=1).tolist()
    hint = (
        " — rank r holds experts r·E/ep … (r+1)·E/ep − 1, not e % ep"
        if got == per_expert.view(E // ep, ep).sum(dim=0).tolist()
        else " — count every (token, slot) pair: a token goes to k experts"
        if got is not None and k > 1 and sum(got) == T
        else ""
    )
    return got != expected and f"T={T}, k={k}, E={E}, ep={ep}: {got}, not {expected}{hint}"


def _combine_problem(module, T, k, E, ep) -> str | None:
    """Expert e computes x·(e+1) + e: the results, in the reference dispatch order, combined."""
    index, gates = _routing(T, k, E)
    x = torch.randn(T, 4, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
    order = index.flatten().sort(stable=True).indices
    expert = index.flatten()[order, None]
    per_slot = x[:, None, :] * (index[..., None] + 1) + index[..., None]  # [T, k, 4], ungated
    got = module.combine(x[order // k] * (expert + 1) + expert, order, gates)
    problem = differs(got, (gates[..., None] * per_slot).sum(dim=1))
    return problem and f"T={T}, k={k}: {problem}" + " — weight each result by its gate" * (
        got is not None and not differs(got, per_slot.sum(dim=1))
    )


def check_dispatch(module, report: Report) -> None:
    """dispatch_order, send_counts and combine against the reference over several routings."""
    for label, problem, success in (
        ("dispatch_order", _order_problem, "grouped by expert, token order within each"),
        ("send_counts", _counts_problem, "the pairs per destination rank"),
        ("combine", _combine_problem, "each token's gated sum of its k results"),
    ):
        report.check(
            label,
            (problem(module, *case) for case in DISPATCH_CASES),
            f"{success}, for {len(DISPATCH_CASES)} routings (T, k, E, ep)",
        )


# --- running a check ------------------------------------------------------------------------
# nproc: the processes it runs on (0: this one, no Mesh); hint: what a CommTimeout often means
Exercise = namedtuple("Exercise", "lab file nproc check hint", defaults=("",))
SAME_ORDER = "do all ranks launch the same collectives (buckets) in the same order?"
EXERCISES = {
    "memory": Exercise("00", "lab00_memory.py", 0, check_memory),
    "ring_allreduce": Exercise(
        "01",
        "lab01_ring_allreduce.py",
        4,
        check_ring,
        "did a send wait for a receive that never came? start sends with async_op=True",
    ),
    "buckets": Exercise("02", "lab02_buckets.py", 2, check_buckets, SAME_ORDER),
    "zero1": Exercise("03", "lab03_zero1.py", 2, check_zero1, SAME_ORDER),
    "tp_linear": Exercise("04", "lab04_tp_linear.py", 2, check_tp_linear, SAME_ORDER),
    "one_f_one_b": Exercise("05", "lab05_1f1b.py", 0, check_one_f_one_b),
    "mesh": Exercise("06", "lab06_mesh.py", 0, check_mesh),
    "planning": Exercise("07", "lab07_planning.py", 0, check_planning),
    "lse_merge": Exercise("08", "lab08_lse_merge.py", 0, check_lse_merge),
    "dispatch": Exercise("09", "lab09_dispatch.py", 0, check_dispatch),
}


def check_files(name: str, paths: list[str], limit_s: float) -> list[list[Result]]:
    """Per file, its Results as this process sees them; each file gets `limit_s` seconds."""

    def expire(*_):  # SIGALRM's handler (checks run in a main thread)
        raise CheckTimeout

    exercise, previous = EXERCISES[name], signal.signal(signal.SIGALRM, expire)
    mesh, out = [Mesh.create(dp=exercise.nproc)] if exercise.nproc else [], []
    for path in paths:
        report = Report(path, exercise.hint)
        try:
            signal.setitimer(signal.ITIMER_REAL, limit_s)
            with report.case("import"):  # the learner's file, run by path
                exercise.check(SimpleNamespace(**runpy.run_path(path)), report, *mesh)
        except CheckTimeout:
            report.add(f"did not finish in {limit_s:g} s: an endless loop, or ranks waiting?", "")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.append(report.results)
    signal.signal(signal.SIGALRM, previous)
    return out


def _merge(per_rank: list[list[Result]]) -> list[Result]:
    """Rank 0's cases, each failed when it failed on any rank (the first such rank's message)."""
    return [
        next(
            (
                Result(r.name, False, f"{rows[c].message} (rank {k})")
                for k, rows in enumerate(per_rank)
                if c < len(rows) and not rows[c].passed
            ),
            r,
        )
        for c, r in enumerate(per_rank[0])
    ]


def run_check(name: str, paths: list[str | Path], limit_s: float = FILE_LIMIT_S) -> list:
    """Per file, its Results, all checked in one launch (ValueError: unknown exercise or file)."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}: choose one of {', '.join(EXERCISES)}")
    nproc, paths = EXERCISES[name].nproc, [str(Path(p).resolve()) for p in paths]
    if missing := [p for p in paths if not Path(p).is_file()]:
        raise ValueError(f"no such file: {missing[0]}")
    if nproc == 0:
        return check_files(name, paths, limit_s)
    try:
        by_rank = run_distributed(
            check_files, nproc, name, paths, limit_s, timeout_s=limit_s * len(paths) + 60
        )
    except (TimeoutError, RuntimeError) as err:  # a process died or hung outside the limit
        line = f"the {nproc}-process check ended early: {str(err).strip().splitlines()[-1]}"
        return [[Result("run", False, line)] for _ in paths]
    return [_merge(per_rank) for per_rank in zip(*by_rank)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("python -m hplab.check", description=__doc__.split("\n")[0])
    parser.add_argument("name", help=", ".join(f"{n} (lab {v.lab})" for n, v in EXERCISES.items()))
    parser.add_argument("file", nargs="?", help="your file (default: labs/exercises/...)")
    args = parser.parse_args(argv)
    exercise = EXERCISES.get(args.name, Exercise("", "", 0, None))
    path = args.file or str(EXERCISES_DIR / exercise.file)
    try:
        results = run_check(args.name, [path])[0]
    except ValueError as err:
        print(f"hplab: error: {err}", file=sys.stderr)
        return 2
    shown, failed = os.path.relpath(path), sum(not r.passed for r in results)
    where = f"on {exercise.nproc} processes" if exercise.nproc else "in this process"
    print(
        f"check {args.name} (lab {exercise.lab}) {where}: "
        f"{path if shown.startswith('..') else shown}"
    )
    for r in results:
        print(f"  {'✓' if r.passed else '✗'} {r.name}: {r.message}")
    print(
        f"FAIL: {failed} of {len(results)} checks failed"
        if failed
        else f"PASS: all {len(results)} checks passed"
    )
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
