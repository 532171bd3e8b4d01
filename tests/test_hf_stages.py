"""twinpipe.hf: transformers causal LMs cut into stages, exact against the unsplit model.

Every case builds a tiny float64 model (tests/hf_models.py) on each rank from the same seed, runs
training steps through ``Pipeline`` and compares with the unsplit model called on each micro-batch
with ``num_items_in_batch`` (the whole batch's token count): losses bitwise, gradients within 1e-13
(the official metric, tests/models.py). One 4-rank world runs every case.
"""

from __future__ import annotations

import copy
import hashlib
import itertools

import pytest

pytest.importorskip("transformers", reason="twinpipe.hf needs transformers (pip install twinpipe[hf])")

import torch  # noqa: E402

import hf_models  # noqa: E402
from distributed import run_world  # noqa: E402
from models import grad_error  # noqa: E402
from twinpipe import batch_layout, hf  # noqa: E402
from twinpipe.hf.layout import format_layout, parse_layout  # noqa: E402

TOL = 1e-13
ARCHS = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
SCHEDULES = ("dualpipev", "dualpipe", "1f1b", "zb-h1", "interleaved-1f1b")


def _case(arch, schedule, ranks, *, tied=False, aux=None, rotary="recompute", layout=None, seqs=(8,), chunks=4,
          padded=True, parts=False):
    aux = arch in ("mixtral", "qwen3_moe") if aux is None else aux
    layers = 6 if ranks == 4 and schedule in ("dualpipev", "interleaved-1f1b") else 2  # >= 1 item per stage
    return dict(arch=arch, schedule=schedule, ranks=ranks, tied=tied, aux=aux, rotary=rotary, layout=layout, seqs=seqs,
                chunks=chunks, padded=padded, layers=layers, parts=parts)


CASES = {}
for i, (arch, schedule, ranks) in enumerate(itertools.product(ARCHS, SCHEDULES, (2, 4))):
    # Every other case passes the rotary tables instead of recomputing them; some change the sequence length.
    CASES[f"{arch}-{schedule}-p{ranks}"] = _case(arch, schedule, ranks, rotary=("recompute", "pass")[i % 2],
                                                 seqs=(8, 5) if i % 5 == 0 else (8,))
# Tied embeddings: one parameter on the rank holding both ends (V), else two copies summed by sync_tied_grads.
for schedule, ranks in (("dualpipev", 4), ("dualpipe", 2), ("1f1b", 4), ("zb-h1", 2), ("interleaved-1f1b", 2)):
    CASES[f"llama-tied-{schedule}-p{ranks}"] = _case("llama", schedule, ranks, tied=True, seqs=(8, 6) if ranks == 4 else (8,))
CASES["mixtral-noaux-1f1b-p2"] = _case("mixtral", "1f1b", 2, aux=False)
CASES["llama-layout-1f1b-p2"] = _case("llama", "1f1b", 2, layout="E|t*2,L")
CASES["llama-unpadded-1f1b-p2"] = _case("llama", "1f1b", 2, padded=False)
# Layers declaring parts (the convention MoE layers with expert parallelism follow): F&B ops overlap them.
CASES["llama-parts-dualpipev-p2"] = _case("llama", "dualpipev", 2, parts=True)
CASES["mixtral-parts-dualpipe-p4"] = _case("mixtral", "dualpipe", 4, parts=True, rotary="pass", aux=False)
CASES["deepseek_v3-layout-dualpipe-p2"] = _case("deepseek_v3", "dualpipe", 2, layout="E,t*2|L", chunks=2)


_MODELS: dict = {}


def _model(case: dict):
    """A fresh copy of the case's model (built once per process: copying is cheaper than initialising)."""
    key = (case["arch"], case["tied"], case["aux"], case["layers"])
    if key not in _MODELS:
        _MODELS[key] = hf_models.model(case["arch"], tied=case["tied"], aux=case["aux"], layers=case["layers"])
    return copy.deepcopy(_MODELS[key])


def _ref_key(case: dict) -> tuple:
    return tuple(case[k] for k in ("arch", "tied", "aux", "layers", "seqs", "chunks", "padded"))


