"""The exercise checker can tell right from wrong: reference solutions pass, untouched skeletons
fail, and typical mistakes fail with a message that names them.

Each wrong solution is the reference solution with one targeted edit (`WRONG` below), written
to tmp_path, so it stays in step with the solution: an edit whose text is no longer in the
solution fails the test instead of silently testing nothing. Each exercise's files are checked
in ONE launch (`run_check` takes several files): one 4-process launch for the ring, one
2-process launch each for the buckets, the ZeRO-1 step and the tensor-parallel layers.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hplab.course.check import EXERCISES, EXERCISES_DIR, SOLUTIONS_DIR, main, run_check

# A ring that passes whole tensors around (using the solution's own `_exchange`): right sums,
# (n-1)·S bytes sent instead of 2(n-1)/n·S.
RING_WHOLE_TENSOR = """

def ring_all_reduce(tensor, comm):
    n, r = comm.size, comm.rank
    total, passing = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        passing = _exchange(comm, passing, passing, (r + 1) % n, (r - 1) % n)
        total += passing
    return tensor.copy_(total)
"""

# Not a ring, though it moves a ring's bytes and sums right: every rank sends chunk j straight
# to rank j, then its finished chunk to every other rank (using the solution's `_exchange`).
RING_ALL_PAIRS = """

def ring_all_reduce(tensor, comm):
    n, r = comm.size, comm.rank
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        chunks[r].add_(_exchange(comm, chunks[to], chunks[r], to, frm))
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        chunks[frm].copy_(_exchange(comm, chunks[r], chunks[frm], to, frm))
    return tensor
"""

# exercise -> {mistake: [(text in the solution, what replaces it), ...]}; ("", text) appends.
PATCHES_THE_TP_CHECKER = """
import hplab.course.check.lab04_tp_linear as checker
import hplab.course.check.report as report

