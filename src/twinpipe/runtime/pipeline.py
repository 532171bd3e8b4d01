"""The user-facing pipeline: ``Pipeline`` runs any schedule; ``DualPipe``/``DualPipeV`` name two.

``step()`` keeps the official DualPipe contract: a rank passes inputs if it holds a chain's first
stage, labels and a criterion if it holds a last stage, and gets the per-micro-batch losses (and,
with ``return_outputs``, the outputs) back there; other ranks get ``(None, None)``. Gradients
accumulate into ``.grad`` unscaled (summed over micro-batches), so call ``zero_grad()`` between
steps. Training runs when grad mode is on; under ``torch.no_grad()`` only forwards run.
"""

from __future__ import annotations

import atexit
import gc
import uuid
import weakref
from functools import cached_property
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from twinpipe.checks import DEFAULT_TIMEOUT, bad, check_bool, check_choice, check_int
from twinpipe.runtime import waits
from twinpipe.runtime import mirrors
from twinpipe.runtime.agreement import REASON_CHARS, AgreementRound, Claim, Venue, disagreements, out_of_step_error, short
from twinpipe.runtime.board import release_board, shared_board
from twinpipe.runtime.collectives import checked_timeout, cpu_group, gather_objects, release_cpu_group
from twinpipe.runtime.comm import PointToPoint, declared_layout
from twinpipe.runtime.errors import PipelineAbortedError, PipelineBrokenError, PipelineCommError, PipelineMismatchError
from twinpipe.runtime.executor import Executor, StepData, StepResult
from twinpipe.runtime.memory import ActivationMeter, grad_bytes, storage_bytes
from twinpipe.runtime.recorder import Recorder
from twinpipe.runtime.shm import shm_pipes
from twinpipe.runtime.weight_grad import GradStore
from twinpipe.runtime.wiring import StepWiring
from twinpipe.schedule.lower import LoweredSchedule, forward_only, lower
from twinpipe.schedule.ops import Schedule
from twinpipe.schedule.spec import ScheduleSpec, describe, name_of, resolve
from twinpipe.sim.memory import MemoryParts, activation_peak

__all__ = ["Pipeline", "DualPipe", "DualPipeV"]

# Every pipeline of this process by the name its claims give it, so that ranks found out of step
# mark every pipeline the mismatched claims name (rank 0 stepping A while rank 1 steps B puts both
# out of step, on both ranks).
_BY_IDENTITY: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

# The p2p tag of every pipeline's mirrored-copy headers (see mirrors.py).
_SWAP_HEADER_TAG = mirrors.HEADER_TAG


def _device_of(modules: Sequence[nn.Module]) -> torch.device:
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            return tensor.device
    return torch.device("cpu")


def _stage_modules(modules, count: int) -> list[nn.Module]:
    """This rank's ``count`` stage modules from what the user passed (the official API's containers)."""
    if isinstance(modules, nn.Sequential) and count > 1:
        modules = list(modules)  # the stages, in order (with one stage, a Sequential is the stage)
    elif isinstance(modules, (nn.ModuleList, list, tuple)):
        modules = list(modules)
    elif isinstance(modules, nn.Module):
        modules = [modules]
    else:
        raise ValueError(f"modules={type(modules).__name__}: pass this rank's stage module(s) as an nn.Module, "
                         "a tuple, a list, an nn.ModuleList or an nn.Sequential")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise ValueError(f"modules[{i}] is a {type(m).__name__}; every stage must be an nn.Module")
    return modules


def _overlapped_forward_backward(modules: nn.ModuleList):
    """Like the official DualPipe: the user's overlapped F&B runs when all of this rank's stage
    modules are of one class that defines it."""
    kinds = {type(m) for m in modules}
    if len(kinds) == 1 and hasattr(kinds.pop(), "overlapped_forward_backward"):
        return type(modules[0]).overlapped_forward_backward
    return None


def _check_step_hooks(on_grads_ready, step_id, measure_memory=False) -> None:
    if on_grads_ready is not None and not callable(on_grads_ready):
        raise bad("on_grads_ready", on_grads_ready, "must be a callable taking a stage number, or None")
    if step_id is not None:
        check_int(step_id, "step_id")
    check_bool(measure_memory, "measure_memory")


