"""The exercise checker can tell right from wrong: reference solutions pass, untouched skeletons
fail, and typical mistakes fail with the message that names them.

Each exercise's files are checked in ONE launch (`run_check` takes several files): one
4-process launch for the ring, one 2-process launch each for the buckets and the ZeRO-1 step.
"""

import textwrap

import pytest

from hplab.check import EXERCISES, EXERCISES_DIR, SOLUTIONS_DIR, main, run_check

# A ring all-reduce that cheats with the built-in all-reduce: right sums, wrong algorithm.
RING_CHEAT = """
def ring_all_reduce(tensor, comm):
    comm.all_reduce(tensor)
    return tensor
"""

# A ring that passes the whole tensor around: right sums, (n-1)·S bytes instead of 2(n-1)/n·S.
RING_WHOLE_TENSOR = """
import torch

def ring_all_reduce(tensor, comm):
    n, r = comm.size, comm.rank
    total, passing = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(passing)
        pending = comm.send(passing, dst=(r + 1) % n, async_op=True)
        comm.recv(incoming, src=(r - 1) % n)
        pending.wait()
        total += incoming
        passing = incoming
    tensor.copy_(total)
    return tensor
"""

# Buckets with the right count and sums, but all launched after backward: no overlap.
BUCKETS_NO_OVERLAP = """
import sys
sys.path.insert(0, {solutions!r})
from lab02_buckets import make_buckets

class BucketedAllReduce:
    def __init__(self, params, comm, bucket_bytes):
        self.comm, self.buckets = comm, make_buckets(params, bucket_bytes)

    def wait(self):
        for bucket in self.buckets:
            flat = __import__("torch").cat([p.grad.reshape(-1) for p in bucket])
            self.comm.all_reduce(flat)
            flat /= self.comm.size
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
"""

# Memory counted with the LM head as a second matrix.
MEMORY_UNTIED = """
def num_params(c):
    V, S, h, L = c.vocab_size, c.n_positions, c.n_embd, c.n_layer
    return 2 * V * h + S * h + L * (12 * h * h + 13 * h) + 2 * h

def model_state_bytes(c):
    return {"params": 4 * num_params(c), "grads": 4 * num_params(c), "optim": 8 * num_params(c)}
"""


# The bubble as a fraction of the whole step instead of relative to the useful time.
PLANNING_STEP_FRACTION = """
def model_state_bytes_per_gpu(psi, dp, zero, precision):
    per = {"fp32": (4, 4, 8, 0), "bf16": (2, 2, 8, 4)}[precision]
    divisors = (dp if zero >= 3 else 1, dp if zero >= 2 else 1, dp if zero >= 1 else 1,
                dp if zero >= 1 else 1)
    return sum(b * psi / d for b, d in zip(per, divisors))

def bubble_fraction(pp, m):
    return (pp - 1) / (m + pp - 1)
"""


# ZeRO-1 with an all-reduce of the whole gradient: right parameters, DDP's communication pattern.
ZERO1_ALL_REDUCE = """
import sys
import torch
sys.path.insert(0, {solutions!r})
from lab03_zero1 import ZeRO1 as Reference

class ZeRO1(Reference):
    @torch.no_grad()
    def step(self):
        grads = torch.zeros(self.padded_numel)
        grads[:self.numel] = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.comm.all_reduce(grads)
        grads /= self.comm.size
        r = self.comm.rank
        self.master.grad = grads[r * self.shard_numel:(r + 1) * self.shard_numel].clone()
        self.optimizer.step()
        full = torch.empty(self.padded_numel)
        self.comm.all_gather(full, self.master.detach().clone())
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
"""

# ZeRO-1 that forgets to divide by n: AdamW hardly notices the scale, the gradient check does.
ZERO1_NO_DIVIDE = """
import sys
sys.path.insert(0, {solutions!r})
import lab03_zero1

class ZeRO1(lab03_zero1.ZeRO1):
    def step(self):
        for p in self.params:
            p.grad.mul_(self.comm.size)  # so the solution's division by n cancels out
        super().step()
"""


