"""Schedule names -> generators, so that every tool can ask for a schedule by name.

The built-in schedules are one explicit table (``BUILTIN``); ``register`` adds your own. A
generator is ``fn(num_ranks, num_microbatches, **options) -> Schedule``; its placement function
``placement(num_ranks, **options) -> Placement`` tells users which stages each rank holds before
they build anything. ``build`` and ``placement_for`` check what every schedule shares: the counts
(integers within ``limits.py``) and the option names (a ValueError lists the allowed ones); the
generator checks the option values. Schedules with a 1F1B steady phase (``steady``) also take
``overlap`` and ``warmup_extra``, applied here to whatever the generator builds (``fb_pairing.py``).
Tools outside this package resolve a schedule once with
``twinpipe.schedule.resolve`` (``spec.py``) and pass the spec on, rather than asking here again.
"""

from __future__ import annotations

import inspect
from dataclasses import KW_ONLY, dataclass, replace
from functools import cached_property
from typing import Callable

from twinpipe import checks
from twinpipe.schedule import bitpipe, chimera, dualpipe, fb_pairing, gpipe, interleaved, one_f_one_b, vshape_memory, zb_auto, zbv, zero_bubble
from twinpipe.schedule.limits import MAX_PLANNED_STAGE_MICROBATCHES as _PLANNED
from twinpipe.schedule.limits import MAX_STAGE_MICROBATCHES, check_counts, check_size
from twinpipe.schedule.ops import Schedule
from twinpipe.schedule.placement import Placement, dual, dual_v, linear, vshape

__all__ = ["ScheduleInfo", "BUILTIN", "FB_OPTIONS", "overlappable", "register", "get", "names", "variants", "build",
           "placement_for", "stages_of_rank"]


def _keywords(fn: Callable, skip: int) -> tuple[str, ...] | None:
    """Names of the keyword options ``fn`` takes after its first ``skip`` parameters (None: any)."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule: its generator, placement function, a one-line summary and aliases."""

    name: str
    generator: Callable[..., Schedule]
    placement: Callable[..., Placement]
    summary: str
    aliases: tuple[str, ...] = ()
    max_pairs: int = MAX_STAGE_MICROBATCHES  # stages x micro-batches (limits.py)
    _: KW_ONLY
    # Other option sets worth comparing at p ranks (the planner's rows), beside the defaults.
    variants: Callable[[int], list[dict]] | None = None
    # A 1F1B steady phase (a forward and a backward in turn): takes FB_OPTIONS (fb_pairing.py).
    steady: bool = False

    @cached_property
    def options(self) -> tuple[str, ...] | None:
        """The keyword options the schedule takes (None: any): its generator's, and FB_OPTIONS if ``steady``."""
        own = _keywords(self.generator, 2)
        return own + FB_OPTIONS if self.steady and own is not None else own


FB_OPTIONS = ("overlap", "warmup_extra")  # taken by every schedule with a steady phase


BUILTIN: tuple[ScheduleInfo, ...] = (
    ScheduleInfo("gpipe", gpipe.gpipe, linear, "GPipe: all forwards, then all full backwards"),
    ScheduleInfo("1f1b", one_f_one_b.one_f_one_b, linear, "1F1B: one forward, one full backward", ("one-f-one-b",), steady=True),
    ScheduleInfo("interleaved-1f1b", interleaved.interleaved_1f1b, interleaved.placement,
                 "Megatron interleaved 1F1B: v stages per rank, bubble / v", ("interleaved",), steady=True),
    ScheduleInfo("zb-h1", zero_bubble.zb_h1, linear, "ZB-H1: 1F1B memory, bubble (p-1)(T_F+T_B-T_W)", ("zb1p",), steady=True),
    ScheduleInfo("zb-h2", zero_bubble.zb_h2, linear, "ZB-H2: ~2x 1F1B memory, bubble (p-1)(T_F+T_B-2T_W)", steady=True),
    ScheduleInfo("zb-auto", zb_auto.zb_auto, linear, "Zero-bubble automatic scheduler (ZB-1p at mem_limit=p, ZB-2p at 2p)", ("zb",), _PLANNED),
    ScheduleInfo("zbv", zbv.zbv, vshape, "ZB-V: zero bubble on a V placement at 1F1B memory", ("zb-v",), _PLANNED, steady=True),
    ScheduleInfo("v-half", vshape_memory.v_half, vshape, "V-Half: V placement, half of 1F1B's activation memory, bubble about p/(2m)", (), _PLANNED),
    ScheduleInfo("v-min", vshape_memory.v_min, vshape, "V-Min: V placement, a third of 1F1B's activation memory, bubble about 2p/(3m)", (), _PLANNED),
    ScheduleInfo("dualpipe", dualpipe.dualpipe, dual, "DeepSeek DualPipe: bidirectional, two mirrored weight copies"),
    ScheduleInfo("dualpipev", dualpipe.dualpipev, vshape, "DeepSeek DualPipeV: V-shaped cut-in-half DualPipe, one weight copy"),
    ScheduleInfo("chimera", chimera.chimera, chimera.placement,
                 "Chimera: 1F1B pipelines in opposite directions, k pairs (pairs=k, default 1), 2k weight copies",
                 variants=chimera.variants),
    ScheduleInfo("bitpipe", bitpipe.bitpipe, dual_v, "BitPipe: a V-shaped pipeline in each direction, four half-size stages per rank, two weight copies"),
)

_REGISTRY: dict[str, ScheduleInfo] = {info.name: info for info in BUILTIN}
_ALIASES: dict[str, str] = {alias: info.name for info in BUILTIN for alias in info.aliases}