def _describe_schedule(spec, options: dict) -> str:
    """The construction agreement's "schedule" fact: a ``ScheduleSpec``'s own, else named without resolving."""
    if isinstance(spec, ScheduleSpec):
        return spec.describe()
    return describe(name_of(spec), options)


# A pipeline no longer reachable at exit (a script's main() returned without dropping it: a pipeline
# holds reference cycles) was freed by the interpreter's teardown, and with it the communication
# objects it held, while torch.distributed's C++ threads still ran: a rank then aborted after its
# work was done ("terminate called without an active exception", SIGABRT; 2 of 6 runs of
# examples/tracing.py here, 0 of 8 with this). Collected at exit instead, while all is intact.
atexit.register(gc.collect)


class Pipeline(nn.Module):
    """Runs ``schedule`` over the ranks of ``process_group`` with this rank's stage ``modules``.

    ``modules`` holds this rank's stages in ascending stage order (see ``twinpipe.stages_of_rank``):
    one module, or a tuple, list, ``nn.ModuleList`` or ``nn.Sequential`` of them. ``schedule`` is a
    registered name, a generator ``fn(num_ranks, num_microbatches, **options) -> Schedule``, or a
    fixed ``Schedule``. Message shapes come from ``tensor_shapes``/``tensor_dtype``, the
    process-wide setters, or are discovered on the first step (``dynamic_shapes=True``
    rediscovers them every step). ``timeout`` bounds every wait for a peer, in seconds, collectives
    included. ``transport="auto"`` sends CPU messages between ranks on one host through shared
    memory and everything else through the process group; ``"process-group"`` always uses the
    group. Construction is collective, and ranks that disagree on how they built the pipeline
    (schedule, options, transport, declared layouts) all raise ``PipelineMismatchError``.
    """

    _out_of_step: str | None = None  # why the ranks are known to run different steps (until resync())
    measure_memory = False  # every step measures its memory while True (``step(measure_memory=...)``)

    def __init__(
        self,
        modules: nn.Module | Sequence[nn.Module],
        schedule: str | Callable[..., Schedule] | Schedule = "dualpipev",
        batch_dim: int = 0,
        process_group=None,
        rank_mapping: Sequence[int] | None = None,
        *,
        tensor_shapes=None,
        tensor_dtype=None,
        dynamic_shapes: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        transport: str = "auto",
        **schedule_options,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group() first (or use torchrun)")
        self.timeout = checked_timeout(timeout)
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.num_ranks = dist.get_world_size(self.group)
        group_rank = dist.get_rank(self.group)
        self._agree_group = cpu_group(self.group, self.timeout)  # shared by pipelines on the same ranks
        self._scope = waits.Scope(self.timeout, [self.group])  # the steps' limit and failure notices
        self._closed = False
        self.store = GradStore()  # this pipeline's deferred weight gradients
        self._rounds = 0  # steps begun (agreement rounds); equal on every rank
        self._broken: str | None = None
        error = None
        try:
            self._configure(modules, schedule, batch_dim, rank_mapping, group_rank, tensor_shapes, tensor_dtype,
                            dynamic_shapes, transport, schedule_options)
        except Exception as exc:  # tell the other ranks before raising, so that none of them waits
            error = exc
        try:
            self._agree_on_construction(group_rank, error, schedule, schedule_options, rank_mapping, tensor_shapes,
                                        tensor_dtype, dynamic_shapes, transport)
        except BaseException:
            release_cpu_group(self._agree_group)  # as every rank does: none built it
            raise
        if error is not None:
            release_cpu_group(self._agree_group)
            raise error
        # Step agreements go through shared memory when every rank is on this host (collective).
        self._board = shared_board(self._agree_group, group_rank, self.num_ranks, self.timeout)
        pipes = None
        if transport == "auto":  # collective: every rank of the group takes part
            placement = self._placement()
            neighbours = {placement.rank_of(n) for s in self.stages
                          for n in (placement.prev_stage(s), placement.next_stage(s)) if n is not None}
            pipes = shm_pipes(self._agree_group, self.rank, self.group_rank_of, neighbours - {self.rank}, self.device, self.timeout)
        self._p2p = PointToPoint(self.group, self.group_rank_of, pipes, self._tag)
        self._made = (self._board, pipes)  # what close() gives back
        self._overlap = _overlapped_forward_backward(self.module)

    def _configure(self, modules, schedule, batch_dim, rank_mapping, group_rank, tensor_shapes, tensor_dtype,
                   dynamic_shapes, transport, schedule_options) -> None:
        """Everything construction checks on this rank alone."""
        if rank_mapping is None:
            rank_mapping = list(range(self.num_ranks))
        if sorted(rank_mapping) != list(range(self.num_ranks)):
            raise bad("rank_mapping", list(rank_mapping), f"must be a permutation of 0..{self.num_ranks - 1}")
        self.rank = rank_mapping[group_rank]
        self.global_rank_of = {pp: dist.get_global_rank(self.group, g) for g, pp in enumerate(rank_mapping)}
        self.group_rank_of = {pp: g for g, pp in enumerate(rank_mapping)}
        check_int(batch_dim, "batch_dim")
        check_choice(transport, "transport", ("auto", "process-group"))
        self.batch_dim, self.dynamic_shapes = batch_dim, bool(dynamic_shapes)
        # Resolved once: the placement, the agreement's fact and every step's schedule come from it.
        self._schedule_spec = resolve(schedule, self.num_ranks, **schedule_options)
        self._schedule_options = dict(self._schedule_spec.options)
        self._tensor_shapes, self._tensor_dtype = tensor_shapes, tensor_dtype
        declared_layout(tensor_shapes, tensor_dtype)  # reject bad shapes/dtypes now, not mid-step
        self._layouts: dict = {}
        self._layout_key = None
        self._lowered: dict[tuple[int, bool], LoweredSchedule] = {}
        self.last_trace: list | None = None
        self.last_peak_live = 0
        self.last_busy_s = 0.0  # seconds the last step ran this rank's ops, not waiting (stragglers show here)
        self.last_memory: MemoryParts | None = None
        placement = self._placement()
        self.stages = placement.stages_of(self.rank)
        self.module = nn.ModuleList(_stage_modules(modules, len(self.stages)))
        if len(self.stages) != len(self.module):
            raise ValueError(
                f"rank {self.rank} holds stages {list(self.stages)} under this schedule, so it needs "
                f"{len(self.stages)} module(s); got {len(self.module)}"
            )
        self.device = _device_of(self.module)
        self._by_stage = dict(zip(self.stages, self.module))

    @property
    def _declared(self):
        """Declared message layout: this pipeline's, else the process-wide setters' (read every step)."""
        return declared_layout(self._tensor_shapes, self._tensor_dtype)

    def _agree_on_construction(self, group_rank, error, schedule, options, rank_mapping, shapes, dtype, dynamic, transport):
        """Every rank checks that all built the same pipeline, and learns of any rank that failed to."""
        where = f"rank {getattr(self, 'rank', group_rank)}: building the pipeline"
        facts = {}
        if error is None:
            facts = {
                "schedule": _describe_schedule(schedule, options),
                "rank_mapping": "identity" if rank_mapping is None else str(list(rank_mapping)),
                "transport": transport,
                "message layouts": f"declared [{self._declared}]" if self._declared else
                                   ("discovered every step" if dynamic else "discovered on the first step"),
            }
        # Long facts (a rank_mapping of hundreds of ranks, many declared tensors) are shortened as a
        # step's claims are, keeping a checksum: the claim must fit the agreement's fixed frame.
        claim = (group_rank, {k: short(v) for k, v in facts.items()}, "ready" if error is None else "rejected",
                 "" if error is None else short(f"{type(error).__name__}: {error}", REASON_CHARS), uuid.uuid4().hex)
        claims = gather_objects(self._agree_group, claim, self.timeout, f"{where}: waiting for every rank to build it")
        token = min(c[4] for c in claims)  # the same on every rank, new for every pipeline
        self._identity = f"#{token[:8]}"
        # Point-to-point tag of this pipeline's messages (gloo): whatever a broken pipeline left
        # posted on the group can never match a message of a pipeline built after it.
        self._tag = 1 + int(token[:5], 16)
        if error is not None:
            return
        claims = [Claim(rank, their_facts, status, reason) for rank, their_facts, status, reason, _ in claims]
        rejected = [c for c in claims if c.status == "rejected"]
        if rejected:
            reasons = "; ".join(f"group rank {c.rank}: {c.reason}" for c in rejected)
            raise PipelineAbortedError(f"{where}: construction failed on another rank ({reasons})")
        problems = disagreements(claims, facts)  # ranks here are group ranks
        if problems:
            raise PipelineMismatchError(f"{where}: ranks (numbered in the process group) built it differently: " + ", and ".join(problems))
        self._identity = f"{facts['schedule']} pipeline #{token[:8]}"
        _BY_IDENTITY[short(self._identity)] = self

    @property
    def shared_memory_peers(self) -> set[int]:
        """Pipeline ranks this rank exchanges messages with through shared memory."""
        return set(self._p2p.piped)

    def close(self) -> None:
        """Give back what the pipeline made: its shared-memory pipes, its share of the agreement
        board and of the gloo group made for an NCCL-only process group (the last pipeline using
        them frees them). Call it on every rank, as construction; later calls do nothing, and a
        closed pipeline's ``step()`` raises. ``with Pipeline(...) as pipe:`` closes it at the end."""
        if self._closed:
            return
        self._closed = True
        board, pipes = self._made
        self._made = (None, None)
        if pipes is not None:
            pipes.close()
        release_board(board)
        release_cpu_group(self._agree_group)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: this pipeline was closed (close(), or the end of its with-block); "
                               "build a new one on every rank")

    # ------------------------------------------------------------------ schedule
    def _placement(self):
        return self._schedule_spec.placement

    def schedule_for(self, num_chunks: int) -> Schedule:
        """The schedule this pipeline runs for ``num_chunks`` micro-batches (size limits checked first)."""
        return self._schedule_spec.build(num_chunks)

    def _lowered_for(self, num_chunks: int, training: bool) -> LoweredSchedule:
        key = (num_chunks, training)
        if key not in self._lowered:
            schedule = self.schedule_for(num_chunks)
            self._lowered[key] = lower(schedule if training else forward_only(schedule))
        return self._lowered[key]

    # ------------------------------------------------------------------ step
    def step(self, *inputs, num_chunks: int = 0, criterion=None, labels=(), return_outputs: bool = False, trace: bool = False,
             on_grads_ready: Callable[[int], None] | None = None, step_id: int | None = None, measure_memory: bool | None = None):
        """Run one pipelined step over ``num_chunks`` micro-batches. Returns ``(loss, outputs)``.

        ``on_grads_ready(stage)``, in training, is called once for each of this rank's stages, right
        after the last op of this step that writes that stage's parameter gradients (its last W, BW
        or F&B), while later ops still wait: a data-parallel reduction of those gradients can start
        there. ``stage`` is the pipeline stage number (its module: ``self.module[self.stages.index(stage)]``).
        An exception in it fails the step like a failing stage.

        Before any message moves, every rank checks that all run the same step (see
        ``twinpipe.runtime.agreement``); a rank that rejects its inputs makes the others raise
        ``PipelineAbortedError``, and the pipeline stays usable for the next step. ``step_id``, an
        int the user numbers steps with (the batch's index, say), joins that check: ranks with
        different ids raise ``PipelineMismatchError`` naming them. Ranks found running different
        steps (other ids, or one rank's extra step) stay out of step: every later ``step()``
        raises ``PipelineOutOfStepError`` until every rank calls ``resync()``.

        ``measure_memory=True`` (default: the pipeline's ``measure_memory`` attribute, False):
        ``last_memory`` then holds this rank's bytes (``twinpipe.sim.memory.MemoryParts``: its stages'
        parameters and gradients, and the peak its activations reached, counted as
        ``twinpipe.runtime.memory`` says); otherwise it is None.
        """
        self._check_open()
        training = torch.is_grad_enabled()
        measure_memory = self.measure_memory if measure_memory is None else measure_memory
        round_index = self._rounds
        self._rounds += 1
        where = f"rank {self.rank}, step {round_index}"
        if self._out_of_step is not None:  # every rank knows: raise without an exchange (see agreement.py)
            raise out_of_step_error(where, self._out_of_step)
        error = None
        try:
            _check_step_hooks(on_grads_ready, step_id, measure_memory)
            lowered, data = self._prepare(inputs, num_chunks, criterion, labels, return_outputs, training)
        except Exception as exc:  # reported to every rank before raising
            error = exc
        declared = self._declared
        discovering = declared is None and (self.dynamic_shapes or self._layout_key != num_chunks)
        facts = {
            "call": "step()",
            "pipeline": self._identity,
            "step": str(round_index),
            "step_id": "none" if step_id is None else str(step_id),
            "mode": "training" if training else "forward-only (torch.no_grad())",
            "num_chunks": repr(num_chunks),
            "message layouts": f"declared [{declared}]" if declared is not None else
                               "to discover" if discovering else f"discovered for num_chunks={self._layout_key}",
        }
        agreement = self._start_round(facts, error, where, round_index)  # raises if this rank will not run it
        wiring = self._wiring(lowered, declared, agreement, num_chunks if discovering else None)
        recorder = Recorder(self.device) if trace else None
        executor = Executor(wiring, self._by_stage, self.store, recorder, self._overlap, on_grads_ready)
        meter = executor.observer = ActivationMeter(self._not_activations(data), self.device) if measure_memory else None
        result = self._run(executor, data, num_chunks, agreement, round_index)
        self.last_memory = self._memory(meter) if meter is not None else None
        self.last_peak_live = result.peak_live
        self.last_busy_s = result.busy_s
        self.last_trace = recorder.events if recorder else None
        return self._collect(result)

    def predict_activation_peak(self, num_chunks: int, stages: dict) -> int:
        """The peak bytes this rank's activations reach in a training step of ``num_chunks``
        micro-batches (after the first, once message layouts are known), from its stages'
        ``StageMemory`` (``stages``: stage -> ``twinpipe.runtime.memory.measure_stage``'s result):
        ``twinpipe.sim.memory.activation_peak`` on this rank's program."""
        lowered = self._lowered_for(num_chunks, True)
        return activation_peak(lowered.programs[self.rank], lowered.schedule.placement, stages, self._p2p.flattens,
                               fb_middle=self._overlap is None)

    def _not_activations(self, data: StepData) -> list[torch.Tensor]:
        """Storages a memory measurement leaves out: parameters, buffers, the user's inputs and labels."""
        held = [*self.module.parameters(), *self.module.buffers()]
        for chunks in (*data.inputs.values(), *data.labels.values()):
            held += [t for chunk in chunks for t in chunk if isinstance(t, torch.Tensor)]
        return held

    def _memory(self, meter: ActivationMeter) -> MemoryParts:
        params = list(self.module.parameters())
        return MemoryParts(params=storage_bytes(params), grads=grad_bytes(params), activations_peak=meter.peak,
                           device_peak=meter.device_peak)

    def _start_round(self, facts: dict, error, where: str, round_index: int) -> AgreementRound | None:
        """Post this rank's claim for the step (collected before its first message). A rank that
        will not run the step (it rejected its arguments, or the pipeline is broken) tells the
        others and raises here."""
        status, reason = self._status(error)
        agreement = None
        if self.num_ranks > 1:
            agreement = self._agreement(Claim(self.rank, facts, status, reason), where, "start the step", f"step {round_index}")
        if status != "ready":
            self._refuse(agreement, status, reason, error, where, round_index)
        return agreement

    def _wiring(self, lowered: LoweredSchedule, declared, agreement: AgreementRound | None, discover_for: int | None) -> StepWiring:
        """This rank's wiring for the step: before its first message, the agreement is confirmed and,
        when layouts are rediscovered (for ``discover_for`` micro-batches), the old ones forgotten."""

        def before_first_message() -> None:
            if agreement is not None:
                agreement.confirm()
            if discover_for is not None:
                self._layouts.clear()
                self._layout_key = discover_for

        return StepWiring(
            program=lowered.programs[self.rank], placement=lowered.schedule.placement, p2p=self._p2p, device=self.device,
            layouts=self._layouts, declared=declared, timeout=self.timeout, before_first_message=before_first_message,
            agreement_arrived=agreement.arrived if agreement is not None else None,
        )

    def _run(self, executor: Executor, data: StepData, num_chunks: int, agreement, round_index: int) -> StepResult:
        """Run this rank's program under the pipeline's wait scope (its limit and failure notices, for
        every wait inside the step, EP collectives included)."""
        self.store.clear()
        scope = waits.enter(self._scope)
        try:
            with self.store.active():
                result = executor.run(data, num_chunks)
            if data.training and self.store.pending():
                raise RuntimeError(f"rank {self.rank}: {self.store.pending()} deferred weight gradients never ran")
        except BaseException as exc:
            self._failed(exc, executor.transport.opened, agreement, round_index)
            raise
        finally:
            waits.leave(scope)
            self.store.clear()
        return result

    def _failed(self, exc: BaseException, opened: bool, agreement, round_index: int) -> None:
        """After a failed step: finish the agreement round if no message was posted yet, as every rank
        does; once messages may have moved (``opened``, EP collectives included), or the ranks' rounds
        fell out of step, the step cannot be undone: mark the pipeline broken and tell every rank
        waiting on its groups (and the EP groups its steps used)."""
        if agreement is not None and not opened:
            try:  # failed before its first message: still finish the round, as every rank does
                agreement.confirm()
            except Exception:
                pass
        if isinstance(exc, PipelineCommError) or (
            (opened or self._scope.moved) and not isinstance(exc, (PipelineMismatchError, PipelineAbortedError, PipelineBrokenError))
        ):
            self._broken = f"rank {self.rank} failed during step {round_index}: {type(exc).__name__}: {exc}"
            waits.publish_failure(getattr(exc, "first", "") or f"global rank {dist.get_rank()} (pipeline rank "
                                  f"{self.rank}) failed during step {round_index}: {type(exc).__name__}: {exc}", self._scope.groups)

    def _status(self, error: Exception | None) -> tuple[str, str]:
        """This rank's status for the next agreement round, and why."""
        if self._broken is not None:
            return "broken", self._broken
        if error is not None:
            return "rejected", f"{type(error).__name__}: {error}"
        return "ready", ""

    def _agreement(self, claim: Claim, where: str, what: str, label: str) -> AgreementRound:
        return AgreementRound(Venue(self._agree_group, self._board, self.timeout, _fell_out_of_step), claim, where, what, label)

    def _refuse(self, agreement, status: str, reason: str, error, where: str, round_index: int):
        """A step this rank will not run: tell the others (they raise too) and raise."""
        if agreement is not None:
            try:
                agreement.confirm()  # let the others know; hear from them
            except PipelineBrokenError:
                raise
            except PipelineCommError as exc:  # the others never started this step
                if status == "rejected":
                    self._broken = f"rank {self.rank}: step {round_index} never started on every rank ({exc})"
            except (PipelineMismatchError, PipelineAbortedError):
                pass  # this rank's own error says more
        if status == "broken":
            raise PipelineBrokenError(f"{where}: this pipeline cannot run again ({reason}). Build a new pipeline on every rank, on a new process group (gloo closes a connection whose wait timed out).")
        raise error

    def resync(self) -> None:
        """Realign the ranks after they were found running different steps: collective, every
        rank of the pipeline calls it at the same point of its loop, so that each rank's next
        ``step()`` is the same step. The ranks agree that they all resync this pipeline and take
        the highest step count among them; a rank that calls ``step()`` or another pipeline's
        ``resync()`` instead makes every rank raise ``PipelineMismatchError`` (nothing changes), and
        ranks that never call it make the others raise ``PipelineTimeoutError`` after the timeout
        (the pipeline is then broken). A pipeline broken half-way cannot be resynced
        (``PipelineBrokenError`` on every rank). Harmless when the ranks are in step."""
        where = f"rank {self.rank}: resync()"
        status = "broken" if self._broken is not None else "ready"
        claim = Claim(self.rank, {"call": "resync()", "pipeline": self._identity}, status, self._broken or "", str(self._rounds))
        claims = None
        if self.num_ranks > 1:
            try:
                claims = self._agreement(claim, where, "call resync()", "resync()").confirm()
            except PipelineCommError as exc:
                self._broken = f"rank {self.rank}: resync() did not complete on every rank ({exc})"
                raise
        if status == "broken":
            raise PipelineBrokenError(f"{where}: this pipeline cannot run again ({self._broken}). Build a new pipeline on every rank, on a new process group.")
        self._rounds = max(int(c.note) for c in claims) if claims else self._rounds
        self._out_of_step = None

    def _prepare(self, inputs, num_chunks, criterion, labels, return_outputs, training) -> tuple[LoweredSchedule, StepData]:
        """Check this rank's arguments and split its batch; raises before anything is sent."""
        check_int(num_chunks, "num_chunks", low=1, why="micro-batches per step, all chains together")
        lowered = self._lowered_for(num_chunks, training)
        placement = lowered.schedule.placement
        labels = tuple(labels) if isinstance(labels, (list, tuple)) else (labels,)
        data = StepData({}, {}, criterion, return_outputs, training)
        for stage in self.stages:
            chain = placement.chain_of_stage(stage)
            count = len(placement.microbatches_of_chain(chain, num_chunks))
            if placement.is_first(stage):
                if not inputs:
                    raise ValueError(f"rank {self.rank} holds stage {stage}, a first stage: step() needs its inputs here")
                data.inputs[stage] = self._split(inputs, count, "inputs")
            if placement.is_last(stage):
                if training and criterion is None:
                    raise ValueError(f"rank {self.rank} holds stage {stage}, a last stage: training needs criterion= here")
                if criterion is not None:
                    data.labels[stage] = self._split(labels, count, "labels") if labels else [()] * count
        return lowered, data

    def _split(self, tensors: tuple, count: int, what: str) -> list[tuple]:
        chunks = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what}[{i}] is a {type(t).__name__}; step() takes tensors")
            size = t.shape[self.batch_dim] if t.dim() > self.batch_dim else 0
            if size < count:
                raise ValueError(
                    f"{what}[{i}] has {size} rows along batch_dim={self.batch_dim}, fewer than the {count} micro-batches it must be split into"
                )
            chunks.append(torch.tensor_split(t, count, dim=self.batch_dim))
        return [tuple(c[k] for c in chunks) for k in range(count)]

    def _collect(self, result):
        last = [s for s in self.stages if s in result.losses or s in result.outputs]
        if not last:
            return None, None
        stage = last[0]
        loss = torch.stack(result.losses[stage]) if stage in result.losses else None
        outputs = None
        if stage in result.outputs:
            per_tensor = list(zip(*result.outputs[stage]))
            joined = [torch.cat(parts, dim=self.batch_dim) for parts in per_tensor]
            outputs = joined[0] if len(joined) == 1 else tuple(joined)
        return loss, outputs

    # ------------------------------------------------------------------ mirrored copies (mirrors.py)
    @cached_property
    def _copies(self) -> dict[int, list[tuple[int, int]]]:
        """Model stage -> all its copies as (rank, stage), in chain order, for each model stage this
        rank holds that has more than one copy (``mirrors.copies_of``)."""
        return mirrors.copies_of(self._placement(), self.rank, self.stages)

    @cached_property
    def _mirrors(self) -> mirrors.Mirrors:
        return mirrors.Mirrors(rank=self.rank, copies=self._copies, modules=self._by_stage, device=self.device, p2p=self._p2p,
                               timeout=self.timeout, identity=self._identity)

    def sync_mirrored_grads(self) -> None:
        """Sum the gradients of all copies of each model stage, in place, so that every copy holds
        the full gradient, bitwise equal on every rank: each rank adds the copies in chain order
        (with two copies no order could differ, as a + b == b + a). A no-op for schedules that hold
        one copy of each stage. Every rank holding a copy must call it."""
        self._check_open()
        self._mirrors.sync_grads()

    def sync_mirrored_weights(self) -> None:
        """Give every copy of each model stage the weights of one copy, in place: the copy on the
        lowest rank (of several copies there, the lowest chain's)."""
        self._check_open()
        self._mirrors.sync_weights()