# Column parallel without f: forward right, X.grad only this rank's contribution.
TP_NO_F = """
import sys
import torch.nn.functional as F
sys.path.insert(0, {solutions!r})
import lab04_tp_linear
from lab04_tp_linear import CopyToTP, ReduceFromTP, RowParallelLinear

class ColumnParallelLinear(lab04_tp_linear.ColumnParallelLinear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)
"""

# Row parallel that adds the bias before g: the bias is summed T times.
TP_BIAS_BEFORE_G = """
import sys
import torch.nn.functional as F
sys.path.insert(0, {solutions!r})
import lab04_tp_linear
from lab04_tp_linear import CopyToTP, ReduceFromTP, ColumnParallelLinear

class RowParallelLinear(lab04_tp_linear.RowParallelLinear):
    def forward(self, x_slice):
        return ReduceFromTP.apply(F.linear(x_slice, self.weight, self.bias), self.comm)
"""


# GPipe's order: right work, no deadlock, same step time, but every rank holds all m microbatches.
ONE_F_ONE_B_GPIPE = """
def one_f_one_b(p, m):
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for r in range(p)]
"""

# No warm-up: each rank waits for every backward before its next forward.
ONE_F_ONE_B_NO_WARMUP = """
def one_f_one_b(p, m):
    return [[a for i in range(m) for a in (("F", i), ("B", i))] for r in range(p)]
"""


def _files(name, tmp_path, extra: dict[str, str]):
    filename = EXERCISES[name][1]
    paths = {"solution": SOLUTIONS_DIR / filename}
    for label, source in extra.items():
        path = tmp_path / f"{name}_{label}.py"
        path.write_text(textwrap.dedent(source.format(solutions=str(SOLUTIONS_DIR))
                                        if "{solutions" in source else source))
        paths[label] = path
    paths["skeleton"] = EXERCISES_DIR / filename  # last: it fails at once on every rank
    return paths


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exercises")
    wrong = {"memory": {"untied": MEMORY_UNTIED},
             "ring_allreduce": {"cheat": RING_CHEAT, "whole_tensor": RING_WHOLE_TENSOR},
             "buckets": {"no_overlap": BUCKETS_NO_OVERLAP},
             "zero1": {"all_reduce": ZERO1_ALL_REDUCE, "no_divide": ZERO1_NO_DIVIDE},
             "tp_linear": {"no_f": TP_NO_F, "bias_before_g": TP_BIAS_BEFORE_G},
             "one_f_one_b": {"gpipe": ONE_F_ONE_B_GPIPE, "no_warmup": ONE_F_ONE_B_NO_WARMUP},
             "planning": {"step_fraction": PLANNING_STEP_FRACTION},
             "mesh": {}}  # its wrong variants are in tests/test_lab06.py
    out = {}
    for name in EXERCISES:
        paths = _files(name, tmp, wrong[name])
        results = run_check(name, list(paths.values()))
        out[name] = dict(zip(paths, results))
    return out


@pytest.mark.parametrize("name", list(EXERCISES))
def test_solution_passes(outcomes, name):
    results = outcomes[name]["solution"]
    assert len(results) >= 3
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]


@pytest.mark.parametrize("name", list(EXERCISES))
def test_untouched_skeleton_fails(outcomes, name):
    results = outcomes[name]["skeleton"]
    assert results and not any(r.passed for r in results)
    assert "not implemented yet" in results[0].message


def test_memory_names_the_tied_head(outcomes):
    failed = [r for r in outcomes["memory"]["untied"] if not r.passed]
    assert failed and "count it once" in failed[0].message


def test_ring_refuses_the_builtin_all_reduce(outcomes):
    results = outcomes["ring_allreduce"]["cheat"]
    assert not any(r.passed for r in results)
    assert "used all_reduce" in results[0].message


def test_ring_counts_bytes_of_a_whole_tensor_ring(outcomes):
    results = outcomes["ring_allreduce"]["whole_tensor"]
    # right sums, but 3·S bytes per rank on 4 ranks instead of 1.5·S
    first = results[0]
    assert not first.passed and "sent 12,000 bytes" in first.message
    assert "6,000" in first.message