checker._forward_problem = checker._x_grad_problem = lambda *a: None
checker._gradients_problem = checker._communication_problem = lambda *a: None
report.first = report.differs = report.first_wrong = lambda *a, **k: None
"""


WRONG = {
    "memory": {
        "untied_head": [("embeddings = V * h + S * h", "embeddings = 2 * V * h + S * h")],
        "no_ln_f": [
            ("return embeddings + L * block + layer_norm", "return embeddings + L * block")
        ],
    },
    "ring_allreduce": {
        "builtin": [
            (
                "    if n == 1:\n        return tensor\n",
                "    comm.all_reduce(tensor)\n    return tensor\n",
            )
        ],
        "whole_tensor": [("", RING_WHOLE_TENSOR)],
        "all_pairs": [("", RING_ALL_PAIRS)],
        "to_the_left": [
            ("right, left = (r + 1) % n, (r - 1) % n", "right, left = (r - 1) % n, (r + 1) % n")
        ],
        "chunk_order": [  # sends chunk (r + s) at step s: not the one that came from the left
            (
                "_exchange(comm, chunks[(r - s) % n], mine",
                "_exchange(comm, chunks[(r + s) % n], mine",
            )
        ],
    },
    "buckets": {
        "forward_order": [("for p in reversed(params):", "for p in params:")],
        "from_last_hook": [
            (
                "if self.ready[next_bucket] < len(bucket):",
                "if sum(self.ready) < len(self.bucket_index):",
            )
        ],
        "in_wait": [
            (
                "self.in_flight.append((bucket, flat, self.comm.all_reduce(flat, async_op=True)))",
                "self.in_flight.append((bucket, flat, None))",
            ),
            ("            handle.wait()\n", "            self.comm.all_reduce(flat)\n"),
        ],
        "no_divide": [(" / self.comm.size", "")],
        "blocking_in_hook": [  # right sums, right launches: but backward stops in each hook
            (
                "self.in_flight.append((bucket, flat, self.comm.all_reduce(flat, async_op=True)))",
                "self.comm.all_reduce(flat)\n"
                "            self.in_flight.append((bucket, flat, None))",
            ),
            ("            handle.wait()\n", ""),
        ],
        "wait_in_hook": [
            (
                "self.in_flight.append((bucket, flat, self.comm.all_reduce(flat, async_op=True)))",
                "handle = self.comm.all_reduce(flat, async_op=True)\n"
                "            handle.wait()\n"
                "            self.in_flight.append((bucket, flat, handle))",
            )
        ],
        "wait_for_previous": [  # one all-reduce in flight at a time
            (
                "            flat = torch.cat(",
                "            if self.in_flight:\n"
                "                self.in_flight[-1][2].wait()\n"
                "            flat = torch.cat(",
            )
        ],
        "spin_in_hook": [  # waits without calling wait(): only the link's clock sees it
            (
                "self.in_flight.append((bucket, flat, self.comm.all_reduce(flat, async_op=True)))",
                "handle = self.comm.all_reduce(flat, async_op=True)\n"
                "            while not handle.is_completed():\n"
                "                pass\n"
                "            self.in_flight.append((bucket, flat, handle))",
            )
        ],
    },
    "zero1": {
        "all_reduce": [
            (
                "        self.comm.reduce_scatter(my_grad, grads)\n",
                "        self.comm.all_reduce(grads)\n"
                "        my_grad = grads.view(n, -1)[self.comm.rank].clone()\n",
            )
        ],
        "no_divide": [("        grads /= n\n", "")],
        "own_shard_only": [  # each rank writes back only the shard it stepped: no all-gather
            (
                "        self.comm.all_gather(flat, self.master.detach().clone())\n",
                "        flat[: self.numel] = torch.cat([p.reshape(-1) for p in self.params])\n"
                "        flat[self.comm.rank * self.shard_numel :][: self.shard_numel] = "
                "self.master.detach()\n",
            )
        ],
        "gather_before_step": [  # the all-gather sends the shards as they were before the step
            ("        self.optimizer.step()\n", ""),
            ("        offset = 0\n", "        self.optimizer.step()\n        offset = 0\n"),
        ],
    },
    "tp_linear": {
        "no_f": [
            (
                "F.linear(CopyToTP.apply(x, self.comm), self.weight, self.bias)",
                "F.linear(x, self.weight, self.bias)",
            )
        ],
        "no_g": [
            (
                "ReduceFromTP.apply(F.linear(x_slice, self.weight), self.comm) + self.bias",
                "F.linear(x_slice, self.weight) + self.bias",
            )
        ],
        "bias_before_g": [
            (
                "ReduceFromTP.apply(F.linear(x_slice, self.weight), self.comm) + self.bias",
                "ReduceFromTP.apply(F.linear(x_slice, self.weight, self.bias), self.comm)",
            )
        ],
        "g_backward_reduces": [  # g's backward all-reduces like f's: X.grad counted T times
            (
                "    def forward(ctx, x, comm):\n        x = x.clone()",
                "    def forward(ctx, x, comm):\n        ctx.comm = comm\n        x = x.clone()",
            ),
            (
                "    def backward(ctx, grad):\n        return grad, None",
                "    def backward(ctx, grad):\n        grad = grad.clone()\n"
                "        ctx.comm.all_reduce(grad)\n        return grad, None",
            ),
        ],
        # the learner's code runs in a sandbox (check/sandbox.py): it cannot reach the checker
        "no_g_patching_the_checker": [
            (
                "ReduceFromTP.apply(F.linear(x_slice, self.weight), self.comm) + self.bias",
                "F.linear(x_slice, self.weight) + self.bias",
            ),
            ("", PATCHES_THE_TP_CHECKER),
        ],
        "exits_with_a_pass": [("", "\nimport os\n\nos._exit(0)\n")],
        "torch_distributed_directly": [  # not the comm it was given (the checker sees that)
            ("        comm.all_reduce(x)", "        torch.distributed.all_reduce(x)")
        ],
    },
    "one_f_one_b": {
        "gpipe": [("warmup = min(p - 1 - r, m)", "warmup = m")],
        "no_warmup": [("warmup = min(p - 1 - r, m)", "warmup = 0")],
        "one_warmup_too_many": [("warmup = min(p - 1 - r, m)", "warmup = min(p - r, m)")],
        "warmup_by_rank": [("warmup = min(p - 1 - r, m)", "warmup = min(r, m)")],
        "backward_first": [
            ('order += [("F", warmup + i), ("B", i)]', 'order += [("B", i), ("F", warmup + i)]')
        ],
    },
    "mesh": {  # more mix-ups of the numbering are in tests/test_lab06.py
        "dp_groups_keyed_like_tp": [
            ('families["dp"].setdefault((t, p), [])', 'families["dp"].setdefault((d, p), [])')
        ],
    },
    "planning": {
        "bubble_ratio": [
            ("return (pp - 1) / (microbatches + pp - 1)", "return (pp - 1) / microbatches")
        ],
        "grads_never_sharded": [("grads / (dp if zero >= 2 else 1)", "grads")],
        "master_never_sharded": [
            (
                "(optim + master) / (dp if zero >= 1 else 1)",
                "optim / (dp if zero >= 1 else 1) + master",
            )
        ],
        "params_sharded_from_stage_2": [
            ("params / (dp if zero >= 3 else 1)", "params / (dp if zero >= 2 else 1)")
        ],
        "no_master_copy": [('"bf16": (2, 2, 8, 4)', '"bf16": (2, 2, 8, 0)')],
    },
    "lse_merge": {
        "exp_of_lse": [
            (
                "    lse = torch.logaddexp(lse_a, lse_b)\n",
                "    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))\n",
            )
        ],
        "plain_average": [
            (
                "return share_a[..., None] * out_a + share_b[..., None] * out_b, lse",
                "return (out_a + out_b) / 2, lse",
            )
        ],
        "nan_where_nothing_seen": [
            (".nan_to_num(0.0)\n    share_b", "\n    share_b"),
            (
                "share_b = torch.exp(lse_b - lse).nan_to_num(0.0)",
                "share_b = torch.exp(lse_b - lse)",
            ),
        ],
    },
    "dispatch": {
        "token_order": [
            (
                "return torch.sort(expert_index.flatten(), stable=True).indices",
                "return torch.arange(expert_index.numel())",
            )
        ],
        "reversed_within_expert": [
            (
                "torch.sort(expert_index.flatten(), stable=True).indices",
                "torch.sort(expert_index.flatten(), stable=True, descending=True).indices.flip(0)",
            )
        ],
        "one_count_per_token": [
            (
                "torch.bincount(expert_index.flatten(), minlength",
                "torch.bincount(expert_index[:, 0], minlength",
            )
        ],
        "experts_dealt_round_robin": [
            (
                "per_expert.view(ep_size, n_experts // ep_size).sum(dim=1)",
                "per_expert.view(n_experts // ep_size, ep_size).sum(dim=0)",
            )
        ],
        "no_gates": [
            (
                "(by_pair.view(T, k, -1) * gates[..., None]).sum(dim=1)",
                "by_pair.view(T, k, -1).sum(dim=1)",
            )
        ],
        "not_unpermuted": [("by_pair[order] = results", "by_pair[:] = results")],
    },
    "goodput": {
        "whole_interval_lost": [
            (
                "(restart_s + (interval_s + checkpoint_s) / 2)",
                "(restart_s + interval_s + checkpoint_s)",
            )
        ],
        "no_restart": [
            (
                "lost = (restart_s + (interval_s + checkpoint_s) / 2)",
                "lost = ((interval_s + checkpoint_s) / 2)",
            )
        ],
        "no_saving_cost": [("saving = interval_s / (interval_s + checkpoint_s)", "saving = 1.0")],
        "no_floor": [("return max(0.0, saving * (1 - lost))", "return saving * (1 - lost)")],
        "no_factor_2": [
            ("math.sqrt(2 * checkpoint_s * mtbf_s)", "math.sqrt(checkpoint_s * mtbf_s)")
        ],
    },
    "gqa_heads": {
        "queries_strided": [
            (
                "queries = list(range(rank * per_rank, (rank + 1) * per_rank))",
                "queries = list(range(rank, n_head, tp))",
            )
        ],
        "kv_round_robin": [
            (
                "kv = sorted({q // group for q in queries})",
                "kv = sorted({q % n_kv_head for q in queries})",
            )
        ],
        "kv_split_like_queries": [  # fewer K/V heads than ranks: some ranks get none
            (
                "kv = sorted({q // group for q in queries})",
                "kv = list(range(rank * n_kv_head // tp, (rank + 1) * n_kv_head // tp))",
            )
        ],
        "no_gradient_sum": [("sharing = max(1, tp // n_kv_head)", "sharing = 1")],
        "groups_strided": [
            (
                "return [list(range(first, first + sharing)) for first in range(0, tp, sharing)]",
                "return [list(range(i, tp, tp // sharing)) for i in range(tp // sharing)]",
            )
        ],
        "whole_tp_group": [
            (
                "return [list(range(first, first + sharing)) for first in range(0, tp, sharing)]",
                "return [list(range(tp))]",
            )
        ],
    },
}


def write_variant(name: str, mistake: str, tmp_path):
    """The solution of exercise `name` with the edits of WRONG[name][mistake], as a new file."""
    source = (SOLUTIONS_DIR / EXERCISES[name].file).read_text()
    for old, new in WRONG[name][mistake]:
        assert not old or source.count(old) == 1, f"{name}/{mistake}: {old!r} left the solution"
        source = source.replace(old, new) if old else source + new
    path = tmp_path / f"{name}_{mistake}.py"
    path.write_text(source)
    return path


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{exercise: {"solution" | mistake | "skeleton": {case name: Result}}}, one launch each."""
    tmp, out = tmp_path_factory.mktemp("exercises"), {}
    for name, exercise in EXERCISES.items():
        paths = {
            "solution": SOLUTIONS_DIR / exercise.file,
            **{mistake: write_variant(name, mistake, tmp) for mistake in WRONG[name]},
            "skeleton": EXERCISES_DIR / exercise.file,
        }  # last: it fails at once
        results = run_check(name, list(paths.values()))
        out[name] = {label: {r.name: r for r in rs} for label, rs in zip(paths, results)}
    return out


