"""Unified checkpoints: one single-device layout, whatever layout saved it.

A run sharded as dp × tp × pp × ZeRO holds its model in pieces; saved as they are, they would
tie the checkpoint to that layout. Like PaddleNLP's "unified checkpoint" and PyTorch's
distributed checkpoint, hplab gathers every piece into the tensor one process would hold, under
its ordinary name; on load each rank of the *new* layout slices out what it holds: saved under
tp2 × pp2, a run resumes under dp4 + ZeRO-3, tp4 or one process as if it had never stopped.
The directory is also a Hugging Face model directory (`from_pretrained` opens it):

    config.json              GPT2Config (+ an "hplab" entry with hplab's own config)
    model.safetensors        fp32 weights, Hugging Face GPT-2 names and layout
    optimizer.safetensors    per parameter (hplab name): every state tensor, e.g. exp_avg
    rng.safetensors          the torch RNG states (CPU, and CUDA where present)
    trainer_state.json       the step to continue from, the flags, the losses, the lr schedule

Nothing is pickled (safetensors and JSON), so loading never runs code. Writes are atomic: all
goes to a temporary sibling directory, then the previous checkpoint is renamed aside, the new
one into place, the old one removed. A kill mid-save leaves the previous checkpoint; one
between the two renames leaves it as `.NAME.previous`, where `load` finds it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hplab import sharded_state
from hplab.models.gpt import GPTConfig, build_model
from hplab.models.hf import (
    architecture,
    config_from_hf,
    from_hf_state_dict,
    to_hf_config,
    to_hf_state_dict,
)
from hplab.parallel import fsdp, moe, placement, tp
from hplab.parallel.precision import MasterWeightOptimizer
from hplab.parallel.zero import ZeroOptimizer
from hplab.runtime import faults
from hplab.runtime.errors import explained

FORMAT_VERSION = 1
FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # what a model's weights may be stored as


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why and what to do."""


def _aside(directory: Path, tag: str) -> Path:
    return directory.parent / f".{directory.name}.{tag}"