def _reference(case: dict) -> list:
    """Per step: the unsplit model on each micro-batch (the loss over the whole batch's tokens), its
    gradients by name, and the whole batch's loss in one call."""
    ref, n, steps = _model(case), case["chunks"], []
    for step, seq in enumerate(case["seqs"]):
        ids, mask, labels = hf_models.batch(n, seq, seed=step + 1, padded=case["padded"])
        count = torch.tensor(hf.count_items(labels))
        losses = []
        for rows in torch.tensor_split(torch.arange(n), n):
            out = ref(input_ids=ids[rows], attention_mask=mask[rows] if case["padded"] else None, labels=labels[rows],
                      num_items_in_batch=count)
            out.loss.backward()
            losses.append(out.loss.detach())
        grads = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for name, p in ref.named_parameters(remove_duplicate=False)}
        with torch.no_grad():
            whole = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        steps.append((losses, grads, whole))
        ref.zero_grad(set_to_none=True)
    return steps


def _run(case: dict, reference: list, group) -> str:
    import torch.distributed as dist

    rank = dist.get_rank(group)
    stages = hf.build(_model(case), case["schedule"], case["ranks"], rank, layout=case["layout"], rotary=case["rotary"],
                      wrap_layer=hf_models.parted if case["parts"] else None)
    problems = []
    holds_layers = any(m.layer_ids for m in stages.modules)
    if case["parts"] and holds_layers and not all(isinstance(m, hf.HFPartedStage) for m in stages.modules):
        problems.append(f"stages {[type(m).__name__ for m in stages.modules]} are not HFPartedStage")
    if case["tied"]:
        expected_tie = "shared" if case["schedule"] == "dualpipev" else "split"
        if stages.tie != expected_tie:
            problems.append(f"tie {stages.tie!r} != {expected_tie!r}")
    n = case["chunks"]
    with stages.pipeline(group, timeout=60) as pipe:
        for step, seq in enumerate(case["seqs"]):
            ids, mask, labels = hf_models.batch(n, seq, seed=step + 1, padded=case["padded"])
            inputs, labs = stages.batch(ids, mask if case["padded"] else None, labels, num_chunks=n)
            loss, _ = pipe.step(*inputs, num_chunks=n, criterion=stages.criterion, labels=labs)
            stages.sync_grads(pipe)
            ref_losses, ref_grads, whole = reference[step]
            layout = batch_layout(stages.spec, case["ranks"], rank, n)
            if loss is not None:
                expected = torch.stack([ref_losses[j] for j in layout.label_microbatches])
                if not torch.equal(loss, expected):
                    problems.append(f"step {step}: losses {loss.tolist()} != reference {expected.tolist()}")
                if len(layout.label_microbatches) == n and not case["aux"]:  # the sum is the whole batch's mean loss
                    if not torch.allclose(loss.sum(), whole, rtol=1e-6, atol=0):
                        problems.append(f"step {step}: summed loss {loss.sum().item()} != whole-batch loss {whole.item()}")
            for module in stages.modules:
                for name, p in module.named_model_parameters():
                    err = grad_error(p.grad if p.grad is not None else torch.zeros_like(p), ref_grads[name])
                    if not err <= TOL:
                        problems.append(f"step {step} {name}: gradient error {err:.3g}")
            if case["tied"]:
                problems += _tied_copies_differ(stages, group)
            for m in stages.modules:
                m.zero_grad(set_to_none=True)
        if len(case["seqs"]) > 1:  # forward only (evaluation) on the last batch: the same losses
            with torch.no_grad():
                loss, _ = pipe.step(*inputs, num_chunks=n, criterion=stages.criterion, labels=labs)
            if loss is not None and not torch.equal(loss, expected):
                problems.append(f"forward-only losses {loss.tolist()} != reference {expected.tolist()}")
    has_fb = any(op.kind.value == "FB" for op in stages.spec.build(n).ops[rank])
    if case["parts"] and holds_layers and has_fb and not any(m.fb_events for m in stages.modules):
        problems.append("no F&B op overlapped the parts")
    return "; ".join(problems[:6]) or "ok"