def failed(outcomes, name: str, mistake: str, case: str | None = None) -> str:
    """The message of `case` (default: the first case), which must have failed."""
    results = outcomes[name][mistake]
    result = results[case] if case else next(iter(results.values()))
    assert not result.passed, (name, mistake, result)
    return result.message


@pytest.mark.parametrize("name", list(EXERCISES))
def test_solution_passes(outcomes, name):
    results = outcomes[name]["solution"].values()
    assert len(results) >= 3
    assert all(r.passed for r in results), [r.message for r in results if not r.passed]


@pytest.mark.parametrize("name", list(EXERCISES))
def test_untouched_skeleton_fails(outcomes, name):
    results = list(outcomes[name]["skeleton"].values())
    assert results and not any(r.passed for r in results)
    assert "not implemented yet" in results[0].message


@pytest.mark.parametrize("name", list(EXERCISES))
def test_every_wrong_solution_fails(outcomes, name):
    for mistake in WRONG[name]:
        assert not all(r.passed for r in outcomes[name][mistake].values()), mistake


def test_memory_names_the_mistake(outcomes):
    assert "count it once" in failed(outcomes, "memory", "untied_head")
    assert "off by -128) — the final layer norm ln_f" in failed(outcomes, "memory", "no_ln_f")


def test_ring_names_the_builtin_and_the_whole_tensor_ring(outcomes):
    assert "used all_reduce: build it from send and recv only" in failed(
        outcomes, "ring_allreduce", "builtin"
    )
    # right sums, but 3·S bytes per rank on 4 ranks instead of 1.5·S
    message = failed(outcomes, "ring_allreduce", "whole_tensor")
    assert "sent 12,000 bytes" in message and "6,000" in message


