"""API promises beyond exactness: the official setters, batch_dim, uneven micro-batches,
rank_mapping, DualPipe's mirrored weights, and defer_weight_grads."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from distributed import run_cases, run_world

WORLD = 4


def _v_pipeline(group, world, seed=5, **kw):
    import twinpipe

    rank = dist.get_rank(group)
    model = models.make_model(models.MLPStage, 2 * world, seed=seed)
    mine = [copy.deepcopy(model[rank]), copy.deepcopy(model[2 * world - 1 - rank])]
    return model, twinpipe.DualPipeV(mine, process_group=group, **kw)


def _reference(model, xs, labels):
    losses = []
    for x, label in zip(xs, labels):
        out = x
        for stage in model:
            out = stage(out)
        loss = models.mse(out, label)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def case_official_setters(group):
    import twinpipe
    from twinpipe.runtime import comm

    twinpipe.set_p2p_tensor_shapes([(2, 3, models.HIDDEN)])
    twinpipe.set_p2p_tensor_dtype(torch.float64)
    try:
        model, pipe = _v_pipeline(group, 2)
        x = torch.randn(8, 3, models.HIDDEN, dtype=torch.float64)
        y = torch.randn_like(x)
        ref = _reference(model, torch.tensor_split(x, 4), torch.tensor_split(y, 4))
        if dist.get_rank(group) == 0:
            loss, _ = pipe.step(x, num_chunks=4, criterion=models.mse, labels=(y,))
            return torch.equal(loss, ref)
        pipe.step(num_chunks=4)
        return True
    finally:
        comm._SHAPES, comm._DTYPE = None, None


def case_batch_dim_and_uneven_chunks(group):
    model, pipe = _v_pipeline(group, 2, batch_dim=1)
    x = torch.randn(3, 9, models.HIDDEN, dtype=torch.float64)  # 9 rows along dim 1 into 4 micro-batches
    y = torch.randn_like(x)
    ref = _reference(model, torch.tensor_split(x, 4, dim=1), torch.tensor_split(y, 4, dim=1))
    if dist.get_rank(group) == 0:
        loss, out = pipe.step(x, num_chunks=4, criterion=models.mse, labels=(y,), return_outputs=True)
        return torch.equal(loss, ref) and out.shape == x.shape
    pipe.step(num_chunks=4)
    return True


def case_rank_mapping(group):
    import twinpipe

    # Pipeline rank = 1 - group rank: group rank 1 holds the first and last stage.
    group_rank = dist.get_rank(group)
    pp_rank = 1 - group_rank
    model = models.make_model(models.MLPStage, 4, seed=9)
    mine = [copy.deepcopy(model[pp_rank]), copy.deepcopy(model[3 - pp_rank])]
    pipe = twinpipe.DualPipeV(mine, process_group=group, rank_mapping=[1, 0])
    x = torch.randn(8, 3, models.HIDDEN, dtype=torch.float64)
    y = torch.randn_like(x)
    ref = _reference(model, torch.tensor_split(x, 4), torch.tensor_split(y, 4))
    if pp_rank == 0:
        loss, _ = pipe.step(x, num_chunks=4, criterion=models.mse, labels=(y,))
        return pipe.rank == 0 and torch.equal(loss, ref)
    loss, _ = pipe.step(num_chunks=4)
    return pipe.rank == 1 and loss is None


def case_mirrored_weights(group):
    import twinpipe

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(100 + rank)  # every rank starts with different weights on purpose
    pipe = twinpipe.DualPipe([models.MLPStage().double(), models.MLPStage().double()], process_group=group)
    pipe.sync_mirrored_weights()
    mine = torch.cat([p.detach().reshape(-1) for m in (pipe.module[1], pipe.module[0]) for p in m.parameters()])
    theirs = torch.empty_like(mine)
    peer = world - 1 - rank
    reqs = [dist.isend(mine, peer, group=group), dist.irecv(theirs, peer, group=group)]
    for r in reqs:
        r.wait()
    own_first = torch.cat([p.detach().reshape(-1) for m in (pipe.module[0], pipe.module[1]) for p in m.parameters()])
    return torch.equal(own_first, theirs)


def case_full_backward_sends_before_weight_grads(group):
    import twinpipe
    from twinpipe.runtime.transport import Transport

    rank = dist.get_rank(group)
    model = models.make_model(models.MLPStage, 2, seed=3)
    pipe = twinpipe.Pipeline([copy.deepcopy(model[rank])], "1f1b", process_group=group)
    events = []
    send, pop = Transport.send, pipe.store.pop

    def logged_send(self, msg, tensors):
        events.append(("send", msg.kind, msg.src_stage, msg.microbatch))
        send(self, msg, tensors)

    def logged_pop(key=None):
        events.append(("W", *key))
        pop(key)

    Transport.send, pipe.store.pop = logged_send, logged_pop
    try:
        x = torch.randn(8, 3, models.HIDDEN, dtype=torch.float64)
        y = torch.randn_like(x)
        ref = _reference(model, torch.tensor_split(x, 4), torch.tensor_split(y, 4))
        if rank == 0:
            pipe.step(x, num_chunks=4)
            return events.count(("send", "act", 0, 0)) == 1  # stage 0 has no input gradient to send
        loss, _ = pipe.step(num_chunks=4, criterion=models.mse, labels=(y,))
    finally:
        Transport.send = send
    # Stage 1's every BW: its input gradient leaves before its weight gradients are computed.
    order = [e for e in events if e[0] == "W" or e[1] == "grad"]
    expected = [e for j in range(4) for e in (("send", "grad", 1, j), ("W", 1, j))]
    return torch.equal(loss, ref) and (order == expected or order)


def _containers_case(group, make):
    """DualPipeV takes this rank's two stages in any of the official API's containers."""
    import twinpipe

    rank = dist.get_rank(group)
    model = models.make_model(models.MLPStage, 4, seed=9)
    pipe = twinpipe.DualPipeV(make(copy.deepcopy(model[rank]), copy.deepcopy(model[3 - rank])), process_group=group)
    x = torch.randn(8, 3, models.HIDDEN, dtype=torch.float64)
    y = torch.randn_like(x)
    ref = _reference(model, torch.tensor_split(x, 4), torch.tensor_split(y, 4))
    if rank == 0:
        loss, _ = pipe.step(x, num_chunks=4, criterion=models.mse, labels=(y,))
        if not torch.equal(loss, ref):
            return "loss differs"
    else:
        pipe.step(num_chunks=4)
    mine = [model[rank], model[3 - rank]]
    for got, want in zip(pipe.module, mine):
        for p, q in zip(got.parameters(), want.parameters()):
            if not models.grad_error(p.grad, q.grad) <= 1e-13:
                return "gradients differ"
    return True


def _as_tuple(a, b):
    return (a, b)


def _as_list(a, b):
    return [a, b]


def _as_module_list(a, b):
    return nn.ModuleList([a, b])


def _as_sequential(a, b):
    return nn.Sequential(a, b)


CONTAINERS = {"tuple": _as_tuple, "list": _as_list, "ModuleList": _as_module_list, "Sequential": _as_sequential}


def case_loss_is_a_view(group):
    """A criterion may return a one-element view (e.g. ``loss.view(1)`` or ``losses[0:1]``)."""
    model, pipe = _v_pipeline(group, 2, seed=4)
    x = torch.randn(8, 3, models.HIDDEN, dtype=torch.float64)
    y = torch.randn_like(x)
    ref = _reference(model, torch.tensor_split(x, 4), torch.tensor_split(y, 4))

    def view_loss(out, label):
        return models.mse(out, label).view(1)

    if dist.get_rank(group) == 0:
        loss, _ = pipe.step(x, num_chunks=4, criterion=view_loss, labels=(y,))
        return torch.equal(loss.reshape(-1), ref)
    pipe.step(num_chunks=4)
    return True


def case_bool_num_chunks(group):
    _, pipe = _v_pipeline(group, 2)
    x = torch.randn(8, 3, models.HIDDEN, dtype=torch.float64)
    try:
        pipe.step(x, num_chunks=True, criterion=models.mse, labels=(x,))
    except ValueError as exc:
        return "num_chunks=True" in str(exc)
    except Exception as exc:  # the other rank learns of the rejection
        return type(exc).__name__ == "PipelineAbortedError" and "num_chunks=True" in str(exc)
    return "accepted"


CASES = {
    "official_setters": (2, case_official_setters),
    "batch_dim_and_uneven_chunks": (2, case_batch_dim_and_uneven_chunks),
    "rank_mapping": (2, case_rank_mapping),
    "mirrored_weights": (4, case_mirrored_weights),
    "full_backward_sends_before_weight_grads": (2, case_full_backward_sends_before_weight_grads),
    **{f"containers_{name}": (2, functools.partial(_containers_case, make=make)) for name, make in CONTAINERS.items()},
    "loss_is_a_view": (2, case_loss_is_a_view),
    "bool_num_chunks": (2, case_bool_num_chunks),
}


@pytest.fixture(scope="module")
def out():
    return run_world(WORLD, run_cases, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_case(out, name):
    ranks = CASES[name][0]
    assert all(out[r][name] is True for r in range(ranks)), [out[r][name] for r in range(ranks)]


def test_official_utils_import_path():
    from twinpipe.runtime.executor import run_backward
    from twinpipe.runtime.weight_grad import WeightGradStore
    from twinpipe.utils import WeightGradStore as store, run_backward as backward

    assert (store, backward) == (WeightGradStore, run_backward)


def test_defer_weight_grads_same_parameters_same_results():
    import twinpipe
    from twinpipe.runtime.weight_grad import WeightGradStore

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 8, bias=False))).double()
    deferred = twinpipe.defer_weight_grads(copy.deepcopy(plain))
    assert [type(m).__name__ for m in deferred.modules()].count("DeferredLinear") == 2
    x = torch.randn(4, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.equal(plain(x), deferred(x))
    plain(x).square().sum().backward()
    grad_x = x.grad.clone()
    x.grad = None
    WeightGradStore.enabled = True
    deferred(x).square().sum().backward()
    WeightGradStore.flush("w")
    WeightGradStore.enabled = False
    assert torch.allclose(x.grad, grad_x, rtol=0, atol=1e-14)
    assert all(p.grad is None for n, p in deferred.named_parameters() if "weight" in n)  # deferred
    WeightGradStore.pop("w")
    for p, q in zip(plain.parameters(), deferred.parameters()):
        assert models.grad_error(p.grad, q.grad) < 1e-15


def test_defer_weight_grads_keeps_parameter_objects_and_other_layers():
    import twinpipe

    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.LayerNorm(4))
    weight = lin.weight
    twinpipe.defer_weight_grads(model)
    assert model[0].weight is weight and isinstance(model[1], nn.LayerNorm)
    no_linear = nn.Sequential(nn.Tanh())
    assert twinpipe.defer_weight_grads(no_linear) is no_linear


def test_each_pipeline_has_its_own_weight_grad_store():
    """The class-level API acts on the store active in the calling thread, never another thread's."""
    import threading

    from twinpipe.runtime.weight_grad import GradStore, WeightGradStore

    store, seen = GradStore(), {}
    inside, done = threading.Event(), threading.Event()

    def pipeline_thread():
        with store.active():
            WeightGradStore.enabled = True
            WeightGradStore.put(lambda: None)
            inside.set()
            done.wait(10)

    worker = threading.Thread(target=pipeline_thread)
    worker.start()
    inside.wait(10)
    seen["enabled"], seen["cache"] = WeightGradStore.enabled, len(WeightGradStore.cache)
    done.set()
    worker.join()
    assert seen == {"enabled": False, "cache": 0}
    assert store.enabled and len(store.cache) == 1


def test_official_class_level_store_api_still_works():
    """Code written for the official WeightGradStore (class attributes, FIFO flush/pop) runs unchanged."""
    from twinpipe.runtime.weight_grad import WeightGradStore

    ran = []
    WeightGradStore.clear()
    WeightGradStore.enabled = True
    assert WeightGradStore.enabled is True
    WeightGradStore.put(lambda: ran.append(1))
    WeightGradStore.flush()
    WeightGradStore.enabled = False
    assert WeightGradStore.funcs_queue.qsize() == 1
    WeightGradStore.pop()
    assert ran == [1] and WeightGradStore.pending() == 0