def save(
    directory: str | Path,
    config: GPTConfig,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, dict[str, torch.Tensor]],
    trainer_state: dict,
) -> Path:
    """Write a checkpoint atomically; one process (rank 0) calls it with full tensors:
    `model_state` {hplab name: fp32 tensor} (tied weights once or twice, either works),
    `optimizer_state` {hplab name: {state name: tensor}}, `trainer_state` JSON-able, with
    "step": the number of steps already taken."""
    directory = resolved(directory)
    check_save_target(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = _aside(directory, f"tmp-{os.getpid()}")
    previous = _aside(directory, "previous")
    for stale in directory.parent.glob(f".{directory.name}.tmp-*"):  # left by killed saves
        shutil.rmtree(stale, ignore_errors=True)
    if previous.exists() and not directory.exists():  # a kill between the renames: restore
        os.rename(previous, directory)
    tmp.mkdir()
    try:
        _write_files(tmp, config, model_state, optimizer_state, trainer_state)
    except BaseException:  # a full disk, Ctrl-C: no half-written folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    # the swap: old aside, new in place, old removed
    shutil.rmtree(previous, ignore_errors=True)
    if directory.exists():
        os.rename(directory, previous)
    os.rename(tmp, directory)
    shutil.rmtree(previous, ignore_errors=True)
    return directory


def _write_files(tmp: Path, config, model_state, optimizer_state, trainer_state) -> None:
    """Every file of a checkpoint into `tmp`, on disk (fsync), trainer_state.json last."""
    hf_state = to_hf_state_dict(  # (a tied head once: transformers ties it again on load)
        {k: v.detach().float().cpu().contiguous() for k, v in model_state.items()}, config
    )
    save_file(hf_state, tmp / "model.safetensors", metadata={"format": "pt"})
    faults.strike_in_save(trainer_state.get("step"))  # HPLAB_FAULT: none unless asked
    hf_config = {
        **to_hf_config(config).to_dict(),
        "architectures": [architecture(config)],
        "hplab": {"format_version": FORMAT_VERSION, "config": asdict(config)},
    }
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=1))

    flat_optimizer = {
        f"{name}::{key}": t.detach().cpu().contiguous()
        for name, state in optimizer_state.items()
        for key, t in state.items()
    }
    save_file(flat_optimizer, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, tmp / "rng.safetensors")
    checksums = {path.name: sha256(path) for path in sorted(tmp.iterdir())}
    last = {"format_version": FORMAT_VERSION, **trainer_state, "checksums": checksums}
    (tmp / "trainer_state.json").write_text(json.dumps(last, indent=1))
    for path in tmp.iterdir():  # on disk before the renames
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def regular_file(path: Path) -> Path:
    """`path` if it is a regular file (a link to one counts); a FIFO, a device such as
    /dev/zero or a folder is a CheckpointError: reading one would block or never end."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return path  # (missing: the read that follows says so, as it always did)
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file: a checkpoint holds only files")
    return path


def newest(directory: str | Path) -> Path | None:
    """The checkpoint in `directory`, or else the previous one, that a save killed between its
    two renames left aside; None when there is none (a save writes trainer_state.json last)."""
    folders = (Path(directory), _aside(Path(directory), "previous"))
    return next((d for d in folders if (d / "trainer_state.json").exists()), None)


def load(directory: str | Path) -> dict:
    """Read a checkpoint: {"config", "model", "optimizer", "rng", "trainer_state"} with hplab
    names and full single-device tensors, whatever layout saved it. A missing, damaged or
    non-finite piece is a CheckpointError that names it; the files are never changed."""
    asked = Path(directory)
    directory = newest(asked)
    if directory is None:
        raise CheckpointError(
            f"no checkpoint in {asked} (--save writes trainer_state.json): to "
            "start from weights alone, e.g. save_pretrained's, use --init-from"
        )
    _refuse(
        directory,
        "is incomplete:",
        [
            f"{name} is {'not a regular file' if (directory / name).exists() else 'missing'}"
            for name in CHECKPOINT_FILES
            if not (directory / name).is_file()
        ],
    )
    try:
        trainer_state = json.loads(regular_file(directory / "trainer_state.json").read_text())
        changed = [
            name
            for name, digest in trainer_state.get("checksums", {}).items()
            if sha256(checked_name(directory, name)) != digest
        ]
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in load_file(regular_file(directory / "optimizer.safetensors")).items():
            name, state_key = key.split("::")
            optimizer.setdefault(name, {})[state_key] = t
        rng = load_file(regular_file(directory / "rng.safetensors"))
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OSError, SafetensorError) as err:
        raise CheckpointError(f"{directory} is damaged and cannot be read ({err})") from None
    _refuse(
        directory,
        "is damaged: the checksum saved with it differs for",
        changed,
        "; resume from another copy",
    )
    return {
        **load_pretrained(directory),
        "optimizer": optimizer,
        "rng": rng,  # config, model
        "trainer_state": trainer_state,
        "directory": directory,
    }


def checked_name(directory: Path, name: str) -> Path:
    """The file a checksum in trainer_state.json names: one of the folder's own files (a name
    such as ../x or /etc/passwd would make --resume read any file on the machine)."""
    if not isinstance(name, str) or name not in CHECKPOINT_FILES:
        raise CheckpointError(
            f"{directory}/trainer_state.json has a checksum for {name!r}, which is not a file "
            f"of a checkpoint ({', '.join(CHECKPOINT_FILES)})"
        )
    return regular_file(directory / name)


def _refuse(directory: Path, problem: str, names: list[str], advice: str = "") -> None:
    if names:
        raise CheckpointError(
            f"{directory} {problem} {', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}{advice}"
        )


def load_pretrained(directory: str | Path) -> dict:
    """{"config", "model"}: hplab names, fp32, from any GPT-2, Llama or Qwen2 folder
    `save_pretrained` wrote (config.json, model.safetensors or its shards) or --save; checked
    against config.json."""
    directory = Path(directory)
    try:
        config = config_from_hf(json.loads(regular_file(directory / "config.json").read_text()))
    except CheckpointError:
        raise
    except OSError as err:
        raise CheckpointError(
            f"{directory}/config.json: {err.strerror}: expected a Hugging Face "
            "model folder (save_pretrained) or an hplab checkpoint"
        ) from None
    except (ValueError, TypeError, AttributeError) as err:
        err = f"is not JSON ({err})" if isinstance(err, json.JSONDecodeError) else err
        raise CheckpointError(f"{directory}/config.json {err}") from None
    index = directory / "model.safetensors.index.json"  # a sharded model's list of its files
    try:
        files = (
            {*json.loads(regular_file(index).read_text())["weight_map"].values()}
            if index.exists()
            else ["model.safetensors"]
        )
        hf_state = {
            name: t for f in files for name, t in load_file(weights_file(directory, f)).items()
        }
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, OSError, SafetensorError) as err:
        raise CheckpointError(
            f"{directory} holds no readable model.safetensors ({err}); a "
            "pytorch_model.bin is never read: unpickling can run code"
        ) from None
    model = from_hf_state_dict(hf_state, config)
    with torch.device("meta"):  # the model's names and shapes, without its memory
        shapes = {name: t.shape for name, t in build_model(config).state_dict().items()}
    _refuse(directory, "lacks tensors of its model:", [n for n in shapes if n not in model])
    _refuse(  # (dropping them would train another model than the folder holds)
        directory,
        "holds tensors its config.json's model has no place for:",
        [n for n in model if n not in shapes],
        ": its config.json describes another model than its weights",
    )
    _refuse(
        directory,
        "holds tensors of other shapes than its config.json says:",
        [f"{n} {list(model[n].shape)}" for n in shapes if model[n].shape != shapes[n]],
    )
    odd = [f"{n} ({t.dtype})" for n, t in model.items() if t.dtype not in FLOATS]
    _refuse(directory, "holds weights that are not float32, bfloat16 or float16:", odd)
    bad = [name for name, t in model.items() if not torch.isfinite(t).all()]
    _refuse(directory, "holds non-finite weights (NaN or inf) in", bad)
    return {"config": config, "model": {name: model[name].float() for name in shapes}}


def weights_file(directory: Path, name) -> Path:
    """A file a sharded model's index names: a safetensors file inside `directory`."""
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
        raise CheckpointError(
            f"{directory}/model.safetensors.index.json names {name!r}: expected the name of a "
            ".safetensors file in the same folder"
        )
    return regular_file(directory / name)


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.random.set_rng_state(rng["cpu"])
    cuda = [rng[f"cuda{i}"] for i in range(sum(k.startswith("cuda") for k in rng))]  # in order
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def check_compatible(saved, wanted, advice="resume with the same --model and size flags"):
    """A run resumes only into the model it saved (the layout may change, the model not). A
    Llama's sequence length is not part of its weights (RoPE has no position table): it may
    differ, so that --seq-len can shorten a folder whose max_position_embeddings is 131072."""
    free = {"n_positions"} if saved.arch == "llama" else set()
    a, b = (
        {f.name: getattr(c, f.name) for f in fields(c) if f.compare and f.name not in free}
        for c in (saved, wanted)
    )
    if a != b:
        diffs = "; ".join(f"{k}: saved {a[k]}, asked {b[k]}" for k in a if a[k] != b[k])
        raise CheckpointError(f"the checkpoint holds a different model ({diffs}): {advice}")