def test_ring_checker_requires_a_ring(outcomes):
    # the all-pairs exchange moves a ring's bytes and sums right, and is still no ring
    message = failed(outcomes, "ring_allreduce", "all_pairs")
    assert "this is not a ring" in message and "only to the next rank (r+1) % n" in message
    message = failed(outcomes, "ring_allreduce", "to_the_left")
    assert "sent to rank 3: this is not a ring" in message  # rank 0's left neighbour
    message = failed(outcomes, "ring_allreduce", "chunk_order")
    assert "reduce-scatter step 1" in message and "not the ring's chunk order" in message
    assert "the result is not the sum" not in message  # the cause, not the symptom
    assert all(r.passed for r in outcomes["ring_allreduce"]["solution"].values())


def test_buckets_need_reverse_order_and_overlap(outcomes):
    for mistake in ("forward_order", "from_last_hook", "in_wait"):
        results = outcomes["buckets"][mistake]
        message = failed(outcomes, "buckets", mistake, "bucket_bytes=0")
        assert "0 all-reduce(s) of 0 B had started, hplab.DDP's" in message, mistake
        assert "parameters in reverse" in message and "hook that completes it" in message
        assert not results["bucket_bytes=20000"].passed, mistake
    # one bucket: from the last hook is right; after backward returned is too late
    assert outcomes["buckets"]["from_last_hook"]["bucket_bytes=inf"].passed
    assert outcomes["buckets"]["forward_order"]["bucket_bytes=inf"].passed
    assert "when backward returned, 0 all-reduce(s)" in failed(
        outcomes, "buckets", "in_wait", "bucket_bytes=inf"
    )


def test_buckets_name_a_hook_that_waits(outcomes):
    """A hook that waits for its all-reduce (a blocking call, or wait() on its handle or on the
    previous bucket's) leaves nothing to overlap: named, with what it cost on the link."""
    for mistake, how in (
        ("blocking_in_hook", "comm.all_reduce without async_op=True: a blocking call"),
        ("wait_in_hook", "handle.wait()"),
        ("wait_for_previous", "handle.wait()"),
    ):
        for case in ("bucket_bytes=inf", "bucket_bytes=0", "bucket_bytes=20000"):
            if mistake == "wait_for_previous" and case == "bucket_bytes=inf":
                assert outcomes["buckets"][mistake][case].passed  # one bucket: no previous one
                continue
            message = failed(outcomes, "buckets", mistake, case)
            assert f"waited for an all-reduce ({how}): backward stood still" in message
            assert "launch with async_op=True, return, and wait in wait()" in message


def test_buckets_see_on_the_link_a_hook_that_spins(outcomes):
    """Waiting without wait() (spinning on is_completed) only the link's clock can see: no
    all-reduce ran while backward computed."""
    assert outcomes["buckets"]["spin_in_hook"]["bucket_bytes=inf"].passed  # nothing to overlap
    for case in ("bucket_bytes=0", "bucket_bytes=20000"):
        message = failed(outcomes, "buckets", "spin_in_hook", case)
        assert "was on the check's link (100MB/s,1ms) while backward computed" in message


def test_buckets_overlap_on_hand_made_times():
    from hplab.course.check.lab02_buckets import overlap_problem, overlap_s

    arrived, returned = [0.0, 2.0, 4.0], [1.0, 3.0, 5.0]  # hooks 0-1, 2-3, 4-5; compute between
    assert overlap_s([(0.5, 1.5)], returned, arrived) == pytest.approx(0.5)  # 1 → 1.5
    assert overlap_s([(1.5, 3.5)], returned, arrived) == pytest.approx(0.5 + 0.5)
    assert overlap_s([(2.0, 3.0), (4.1, 6.0)], returned, arrived) == 0.0  # inside hooks, after
    assert overlap_problem(0.0, 1) is None  # one bucket: nothing to overlap
    assert "none of the 7 all-reduces" in overlap_problem(0.0, 7)
    assert overlap_problem(1e-3, 7) is None


def test_buckets_name_the_missing_division(outcomes):
    for case in ("bucket_bytes=inf", "bucket_bytes=0"):
        message = failed(outcomes, "buckets", "no_divide", case)
        assert "not the global-batch average" in message and "2× too large: divide by n" in message


