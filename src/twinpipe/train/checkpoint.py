"""Checkpoints with ``torch.distributed.checkpoint``, stored by the unsplit model's parameter names.

Tensor keys: ``model.<name>`` for each parameter (the value the optimizer updates: the FP32 master
under mixed precision), ``optim.<name>.<state>`` for its optimizer state and ``buffer.<name>`` for
each MoE router's routing bias (``twinpipe.moe.bias``; a transformers DeepSeek-V3 gate's under its
own name, ``buffer.model.layers.N.mlp.gate.e_score_correction_bias``). Each model parameter is written once: by
data-parallel replica 0 (a MoE expert by the data-parallel rank that holds it, under the expert's own
name; with ZeRO-1 by the rank that owns its shard), from the copy that is not DualPipe's mirror; a
tied copy (``Trainer.tied``: a transformers model's tied head, an MTP head's embedding copy) is its
main parameter's value and is not written (the marker lists the pairs), and loads from the main's keys.
Both read the trainer only through its ``checkpoint_view()`` (``checkpoint_view.CheckpointView``).
Because keys name model parameters, not ranks or stages, a checkpoint loads under any schedule,
pipeline size, data-parallel size, ZeRO stage or precision (each rank reads the experts it holds, and
the optimizer state of the parameters it updates).

A checkpoint is complete or absent (``checkpoint_files.py``): written into a temporary folder,
then a completion marker (JSON: the step, the model's parameters and configuration, the
optimizer's class and hyper-parameters, each file's size and SHA-256) is written last and the
folder renamed into place. Nothing is stored as a pickle but DCP's own ``.metadata``, which is
read with an allow-list (``safe_metadata.py``); optimizer state that is not a tensor goes into
per-rank JSON files. Saving and loading are collective over the world, on the trainer's gloo group
whose timeout is the trainer's; every rank raises alike when any rank fails.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import twinpipe
from twinpipe.checks import check_bool, check_choice, check_int
from twinpipe.train.agreement import gather_json
from twinpipe.train.checkpoint_files import (
    METADATA, CheckpointError, CheckpointInfo, file_digest, prepare_folder, put_in_place, read_checkpoint_info,
    read_optimizer_state, verify_files, write_marker,
)
from twinpipe.train.checkpoint_view import CheckpointView
from twinpipe.train.config import record_differences
from twinpipe.train.safe_metadata import SafeFileSystemReader, TensorsOnlyLoadPlanner, load_metadata

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint_info", "CheckpointError", "CheckpointWriteError",
           "CheckpointInfo", "OPTIMIZER_HPARAMS"]

OPTIMIZER_HPARAMS = ("checkpoint", "current")
_PLAIN = (type(None), bool, int, float, str)  # optimizer state values a JSON file keeps as they are


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank (raised on every rank); the target folder is as it was before."""