# --- from a layout's pieces to the single-device state, and back ------------------------------
# `par` is the run's hplab.training.TrainState (the model `parallelize` returned, its
# optimizer and schedule). A rank's own parameters
# (requires_grad: not a pipeline rank's freed layers) are rebuilt in two steps: data-parallel
# shards (ZeroOptimizer, fully_shard) gathered over dp, then tensor-parallel slices over tp; stages
# meet on rank 0.


def _glued(p, t: torch.Tensor, mesh) -> torch.Tensor:
    """On the CPU: `t` (of p's shape here) with every tp rank's piece glued into the full tensor
    (a collective over tp); `t` itself where `p` is not split."""
    split = placement.of(p).split  # (None: whole over tp)
    if split is None or t.dim() == 0:
        return t.detach().cpu().clone()
    return tp.gather_full(t.to(mesh.device), split, mesh.tp).cpu()


def _cut(p, t: torch.Tensor, mesh) -> torch.Tensor:
    """On the CPU: this rank's tp piece of the full tensor `t`; `t` itself where `p` is whole."""
    split = placement.of(p).split
    if split is None or t.dim() == 0:
        return t.detach().cpu().clone()
    return tp.piece_of(t.to(mesh.device), split, mesh.tp).cpu()


def _stepped(optimizer, p):
    """(the torch optimizer that holds p's state, the fp32 tensor it steps for p)."""
    if isinstance(optimizer, MasterWeightOptimizer):
        return optimizer.inner, optimizer.masters[p]
    return optimizer, p