def test_zero1_names_the_all_reduce_and_the_missing_division(outcomes):
    assert "used all_reduce: ZeRO-1 needs only a reduce-scatter" in failed(
        outcomes, "zero1", "all_reduce"
    )
    message = failed(outcomes, "zero1", "no_divide")
    assert "not my shard of the global-batch average" in message
    assert "2× too large: divide by n" in message


def test_zero1_names_a_missing_all_gather_and_parameters_that_did_not_move(outcomes):
    assert "no all-gather: each rank updated only its own shard" in failed(
        outcomes, "zero1", "own_shard_only"
    )
    assert "the parameters did not change in this step" in failed(
        outcomes, "zero1", "gather_before_step"
    )


def test_tp_linear_names_a_missing_f_or_g(outcomes):
    results = outcomes["tp_linear"]["no_f"]
    assert results["b=2 s=8 h=16: forward"].passed  # f does nothing in forward
    assert "f's backward must all-reduce" in failed(
        outcomes, "tp_linear", "no_f", "b=2 s=8 h=16: X.grad"
    )
    assert "backward: nothing" in failed(
        outcomes, "tp_linear", "no_f", "b=2 s=8 h=16: communication"
    )
    assert "only this rank's partial sum: g must all-reduce it" in failed(
        outcomes, "tp_linear", "no_g", "b=2 s=8 h=16: forward"
    )


def test_tp_linear_names_the_bias_and_a_reducing_g(outcomes):
    assert "add it once, after g" in failed(
        outcomes, "tp_linear", "bias_before_g", "b=2 s=8 h=16: forward"
    )
    assert outcomes["tp_linear"]["g_backward_reduces"]["b=2 s=8 h=16: forward"].passed
    message = failed(outcomes, "tp_linear", "g_backward_reduces", "b=2 s=8 h=16: X.grad")
    assert "2× too large: only f's backward all-reduces" in message


def test_a_distributed_check_cannot_be_patched_or_exited(outcomes):
    """On each rank the learner's code runs in a sandbox, given a communicator whose calls run
    in the checker's process: patching the checker there, or exiting, passes nothing."""
    assert "only this rank's partial sum: g must all-reduce it" in failed(
        outcomes, "tp_linear", "no_g_patching_the_checker", "b=2 s=8 h=16: forward"
    )
    exits = outcomes["tp_linear"]["exits_with_a_pass"]
    assert [(r.name, r.passed) for r in exits.values()] == [("import", False)]
    assert "your file ended its process while loading it" in exits["import"].message
    message = failed(outcomes, "tp_linear", "torch_distributed_directly")
    assert "at line" in message and "through the comm it is given" in message


def test_one_f_one_b_names_wrong_warmup_counts(outcomes):
    assert "p=2, m=2: ranks hold at most [2, 2] microbatches' activations, 1F1B [2, 1]" in failed(
        outcomes, "one_f_one_b", "gpipe"
    )
    message = failed(outcomes, "one_f_one_b", "one_warmup_too_many")
    assert "ranks hold at most [2, 2]" in message and "too many forwards" in message
    message = failed(outcomes, "one_f_one_b", "no_warmup")
    assert "p=2, m=2: the step takes 8 time units, 1F1B 6" in message
    assert "forwards before the first backward: [1, 1], 1F1B [2, 1]" in message
    assert "schedule deadlocks" in failed(outcomes, "one_f_one_b", "warmup_by_rank")
    assert "rank 1 runs B0.1 before its F" in failed(outcomes, "one_f_one_b", "backward_first")


def test_mesh_names_a_group_keyed_by_the_wrong_coordinates(outcomes):
    assert outcomes["mesh"]["dp_groups_keyed_like_tp"]["coordinates"].passed
    assert (
        "rank 0's dp group is [0, 1], expected [0] (the ranks that share its tp and pp"
        in failed(outcomes, "mesh", "dp_groups_keyed_like_tp", "groups: dp")
    )


def test_planning_names_the_bubble_ratio_and_shows_the_memory_by_kind(outcomes):
    results = outcomes["planning"]["bubble_ratio"]
    assert results["model_state_bytes_per_gpu(zero=3, bf16)"].passed
    message = failed(outcomes, "planning", "bubble_ratio", "bubble_fraction")
    assert "pp=2, m=1: you say 1, the bubble fraction (p−1)/(m+p−1) is 0.5" in message
    assert "that is the bubble ratio (p−1)/m" in message
    assert outcomes["planning"]["grads_never_sharded"][
        "model_state_bytes_per_gpu(zero=1, bf16)"
    ].passed
    assert (
        "= 2 (params) + 0.6667 (grads) + 2.667 (optim) + 1.333 (master) bytes per "
        "parameter"
        in failed(
            outcomes, "planning", "grads_never_sharded", "model_state_bytes_per_gpu(zero=2, bf16)"
        )
    )