def register(name: str, generator: Callable[..., Schedule], placement: Callable[..., Placement], summary: str,
             aliases: tuple[str, ...] = (), max_pairs: int = MAX_STAGE_MICROBATCHES,
             variants: Callable[[int], list[dict]] | None = None, steady: bool = False) -> ScheduleInfo:
    """Make your own ``generator`` available under ``name`` (and ``aliases``) to every tool;
    ``variants(p)``: option sets the planner compares beside the defaults; ``steady``: it has a
    1F1B steady phase, so it takes ``overlap`` and ``warmup_extra``."""
    taken = [n for n in (name, *aliases) if n.lower() in _REGISTRY or n.lower() in _ALIASES]
    if taken:
        raise ValueError(f"schedule name(s) {', '.join(map(repr, taken))} already registered; choose another")
    info = ScheduleInfo(name.lower(), generator, placement, summary, tuple(a.lower() for a in aliases), max_pairs, variants=variants,
                        steady=checks.check_bool(steady, "steady"))
    _REGISTRY[info.name] = info
    _ALIASES.update({alias: info.name for alias in info.aliases})
    return info


def variants(name: str, num_ranks: int) -> list[dict]:
    """The option sets of ``name`` to compare at ``num_ranks`` ranks: the defaults ``{}`` first, then
    the schedule's own variants (Chimera: each allowed number of pipeline pairs)."""
    info = get(name)
    return [{}] + (info.variants(num_ranks) if info.variants else [])


def names() -> list[str]:
    """Registered schedule names (aliases not included)."""
    return list(_REGISTRY)


def get(name: str) -> ScheduleInfo:
    """The schedule called ``name`` (or one of its aliases, any case); ValueError lists the allowed names."""
    key = _ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else name
    if key not in _REGISTRY:
        raise checks.bad("schedule", name, f"allowed are {', '.join(sorted(_REGISTRY) + sorted(_ALIASES))}")
    return _REGISTRY[key]


def overlappable() -> list[str]:
    """The registered schedules that take ``overlap`` (those with a 1F1B steady phase)."""
    return [info.name for info in _REGISTRY.values() if info.steady]


def _check_options(info: ScheduleInfo, options: dict) -> None:
    allowed = info.options
    unknown = [key for key in options if allowed is not None and key not in allowed]
    if unknown and unknown[0] in FB_OPTIONS:
        already = " (it overlaps F&B ops already)" if info.name in ("dualpipe", "dualpipev") else ""
        raise checks.bad(f"{info.name}: option {unknown[0]}", options[unknown[0]],
                         f"not taken by {info.name}{already}; schedules that take it: {', '.join(overlappable())}")
    if unknown:
        also = f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""
        takes = f"{info.name} takes {', '.join(allowed) if allowed else 'no options'}"
        raise checks.bad(f"{info.name}: option {unknown[0]}", options[unknown[0]], f"unknown{also}; {takes}")


def _placement(info: ScheduleInfo, num_ranks: int, options: dict) -> Placement:
    takes = _keywords(info.placement, 1)
    return info.placement(num_ranks, **{k: v for k, v in options.items() if takes is None or k in takes})


def build(name: str, num_ranks: int, num_microbatches: int, **options) -> Schedule:
    """Generate the schedule ``name`` for ``num_ranks`` ranks and ``num_microbatches`` micro-batches."""
    info = get(name)
    _check_options(info, options)
    _fb_options(info, options)
    p, _ = check_counts(info.name, num_ranks, num_microbatches)
    return _generate(info, p, num_microbatches, options, _placement(info, p, options).num_stages)


def _generate(info: ScheduleInfo, num_ranks: int, num_microbatches: int, options: dict, num_stages: int) -> Schedule:
    """Run ``info``'s generator (options already checked, ``num_stages`` its placement's) within the size limits."""
    p, m = check_counts(info.name, num_ranks, num_microbatches)
    check_size(info.name, num_stages, m, info.max_pairs)
    overlap, warmup_extra = _fb_options(info, options)
    schedule = info.generator(p, m, **{k: v for k, v in options.items() if k not in FB_OPTIONS})
    if overlap:
        schedule = fb_pairing.overlap(schedule, warmup_extra)
    missing = {k: v for k, v in options.items() if k not in schedule.options}
    return replace(schedule, options={**schedule.options, **missing}) if missing else schedule  # a trace says how it was built


def _fb_options(info: ScheduleInfo, options: dict) -> tuple[bool, int]:
    """(overlap, warmup_extra) of ``options``, checked: a bool, and an int >= 0 given only with overlap."""
    overlap = checks.check_bool(options.get("overlap", False), f"{info.name}: overlap")
    extra = checks.check_int(options.get("warmup_extra", 0), f"{info.name}: warmup_extra", low=0)
    if extra and not overlap:
        raise checks.bad(f"{info.name}: warmup_extra", extra, "is the extra warm-up of overlapped F&B ops: give overlap=True too")
    return overlap, extra


def placement_for(name: str, num_ranks: int, **options) -> Placement:
    """Which rank holds which stage under schedule ``name`` (same checks as ``build``)."""
    info = get(name)
    _check_options(info, options)
    _fb_options(info, options)
    p, _ = check_counts(info.name, num_ranks, 1)
    return _placement(info, p, options)


def stages_of_rank(name: str, num_ranks: int, rank: int, **options) -> tuple[int, ...]:
    """Which global stages ``rank`` holds under schedule ``name`` (its modules, in order)."""
    placement = placement_for(name, num_ranks, **options)
    checks.check_int(rank, "rank", low=0, high=num_ranks - 1)
    return placement.stages_of(rank)
