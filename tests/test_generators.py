"""Schedule generators: every schedule is valid, small cases match the published op orders,
bad input is refused with a clear message."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinpipe.schedule import registry
from twinpipe.schedule.check import validate
from twinpipe.schedule.ops import OpKind

DOCS = Path(__file__).resolve().parents[1] / "docs"

# Every (p, m) a generator accepts in these ranges is built and validated.
LINEAR = ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto"]
ALL = LINEAR + ["interleaved-1f1b", "zbv", "v-half", "v-min", "dualpipe", "dualpipev", "chimera", "bitpipe"]
GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 5, 7, 8, 12, 16)]


def checked(name: str, p: int, m: int, **options):
    """Build and validate (dependencies, counts, deadlock freedom)."""
    schedule = registry.build(name, p, m, **options)
    validate(schedule)
    return schedule


def accepts(name: str, p: int, m: int, **options) -> bool:
    try:
        registry.build(name, p, m, **options)
    except ValueError:
        return False
    return True


def test_registered_names_and_aliases():
    assert set(ALL) <= set(registry.names())
    assert registry.get("zb1p").name == "zb-h1"
    assert registry.get("ZB-H2").name == "zb-h2"
    with pytest.raises(ValueError, match=r"schedule='nope': allowed are .*zb-h1"):
        registry.get("nope")


@pytest.mark.parametrize("name", ALL)
def test_every_accepted_schedule_is_valid(name):
    built = 0
    for p, m in GRID:
        if accepts(name, p, m):
            schedule = checked(name, p, m)
            assert schedule.num_microbatches == m and schedule.num_ranks == p
            built += 1
    assert built >= 10


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv"])
def test_any_m_and_p_accepted(name):
    for p, m in GRID:
        assert accepts(name, p, m), (p, m)


@pytest.mark.parametrize("name", ALL)
def test_deterministic(name):
    p, m = (4, 8)
    assert registry.build(name, p, m).ops == registry.build(name, p, m).ops


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "chimera", "bitpipe"])
def test_full_backward_schedules_use_bw(name):
    kinds = {op.kind for ops in checked(name, 4, 8).ops for op in ops}
    assert kinds == {OpKind.F, OpKind.BW}


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-auto", "zbv"])
def test_zero_bubble_schedules_split_the_backward(name):
    kinds = {op.kind for ops in checked(name, 4, 8).ops for op in ops}
    assert kinds == {OpKind.F, OpKind.B, OpKind.W}


# --- op orders from zero-bubble.md (p=4, m=8, unit times) ---------------------------------

ZB_H1 = ["FFFFBWFBWFBWFBWFBWBWBWBW", "FFFBFBWFBWFBWFBWFBWBWBWW", "FFBFBFBWFBWFBWFBWFBWBWWW", "FBFBFBFBWFBWFBWFBWFBWWWW"]
ZB_H2 = ["FFFFFFFBWFBWBWBWBWBWBWBW", "FFFFFBFBFBWFBWBWBWBWBWWW", "FFFBFBFBFBFBWFBWBWBWWWWW", "FBFBFBFBFBFBFBWFBWWWWWWW"]
ZB_2P = ["FFFFFFFBFWBWBWBWBWBWBWBW", "FFFFFBFBFBFBWBWBWBWBWWWW", "FFFBFBFBFBFBFBWBWBWWWWWW", "FBFBFBFBFBFBFBFBWWWWWWWW"]


def kinds(schedule) -> list[str]:
    return [schedule.kinds_string(r) for r in range(schedule.num_ranks)]


def test_zb_h1_and_h2_match_the_table():
    assert kinds(checked("zb-h1", 4, 8)) == ZB_H1
    assert kinds(checked("zb-h2", 4, 8)) == ZB_H2


@pytest.mark.parametrize("mw", [0.5, 0.9, 1.0])
def test_zb_auto_reproduces_zb_1p_and_zb_2p(mw):
    one_p = checked("zb-auto", 4, 8, mw=mw)  # default mem_limit = p
    assert kinds(one_p) == ZB_H1 and one_p.options["cost"] == 27
    two_p = checked("zb-auto", 4, 8, mem_limit=8, mw=mw)
    assert kinds(two_p) == ZB_2P and two_p.options["cost"] == 24


def test_zb_auto_micro_batches_in_order_per_kind():
    schedule = checked("zb-auto", 5, 11, t_f=1.0, t_b=2.0, t_w=0.7, t_comm=0.3)
    for rank_ops in schedule.ops:
        for kind in (OpKind.F, OpKind.B, OpKind.W):
            assert [op.microbatch for op in rank_ops if op.kind is kind] == list(range(11))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (6, 12), (8, 20)])
def test_zb_auto_more_memory_never_costs_more(p, m):
    costs = [checked("zb-auto", p, m, mem_limit=limit).options["cost"] for limit in (p, 1.5 * p, 2 * p, 3 * p)]
    assert costs == sorted(costs, reverse=True)
    assert costs[0] == registry.build("zb-auto", p, m).options["cost"]  # the default limit is p


def test_zb_auto_per_stage_times():
    schedule = checked("zb-auto", 3, 6, t_f=[1, 2, 1], t_b=[1, 1, 3], t_w=0.5)
    assert schedule.options["cost"] > 0


def test_one_f_one_b_warmup():
    # Rank r runs p-1-r forwards before its first backward.
    schedule = checked("1f1b", 4, 8)
    for r in range(4):
        assert schedule.kinds_string(r).replace("BW", "B").index("B") == 4 - r


def test_interleaved_op_order_and_stages():
    schedule = checked("interleaved-1f1b", 2, 4, stages_per_rank=2)
    assert schedule.placement.stages_of(0) == (0, 2) and schedule.placement.stages_of(1) == (1, 3)
    # Rank 0: warm-up 2(p-1-r) + (v-1)p = 4 forwards: micro-batches 0,1 on stage 0, then on stage 2.
    assert [str(op) for op in schedule.ops[0][:5]] == ["0F0", "0F1", "2F0", "2F1", "0F2"]
    assert registry.placement_for("interleaved-1f1b", 4, stages_per_rank=3).num_stages == 12


@pytest.mark.parametrize("v", [1, 2, 3, 4])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_interleaved_every_multiple_of_p(p, v):
    for m in (p, 2 * p, 3 * p):
        checked("interleaved-1f1b", p, m, stages_per_rank=v)


def test_zbv_layout():
    schedule = checked("zbv", 4, 8)
    assert [schedule.placement.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert str(schedule.ops[0][0]) == "0F0"


# Chimera, D = 4, N = 4 (one basic unit): micro-batches 0, 1 go down (stages 0-3 on ranks 0-3),
# 2, 3 up (stages 4-7 on ranks 3-0); slot of F on chain position k: 2i + k, of BW: 2i + 7 - k.
CHIMERA_4 = [
    "0F0 0F1 7F2 7BW2 7F3 7BW3 0BW0 0BW1",
    "1F0 6F2 1F1 6F3 6BW2 1BW0 6BW3 1BW1",
    "5F2 2F0 5F3 2F1 2BW0 5BW2 2BW1 5BW3",
    "4F2 4F3 3F0 3BW0 3F1 3BW1 4BW2 4BW3",
]


def test_chimera_basic_unit_op_order():
    schedule = checked("chimera", 4, 4)
    assert [" ".join(ops) for ops in schedule.to_strings()] == CHIMERA_4
    assert [schedule.placement.stages_of(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


# Chimera with two pairs, D = 4, N = 4: chain 2i goes down from rank 2i, chain 2i+1 up from rank
# 2i-1 (mod 4); one micro-batch per chain, F on chain position k in slot k and BW in slot 7 - k.
CHIMERA_4_PAIRS_2 = [
    "0F0 13F3 10F2 7F1 7BW1 10BW2 13BW3 0BW0",
    "12F3 1F0 6F1 11F2 11BW2 6BW1 1BW0 12BW3",
    "8F2 5F1 2F0 15F3 15BW3 2BW0 5BW1 8BW2",
    "4F1 9F2 14F3 3F0 3BW0 14BW3 9BW2 4BW1",
]


def test_chimera_two_pairs_op_order():
    schedule = checked("chimera", 4, 4, pairs=2)
    assert [" ".join(ops) for ops in schedule.to_strings()] == CHIMERA_4_PAIRS_2
    assert [schedule.placement.stages_of(r) for r in range(4)] == [(0, 7, 10, 13), (1, 6, 11, 12), (2, 5, 8, 15), (3, 4, 9, 14)]
    assert registry.placement_for("chimera", 4, pairs=2) == schedule.placement
    assert registry.placement_for("chimera", 4, pairs=1) == registry.placement_for("chimera", 4) == checked("chimera", 4, 4).placement


@pytest.mark.parametrize("p", [2, 4, 6, 8, 12])
def test_chimera_every_allowed_pair_count_is_valid(p):
    # Each micro-batch's F and BW on every stage of its chain exactly once, in a deadlock-free order.
    for pairs in range(1, p // 2 + 1):
        if p % (2 * pairs):
            assert not accepts("chimera", p, 2 * p, pairs=pairs)
            continue
        for m in (2 * pairs, 4 * pairs, p, 3 * p, 2 * p + 2 * pairs):
            schedule = checked("chimera", p, m, pairs=pairs)
            assert len(schedule.placement.chains) == 2 * pairs and schedule.num_microbatches == m


def test_bitpipe_unit_matches_the_paper_figure():
    # arXiv 2410.19367, D = 4: worker 0 runs F1c0 F2c0 F3c3 F3c4 F4c3 F4c4 F1c7 B1c7 F2c7 B2c7
    # B3c4 B3c3 B4c4 B4c3 B1c0 B2c0 (micro-batches 1-4, chunks of each direction's V).
    schedule = checked("bitpipe", 4, 4)
    placement = schedule.placement
    assert [placement.stages_of(r) for r in range(4)] == [(0, 7, 11, 12), (1, 6, 10, 13), (2, 5, 9, 14), (3, 4, 8, 15)]

    def paper(op):
        return f"{'F' if op.kind is OpKind.F else 'B'}{op.microbatch + 1}c{placement.stage_chain_position(op.stage)}"

    assert " ".join(map(paper, schedule.ops[0])) == (
        "F1c0 F2c0 F3c3 F3c4 F4c3 F4c4 F1c7 B1c7 F2c7 B2c7 B3c4 B3c3 B4c4 B4c3 B1c0 B2c0"
    )


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 14),
    t_f=st.sampled_from([0.5, 1.0, 1.7]),
    t_b=st.sampled_from([0.5, 1.0, 2.0]),
    t_w=st.sampled_from([0.3, 1.0, 1.5]),
    t_comm=st.sampled_from([0.0, 0.2, 1.0]),
    mw=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_cost_driven_generators_are_valid_for_any_costs(p, m, t_f, t_b, t_w, t_comm, mw):
    costs = dict(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, mw=mw)
    checked("zb-auto", p, m, **costs)
    checked("zb-auto", p, m, mem_limit=2 * p, **costs)
    checked("zbv", p, m, **costs)
    checked("zbv", p, m, mem_limit=p + 2, **costs)


# --- bad input ------------------------------------------------------------------------------

BAD = [
    ("gpipe", 0, 4, {}, r"gpipe: num_ranks=0: must be >= 1"),
    ("1f1b", 4, 0, {}, r"1f1b: num_microbatches=0: must be >= 1"),
    ("1f1b", 4.0, 8, {}, r"num_ranks=4.0: must be an int >= 1"),
    ("zb-h1", True, 8, {}, r"num_ranks=True: must be an int >= 1"),
    ("zb-h2", 2, -3, {}, r"num_microbatches=-3"),
    ("interleaved-1f1b", 4, 6, {}, r"num_microbatches=6: must be >= 4 and a multiple of 4$"),
    ("interleaved-1f1b", 4, 8, {"stages_per_rank": 0}, r"stages_per_rank=0: must be >= 1"),
    ("zb-auto", 4, 8, {"mem_limit": 0.5}, r"mem_limit=0.5: must be >= max\(1, mw\) = 1 on every rank"),
    ("zb-auto", 4, 8, {"mem_limit": 1.5, "mw": 2.0}, r"mem_limit=1.5: must be >= .* = 2"),
    ("zb-auto", 4, 8, {"t_f": -1}, r"zb-auto: t_f=-1: must be a finite number > 0$"),
    ("zb-auto", 4, 8, {"t_b": [1, 2]}, r"zb-auto: t_b=\[1, 2\]: must be one number or 4"),
    ("zb-auto", 4, 8, {"t_comm": -0.5}, r"t_comm=-0.5: must be a finite number >= 0"),
    ("zbv", 4, 8, {"mem_limit": 1}, r"zbv: mem_limit=1: must be >= 1 \+ max\(1, mw\) = 2"),
    ("zbv", 4, 8, {"t_w": 0}, r"zbv: t_w=0: must be a finite number > 0$"),
    ("chimera", 3, 6, {}, r"chimera: num_ranks=3: must be >= 2 and even$"),
    ("chimera", 4, 5, {}, r"chimera: num_microbatches=5: must be >= 2 and even$"),
    ("chimera", 8, 8, {"pairs": 3}, r"chimera: pairs=3: must be an int >= 1 with 2\*pairs dividing "
                                    r"num_ranks=8 \(here: 1, 2, 4\)$"),
    ("chimera", 6, 6, {"pairs": 2}, r"chimera: pairs=2: must be .* num_ranks=6 \(here: 1, 3\)$"),
    ("chimera", 4, 8, {"pairs": 0}, r"chimera: pairs=0: must be an int >= 1 .* num_ranks=4"),
    ("chimera", 4, 8, {"pairs": True}, r"chimera: pairs=True: must be an int"),
    ("chimera", 4, 8, {"pairs": 2.0}, r"chimera: pairs=2.0: must be an int"),
    ("chimera", 4, 6, {"pairs": 2}, r"chimera: num_microbatches=6: must be >= 4 and a multiple of 4 \(2\*pairs for pairs=2"),
    ("chimera", 3, 6, {"pairs": 2}, r"chimera: num_ranks=3: must be >= 2 and even$"),
    ("bitpipe", 1, 2, {}, r"bitpipe: num_ranks=1: must be >= 2 and even$"),
    ("bitpipe", 2, 3, {}, r"bitpipe: num_microbatches=3: must be >= 2 and even$"),
]


@pytest.mark.parametrize("name,p,m,options,message", BAD)
def test_bad_input_names_argument_value_and_allowed(name, p, m, options, message):
    with pytest.raises(ValueError, match=message):
        registry.build(name, p, m, **options)


@pytest.mark.parametrize(
    "name,options,allowed",
    [
        ("1f1b", {"mem_limit": 4}, "1f1b takes overlap, warmup_extra"),
        ("dualpipev", {"mem_limit": 4}, "dualpipev takes no options"),
        ("dualpipe", {"stages_per_rank": 2}, "dualpipe takes no options"),
        ("zbv", {"mem_limt": 9}, "zbv takes mem_limit, t_f, t_b, t_w, t_comm, mw, overlap, warmup_extra"),
        ("interleaved", {"stages": 2}, "interleaved-1f1b takes stages_per_rank, overlap, warmup_extra"),
        ("chimera", {"pair": 2}, "chimera takes pairs"),
    ],
)
def test_unknown_option_is_refused_the_same_way_by_every_schedule(name, options, allowed):
    (key, value), = options.items()
    for call in (lambda: registry.build(name, 4, 8, **options), lambda: registry.placement_for(name, 4, **options)):
        with pytest.raises(ValueError, match=rf"option {key}={value!r}: unknown; {allowed}$"):
            call()


@pytest.mark.parametrize("name", ALL)
def test_a_bool_is_not_a_count(name):
    with pytest.raises(ValueError, match=r"num_microbatches=True: must be an int"):
        registry.build(name, 2, True)
    with pytest.raises(ValueError, match=r"num_ranks=True: must be an int"):
        registry.build(name, True, 4)
    with pytest.raises(ValueError, match=r"num_ranks=True"):
        registry.placement_for(name, True)


@pytest.mark.parametrize(
    "name,p,m,message",
    [
        ("dualpipev", 4, 10**5, r"num_microbatches=100000: must be >= 1 and <= 16384"),
        ("1f1b", 10**6, 8, r"num_ranks=1000000: must be >= 1 and <= 1024"),
        ("dualpipe", 64, 2048, r"128 stages x num_microbatches=2048 = 262144 .* at most 131072"),
    ],
)
def test_absurd_sizes_fail_fast(name, p, m, message):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        registry.build(name, p, m)
    assert time.perf_counter() - start < 0.5


def test_limits_doc_states_the_limits_in_the_code():
    from twinpipe.schedule import limits

    text = (DOCS / "limits.md").read_text()
    for name in ("MAX_RANKS", "MAX_MICROBATCHES", "MAX_STAGE_MICROBATCHES", "MAX_PLANNED_STAGE_MICROBATCHES"):
        stated = re.search(rf"(\d[\d,]*) \(`{name}`\)", text)
        assert stated and int(stated.group(1).replace(",", "")) == getattr(limits, name), name


def test_the_registry_is_an_explicit_table():
    # No import side effects: the table lists every built-in, and generator modules do not know the registry
    # (only the registry, its client spec.py, the resolver, and the package's public face do).
    assert [info.name for info in registry.BUILTIN] == registry.names()[: len(registry.BUILTIN)]
    for path in (Path(__file__).resolve().parents[1] / "src" / "twinpipe" / "schedule").glob("*.py"):
        if path.name not in ("registry.py", "spec.py", "__init__.py"):
            assert not re.search(r"import .*registry|from twinpipe.schedule.registry", path.read_text()), path.name


def test_importing_schedule_and_sim_does_not_import_torch():
    code = (
        "import sys, twinpipe.schedule.registry as r, twinpipe.sim, twinpipe.sim.cli;"
        "r.build('zb-auto', 4, 8); r.build('dualpipev', 2, 4);"
        "assert 'torch' not in sys.modules, 'torch was imported'; assert 'rich' not in sys.modules"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    result = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": src}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- the example in docs/adding-a-schedule.md ----------------------------------------------


@pytest.fixture
def scratch_registry(monkeypatch):
    """Let a test register schedules without leaving them behind."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_ALIASES", dict(registry._ALIASES))


def test_adding_a_schedule_doc_example_runs_as_written(scratch_registry, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "adding-a-schedule.md").read_text(), re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, "adding-a-schedule.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "30.0 0.2 (8.0, 8.0, 8.0, 8.0)"
    for p, m in GRID:
        checked("gpipe-split", p, m)
    with pytest.raises(ValueError, match="num_ranks=0"):
        registry.build("gpipe-split", 0, 4)


def test_all_lists_every_registered_schedule():
    assert set(ALL) == set(registry.names())
