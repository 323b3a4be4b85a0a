"""Pipeline parallel, from scratch.

The idea: cut the model's layers into `p` consecutive **stages**, one per rank. A batch flows
through the stages like cars through a car wash: rank 0 embeds the tokens and runs the first
layers, sends the activation to rank 1, which runs the next layers, ..., and the last rank
applies the LM head and the loss. Backward flows the other way: each rank receives the
gradient of its output, backpropagates through its layers, and sends the gradient of its
input to the rank before. Each rank holds only 1/p of the weights, and only point-to-point
messages of one activation cross the wire.

Done naively, only one rank works at a time. So the batch is cut into `m` **microbatches**:
while rank 1 works on microbatch 0, rank 0 already runs microbatch 1; the idle time left at
the start and end of a step is the **bubble**. The schedules (GPipe, 1F1B, interleaved, ZB-H1)
are plain data, built in `hplab/parallel/schedule.py`, whose names this file re-exports
(`pp.build_schedule`, ...; the planner simulates them: `hplab.plan.simulate`). Each
microbatch's loss is divided by m, so the accumulated gradients are those of the mean loss over
the whole batch.

This file reads in three parts: 1. **stages**, the decoder split by layers (the tied embedding /
LM-head copies kept equal by summing their gradients, as Megatron-LM); 2. **split backward**
(ZB-H1): B the stage input's gradient, W the weight gradients later, for any layer; 3. the
**executor**, which runs this rank's action list with point-to-point messages (observers, such
as `hplab.observe.observers`'s trace, watch each action from outside) and, when its backwards
are done, sums the tied embedding's two gradients. Data parallel and the optimizer step are
the caller's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge

from hplab.config import check_pipeline_depth
from hplab.models.gpt import cross_entropy as loss_fn  # noqa: F401 (for torch's pipelining)
from hplab.parallel import placement
from hplab.parallel.collectives import Communicator, communicator
from hplab.parallel.schedule import (  # pp.build_schedule, ...: the labs' names
    COMPUTE,  # noqa: F401
    Action,  # noqa: F401
    add_communication,  # noqa: F401
    build_schedule,  # noqa: F401
    chunk_owner,  # noqa: F401
    message_key,  # noqa: F401
    one_f_one_b_order,  # noqa: F401
    receives_ahead,
    schedule_text,  # noqa: F401
)
from hplab.plan.formulas import SCHEDULES, bubble_formula  # noqa: F401  (pp.bubble_formula: labs)
from hplab.runtime.group import new_group

# --- 1. Stages ------------------------------------------------------------------------------------


def split_layers(n_layer: int, num_chunks: int) -> list[range]:
    """Balanced consecutive layer ranges: the first `n_layer % num_chunks` chunks get one
    layer more. Every chunk needs at least one layer."""
    check_pipeline_depth(n_layer, num_chunks)
    base, extra = divmod(n_layer, num_chunks)
    start = [c * base + min(c, extra) for c in range(num_chunks + 1)]
    return [range(start[c], start[c + 1]) for c in range(num_chunks)]


class Stage(nn.Module):
    """One model chunk: the embedding (first chunk only), some blocks, the head (last only).
    Its registered submodules are only the pieces it owns, so `stage.parameters()` is the
    chunk's own weights (on the last chunk a tied `lm_head.weight` is the embedding's)."""

    def __init__(self, decoder, chunk: int, num_chunks: int, layers: range):
        super().__init__()
        self.__dict__["decoder"] = decoder  # the model the pieces come from (not registered here)
        self.chunk = chunk
        self.layers = layers
        self.is_first = chunk == 0
        self.is_last = chunk == num_chunks - 1
        if self.is_first:  # what `embed` uses (GPT-2: wte, wpe; a Llama: embed_tokens)
            self.embedding = decoder.embedding_part()
        self.blocks = nn.ModuleList(decoder.blocks[i] for i in layers)
        if self.is_last:  # what `head` uses: the final norm and the LM head
            self.final = decoder.head_part()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first chunk) or an activation in; an activation or logits out."""
        if self.is_first:
            x = self.decoder.embed(x)
        for block in self.blocks:
            x = self.decoder.run_block(block, x)
        return self.decoder.head(x) if self.is_last else x

    def aux_loss(self):
        """This chunk's auxiliary losses of its last forward (experts' balance; 0 if dense)."""
        return self.decoder.aux_loss(self.blocks)