def test_planning_names_the_kind_a_stage_shards_or_keeps(outcomes):
    assert "the gradients (4 B per parameter) are not divided by dp: ZeRO-2 and up shard them" in (
        failed(
            outcomes, "planning", "grads_never_sharded", "model_state_bytes_per_gpu(zero=2, fp32)"
        )
    )
    assert "the fp32 master weights (4 B per parameter) are not divided by dp: ZeRO-1 and up" in (
        failed(
            outcomes, "planning", "master_never_sharded", "model_state_bytes_per_gpu(zero=1, bf16)"
        )
    )
    assert outcomes["planning"]["master_never_sharded"][
        "model_state_bytes_per_gpu(zero=3, fp32)"
    ].passed
    assert (
        "the parameters (4 B per parameter) are divided by dp: only ZeRO-3 and up shard them"
        in (
            failed(
                outcomes,
                "planning",
                "params_sharded_from_stage_2",
                "model_state_bytes_per_gpu(zero=2, fp32)",
            )
        )
    )
    assert "the fp32 master weights (4 B per parameter) are missing: bf16 training keeps them" in (
        failed(outcomes, "planning", "no_master_copy", "model_state_bytes_per_gpu(zero=0, bf16)")
    )


def test_lse_merge_names_the_overflow_the_weights_and_the_nan(outcomes):
    assert "exp(lse) overflowed — factor out the larger lse" in failed(
        outcomes, "lse_merge", "exp_of_lse", "scores past exp's range (~1000)"
    )
    assert outcomes["lse_merge"]["exp_of_lse"]["two blocks"].passed  # only large scores show it
    assert "each partial weighs exp(its lse − the merged lse)" in failed(
        outcomes, "lse_merge", "plain_average"
    )
    assert "−inf − (−inf) is NaN" in failed(
        outcomes, "lse_merge", "nan_where_nothing_seen", "a ring of four blocks, causal"
    )


def test_dispatch_names_the_order_the_counts_and_the_gates(outcomes):
    assert "not grouped by expert" in failed(outcomes, "dispatch", "token_order")
    assert "keep token order (sort stably)" in failed(
        outcomes, "dispatch", "reversed_within_expert"
    )
    assert "a token goes to k experts" in failed(
        outcomes, "dispatch", "one_count_per_token", "send_counts"
    )
    assert "not e % ep" in failed(outcomes, "dispatch", "experts_dealt_round_robin", "send_counts")
    assert "weight each result by its gate" in failed(outcomes, "dispatch", "no_gates", "combine")
    assert "differ" in failed(outcomes, "dispatch", "not_unpermuted", "combine")


def test_gqa_heads_names_the_block_the_shared_head_and_the_sum(outcomes):
    assert "a consecutive block of n_head / tp" in failed(outcomes, "gqa_heads", "queries_strided")
    message = failed(outcomes, "gqa_heads", "kv_round_robin")
    assert "query head i reads K/V head i // 2 (n_head / n_kv_head)" in message
    assert "15 of 15 elements differ" in failed(
        outcomes, "gqa_heads", "kv_round_robin", "attention of each rank"
    )  # rank 1's query head read the other K/V head
    assert "it still reads one: hold that K/V head whole" in failed(
        outcomes, "gqa_heads", "kv_split_like_queries"
    )
    for mistake in ("queries_strided", "kv_round_robin", "kv_split_like_queries"):
        assert outcomes["gqa_heads"][mistake]["K/V gradient groups"].passed  # (only the heads)
    for mistake in ("no_gradient_sum", "groups_strided", "whole_tp_group"):
        assert outcomes["gqa_heads"][mistake]["heads of each rank"].passed, mistake
    assert "holds part of its gradient: add all" in failed(
        outcomes, "gqa_heads", "no_gradient_sum", "K/V gradient groups"
    )
    for mistake in ("groups_strided", "whole_tp_group"):
        assert "only ranks holding the same heads add their gradients" in failed(
            outcomes, "gqa_heads", mistake, "K/V gradient groups"
        )


def test_goodput_names_the_lost_half_the_restart_the_save_and_the_factor_2(outcomes):
    for mistake, says in (
        ("whole_interval_lost", "loses half an interval on average, not all of it"),
        ("no_restart", "each failure also costs the restart"),
        ("no_saving_cost", "saving stops training: multiply by τ/(τ+C)"),
        ("no_floor", "goodput cannot be negative"),
    ):
        assert says in failed(outcomes, "goodput", mistake, "goodput"), mistake
    assert "the factor 2" in failed(outcomes, "goodput", "no_factor_2", "best_interval")
    assert "your best interval is higher" in failed(
        outcomes, "goodput", "no_factor_2", "the best interval is the best"
    )