def test_buckets_without_overlap_fail(outcomes):
    results = {r.name: r for r in outcomes["buckets"]["no_overlap"]}
    assert results["bucket_bytes=inf"].passed  # one bucket: nothing to overlap with
    assert not results["bucket_bytes=0"].passed
    assert "after backward returned" in results["bucket_bytes=0"].message


def test_zero1_refuses_an_all_reduce(outcomes):
    results = outcomes["zero1"]["all_reduce"]
    assert not results[0].passed and "used all_reduce" in results[0].message


def test_zero1_names_the_missing_division(outcomes):
    results = outcomes["zero1"]["no_divide"]
    assert not results[0].passed
    assert "not my shard of the global-batch average" in results[0].message
    assert "2× too large: divide by n" in results[0].message


def test_tp_linear_without_f_gets_the_input_gradient_wrong(outcomes):
    results = {r.name: r for r in outcomes["tp_linear"]["no_f"]}
    assert results["b=2 s=8 h=16: forward"].passed  # f does nothing in forward
    failed = results["b=2 s=8 h=16: X.grad"]
    assert not failed.passed and "f's backward must all-reduce" in failed.message
    assert not results["b=2 s=8 h=16: communication"].passed


def test_tp_linear_names_a_bias_added_before_g(outcomes):
    results = {r.name: r for r in outcomes["tp_linear"]["bias_before_g"]}
    failed = results["b=2 s=8 h=16: forward"]
    assert not failed.passed and "add it once, after g" in failed.message


def test_one_f_one_b_tells_gpipe_by_its_memory(outcomes):
    failed = outcomes["one_f_one_b"]["gpipe"][0]
    assert not failed.passed
    assert "p=2, m=2: ranks hold at most [2, 2] microbatches' activations, 1F1B [2, 1]" in \
        failed.message


def test_one_f_one_b_without_warmup_is_slower(outcomes):
    failed = outcomes["one_f_one_b"]["no_warmup"][0]
    assert not failed.passed
    assert "p=2, m=2: the step takes 8 time units, 1F1B 6" in failed.message


def test_command_line_errors_are_one_line(capsys):
    assert main(["no_such_exercise"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hplab: error: unknown exercise") and "\n" not in err
    assert main(["memory", "/nonexistent/file.py"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_planning_tells_the_two_bubble_definitions_apart(outcomes):
    results = {r.name: r for r in outcomes["planning"]["step_fraction"]}
    assert results["model_state_bytes_per_gpu(zero=3, bf16)"].passed
    assert not results["bubble_fraction"].passed
    assert "pp=2, m=1: you say 0.5, the planner 1" in results["bubble_fraction"].message


def test_a_file_that_exits_fails_with_one_line(tmp_path, capsys):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    assert main(["memory", str(exits)]) == 1  # it checked nothing: it must not pass
    out = capsys.readouterr().out
    assert "✗ import: your file called sys.exit(0)" in out and "FAIL: 1 of 1" in out
    assert "Traceback" not in out


def test_an_endless_loop_fails_within_the_time_limit(tmp_path):
    loops = tmp_path / "loops.py"
    loops.write_text("def bubble_fraction(pp, m):\n    while True:\n        pass\n")
    results = run_check("planning", [loops], limit_s=2)[0]
    assert not any(r.passed for r in results)
    assert results[-1].name == "bubble_fraction" and "did not finish in 2 s" in results[-1].message


def test_distributed_checks_report_an_exit_and_an_endless_loop(tmp_path):
    exits, loops = tmp_path / "exits.py", tmp_path / "loops.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    loops.write_text("class ColumnParallelLinear:\n    def __init__(self, full, comm):\n"
                     "        while True:\n            pass\n")
    exited, looped = run_check("tp_linear", [exits, loops], limit_s=5)
    assert [r.passed for r in exited] == [False] and "sys.exit(3)" in exited[0].message
    assert [r.passed for r in looped] == [False] and "did not finish in 5 s" in looped[0].message
