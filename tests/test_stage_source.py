"""One ``StageSource`` contract (``twinpipe.train.stage_source``) for both sources the trainer takes:
the built-in GPT cut by ``SplitStages`` and a ``transformers`` model cut by ``HFSource``. Single
process, no process group: each pipeline rank's stages are built from a fresh model of the same seed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCHEDULES = (("1f1b", 2), ("dualpipev", 2))


def _gpt(**kwargs):
    from twinpipe.train.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab=32, seq_len=8, dim=8, heads=2, layers=4, **kwargs)).double()


def _hf(arch: str, **kwargs):
    from transformers import AutoModelForCausalLM

    from hf_models import config

    return AutoModelForCausalLM.from_config(config(arch, **kwargs)).to(torch.float64)


def _split():
    from twinpipe.train.split_source import SplitStages

    return SplitStages("params", lambda: None, 10.0, lambda what: what)


def _hf_source():
    from twinpipe.hf import HFSource

    return HFSource("unused")


MODELS = {  # name: (model factory, source factory, has routers, has tied pairs)
    "gpt": (lambda: _gpt(), _split, False, False),
    "gpt-moe-mtp": (lambda: _gpt(experts=4, top_k=2, mtp_depth=1), _split, True, True),
    "llama-tied": (lambda: _hf("llama", tied=True), _hf_source, False, True),
    "deepseek-v3": (lambda: _hf("deepseek_v3", layers=3), _hf_source, True, False),
}


def _contract(make_model, make_source, schedule: str, pp: int) -> dict:
    """What a source says of the unsplit model, and what its stages hold over every pipeline rank."""
    from twinpipe.runtime.batches import batch_layout
    from twinpipe.schedule.spec import resolve
    from twinpipe.train.stage_source import StageSource

    spec = resolve(schedule, pp)
    source, model = make_source(), make_model()
    assert isinstance(source, StageSource), type(source)
    names = dict((n, tuple(s)) for n, s in source.parameter_names(model))
    out = {"names": names, "held": {}, "router keys": set(), "biases": dict(source.routing_biases(model)),
           "tied": tuple(source.tied_copies(model)), "mtp": source.mtp_modules(model)}
    for rank in range(pp):
        torch.manual_seed(0)
        model = make_model()
        modules = source.build(model, spec, rank)
        out["held"].update((n, tuple(p.shape)) for m in modules for n, p in m.named_model_parameters())
        for m in modules:
            for buffer, key, router in source.routers(m):
                out["router keys"].add(key)
                assert buffer and hasattr(router, "loads") and hasattr(router, "bias"), (buffer, key, router)
        layout = batch_layout(spec, pp, rank, 2)
        x = torch.randint(0, 32, (2, 8))
        assert len(source.batch(layout, x, x)) == 2
        assert source.row_shards(modules) == set() and source.row_group() is None  # no expert parallelism here
    return out


@pytest.mark.parametrize("schedule,pp", SCHEDULES)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_source_names_what_its_stages_hold(name, schedule, pp):
    make_model, make_source, routed, tied = MODELS[name]
    said = _contract(make_model, make_source, schedule, pp)
    assert said["held"] == said["names"], set(said["held"]) ^ set(said["names"])  # every parameter on some rank, by name and shape
    assert said["router keys"] == set(said["biases"]) and bool(said["biases"]) == routed, (said["router keys"], said["biases"])
    assert bool(said["tied"]) == tied and all(n in said["names"] for pair in said["tied"] for n in pair), said["tied"]
    assert said["mtp"] == (1 if name == "gpt-moe-mtp" else 0)


def test_a_stages_object_that_is_not_a_source_is_refused_naming_what_it_lacks():
    from twinpipe.train.stage_source import check_source

    class Partial:  # the four methods the trainer once required, nothing else
        def parameter_names(self, model): ...
        def build(self, model, schedule, pp_rank): ...
        def batch(self, layout, x, y): ...
        def sync_mirrored_grads(self, pipe): ...

    with pytest.raises(ValueError, match=r"stages=Partial: must be a twinpipe.train.StageSource .*lacks add_balance_loss, mtp_modules"):
        check_source(Partial())