class AuxLossRidesAlong(torch.autograd.Function):
    """The activation, unchanged; in backward, the chunk's auxiliary loss gets the gradient
    `weight` (its microbatch's weight in the step's loss). The loss is computed on the last
    stage, so a mixture of experts on another stage learns to balance through the activation
    it sends (Megatron-LM's MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx, activation, aux_loss, weight: float):
        ctx.aux = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        ctx.weight = weight
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


def build_stages(decoder, rank: int, p: int, virtual_stages: int = 1) -> list[Stage]:
    """The chunks this pipeline rank runs, in chunk order. A tied embedding / LM head split
    over two ranks is recorded as such (`placement.pipeline_ends`): its gradient is owed a sum."""
    num_chunks = p * virtual_stages
    layers = split_layers(decoder.config.n_layer, num_chunks)
    stages = [
        Stage(decoder, c, num_chunks, layers[c])
        for c in range(num_chunks)
        if chunk_owner(c, p) == rank
    ]
    if p > 1 and decoder.config.tie_word_embeddings and tied_weight(stages) is not None:
        placement.update(decoder.lm_head.weight, pipeline_ends=True)
    return stages


def tied_weight(stages: list[Stage]) -> nn.Parameter | None:
    """The embedding the first chunk shares with the LM head of the last, if a stage here holds
    it (the first chunk's rank and the last one's each keep a copy)."""
    decoder = stages[0].decoder if stages else None
    ends = any(s.is_first or s.is_last for s in stages)
    return decoder.lm_head.weight if ends and decoder.config.tie_word_embeddings else None


@torch.no_grad()
def sum_tied_gradient(stages: list[Stage], comm, before: torch.Tensor | None = None) -> None:
    """The first stage's embedding and the last stage's LM head are two copies of one weight;
    each backward gave its copy a part of the gradient: sum the two over `comm`
    (`tied_embedding_group`), so both copies take the same step (Megatron-LM's embedding
    all-reduce). `before`: what the gradient held before these backwards (accumulating over
    several steps without zero_grad), already a sum: only what was added since is summed. A
    copy without a gradient sends zeros: the other end is waiting for it."""
    weight = tied_weight(stages)
    if weight is None or comm is None or comm.size == 1:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    added = weight.grad if before is None else weight.grad.sub_(before)
    comm.all_reduce(added)
    if before is not None:
        added.add_(before)


def stage_parameters(stages: list[Stage]) -> list[nn.Parameter]:
    """This rank's parameters, each once (a tied weight owned twice is listed once)."""
    return list({id(p): p for stage in stages for p in stage.parameters()}.values())


@torch.no_grad()
def free_unowned_parameters(decoder, stages: list[Stage]) -> None:
    """A pipeline rank keeps only its own layers of the whole model it built, and frees the rest."""
    owned = {id(p) for p in stage_parameters(stages)}
    for p in decoder.parameters():
        if id(p) not in owned:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.requires_grad_(False)


def message_links(mesh, plans: list[list[Action]]) -> dict[tuple[int, int], Communicator]:
    """One communicator per direction the pipeline's messages travel: (sending, receiving
    pipeline rank) → a group of those two ranks. NCCL runs the sends and receives of one
    communicator between two ranks one after the other, in the order each rank posted them,
    and a send may wait for its receive: with one communicator for both directions, rank r's
    activation for r+1 queues behind the gradient it awaits from r+1, while r+1's gradient
    queues behind the activation it awaits from r (1F1B's steady state: both are sent at
    once), and both wait for ever. With one each way, each is a queue in which the sends and
    the receives meet in order (`schedule.add_communication` posts a peer's receives in the
    order it sends). Every rank creates every group, in the same order (torch.distributed
    requires it), for the links `plans` (every rank's) use."""
    sends = ((r, a.peer) for r, plan in enumerate(plans) for a in plan if a.kind[:4] == "send")
    used = sorted(set(sends))
    links = {}
    for ranks in mesh.groups["pp"]:
        for sender, receiver in used:
            pair = [ranks[sender], ranks[receiver]]
            group = new_group(pair)
            if mesh.rank in pair:
                links[sender, receiver] = Communicator(group, "pp", mesh.ledger, pair, mesh.device)
    return links


def tied_embedding_group(mesh):
    """A communicator between the first and the last rank of this rank's pipeline, for the tied
    embedding / LM-head gradient (Megatron's "embedding group"; `sum_tied_gradient`). Every rank
    creates every group (torch.distributed requires it); ranks outside any group get None."""
    mine = None
    for ends in ([ranks[0], ranks[-1]] for ranks in mesh.groups["pp"] if len(ranks) > 1):
        group = new_group(ends)
        if mesh.rank in ends:
            mine = Communicator(group, "pp", mesh.ledger, ends, mesh.device)
    return mine


