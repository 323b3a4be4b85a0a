"""Unified checkpoints: one single-device layout, whatever layout saved it.

A run sharded as dp × tp × pp × ZeRO holds its model in pieces: tensor-parallel slices,
pipeline stages, ZeRO shards of flat buffers. Saving those pieces as they are (one file per rank)
ties the checkpoint to that layout. PaddleNLP's "unified checkpoint" and PyTorch's distributed
checkpoint take the other road, and so does hplab: before writing, every piece is gathered back
into the tensor one process would hold, under that tensor's ordinary name. Loading does the
reverse: each rank of the *new* layout slices out what it holds. So a run saved under tp2 × pp2
resumes under dp4 + ZeRO-3, under tp4, or on one process, as if it had never stopped.

A checkpoint directory is also an ordinary Hugging Face model directory:

    config.json              GPT2Config (+ an "hplab" entry with hplab's own config)
    model.safetensors        fp32 weights, Hugging Face GPT-2 names and layout
    optimizer.safetensors    per parameter (hplab name): every state tensor, e.g. exp_avg
    rng.safetensors          the torch RNG states (CPU, and CUDA where present)
    trainer_state.json       the step to continue from, the flags, the losses so far

so `GPT2LMHeadModel.from_pretrained(directory)` opens it. Nothing is pickled: tensors go through
safetensors and everything else through JSON, so loading can never run arbitrary code.

Writes are atomic. Everything is written to a temporary sibling directory first; only when it is
complete does a rename put it in place (the previous checkpoint is renamed aside first and
removed last). A run killed mid-save leaves the previous checkpoint untouched; one killed in the
instant between the two renames leaves it under `.NAME.previous`, where `load` finds it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hplab import fsdp, tp
from hplab.models.gpt import GPTConfig, config_dict, from_hf_state_dict, to_hf_state_dict
from hplab.zero import ZeroOptimizer

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to do."""


def _aside(directory: Path, tag: str) -> Path:
    return directory.parent / f".{directory.name}.{tag}"


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def save(directory: str | Path, config: GPTConfig, model_state: dict[str, torch.Tensor],
         optimizer_state: dict[str, dict[str, torch.Tensor]], trainer_state: dict) -> Path:
    """Write a checkpoint atomically. Called by one process (rank 0) with full tensors.

    `model_state`: hplab names → full fp32 tensors (tied weights once or twice, either works).
    `optimizer_state`: hplab parameter name → {state name → full tensor}.
    `trainer_state`: JSON-able; must hold "step", the number of steps already taken.
    """
    from hplab.models.gpt import to_hf_config

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp, previous = _aside(directory, f"tmp-{os.getpid()}"), _aside(directory, "previous")
    for stale in directory.parent.glob(f".{directory.name}.tmp-*"):  # left by killed saves
        shutil.rmtree(stale, ignore_errors=True)
    if previous.exists() and not directory.exists():  # a kill between the renames: restore
        os.rename(previous, directory)
    tmp.mkdir()

    hf_state = to_hf_state_dict({k: v.detach().float().cpu().contiguous()
                                 for k, v in model_state.items()})
    hf_state.pop("lm_head.weight", None)  # tied to transformer.wte.weight: HF re-ties on load
    save_file(hf_state, tmp / "model.safetensors", metadata={"format": "pt"})
    hf_config = to_hf_config(config).to_dict()
    hf_config["architectures"] = ["GPT2LMHeadModel"]
    hf_config["hplab"] = {"format_version": FORMAT_VERSION, "config": config_dict(config)}
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))

    flat_optimizer = {f"{name}::{key}": t.detach().cpu().contiguous()
                      for name, state in optimizer_state.items() for key, t in state.items()}
    save_file(flat_optimizer, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, tmp / "rng.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps(
        {"format_version": FORMAT_VERSION, **trainer_state}, indent=1))
    _fsync_tree(tmp)

    # the swap: old aside, new in place, old removed
    shutil.rmtree(previous, ignore_errors=True)
    if directory.exists():
        os.rename(directory, previous)
    os.rename(tmp, directory)
    shutil.rmtree(previous, ignore_errors=True)
    return directory


def find(directory: str | Path) -> Path:
    """The directory to resume from: `directory`, or the previous checkpoint a save that was
    killed between its two renames left aside."""
    directory = Path(directory)
    if (directory / "trainer_state.json").exists():
        return directory
    previous = _aside(directory, "previous")
    if (previous / "trainer_state.json").exists():
        return previous
    raise CheckpointError(f"no checkpoint in {directory}: expected the files that --save "
                          "writes (config.json, model.safetensors, trainer_state.json, ...)")