def _describe(error: BaseException) -> str:
    if isinstance(error, CheckpointException):  # DCP's: every failing rank's exception
        return "; ".join(f"rank {r}: {_describe(e[0])}" for r, e in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


def _json_value(value):
    """A hyper-parameter as JSON data (tensors as numbers, tuples as lists; anything else by repr)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    return value if isinstance(value, _PLAIN) else repr(value)


def _param_groups(optimizer) -> list[dict]:
    return [{k: _json_value(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _is_rows(view: CheckpointView, p: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` (``p``, its master or a state tensor) holds this rank's rows of a model tensor
    (``row_shards``: a transformers model's fused experts)."""
    return id(p) in view.row_shards and t.dim() > 0 and t.shape == p.shape


def _sharded(view: CheckpointView, t: torch.Tensor) -> torch.Tensor:
    """This EP rank's rows ``t`` (experts ``ep_rank * E/ep ..``, by id) as a DTensor sharded by rows over
    ``row_mesh``: one tensor of all rows in the checkpoint, each row written once, readable at any EP size."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t, view.row_mesh, [Shard(0)], run_check=False)


def _placed_rows(view: CheckpointView, p: torch.Tensor) -> bool:
    """Whether ``p``'s rows are the slots of a placement other than one slot per expert by id (EPLB)."""
    return id(p) in view.row_shards and view.placed is not None and view.placed.placed(p)


def _placed(view: CheckpointView, p: torch.Tensor, t: torch.Tensor) -> bool:
    return _is_rows(view, p, t) and _placed_rows(view, p)


def _rows(view: CheckpointView, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` as DCP should store it: rows of experts by expert id (``_sharded``; from the slots of a
    placement with replicas or moves: ``PlacedRows.to_experts``, collective over the EP group), else ``t``."""
    if not _is_rows(view, p, t):
        return t
    return _sharded(view, view.placed.to_experts(p, t) if _placed(view, p, t) else t)


def _rank_state(view: CheckpointView) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The tensors this rank writes, and its optimizer state that is not a tensor (JSON-able values)."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict] = {}
    copies = view.stored_name()
    for name, p, owned in view.held:
        if not owned or name in copies:  # dp replica 0's (ZeRO-1: the owning rank's) first copy writes; a MoE expert
            continue                     # the one rank holding it; a tied copy is its main parameter's value
        t = view.optimized_tensor(p)  # the owner updates it: the FP32 master under mixed precision
        tensors[f"model.{name}"] = _rows(view, p, t.detach())
        for key, value in view.optimizer.state.get(t, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{name}.{key}"] = _rows(view, p, value)
            elif isinstance(value, _PLAIN):
                plain.setdefault(name, {})[str(key)] = value
            else:
                raise ValueError(f"optimizer state {name}.{key} is a {type(value).__name__}: checkpoints store tensors, "
                                 "numbers, strings, booleans and None only (nothing pickled)")
    for name, buffer, owned in view.buffers:  # routing biases, written once as parameters are
        if owned:
            tensors[f"buffer.{name}"] = buffer.detach()
    return tensors, plain


def _raise_if_failed(said: list[dict], where: str, target, before: str) -> None:
    failed = [(rank, s["error"]) for rank, s in enumerate(said) if s.get("error")]
    if failed:
        reasons = "; ".join(f"rank {rank}: {error}" for rank, error in failed)
        raise CheckpointWriteError(f"{where}: failed ({reasons}); {before}")


def save_checkpoint(trainer, path: str, step: int) -> None:
    """Write the model, optimizer and ``step`` (the next step to run) to directory ``path``,
    completely or not at all (an existing checkpoint there stays loadable until the new one
    replaces it). Collective: every rank of the world calls it."""
    check_int(step, "step", low=0)
    view = trainer.checkpoint_view()
    group, timeout = view.group, view.timeout
    rank = dist.get_rank(group)
    where = view.where(f"saving checkpoint {str(path)!r}")
    before = f"{str(path)!r} is as it was before the save"
    made = None  # rank 0: the temporary folder; removed when the save stops for any reason before it is in place
    try:
        # 1. Each rank gathers what it writes; rank 0 makes the temporary folder. Every rank learns of any failure.
        mine: dict = {"error": None}
        try:
            view.finish_update()  # the last update's pending all-gathers (ZeRO-1)
            tensors, plain = _rank_state(view)
            mine["placements"] = _placements(view)
            if rank == 0:
                made = prepare_folder(path)
                mine["folder"] = str(made)
        except Exception as error:
            mine["error"] = _describe(error)
        said = gather_json(group, mine, timeout, f"{where}: preparing")
        folder = Path(said[0]["folder"]) if said[0].get("folder") else None
        placements = {block: p for s in said for block, p in (s.get("placements") or {}).items()}
        _raise_if_failed(said, where, path, before)
        # 2. Every rank writes (DCP raises on every rank when one fails), then digests its own files.
        try:
            dcp.save(tensors, storage_writer=FileSystemWriter(folder), process_group=group)
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            raise CheckpointWriteError(f"{where}: writing failed ({_describe(error)}); {before}") from error
        mine = {"error": None}
        try:
            mine["files"] = _finish_own_files(folder, rank, plain)
        except Exception as error:
            mine["error"] = _describe(error)
        # 3. The barrier: every rank has written and digested its files, or all raise.
        said = gather_json(group, mine, timeout, f"{where}: waiting for every rank to finish writing")
        _raise_if_failed(said, where, path, before)
        # 4. Rank 0 writes the marker last and renames the folder into place.
        mine = {"error": None}
        if rank == 0:
            try:
                files = {name: {"bytes": size, "sha256": sha} for s in said for name, size, sha in s["files"]}
                _check_listed(folder, files)
                _check_seen(folder, said, files)
                write_marker(folder, _marker_record(view, step, files, placements))
                put_in_place(folder, path)
            except Exception as error:
                mine["error"] = _describe(error)
        said = gather_json(group, mine, timeout, f"{where}: waiting for the checkpoint to be put in place")
        _raise_if_failed(said, where, path, before)
    except BaseException:  # noqa: B036  (an error, KeyboardInterrupt, SystemExit: cleans up, then re-raises)
        if made is not None:  # once in place it has the target's name: this removes nothing then
            shutil.rmtree(made, ignore_errors=True)
        raise


def _finish_own_files(folder: Path, rank: int, plain: dict) -> list[list]:
    """Write this rank's non-tensor optimizer state (if any); (name, size, sha256) of every file it wrote."""
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_") and p.name.endswith(".distcp"))
    if plain:
        name = f"optimizer-state-{rank}.json"
        (folder / name).write_text(json.dumps(plain, sort_keys=True))
        names.append(name)
    if rank == 0:
        names.append(METADATA)  # DCP's coordinator (group rank 0) wrote it
    return [[name, *file_digest(folder / name)] for name in names]


def _check_listed(folder: Path, files: dict) -> None:
    """Every file DCP's metadata refers to was reported by its writer (else the marker would miss one)."""
    metadata = load_metadata((folder / METADATA).read_bytes())
    missing = sorted({info.relative_path for info in metadata.storage_data.values()} - set(files))
    if missing:
        raise RuntimeError(f"DCP wrote files no rank reported ({', '.join(missing)}): this torch's file naming is not the expected one")


def _check_seen(folder: Path, said: list[dict], files: dict) -> None:
    """Every file a rank reported is in the folder as rank 0 sees it: a rank whose ``path`` is another
    folder (another host's local disk, not a shared filesystem) wrote where the marker cannot vouch for."""
    for rank, report in enumerate(said):
        problems = verify_files(str(folder), files, [name for name, _, _ in report["files"]], digests=False)
        if problems:
            raise RuntimeError(f"rank {rank} of the checkpoint group wrote its files where rank 0 does not see them "
                               f"({problems[0]}): the checkpoint folder must be one folder that every rank sees, "
                               "such as a shared filesystem on several hosts")


def _placements(view: CheckpointView) -> dict[str, list[int]]:
    """This rank's MoE blocks (by the unsplit model's name) whose placement is not one slot per expert
    by id (EPLB) -> ``phy2log``: the marker records them; the tensors are stored by expert id regardless."""
    return {name.rsplit(".experts.", 1)[0]: view.placed.phy2log(p) for name, p, _ in view.held if _placed_rows(view, p)}


def _marker_record(view: CheckpointView, step: int, files: dict, placements: dict) -> dict:
    return ({"expert_placements": placements} if placements else {}) | {
        "step": int(step),
        "twinpipe": twinpipe.__version__,
        "model": {"parameters": [[n, list(s)] for n, s in view.parameter_names], "record": view.model_record,
                  "tied": [[main, copy] for copy, main in view.stored_name().items()]},
        "optimizer": {"class": type(view.optimizer).__name__, "param_groups": _param_groups(view.optimizer)},
        "optimizer_state_files": sorted(n for n in files if n.startswith("optimizer-state-")),
        "written_by": dict(view.written_by),
        "files": files,
    }


def _check_model(info: CheckpointInfo, view: CheckpointView, allow_model_config_change: bool) -> None:
    saved, mine = info.parameters, {name: list(shape) for name, shape in view.parameter_names}
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"it lacks {len(missing)} parameter(s) of this model ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
        if extra:
            parts.append(f"it has {len(extra)} this model lacks ({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''})")
        if shapes:
            parts.append("shapes differ: " + ", ".join(f"{n} {saved[n]} in the checkpoint vs {mine[n]}" for n in shapes[:4]))
        raise CheckpointError(info.path, "holds a different model: " + "; ".join(parts))
    differences = record_differences(info.model, view.model_record)
    if differences and not allow_model_config_change:
        raise CheckpointError(info.path, "was written by a model of another configuration with the same parameter shapes ("
                              + "; ".join(differences) + "); pass allow_model_config_change=True to load it anyway")


def _check_optimizer(info: CheckpointInfo, optimizer, optimizer_hparams: str) -> None:
    saved = info.optimizer.get("class")
    if saved != type(optimizer).__name__:
        raise CheckpointError(info.path, f"was written with optimizer {saved}, this run uses {type(optimizer).__name__}")
    groups = info.optimizer.get("param_groups")
    if optimizer_hparams == "checkpoint" and (not isinstance(groups, list) or len(groups) != len(optimizer.param_groups)):
        raise CheckpointError(info.path, f"holds {len(groups) if isinstance(groups, list) else 'no'} optimizer param group(s), "
                              f"this run's optimizer has {len(optimizer.param_groups)}; pass optimizer_hparams='current' "
                              "to keep this run's hyper-parameters")


def _checked(view: CheckpointView, path: str, where: str, **checks) -> tuple[CheckpointInfo, dict]:
    """The checkpoint's info and its optimizer state that is not a tensor, after every rank checked
    it (each rank a share of the data files' digests); every rank raises the same error when any
    rank found a problem."""
    group = view.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    info, plain, mine = None, {}, {"problem": None, "marker": None}
    try:
        info = read_checkpoint_info(path)
        _check_model(info, view, checks["allow_model_config_change"])
        _check_optimizer(info, view.optimizer, checks["optimizer_hparams"])
        share = sorted(n for n in info.files if n != METADATA)[rank::world]
        problems = verify_files(path, info.files, share)
        plain = read_optimizer_state(path, info.optimizer_state_files)  # used only once every rank found the digests right
        mine = {"problem": problems[0] if problems else None, "marker": info.marker_sha256}
    except CheckpointError as error:
        mine["problem"] = error.problem
    except Exception as error:  # every rank must reach the exchange below, whatever went wrong here
        mine["problem"] = _describe(error)
    said = gather_json(group, mine, view.timeout, f"{where}: checking it")
    problems = [s["problem"] for s in said if s["problem"]]
    if problems:
        raise CheckpointError(path, problems[0])
    if len({s["marker"] for s in said}) > 1:
        raise CheckpointError(path, "the ranks read different completion markers (every rank must see the same folder: a shared filesystem)")
    return info, plain


def load_checkpoint(trainer, path: str, *, optimizer_hparams: str = "checkpoint", allow_model_config_change: bool = False) -> int:
    """Load ``path`` into ``trainer``'s model and optimizer; returns the step to run next.

    ``optimizer_hparams``: whose hyper-parameters (learning rate, betas, weight decay, ...) the
    optimizer keeps: ``"checkpoint"`` (the default: the saved run's) or ``"current"`` (those this
    run's optimizer was built with); a difference is warned about either way (``UserWarning``).
    ``allow_model_config_change``: load a checkpoint whose model had another configuration (its
    ``config``, e.g. another head count) but the same parameter names and shapes. Refuses (every
    rank raises ``CheckpointError``, a ValueError) an incomplete, torn or corrupted folder, one of
    another model or optimizer class, and a crafted one, before anything is loaded; nothing in the
    folder is unpickled but through an allow-list. Collective: every rank of the world calls it."""
    check_choice(optimizer_hparams, "optimizer_hparams", OPTIMIZER_HPARAMS)
    check_bool(allow_model_config_change, "allow_model_config_change")
    path = str(path)
    view = trainer.checkpoint_view()
    view.finish_update()  # a pending all-gather (ZeRO-1) would overwrite the loaded weights
    where = view.where(f"loading checkpoint {path!r}")
    info, plain = _checked(view, path, where, optimizer_hparams=optimizer_hparams,
                           allow_model_config_change=allow_model_config_change)
    reads = _Reads(view, info.metadata.state_dict_metadata)
    try:
        dcp.load(reads.state, storage_reader=SafeFileSystemReader(path), planner=TensorsOnlyLoadPlanner(), process_group=view.group)
    except CheckpointException as error:
        raise CheckpointError(path, f"reading failed ({_describe(error)})") from error
    reads.copy_model_values()
    reads.give_optimizer_state(plain)
    view.loaded_weights()  # the bf16 compute copy from the masters (mixed precision)
    _apply_hparams(view.optimizer, info.optimizer.get("param_groups") or [], optimizer_hparams, where)
    return info.step


class _Reads:
    """What this rank reads of a checkpoint (``state``: DCP's ``load`` fills it) and where each value goes."""

    def __init__(self, view: CheckpointView, saved: dict):
        self.view, self.saved = view, saved
        self.stored_as = view.stored_name()  # a tied copy reads its main parameter's keys (older checkpoints hold both, equal)
        self.state: dict[str, torch.Tensor] = {}
        self.optim_keys: dict[int, list[tuple[str, str]]] = {}  # optimized tensor -> (key, state name)
        self.casts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read, into): a model value stored in another dtype
        self.into: dict[str, torch.Tensor] = {}  # model key -> the tensor that holds its value once read
        self.again: list[tuple[str, torch.Tensor]] = []  # (model key, tensor): a second tensor of this rank taking a key's value
        self.placed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (p, read by expert id, its slots to fill)
        for name, p, _ in view.held:
            t = view.optimized_tensor(p)  # the master (mixed precision), p, or None (ZeRO-1: another rank updates it)
            source = self.stored_as.get(name, name)
            self._model_value(source, p, (p if t is None else t).detach())
            if t is not None and id(t) not in self.optim_keys:  # else read already (one tensor under both names of a tied pair)
                self._optimizer_state(source, p, t)
        for name, buffer, _ in view.buffers:
            if f"buffer.{name}" in saved:
                self.state[f"buffer.{name}"] = buffer
            elif view.zero_unsaved_buffers:  # written before routing biases were saved, when nothing moved them: zero
                buffer.zero_()

    def _model_value(self, source: str, p: torch.Tensor, target: torch.Tensor) -> None:
        key = f"model.{source}"
        if key in self.into:  # this rank holds the main parameter too: its value, once read
            if self.into[key].data_ptr() != target.data_ptr():
                self.again.append((key, target))
            return
        self.into[key] = target
        stored = self.saved[key].properties.dtype
        if _placed(self.view, p, target):  # read by expert id, then into the slots (copy_model_values)
            read = self.view.placed.by_expert(p, target, stored)
            self.placed.append((p, read, target))
            self.state[key] = _sharded(self.view, read)
            return
        if stored != target.dtype:  # e.g. FP32 masters into a parameter another rank updates
            read = torch.empty(target.shape, dtype=stored, device=target.device)
            self.casts.append((read, target))
            target = read
        self.state[key] = _rows(self.view, p, target)

    def _optimizer_state(self, source: str, p: torch.Tensor, t: torch.Tensor) -> None:
        prefix = f"optim.{source}."
        for key, meta in self.saved.items():
            if key.startswith(prefix):
                if key not in self.state:  # else the main parameter's, read once and cloned below
                    size = p.shape if id(p) in self.view.row_shards and len(meta.size) else meta.size  # rows: this rank's
                    value = torch.empty(size, dtype=meta.properties.dtype, device=p.device if meta.size else "cpu")
                    if _placed(self.view, p, value):  # by expert id; into the slots in give_optimizer_state
                        value = self.view.placed.by_expert(p, value, value.dtype)
                    self.state[key] = _sharded(self.view, value) if id(p) in self.view.row_shards and len(meta.size) else value
                self.optim_keys.setdefault(id(t), []).append((key, key[len(prefix):]))

    def copy_model_values(self) -> None:
        """After the read: values stored in another dtype cast in, a second holder of a key given its value."""
        with torch.no_grad():
            for p, read, target in self.placed:  # collective over p's EP group, in the same order on every rank
                target.copy_(self.view.placed.to_slots(p, read))
            for read, target in self.casts:
                target.copy_(read)
            for key, target in self.again:
                target.copy_(self.into[key])

    def give_optimizer_state(self, plain: dict) -> None:
        """Each optimized tensor's state: the tensors read, and its values that are not tensors (``plain``)."""
        used: set[str] = set()  # optimizer state keys given to a tensor already: the next one gets its own clone
        done: set[int] = set()  # one tensor under both names of a tied pair: given its state once
        for name, p, _ in self.view.held:
            t = self.view.optimized_tensor(p)
            source = self.stored_as.get(name, name)
            if t is None or id(t) in done or (id(t) not in self.optim_keys and source not in plain):
                continue
            done.add(id(t))
            tensors = {}
            for key, short in self.optim_keys.get(id(t), []):
                value = _local(self.state[key])
                if value.dim() and _placed_rows(self.view, p):
                    value = self.view.placed.to_slots(p, value)  # read by expert id (collective over p's EP group)
                value = _state_dtype(value, short, t)
                tensors[short] = value.clone() if key in used else value
                used.add(key)
            self.view.optimizer.state[t] = {**tensors, **plain.get(source, {})}


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor (``_rows``), else the tensor."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _state_dtype(value: torch.Tensor, key: str, param: torch.Tensor) -> torch.Tensor:
    """Floating optimizer state in its parameter's dtype, as ``Optimizer.load_state_dict`` casts it
    (a checkpoint of FP32 masters loaded by a float64 run), but a ``step`` count as it was saved."""
    if key != "step" and value.is_floating_point() and param.is_floating_point() and value.dtype != param.dtype:
        return value.to(param.dtype)
    return value


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _apply_hparams(optimizer, saved: list[dict], mode: str, where: str) -> None:
    """Take the checkpoint's hyper-parameters (``mode="checkpoint"``) or keep the optimizer's; warn of differences."""
    differences = []
    for i, (group, theirs) in enumerate(zip(optimizer.param_groups, saved)):
        for key in sorted(set(theirs) | {k for k in group if k != "params"}):
            mine, saved_value = (_json_value(group[key]) if key in group else "(absent)"), theirs.get(key, "(absent)")
            if not _same(mine, saved_value):
                differences.append(f"param_groups[{i}].{key}: {saved_value!r} in the checkpoint, {mine!r} in this run's optimizer")
            if mode == "checkpoint" and key in theirs:
                group[key] = _restored(group.get(key), theirs[key])
    if len(saved) != len(optimizer.param_groups):
        differences.append(f"{len(saved)} param group(s) in the checkpoint, {len(optimizer.param_groups)} in this run's optimizer")
    if differences:
        using = ("the checkpoint's are used (optimizer_hparams='checkpoint'; pass 'current' to keep this run's)" if mode == "checkpoint"
                 else "this run's are kept (optimizer_hparams='current')")
        warnings.warn(f"{where}: the optimizer's hyper-parameters differ: {'; '.join(differences)}; {using}", UserWarning, stacklevel=3)


def _restored(current, saved):
    """A saved (JSON) hyper-parameter in the type the optimizer holds (a tuple, a tensor)."""
    if isinstance(current, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(_restored(c, s) for c, s in zip(current, saved)) if len(current) == len(saved) else tuple(saved)
    return saved