# --- 2. Split backward: B (the input's gradient) now, W (the weights' gradients) later ------------
# B is what the previous rank waits for; nobody waits for W, so W fills bubbles (ZB-H1). Autograd
# splits any layer without knowing what it is (a Linear, a TP slice, a hand-written Function):
#
#   B   `torch.autograd.grad(out, [x])` runs only the nodes on a path from the output to the
#       input x; a built-in op asked for its input's gradient alone skips the weight product
#       (for y = x Wᵀ: dx = dy W, not dW = dyᵀ x). On the way, remember the gradient reaching
#       each **frontier** node: one on the path to x whose other inputs lead to weights (the
#       matmul x·Wᵀ, whose other input is Wᵀ).
#   W   start autograd again from the frontier nodes, with the remembered gradients, towards
#       the weights only: exactly the products B skipped, accumulated into `p.grad` as usual
#       (created if None; post-accumulate-grad hooks fire).
#
# As torch.distributed.pipelining's stage_backward_input / _weight. Weights sharing a frontier
# node form one group; a frontier node reached again from another (a weight used twice) is
# pinned to what B saw, so nothing counts twice. A hand-written autograd.Function computes all
# its gradients when it runs: its weight part is dropped in B, redone in W.


def _grad_node(t: torch.Tensor):
    """The autograd node that receives t's gradient: its grad_fn, or for a leaf (a weight, a
    received activation) its AccumulateGrad node, reached through a view."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _reachable(starts, edges) -> set:
    """Every node reached from `starts` by following `edges(node)`."""
    seen = set(starts)
    stack = list(starts)
    while stack:
        new = [n for n in edges(stack.pop()) if n is not None and n not in seen]
        seen.update(new)
        stack += new
    return seen


def weight_groups(out: torch.Tensor, x: torch.Tensor, params) -> list[tuple[list, set]]:
    """(weights, their frontier nodes), in groups that share no frontier node."""
    consumers: dict = {}  # node -> the nodes that hand it a gradient
    for node in _reachable([out.grad_fn], lambda n: [c for c, _ in n.next_functions]):
        for child, _ in node.next_functions:
            consumers.setdefault(child, []).append(node)
    to_input = _reachable([_grad_node(x)], lambda n: consumers.get(n, ()))  # paths out → x
    group_of: dict = {}
    for p in params:
        acc = _grad_node(p)
        if acc not in consumers:
            continue  # not used by this microbatch
        behind = _reachable(
            [acc], lambda n: [c for c in consumers.get(n, ()) if c not in to_input]
        )  # p's side, up to x's
        frontier = {c for n in behind for c in consumers.get(n, ()) if c in to_input}
        weights = [p]
        nodes = set(frontier)
        for other in {id(group_of[n]): group_of[n] for n in frontier if n in group_of}.values():
            weights, nodes = weights + other[0], nodes | other[1]
        for node in nodes:
            group_of[node] = (weights, nodes)
    return list({id(g): g for g in group_of.values()}.values())


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params):
    """B: the gradient of the stage input x, weights untouched; returns it and the work W
    needs (per group: the weights, and each frontier node with the gradient it received)."""
    groups = weight_groups(out, x, params)
    seen: dict = {}
    hooks = [
        node.register_prehook(lambda grads, node=node: seen.__setitem__(node, grads))
        for _, nodes in groups
        for node in nodes
    ]
    try:
        (grad_x,) = torch.autograd.grad(out, [x], grad, retain_graph=True)  # W reuses the graph
    finally:
        for hook in hooks:
            hook.remove()
    work = [
        (weights, [(node, seen[node]) for node in nodes if node in seen])
        for weights, nodes in groups
    ]
    return grad_x, work


def backward_weight(work) -> None:
    """W: the weight gradients B left out, accumulated into `p.grad`."""
    for weights, frontier in work:
        edges = [
            (GradientEdge(node, i), g)
            for node, grads in frontier
            for i, g in enumerate(grads)
            if g is not None
        ]
        if not edges:
            continue
        pins = [node.register_prehook(lambda _, grads=grads: grads) for node, grads in frontier]
        try:  # the graph is kept for the other groups; it goes when `work` goes
            torch.autograd.backward(
                [e for e, _ in edges], [g for _, g in edges], inputs=weights, retain_graph=True
            )
        finally:
            for pin in pins:
                pin.remove()


# --- 3. Executor: run this rank's action list for real --------------------------------------------


@dataclass
class _Step:
    """What one step of the executor holds, by (microbatch, chunk) or message key."""

    inputs: list
    targets: list
    stage_in: dict = field(default_factory=dict)  # kept until the release (B, or W)
    stage_out: dict = field(default_factory=dict)
    input_grads: dict = field(default_factory=dict)
    weight_work: dict = field(default_factory=dict)  # W's closures
    received: dict = field(default_factory=dict)  # message key -> (buffer, pending)
    sends: list = field(default_factory=list)  # (tensor, pending) until delivered
    losses: list = field(default_factory=list)


class PipelineExecutor:
    """Runs one rank's action list for one training step over `comm`, the pipeline group.
    Sends are asynchronous (isend), awaited at the end of the step; a receive is posted (irecv)
    `post_receives_ahead` computations before the list says (`schedule.receives_ahead`: its
    message crosses the link while this rank computes; 0: just before it is needed) and
    awaited by the computation that needs it. With W actions each
    backward is split (the first stage's input is token ids: its B is empty, its W the whole
    backward). `observers` (see hplab.observe.observers) watch from outside: each is called as
    `observer(kind, action, stage)` and returns a context manager wrapped around the whole
    step ("run"), each wait for a message ("recv"), computation (F, B, W) and "send". Under
    sequence parallel (`sequence_shards` = tp) a stage's activations hold this tensor-parallel
    rank's s/tp tokens, and so do the messages: tp times smaller, as in Megatron. `tied`: the
    group of the first and last stage's ranks (`tied_embedding_group`), required where this
    rank holds a copy of a tied embedding (`run` sums its gradient), else None."""

    def __init__(
        self,
        stages: list[Stage],
        plan: list[Action],
        comm,
        links,
        dtype=torch.float32,
        sequence_shards: int = 1,
        post_receives_ahead: int = 0,
        tied=None,
    ):
        if tied is None and any(placement.of(p).pipeline_ends for p in stage_parameters(stages)):
            raise ValueError(
                "PipelineExecutor: this rank's stages hold a copy of the tied embedding / LM head, "
                "whose gradient the first and last stage must sum after backward: pass "
                "tied=pp.tied_embedding_group(mesh) (a group of those two ranks)"
            )
        self.tied = None if tied is None else communicator(tied, "pp")
        self.stages = {s.chunk: s for s in stages}
        self.plan = receives_ahead(plan, post_receives_ahead)  # (0: just before it is needed)
        self.comm = comm
        self.links = links
        self.dtype = dtype
        self.sequence_shards = sequence_shards
        self.split_backward = any(a.kind == "W" for a in plan)
        self.release = "W" if self.split_backward else "B"  # frees a microbatch's activations
        self.loss_scale = 1.0  # fp16: the loss is multiplied by this before backward
        self.observers: list = []

    def observed(self, kind: str, action: Action | None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stage = action and self.stages.get(action.chunk)
        for observer in self.observers:
            stack.enter_context(observer(kind, action, stage))
        return stack

    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> list[float]:
        """One step: the losses of the microbatches whose last chunk is here, and the auxiliary
        losses of the experts' chunks here (their sum over the pipeline is the step's loss).
        Gradients are left accumulated in `.grad` (the tied embedding's summed over its two
        copies) for the caller to average over data parallel and step."""
        step = _Step(inputs, targets)
        tied = tied_weight(list(self.stages.values())) if self.tied else None
        before = None if tied is None or tied.grad is None else tied.grad.clone()
        with self.observed("run", None):
            for a in self.plan:
                step.sends = [s for s in step.sends if not s[1].is_completed()]  # delivered
                if a.kind.startswith("recv"):  # post the receive now, wait for it when needed
                    self.post_receive(a, step)
                    continue
                message = self.wait_for_input(a, step)
                with self.observed("send" if a.kind.startswith("send") else a.kind, a):
                    {"F": self.forward, "B": self.backward, "W": self.weight}.get(
                        a.kind, self.send
                    )(a, step, message)
                if a.kind == self.release:  # this microbatch's activations are gone
                    step.stage_in.pop((a.microbatch, a.chunk))
            for _, pending in step.sends:
                pending.wait()
            sum_tied_gradient(list(self.stages.values()), self.tied, before)
        return [float(loss) for loss in step.losses]

    def wait_for_input(self, a: Action, step: _Step) -> torch.Tensor | None:
        """The activation an F, or the gradient a B, received from its neighbour (else None)."""
        key = ("act" if a.kind == "F" else "grad", a.microbatch, a.chunk)
        if a.kind not in ("F", "B") or key not in step.received:
            return None
        message, pending = step.received.pop(key)
        with self.observed("recv", a):
            pending.wait()
        return message

    def forward(self, a: Action, step: _Step, message) -> None:
        stage = self.stages[a.chunk]
        mb = a.microbatch
        x = step.inputs[mb] if stage.is_first else message.requires_grad_()
        out = stage(x)
        aux = stage.aux_loss()
        if torch.is_tensor(aux):  # experts: counted in the step's loss, trained through `out`
            step.losses.append(aux.detach())
            out = AuxLossRidesAlong.apply(out, aux, self.loss_scale / len(step.inputs))
        if stage.is_last:
            loss = stage.decoder.loss_fn(out, step.targets[mb])  # vocab-parallel under TP
            step.losses.append(loss.detach())
            out = loss * self.loss_scale / len(step.inputs)  # 1/m of the batch's mean
        step.stage_in[mb, a.chunk] = x
        step.stage_out[mb, a.chunk] = out

    def backward(self, a: Action, step: _Step, grad) -> None:
        """B of one microbatch: the gradient of the stage input (None on the first stage), and
        W, what is left to do (None without a split backward)."""
        stage = self.stages[a.chunk]
        key = (a.microbatch, a.chunk)
        out = step.stage_out.pop(key)
        x = step.stage_in[key]
        if not self.split_backward:
            torch.autograd.backward(out, grad)
            step.input_grads[key] = None if stage.is_first else x.grad
        elif stage.is_first:  # nothing for B: W runs the whole backward
            step.weight_work[key] = lambda: torch.autograd.backward(out, grad)
        else:
            weights = [p for p in stage.parameters() if p.requires_grad]
            step.input_grads[key], work = backward_input(out, grad, x, weights)
            step.weight_work[key] = lambda: backward_weight(work)

    def weight(self, a: Action, step: _Step, _) -> None:
        step.weight_work.pop((a.microbatch, a.chunk))()  # the microbatch's graph goes with it

    def send(self, a: Action, step: _Step, _) -> None:
        key = (a.microbatch, a.chunk)
        tensor = step.stage_out[key].detach() if a.kind == "send_act" else step.input_grads.pop(key)
        link = self.links[self.comm.rank, a.peer]  # (this rank at 0, the peer at 1)
        step.sends.append((tensor, link.send(tensor, 1, async_op=True)))

    def message_shape(self, tokens: torch.Tensor) -> tuple[int, ...]:
        """[b, s/sequence_shards, h]: one microbatch's activations between stages."""
        b, s = tokens.shape
        return b, s // self.sequence_shards, next(iter(self.stages.values())).decoder.config.n_embd

    def post_receive(self, a: Action, step: _Step) -> None:
        shape = self.message_shape(step.inputs[0])
        buffer = torch.empty(shape, dtype=self.dtype, device=step.inputs[0].device)
        link = self.links[a.peer, self.comm.rank]  # (the peer at 0, this rank at 1)
        step.received[message_key(a)] = (buffer, link.recv(buffer, 0, async_op=True))

    @torch.no_grad()
    def forward_only(self, microbatches: list) -> list[float]:
        """Evaluation: each (x, y) microbatch through every chunk in order, a blocking message per
        hop; nothing kept, traced or counted. The losses, on the last chunk's rank, and each
        chunk's auxiliary loss where it ran (experts; 0 for dense): the pipeline's sum."""
        p = self.comm.size
        me = self.comm.rank
        losses = []
        last = p * len(self.stages) - 1  # (every rank holds as many chunks)
        for x, y in microbatches:
            for c in range(last + 1):  # chunk c-1 ran on rank (c-1) mod p, c runs on c mod p
                if c - 1 in self.stages:
                    self.links[me, chunk_owner(c, p)].send(x, 1)
                elif c in self.stages and c > 0:
                    x = x.new_empty(self.message_shape(y), dtype=self.dtype)
                    self.links[chunk_owner(c - 1, p), me].recv(x, 0)
                if c in self.stages:
                    x = self.stages[c](x)
                    losses.append(float(self.stages[c].aux_loss()))  # (experts; else 0)
            if last in self.stages:  # x: the logits
                losses.append(float(self.stages[last].decoder.loss_fn(x, y)))
        return losses