def load(directory: str | Path) -> dict:
    """Read a checkpoint: {"config", "model", "optimizer", "rng", "trainer_state"} with hplab
    names and full single-device tensors, whatever layout saved it."""
    directory = find(directory)
    hf_config = json.loads((directory / "config.json").read_text())
    if "hplab" not in hf_config:
        raise CheckpointError(f"{directory}/config.json was not written by hplab --save")
    config = GPTConfig(**hf_config["hplab"]["config"])
    model = from_hf_state_dict(load_file(directory / "model.safetensors"))
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(directory / "optimizer.safetensors").items():
        name, state_key = key.split("::")
        optimizer.setdefault(name, {})[state_key] = t
    return {"config": config, "model": model, "optimizer": optimizer,
            "rng": load_file(directory / "rng.safetensors"),
            "trainer_state": json.loads((directory / "trainer_state.json").read_text()),
            "directory": directory}


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.random.set_rng_state(rng["cpu"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])


def check_compatible(saved: GPTConfig, wanted: GPTConfig) -> None:
    """A run resumes only into the model it saved (the layout may change, the model not)."""
    if saved != wanted:
        diffs = [f"{k}: saved {a}, asked {b}" for k, a, b in
                 ((k, getattr(saved, k), getattr(wanted, k)) for k in config_dict(saved))
                 if a != b]
        raise CheckpointError("the checkpoint holds a different model (" + "; ".join(diffs) +
                              "): resume with the same --model and size flags")


# --- from a layout's pieces to the single-device state, and back ------------------------------
# `par` is what hplab.compose.parallelize returned. A parameter's single-device tensor is
# rebuilt in two steps: its data-parallel shards (ZeroOptimizer, fully_shard) are gathered
# over dp, then its tensor-parallel slices over tp; pipeline stages are collected on rank 0.

def owned_parameters(par) -> list[tuple[str, torch.nn.Parameter]]:
    """(single-device name, this rank's parameter) in an order every rank of a stage shares;
    a pipeline rank's freed layers (requires_grad off) are not its own."""
    return [(name, p) for name, p in par.gpt.named_parameters() if p.requires_grad]


@torch.no_grad()
def gather_full_state(par) -> tuple[dict, dict]:
    """(model_state, optimizer_state): every parameter's full fp32 value and full optimizer
    state under its single-device name. A collective; the result is complete on rank 0."""
    mesh, optimizer, params = par.mesh, par.optimizer, owned_parameters(par)
    if isinstance(optimizer, ZeroOptimizer):
        values, states = optimizer.full_state()
    else:
        inner, masters = getattr(optimizer, "inner", optimizer), getattr(optimizer, "masters", {})
        values, states = {}, {}
        for _, p in params:
            q = masters.get(p, p)  # the fp32 master where there is one
            values[p], states[p] = q.detach().float(), dict(inner.state.get(q, {}))
            if fsdp.is_shard(p):
                values[p] = fsdp.gather_full(p, values[p])
                states[p] = {k: fsdp.gather_full(p, t) if t.dim() else t
                             for k, t in states[p].items()}

    def whole(p, t):
        if getattr(p, "tp_split", None) is None:
            return t.detach().cpu().clone()
        return tp.unshard(t.to(mesh.device), p.tp_split, mesh.tp).cpu()

    model_state = {name: whole(p, values[p]) for name, p in params}
    optimizer_state = {name: {k: whole(p, t) if t.dim() else t.clone()
                              for k, t in states[p].items()} for name, p in params}
    if mesh.pp_size > 1:  # each stage's (dp 0, tp 0) rank hands its stage to rank 0
        mine = (model_state, optimizer_state) if mesh.dp_rank == mesh.tp_rank == 0 else ({}, {})
        everyone = [None] * dist.get_world_size() if mesh.rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)  # in memory, between our own processes
        model_state, optimizer_state = {}, {}
        for stage_model, stage_optimizer in everyone or []:
            model_state.update(stage_model)
            optimizer_state.update(stage_optimizer)
    return model_state, optimizer_state


@torch.no_grad()
def load_full_state(par, model_state: dict, optimizer_state: dict) -> None:
    """The reverse: every rank gets the full dicts and keeps the pieces it holds."""
    mesh, optimizer, params = par.mesh, par.optimizer, owned_parameters(par)

    def mine(p, full):
        if getattr(p, "tp_split", None) is None:
            return full.detach().cpu().clone()
        return tp.shard(full.to(mesh.device), p.tp_split, mesh.tp).cpu()

    values = {p: mine(p, model_state[name].float()) for name, p in params}
    states = {p: {k: mine(p, t) if t.dim() else t.clone()
                  for k, t in optimizer_state.get(name, {}).items()} for name, p in params}
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_full_state(values, states)
        return
    inner, masters = getattr(optimizer, "inner", optimizer), getattr(optimizer, "masters", {})
    for _, p in params:
        value, state = values[p], states[p]
        if fsdp.is_shard(p):
            value = fsdp.local_shard(p, value)
            state = {k: fsdp.local_shard(p, t) if t.dim() else t for k, t in state.items()}
        p.copy_(value)
        q = masters.get(p, p)
        if q is not p:
            q.copy_(value)
        if state:
            inner.state[q] = {k: t.to(q.device) if t.dim() else t for k, t in state.items()}