@torch.no_grad()
def gather_full_state(par) -> tuple[dict, dict]:
    """(model_state, optimizer_state): every parameter's full fp32 value and full optimizer
    state under its single-device name. A collective; the result is complete on rank 0."""
    mesh = par.mesh
    optimizer = par.optimizer
    params = [(name, p) for name, p in par.decoder.named_parameters() if p.requires_grad]
    if isinstance(optimizer, ZeroOptimizer):
        values, states = optimizer.full_state()
    else:
        values = {}
        states = {}
        for _, p in params:
            inner, q = _stepped(optimizer, p)
            full = (
                functools.partial(sharded_state.gather_full, p) if fsdp.is_shard(p) else lambda t: t
            )
            values[p] = full(q.detach().float())
            states[p] = {k: full(t) for k, t in inner.state.get(q, {}).items()}
    model_state = {name: _glued(p, values[p], mesh) for name, p in params}
    optimizer_state = {
        name: {k: _glued(p, t, mesh) for k, t in states[p].items()} for name, p in params
    }
    if mesh.pp_size > 1 or mesh.ep_size > 1:  # to rank 0 in one gather: each stage from its
        # (dp 0, tp 0) rank, the experts that dp ranks 1 .. ep-1 hold (E/ep each) from them
        sender = mesh.tp_rank == 0 and mesh.edp_rank == 0  # edp_rank 0: dp ranks 0 .. ep-1
        names = [n for n, p in params if sender and (mesh.dp_rank == 0 or moe.is_expert(p))]
        mine = ({n: model_state[n] for n in names}, {n: optimizer_state[n] for n in names})
        everyone = [None] * dist.get_world_size() if mesh.rank == 0 else None
        with explained("the checkpoint's gather"):  # in memory, between our processes
            dist.gather_object(mine, everyone, dst=0)
        for model_part, optimizer_part in everyone or []:
            model_state.update(model_part)
            optimizer_state.update(optimizer_part)
    return model_state, optimizer_state


@torch.no_grad()
def load_full_state(par, model_state: dict, optimizer_state: dict) -> None:
    """The reverse: every rank gets the full dicts and keeps the pieces it holds."""
    mesh = par.mesh
    optimizer = par.optimizer
    params = [(name, p) for name, p in par.decoder.named_parameters() if p.requires_grad]
    values = {p: _cut(p, model_state[name].float(), mesh) for name, p in params}
    states = {
        p: {k: _cut(p, t, mesh) for k, t in optimizer_state.get(name, {}).items()}
        for name, p in params
    }
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_full_state(values, states)
        return
    for _, p in params:
        local = functools.partial(sharded_state.local_shard, p) if fsdp.is_shard(p) else lambda t: t
        value = local(values[p])
        inner, q = _stepped(optimizer, p)
        p.copy_(value)
        q.copy_(value)
        if states[p]:
            inner.state[q] = {
                k: local(t).to(q.device) if t.dim() else t for k, t in states[p].items()
            }