def _fell_out_of_step(reason: str, identities: set) -> None:
    """Mark this process's pipelines named ``identities`` out of step (keeping an earlier reason)."""
    for identity in identities:
        pipe = _BY_IDENTITY.get(identity)
        if pipe is not None and pipe._out_of_step is None:
            pipe._out_of_step = reason


class DualPipeV(Pipeline):
    """DeepSeek's DualPipeV: ``modules = (stage r, stage 2P-1-r)`` of a 2P-stage model on rank r."""

    def __init__(self, modules, batch_dim: int = 0, process_group=None, rank_mapping=None, **options):
        super().__init__(modules, "dualpipev", batch_dim, process_group, rank_mapping, **options)


class DualPipe(Pipeline):
    """DeepSeek's DualPipe: two copies of a P-stage model run in opposite directions.

    On rank r, ``modules[0]`` is stage r of the first copy and ``modules[1]`` stage P-1-r of the
    second. ``num_chunks`` counts both directions. After backward, call ``sync_mirrored_grads()``
    so both copies of each stage hold the full gradient.
    """

    def __init__(self, modules, batch_dim: int = 0, process_group=None, rank_mapping=None, **options):
        if dist.is_initialized():
            ranks = dist.get_world_size(process_group if process_group is not None else dist.group.WORLD)
            if ranks % 2:
                raise ValueError(f"DualPipe needs an even number of ranks; the process group has {ranks}")
        super().__init__(modules, "dualpipe", batch_dim, process_group, rank_mapping, **options)