def test_command_line_errors_are_one_line(capsys):
    assert main(["no_such_exercise"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hplab: error: unknown exercise") and "\n" not in err
    assert main(["memory", "/nonexistent/file.py"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_folder_or_a_device_for_the_file_is_one_line(tmp_path, capsys):
    """A folder names the exercise file in it (or the one it holds); a device is no file."""
    assert main(["memory", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"hplab: error: {tmp_path} is a folder, not your exercise file: "
        "name a file in it, lab00_memory.py"
    )
    (tmp_path / "lab00_memory.py").write_text("")
    assert main(["memory", str(tmp_path)]) == 2
    assert f"did you mean {tmp_path / 'lab00_memory.py'}?" in capsys.readouterr().err
    assert main(["memory", "/dev/null"]) == 2
    err = capsys.readouterr().err.strip()
    assert "/dev/null is not a regular file" in err and "\n" not in err


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
    loops.write_text(  # and swallows what it can catch: the checker's timeout is not there
        "import time\n\nclass ColumnParallelLinear:\n    def __init__(self, full, comm):\n"
        "        while True:\n            try:\n                time.sleep(1)\n"
        "            except:  # noqa: E722\n                pass\n"
    )
    exited, looped = run_check("tp_linear", [exits, loops], limit_s=5)
    assert [r.passed for r in exited] == [False] and "sys.exit(3)" in exited[0].message
    assert [r.passed for r in looped] == [False] and "did not finish in 5 s" in looped[0].message


@pytest.mark.parametrize("module", ["hplab.check", "hplab.course.check"])
def test_both_commands_run_the_checker(module):
    """`python -m hplab.check`, the name learners type, runs the course's checker: same help."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m hplab.check [-h] name [file]")
    assert "ring_allreduce (lab 01)" in done.stdout


def test_the_shim_is_the_course_checker():
    from hplab import check

    assert check.main is main and check.run_check is run_check and check.EXERCISES is EXERCISES


CHEATS = {
    "exits with a pass": "import os\n\ndef goodput(*a):\n    os._exit(0)\n\n"
    "def best_interval(c, m):\n    os._exit(0)\n",
    "patches the checker": "import hplab.course.check.lab11_goodput as checker\n"
    "checker.goodput = checker.young_interval_s = lambda *a: 0.5\n"
    "def goodput(*a):\n    return 0.5\n\ndef best_interval(c, m):\n    return 0.5\n",
    "swallows the timeout": "import time\n\ndef goodput(*a):\n    while True:\n        try:\n"
    "            time.sleep(1)\n        except:  # noqa: E722\n            pass\n\n"
    "def best_interval(c, m):\n    return 0.5\n",
}


def test_the_learner_s_code_cannot_reach_the_checker(tmp_path):
    """It runs in a sandbox process of its own (check/sandbox.py): exiting, patching the
    checker's functions or a bare `except:` around the time limit pass nothing."""
    paths = []
    for name, source in CHEATS.items():
        paths.append(tmp_path / f"{name.replace(' ', '_')}.py")
        paths[-1].write_text(source)
    exits, patches, swallows = run_check("goodput", paths, limit_s=3)
    assert all(not r.passed and "ended its process" in r.message for r in exits), exits
    assert not any(r.passed for r in patches[:2]), patches
    assert [(r.passed, r.message) for r in swallows] == [
        (False, "did not finish in 3 s: an endless loop, or ranks waiting?")
    ]


# --- the sandbox's walls: plain data, the checker's files, its processes, forbidden helpers --

PICKLE_BOMBS = """
import os


class Evil(int):  # pickle would call os.system in the process that loads it
    def __reduce__(self):
        return (os.system, ("touch {marker}",))


class EvilNotImplemented(NotImplementedError):
    def __reduce__(self):
        return (os.system, ("touch {marker}",))


def num_params(config):
    return Evil(1)


def model_state_bytes(config):
    raise EvilNotImplemented("soon")
"""

LIARS = """
from unittest import mock


class Liar(int):  # equal to everything
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


def num_params(config):
    return Liar(1)


def model_state_bytes(config):
    return {"params": mock.ANY, "grads": mock.ANY, "optim": mock.ANY}
"""

CALLS_THE_ANSWER = """
from hplab.config import ModelConfig


def num_params(config):
    return config.num_params()


def model_state_bytes(config):
    psi = ModelConfig.num_params(config)
    return {"params": 4 * psi, "grads": 4 * psi, "optim": 8 * psi}
"""


def test_results_cross_as_plain_data_and_are_compared_as_numbers(tmp_path):
    """A learner's object with a crafted __reduce__ runs nothing here (results are JSON), an
    int that equals everything arrives as its digits, and unittest.mock.ANY does not cross."""
    marker = tmp_path / "ran_in_the_checker"
    bombs, liars = tmp_path / "bombs.py", tmp_path / "liars.py"
    bombs.write_text(PICKLE_BOMBS.format(marker=marker))
    liars.write_text(LIARS)
    checked = run_check("memory", [bombs, liars], limit_s=600)  # (+ the forkserver's start)
    bombed, lied = ({r.name.split("(")[0]: r for r in rs} for rs in checked)
    assert not marker.exists()
    assert "you count 1, the model has" in bombed["num_params"].message
    assert bombed["model_state_bytes"].message == "not implemented yet (soon)"
    assert not lied["num_params"].passed and "you count 1" in lied["num_params"].message
    assert not lied["model_state_bytes"].passed
    assert "a _ANY (<ANY>): not plain data" in lied["model_state_bytes"].message


def test_lab_00_sees_a_call_of_the_forbidden_num_params(tmp_path):
    cheat = tmp_path / "cheat.py"
    cheat.write_text(CALLS_THE_ANSWER)
    results = run_check("memory", [cheat])[0]
    assert results and not any(r.passed for r in results)
    assert results[0].message.startswith("you called config.num_params(): it is the answer")
    assert results[0].message.endswith("(line 6)") and results[1].message.endswith("(line 10)")


# A tensor subclass that pickle would turn into os.system: the tensor-parallel solution's column
# layer returns it, so it reaches the communicator and the driver's results.
DISTRIBUTED_PICKLE_BOMB = """

import os


class Evil(torch.Tensor):
    def __reduce_ex__(self, protocol):
        return (os.system, ("touch {marker}",))


_column = ColumnParallelLinear.forward
ColumnParallelLinear.forward = lambda self, x: _column(self, x).as_subclass(Evil)
"""


def test_a_distributed_check_takes_only_plain_data_from_its_sandboxes(tmp_path):
    marker = tmp_path / "ran_in_a_rank"
    bomb = tmp_path / "bomb.py"
    source = (SOLUTIONS_DIR / EXERCISES["tp_linear"].file).read_text()
    bomb.write_text(source + DISTRIBUTED_PICKLE_BOMB.format(marker=marker))
    results = run_check("tp_linear", [bomb])[0]
    assert not marker.exists()
    assert all(r.passed for r in results), results  # its numbers are right: it passes


REWRITES_THE_CHECKER = """
import os

import hplab.course.check.lab00_memory as checker
import hplab.course.check.report as report

with open(checker.__file__, "a") as source:
    source.write("\\ncheck_memory = lambda module, report: None  # everything passes\\n")
os.makedirs(report.__file__[:-3], exist_ok=True)  # a package that shadows report.py
with open(os.path.join(report.__file__[:-3], "__init__.py"), "w") as shadow:
    shadow.write("raise SystemExit('shadowed')\\n")


def num_params(config):
    return 1


def model_state_bytes(config):
    return {}
"""


def test_a_file_that_rewrites_the_checker_fails_and_the_checker_is_put_back(tmp_path):
    """On a copy of hplab (the repository is never written): the rewrite is one failing line,
    and the next check runs the checker as it was."""
    import shutil

    import hplab

    package = tmp_path / "copy" / "hplab"
    shutil.copytree(Path(hplab.__file__).parent, package)
    original = (package / "course/check/lab00_memory.py").read_text()
    rewrites = tmp_path / "rewrites.py"
    rewrites.write_text(REWRITES_THE_CHECKER)

    def check(path):
        return subprocess.run(
            [sys.executable, "-m", "hplab.check", "memory", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,  # (`python -m` puts the working directory first on sys.path)
            env={**os.environ, "PYTHONPATH": str(package.parent)},
        )

    done = check(rewrites)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stderr
    assert (
        "✗ the checker's files: your file added the checker's own "
        "hplab/course/check/report/__init__.py (and 1 more): a checked file must not write"
    ) in done.stdout
    assert (package / "course/check/lab00_memory.py").read_text() == original
    assert not (package / "course/check/report/__init__.py").exists()
    again = check(SOLUTIONS_DIR / EXERCISES["memory"].file)
    assert again.returncode == 0 and "PASS: all 6 checks passed" in again.stdout, again.stdout


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


ESCAPES_BY_SETSID = """
import os
import time

if os.fork() == 0:  # a child in a session of its own, whose child it orphans
    os.setsid()
    if os.fork() == 0:
        with open("{pid_file}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(5)
        print("PASS: all 6 checks passed", flush=True)
    os._exit(0)
while not os.path.exists("{pid_file}"):
    time.sleep(0.05)


def num_params(config):
    return 1


def model_state_bytes(config):
    return {{}}
"""


@pytest.mark.skipif(sys.platform != "linux", reason="prctl and /proc: Linux")
def test_a_setsid_grandchild_dies_with_the_check(tmp_path):
    pid_file, escapes = tmp_path / "grandchild.pid", tmp_path / "escapes.py"
    escapes.write_text(ESCAPES_BY_SETSID.format(pid_file=pid_file))
    results = run_check("memory", [escapes])[0]
    assert not any(r.passed for r in results)
    assert not _running(int(pid_file.read_text()))


@pytest.mark.skipif(sys.platform != "linux", reason="prctl: Linux")
def test_a_killed_checker_leaves_no_sandbox_behind(tmp_path):
    pid_file, spins = tmp_path / "sandbox.pid", tmp_path / "spins.py"
    spins.write_text(
        f"import os\n\nwith open({str(pid_file)!r}, 'w') as f:\n    f.write(str(os.getpid()))\n"
        "while True:\n    pass\n"
    )
    checker = subprocess.Popen(
        [sys.executable, "-m", "hplab.check", "memory", str(spins)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    sandbox = int(pid_file.read_text())
    assert _running(sandbox)
    checker.kill()
    checker.wait()
    deadline = time.monotonic() + 5
    while _running(sandbox) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(sandbox)