def _tied_copies_differ(stages, group) -> list[str]:
    """Every copy of the tied weight, on every rank, holds the same gradient bits."""
    import torch.distributed as dist

    digests = {hashlib.sha256(p.grad.numpy().tobytes()).hexdigest() for key in ("embed", "head")
               for _, _, p in stages._ends.get(key, [])}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digests, group=group)
    merged = set().union(*everyone)
    return [] if len(merged) == 1 else [f"tied weight copies differ: {len(merged)} different gradients"]


def shared_references(rank: int, world: int, cases) -> dict:
    """Each distinct case's ``_reference``, by ``_ref_key``: the i-th computed by rank ``i % world`` alone,
    then every rank gets them all (computed in the parent, one process did all of them while the other
    core idled)."""
    import torch.distributed as dist

    distinct = {}
    for case in cases:
        distinct.setdefault(_ref_key(case), case)
    mine = {key: _reference(case) for i, (key, case) in enumerate(distinct.items()) if i % world == rank}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {key: value for part in everyone for key, value in part.items()}


def _world(rank, world, names):
    """Like distributed.run_cases, with one group per size for all cases (fewer groups to build)."""
    import torch.distributed as dist

    references = shared_references(rank, world, [CASES[name] for name in names if name in CASES])
    groups = {size: dist.new_group(list(range(size))) for size in (2, 4)}
    results = {}
    for name in names:
        case = CASES.get(name)
        if case is None:
            continue
        if rank < case["ranks"]:
            torch.manual_seed(0)
            try:
                results[name] = _run(case, references[_ref_key(case)], groups[case["ranks"]])
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    if TIME_BALANCE in names:
        results[TIME_BALANCE] = _time_balance_agrees(groups[4])
    if PP_EP in names:
        # pipelines over ranks {0, 1} and {2, 3}, expert parallelism over {0, 2} and {1, 3}
        pp_groups, ep_groups = [groups[2], dist.new_group([2, 3])], [dist.new_group([0, 2]), dist.new_group([1, 3])]
        try:
            results[PP_EP] = _pp_ep_case(pp_groups[rank // 2], ep_groups[rank % 2])
        except Exception as exc:
            results[PP_EP] = f"{type(exc).__name__}: {exc}"
    if LAYOUTS_DIFFER in names and rank < 2:
        results[LAYOUTS_DIFFER] = _layouts_differ(groups[2])
    return results


LAYOUTS_DIFFER = "layouts-differ-p2"


def _layouts_differ(group) -> str:
    """Ranks that cut the model differently raise, all of them, when the pipeline is made."""
    import torch.distributed as dist

    from twinpipe.runtime.errors import PipelineMismatchError

    rank = dist.get_rank(group)
    stages = hf.build(hf_models.model("llama", layers=2), "1f1b", 2, rank, layout=("E,t|t,L", "E|t*2,L")[rank])
    try:
        stages.pipeline(group, timeout=60)
    except PipelineMismatchError as exc:
        want = "ranks built different twinpipe.hf stages: rank 0 {"
        return "ok" if str(exc).startswith(want) and "'layout': 'E|t*2,L'" in str(exc) else f"wrong message: {exc}"
    return "no error"


TIME_BALANCE = "balance-time-p4"


def _time_balance_agrees(group) -> str:
    """balance='time': the group's first rank measures, every rank cuts by its times (all alike)."""
    import torch.distributed as dist

    import twinpipe.hf.stages as hf_stages

    model = hf_models.model("llama", layers=4)
    stages = hf.build(model, "1f1b", 4, dist.get_rank(group), balance="time", sample=torch.randint(0, 64, (2, 8)),
                      process_group=group)
    layouts = [None] * 4
    dist.all_gather_object(layouts, stages.layout, group=group)
    if len(set(layouts)) != 1:
        return f"layouts differ: {layouts}"
    # Each rank "measures" different times (as real ranks may): every rank must cut by the first rank's.
    rank = dist.get_rank(group)
    measured = hf_stages.time_weights
    hf_stages.time_weights = lambda items, sample, **_: [1.0 + 10 * (i == rank) for i in range(len(items))]
    try:
        stages = hf.build(model, "1f1b", 4, rank, balance="time", sample=torch.randint(0, 64, (2, 8)), process_group=group)
    finally:
        hf_stages.time_weights = measured
    first = format_layout(hf.balanced_layout([1.0 + 10 * (i == 0) for i in range(6)], 4))
    return "ok" if stages.layout == first else f"cut {stages.layout}, not the first rank's {first}"


PP_EP = "qwen3_moe-aux-ep2-dualpipev-p2"


def _pp_ep_case(pp_group, ep_group) -> str:
    """PP=2 x EP=2 on the 4 ranks: DualPipeV over each pipeline pair, Qwen3-MoE (4 layers, 1 and 3
    MoE) with the router auxiliary loss, its experts sharded over each EP pair, the MoE layers in
    parts (F&B ops overlap their all-to-alls); each EP rank trains its own batch. Losses and every
    gradient (dense ones summed over the EP pair, experts' assembled from both) within EP_BOUND of
    the unsplit model's on the two batches (expert parallelism reorders sums: tests/hf_models.py)."""
    import torch.distributed as dist

    from twinpipe.hf.experts import shard_experts_
    from twinpipe.hf.moe_layer import MoEDecoderLayer, wrap_layer
    from twinpipe.moe import reduce_dense_grads, reduce_replica_grads

    pp_rank, chunks, problems = dist.get_rank(pp_group), 4, []
    base = hf_models.model("qwen3_moe", layers=4, aux=True)
    ids, mask, labels = hf_models.batch(chunks, 8, seed=1 + dist.get_rank(ep_group))
    count = torch.tensor(hf.count_items(labels))
    ref, ref_losses = copy.deepcopy(base), []
    for j in range(chunks):
        out = ref(input_ids=ids[j : j + 1], attention_mask=mask[j : j + 1], labels=labels[j : j + 1], num_items_in_batch=count)
        out.loss.backward()
        ref_losses.append(out.loss.detach())
    model = shard_experts_(copy.deepcopy(base), ep_group)
    stages = hf.build(model, "dualpipev", 2, pp_rank, layout="E,t|t|t|t,L", wrap_layer=wrap_layer)
    moe = sum(isinstance(layer, MoEDecoderLayer) for m in stages.modules for layer in m.modules())
    if moe != 1 or not all(isinstance(m, hf.HFPartedStage) for m in stages.modules):
        problems.append(f"stages {[type(m).__name__ for m in stages.modules]} with {moe} MoE layers in parts")
    inputs, labs = stages.batch(ids, mask, labels, num_chunks=chunks)
    with stages.pipeline(pp_group, timeout=60) as pipe:
        loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=stages.criterion, labels=labs)
        stages.sync_grads(pipe)
    events = [e for m in stages.modules for e in m.fb_events]
    if not any({stream for action, stream, *_ in e if action == "start"} for e in events):
        problems.append(f"{len(events)} F&B ops, none with an all-to-all")
    if loss is not None:
        want = torch.stack([ref_losses[j] for j in batch_layout(stages.spec, 2, pp_rank, chunks).label_microbatches])
        if not hf_models.rel(loss, want) <= hf_models.EP_BOUND:
            problems.append(f"losses off by {hf_models.rel(loss, want):.3g}")
    for module in stages.modules:
        reduce_dense_grads(module, ep_group)
        reduce_replica_grads(module)
    ref_params = dict(ref.named_parameters())

    def summed(t):
        dist.all_reduce(t, group=ep_group)
        return t

    for module in stages.modules:  # the EP pair holds the same stages: the same all-reduces in the same order
        for name, p in module.named_model_parameters():
            want = summed(ref_params[name].grad.clone() if ref_params[name].grad is not None else torch.zeros_like(ref_params[name]))
            if ".experts." in name:
                got = hf_models.full_expert_grads(model.get_submodule(name.rsplit(".experts.", 1)[0]), name.rsplit(".", 1)[1], summed)
            else:
                got = p.grad if p.grad is not None else torch.zeros_like(p)
            if not hf_models.rel(got, want) <= hf_models.EP_BOUND:
                problems.append(f"{name} gradient off by {hf_models.rel(got, want):.3g}")
    return "; ".join(problems[:6]) or "ok"


def run_all(names) -> list:
    """Each case's outcome per rank (the references computed once, in the world: ``shared_references``)."""
    return run_world(4, _world, list(names), timeout=600)


@pytest.fixture(scope="module")
def outcomes():
    return run_all([*CASES, TIME_BALANCE, LAYOUTS_DIFFER, PP_EP])


@pytest.mark.parametrize("name", list(CASES))
def test_exact_against_unsplit_model(outcomes, name):
    ranks = CASES[name]["ranks"]
    results = {r: outcomes[r][name] for r in range(ranks)}
    assert all(v == "ok" for v in results.values()), results


def test_balance_by_time_cuts_alike_on_every_rank(outcomes):
    assert {r: outcomes[r][TIME_BALANCE] for r in range(4)} == {r: "ok" for r in range(4)}


def test_pp2_by_ep2_dualpipev_with_the_aux_loss_matches_the_unsplit_model(outcomes):
    assert {r: outcomes[r][PP_EP] for r in range(4)} == {r: "ok" for r in range(4)}


def test_ranks_with_different_layouts_raise(outcomes):
    assert {r: outcomes[r][LAYOUTS_DIFFER] for r in range(2)} == {0: "ok", 1: "ok"}


# ---------------------------------------------------------------------------------------- layouts
def test_layout_parses_megatron_style():
    assert parse_layout("E,t*3|t*4|t*4|t*3,L", 4, 14) == [["E", "t", "t", "t"], ["t"] * 4, ["t"] * 4, ["t", "t", "t", "L"]]
    assert parse_layout(" E | t*2 | L ", 3, 2) == [["E"], ["t", "t"], ["L"]]
    assert format_layout(parse_layout("E,t*3|t*4|t*4|t*3,L", 4, 14)) == "E,t*3|t*4|t*4|t*3,L"


@pytest.mark.parametrize("layout, why", [
    ("E,t*3|t*3,L", "it has 2 stage(s)"),
    ("E,t*3|t*4|t*4|t*2,L", "it has 13 t"),
    ("t,E,t*2|t*4|t*4|t*3,L", "E must appear once, as the first item"),
    ("E,t*3|t*4|t*4|L,t*3", "L must appear once, as the last item"),
    ("E,t*3||t*8|t*3,L", "stage 1 is empty"),
    ("E,x*3|t*4|t*4|t*3,L", "stage 0 has 'x*3'"),
    ("E,t*0|t*7|t*4|t*3,L", "stage 0 repeats t 0 times"),
    (14, "it is not a str"),
])
def test_layout_errors_say_what_it_must_be(layout, why):
    with pytest.raises(ValueError) as info:
        parse_layout(layout, 4, 14)
    message = str(info.value)
    assert message.startswith(f"layout={layout!r}: must be 4 stage(s) separated by '|'"), message
    assert why in message, message


def test_build_checks_the_layout_against_the_schedule():
    model = hf_models.model("llama", layers=2)
    with pytest.raises(ValueError, match=r"layout='E,t\|t,L': must be 4 stage\(s\).*it has 2 stage\(s\)"):
        hf.build(model, "dualpipev", 2, 0, layout="E,t|t,L")


def test_balance_counts_the_embedding_and_the_head():
    model = hf_models.model("llama", layers=6)
    # The embedding and the head (64 x 16 each) weigh about as much as a layer: each gets a stage of its own.
    stages = hf.build(model, "dualpipev", 4, 0)
    assert stages.layout == "E|t|t|t|t|t|t|L"
    assert hf.build(hf_models.model("llama", layers=6), "1f1b", 2, 0).layout == "E,t*3|t*3,L"
    with pytest.raises(ValueError, match="balance='memory': allowed are 'params', 'time'"):
        hf.build(hf_models.model("llama", layers=2), "1f1b", 2, 0, balance="memory")
    with pytest.raises(ValueError, match="num_stages=8: must be at most 4"):
        hf.build(hf_models.model("llama", layers=2), "dualpipev", 4, 0)


def test_balance_by_time_measures_each_item():
    model = hf_models.model("llama", layers=4)
    stages = hf.build(model, "1f1b", 2, 1, balance="time", sample=torch.randint(0, 64, (2, 8)))
    assert stages.layout.count("|") == 1 and stages.layout.count("t") >= 1
    assert all(p.grad is None for p in model.parameters())  # the measurement leaves no gradients
    with pytest.raises(ValueError, match=r"sample='NoneType': balance='time' measures each item"):
        hf.build(model, "1f1b", 2, 1, balance="time")


# ------------------------------------------------------------------------------ what is refused
def test_unsupported_models_get_a_clear_error():
    import transformers as tf

    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    with pytest.raises(hf.UnsupportedModelError, match="is an encoder-decoder"):
        hf.build(t5, "1f1b", 2, 0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=8, n_layer=2, n_head=2))
    with pytest.raises(hf.UnsupportedModelError, match=r"model=GPT2LMHeadModel: has no model, lm_head|has no model\b"):
        hf.build(gpt2, "1f1b", 2, 0)
    with pytest.raises(hf.UnsupportedModelError, match="must be a transformers causal LM"):
        hf.build(torch.nn.Linear(2, 2), "1f1b", 2, 0)
    import twinpipe

    assert issubclass(hf.UnsupportedModelError, twinpipe.PipelineError)