def save_run(par, directory, flags: dict, step: int, losses: list, background=False) -> dict:
    """A run's checkpoint after `step` steps: the single-device state gathered (a collective),
    written by rank 0 with the trainer's state (flags, losses, lr schedule, loss scale), then
    everyone waits, so no rank runs ahead of a checkpoint still being written. `background`
    (--async-save): the gathered state is already rank 0's own copy, a consistent snapshot at
    this step boundary, so a thread writes it while training goes on (`save` is atomic: a kill
    mid-write leaves the previous checkpoint); the next save, or the run's end, waits for it.
    Returns what it cost: {step, seconds training stood still, bytes and write_seconds (rank 0,
    filled in once written)}."""
    finish_saves()  # one write at a time, in order
    start = time.perf_counter()
    record = {"step": step, "bytes": 0, "write_seconds": 0.0}
    with par.mesh.ledger.unrecorded():  # the gathers are checkpoint traffic, not training
        model_state, optimizer_state = gather_full_state(par)
    if dist.get_rank() == 0:
        scaler = par.precision.scaler
        trainer_state = {
            "step": step,
            "config": flags,
            "losses": losses,
            "lr_scheduler": {"last_epoch": par.scheduler.last_epoch},
        }
        if scaler is not None:
            trainer_state.update(loss_scale=scaler.scale, good_steps=scaler.good_steps)
        state = (par.decoder.config, model_state, optimizer_state, trainer_state)
        writer = threading.Thread(target=_write, args=(record, directory, state), daemon=True)
        WRITING.append(writer)
        writer.start()
        if not background:
            finish_saves()
    par.mesh.world.barrier()
    record["seconds"] = time.perf_counter() - start
    return record


WRITING = []  # rank 0's writes not yet waited for; what failed in one
FAILED_WRITES = []


def _write(record: dict, directory, state: tuple) -> None:
    begin = time.perf_counter()
    try:
        saved = save(directory, *state)
        record["bytes"] = sum(path.stat().st_size for path in saved.iterdir())
    except (OSError, ValueError, SafetensorError) as err:  # e.g. the disk is full (safetensors
        # says so in its own exception): the previous checkpoint stays
        FAILED_WRITES.append(f"the checkpoint of step {record['step']} was not written ({err})")
    record["write_seconds"] = time.perf_counter() - begin


def finish_saves() -> None:
    """Wait until every checkpoint being written is on disk; a failed write raises a
    CheckpointError saying so (the previous checkpoint stays as it was)."""
    while WRITING:
        WRITING.pop(0).join()
    if FAILED_WRITES:
        raise CheckpointError(FAILED_WRITES.pop(0))


def restore(par, saved: dict, resume: bool) -> int:
    """Every rank cuts its pieces of `saved` (load's or load_pretrained's: the files are local);
    to resume (not --init-from, which starts a new optimizer at step 0) also the optimizer, the
    RNG, the loss scale and the lr schedule. Returns the step to go on from."""
    load_full_state(par, saved["model"], saved.get("optimizer", {}))
    if not resume:
        return 0
    state = saved["trainer_state"]
    restore_rng(saved["rng"])
    scaler = par.precision.scaler
    if scaler is not None and "loss_scale" in state:
        scaler.scale = state["loss_scale"]
        scaler.good_steps = state["good_steps"]
    if "lr_scheduler" in state:  # the schedule goes on from its step (torch's way)
        par.scheduler = torch.optim.lr_scheduler.LambdaLR(
            par.optimizer,
            par.scheduler.lr_lambdas[0],
            last_epoch=state["lr_scheduler"]["last_epoch"] - 1,
        )
    return state["step"]


CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "optimizer.safetensors",
    "rng.safetensors",
    "trainer_state.json",
)


def resolved(directory: str | Path) -> Path:
    """`directory`, or the folder a symbolic link points to (the link stays; a dangling one is
    refused): a checkpoint saved through a link goes where it points."""
    if (directory := Path(directory)).is_symlink() and not directory.exists():
        raise CheckpointError(f"{directory} is a symbolic link to nothing: give a folder")
    return Path(os.path.realpath(directory)) if directory.is_symlink() else directory


def check_save_target(directory: str | Path) -> None:
    """A checkpoint replaces `directory` only when it is absent, empty or an hplab checkpoint
    with nothing else in it: a folder holding anyone's own files is refused, never replaced."""
    directory = resolved(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"{directory} is a file, not a checkpoint folder: choose another "
            "path (nothing was changed)"
        )
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    ours = CHECKPOINT_FILES if "trainer_state.json" in names else ()  # (save_pretrained's: not)
    _refuse(
        directory,
        "holds files that are not part of an hplab checkpoint:",
        [name for name in names if name not in ours],
        ": save into a new or empty folder (nothing was changed)",
    )