def test_batch_counts_tokens_of_the_whole_batch():
    stages = hf.build(hf_models.model("llama", layers=2), "dualpipe", 2, 0)
    ids, mask, labels = hf_models.batch(4, 8)
    inputs, labs = stages.batch(ids, mask, labels, num_chunks=2)
    # DualPipe: rank 0 passes the inputs of the first half and the labels of the second half.
    assert torch.equal(inputs[0], ids[:2]) and torch.equal(labs[0], labels[2:])
    assert labs[1].tolist() == [hf.count_items(labels)] * 2 == [int((labels[:, 1:] != -100).sum())] * 2
    assert stages.batch(ids, mask, labels, num_chunks=2, num_items=7)[1][1].tolist() == [7, 7]
    with pytest.raises(ValueError, match=r"attention_mask=\(4, 7\): must be a tensor of input_ids' shape \(4, 8\)"):
        stages.batch(ids, mask[:, :7], labels, num_chunks=2)
    with pytest.raises(ValueError, match="labels=.*must count at least one token"):
        stages.batch(ids, mask, torch.full_like(labels, -100), num_chunks=2)


def test_importing_twinpipe_or_twinpipe_hf_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, twinpipe, twinpipe.hf; print('transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def test_eager_attention_gives_nan_on_left_padded_rows_in_float64():
    """Why the tests (and docs/hf.md) use sdpa: the unsplit model itself, with eager attention."""
    import transformers as tf

    cfg = hf_models.config("llama", layers=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    ids, mask, _ = hf_models.batch(2, 8)
    assert mask[1, 0] == 0  # row 1 is left-padded
    eager = model(input_ids=ids, attention_mask=mask).logits
    assert eager[1].isnan().any() and not eager[0].isnan().any()
    model.config._attn_implementation = "sdpa"
    assert not model(input_ids=ids, attention_mask=mask).logits.isnan().any()


def test_wrap_layer_must_give_a_decoder_layer_and_parts_refuse_the_aux_loss():
    with pytest.raises(ValueError, match=r"wrap_layer=.*must return a twinpipe.hf.DecoderLayer .*it returned a Linear for layer 0"):
        hf.build(hf_models.model("llama", layers=2), "1f1b", 2, 0, wrap_layer=lambda layer: torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"wrap_layer=.*the router auxiliary loss is on.*output_router_logits=False"):
        hf.build(hf_models.model("mixtral", layers=2, aux=True), "1f1b", 2, 0, wrap_layer=hf_models.parted)
    stages = hf.build(hf_models.model("mixtral", layers=2), "1f1b", 2, 0, wrap_layer=hf_models.parted)
    assert [type(m).__name__ for m in stages.modules] == ["HFPartedStage"]


def test_a_stage_in_parts_without_a_router_hands_the_aux_sums_gradients_back():
    """The running sums of the router auxiliary loss through a stage in parts whose layers have no
    router (Qwen3-MoE's dense layer 0): the stage returns the sums it received, and their gradients
    come back as they are (the exit part hands them to the entry part's leaves)."""
    model = hf_models.model("qwen3_moe", layers=2, aux=True)
    first = hf.build(model, "1f1b", 3, 0, layout="E|t|t,L").modules[0]
    middle = hf.build(model, "1f1b", 3, 1, layout="E|t|t,L", wrap_layer=hf_models.parted).modules[0]
    assert isinstance(middle, hf.HFPartedStage) and middle.layer_ids == [0]
    ids, mask, _ = hf_models.batch(2, 8)
    flow = [t.detach().requires_grad_(t.is_floating_point()) for t in first(ids, mask)]
    out = middle(*flow)
    weights = [torch.rand_like(t) if t.is_floating_point() else None for t in out]
    sum((o * w).sum() for o, w in zip(out, weights) if w is not None).backward()
    assert [torch.equal(flow[k].grad, weights[k]) for k in (2, 3, 4)] == [True] * 3
    assert flow[0].grad is not None and flow[0].grad.abs().sum() > 0


def test_what_flows_between_stages():
    ids, mask, _ = hf_models.batch(2, 8)
    for rotary, extra in (("recompute", 0), ("pass", 2)):
        first = hf.build(hf_models.model("llama", layers=2), "1f1b", 2, 0, rotary=rotary).modules[0]
        out = first(ids, mask)
        assert len(out) == 2 + extra and out[0].shape == (2, 8, hf_models.HIDDEN) and out[1] is mask
        if extra:  # cos and sin, [1, S, head dim]
            assert [tuple(t.shape) for t in out[2:]] == [(1, 8, 4), (1, 8, 4)]
        last = hf.build(hf_models.model("llama", layers=2), "1f1b", 2, 1, rotary=rotary).modules[0]
        assert hasattr(last, "rotary_emb") == (rotary == "recompute")
        assert last(*out).shape == (2, 8, hf_models.VOCAB)
    # With the router auxiliary loss, three running sums follow: per expert, [E], [E], and the row count.
    first = hf.build(hf_models.model("mixtral", layers=2, aux=True), "1f1b", 2, 0).modules[0]
    sums = first(ids, mask)[2:]
    assert [tuple(t.shape) for t in sums] == [(4,), (4,), (1,)] and sums[2].item() == int(mask.sum())


@pytest.mark.parametrize("arch, window", [("qwen3", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
                                          ("mixtral", dict(sliding_window=3))])
def test_sliding_window_layers_get_the_models_own_masks(arch, window):
    """Qwen3 picks each layer's mask by config.layer_types, Mixtral slides every layer when
    sliding_window is set: stages cut anywhere give the unsplit model's logits, bit for bit."""
    model = hf_models.model(arch, layers=2)
    for key, value in window.items():
        setattr(model.config, key, value)
    if arch == "qwen3":
        model.config.layer_types = ["full_attention", "sliding_attention"]
        model.model.has_sliding_layers = True
    ids, mask, _ = hf_models.batch(3, 8)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        for ranks in (1, 3):  # one stage, and three cut at every layer
            out = (ids, mask)
            for rank in range(ranks):
                out = hf.build(model, "1f1b", ranks, rank, defer=False).modules[0](*out)
                out = out if isinstance(out, tuple) else (out,)
            assert torch.equal(out[0], want)
        full = hf.build(model, "1f1b", 1, 0, defer=False).modules[0]
        assert full.mask_kinds == (["full_attention", "sliding_attention"] if arch == "qwen3" else ["sliding_attention"])
