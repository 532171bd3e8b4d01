"""twinpipe.hf on more architectures, and the guard for the ones it is not tested on.

Each architecture of ``hf_models.MORE`` (Mistral, Qwen2, Qwen2-MoE, Phi-3, OLMo, Starcoder2, GLM,
Gemma, OLMoE, SmolLM3) runs on 2 ranks under DualPipeV, 1F1B and one more schedule with padded batches, exact
against the unsplit model as in tests/test_hf_stages.py (its runner: losses bitwise, gradients
within 1e-13, float64); one 2-rank world runs them all. The rest runs in this process: the known
extras that make a model's forward differ from the stages' are named, the numerical self-check
accepts an untested architecture that fits (with a warning) and refuses, saying where, one that
does not; ``twinpipe train --model`` goes through the same guard.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest

pytest.importorskip("transformers", reason="twinpipe.hf needs transformers (pip install twinpipe[hf])")

import torch  # noqa: E402

import hf_models  # noqa: E402
from distributed import run_world  # noqa: E402
from test_hf_stages import _case, _ref_key, _run, shared_references  # noqa: E402 (one runner for every architecture)
from twinpipe import hf  # noqa: E402

CASES = {}
for i, arch in enumerate(hf_models.MORE):
    aux = arch in ("qwen2_moe", "olmoe")  # their router auxiliary loss carried through the pipe
    tied = arch in ("gemma", "smollm3")  # tied by default: shared on DualPipeV, two copies summed on 1F1B
    third = ("dualpipe", "zb-h1", "interleaved-1f1b")[i % 3]
    for schedule in ("dualpipev", "1f1b", third):
        CASES[f"{arch}-{schedule}-p2"] = _case(arch, schedule, 2, aux=aux, tied=tied, rotary=("recompute", "pass")[i % 2],
                                               seqs=(8, 5) if schedule == "1f1b" else (8,))


def _world(rank, world, names):
    import torch.distributed as dist

    references = shared_references(rank, world, [CASES[name] for name in names])
    group = dist.new_group([0, 1])
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UntestedModelWarning)  # tested: no self-check, no warning
        for name in names:
            torch.manual_seed(0)
            try:
                results[name] = _run(CASES[name], references[_ref_key(CASES[name])], group)
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
            dist.barrier()
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_world(2, _world, list(CASES), timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_exact_against_unsplit_model(outcomes, name):
    assert {r: outcomes[r][name] for r in range(2)} == {0: "ok", 1: "ok"}


def test_the_new_architectures_are_tested():
    assert set(hf_models.MORE) <= set(hf.TESTED)


# ------------------------------------------------------------------------------ the masks
def test_a_sliding_window_in_a_config_whose_model_ignores_it_changes_nothing():
    """A Llama config.json with a ``sliding_window`` (some conversions carry one): Llama's forward
    uses the full causal mask for every layer, so must the stages (the window is shorter than the batch)."""
    model = hf_models.model("llama", layers=2)
    model.config.sliding_window = 3
    parts = hf.model_parts(model)
    assert parts.mask_kinds == ["full_attention"] * 2
    ids, mask, _ = hf_models.batch(3, 10)
    with torch.no_grad():
        assert torch.equal(hf.HFStage(parts, ["E", "t", "t", "L"], 0)(ids, mask), model(input_ids=ids, attention_mask=mask).logits)


# ------------------------------------------------------------------------------ known extras
def _meta(config):
    """The model of ``config`` on the meta device (the structural checks need no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _small(cls_name, **options):
    import transformers as tf

    given = dict(hf_models.COMMON, num_hidden_layers=2, intermediate_size=32, num_key_value_heads=2)
    given.pop("experts_implementation")
    return getattr(tf, cls_name)(**{**given, **options})


def _default(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


EXTRAS = {
    "granite": (lambda: _small("GraniteConfig", embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0),
                ["an embedding multiplier (Granite): config.embedding_multiplier=12.0",
                 "a residual multiplier in every layer (Granite): config.residual_multiplier=0.22",
                 "logits divided by logits_scaling (Granite): config.logits_scaling=8.0"]),
    "gemma2": (lambda: _small("Gemma2Config", head_dim=8, attn_implementation="eager"),
               ["final logit soft-capping (Gemma2): config.final_logit_softcapping=30.0",
                "have post_feedforward_layernorm, pre_feedforward_layernorm besides input_layernorm"]),
    "gemma3": (lambda: _small("Gemma3TextConfig", head_dim=8),
               ["have post_feedforward_layernorm, pre_feedforward_layernorm besides input_layernorm"]),
    "olmo2": (lambda: _small("Olmo2Config"),
              ["has no input_layernorm", "post-norm layers, as OLMo2's"]),
    "cohere": (lambda: _small("CohereConfig"),
               ["has no post_attention_layernorm", "parallel attention and MLP, as Cohere's",
                ]),
    "phi3-dropout": (lambda: _small("Phi3Config", resid_pdrop=0.1),
                     ["dropout the stages do not apply: model.layers[0].resid_attn_dropout (p=0.1)"]),
    "minicpm3": (lambda: _default("minicpm3"),
                 ["logits divided by logits_scaling (Granite): config.logits_scaling=10.0",
                  "an embedding scale (MiniCPM): config.scale_emb=12", "a residual scale (MiniCPM): config.scale_depth=1.4"]),
    "stablelm-parallel": (lambda: _small("StableLmConfig", use_parallel_residual=True),
                          ["has no post_attention_layernorm", "parallel attention and MLP, as Cohere's"]),
    # Read from the config whatever the model_type (a Llama config carrying them is refused too: safe, not silent).
    "logit-scale": (lambda: _small("LlamaConfig", logit_scale=0.0625),
                    ["logits multiplied by logit_scale (Cohere): config.logit_scale=0.0625"]),
    "parallel-residual": (lambda: _small("LlamaConfig", use_parallel_residual=True),
                          ["parallel attention and MLP (use_parallel_residual): config.use_parallel_residual=True"]),
    "starcoder2-dropout": (lambda: _small("Starcoder2Config", embedding_dropout=0.1),
                           ["dropout on the embeddings (Starcoder2): config.embedding_dropout=0.1"]),
}


@pytest.mark.parametrize("name", list(EXTRAS))
def test_known_extras_are_refused_by_name(name):
    make, said = EXTRAS[name]
    model = _meta(make())
    for untested in (False, True):  # untested=True skips the self-check, not these
        with pytest.raises(hf.UnsupportedModelError) as info:
            hf.model_parts(model, untested=untested)
        for words in said:
            assert words in str(info.value), str(info.value)


def test_neutral_values_of_those_settings_are_not_extras():
    """Granite's multipliers at 1 and Gemma2 without soft-capping... : Granite is then a Llama."""
    model = hf_models.model("llama", layers=2)
    parts = hf.model_parts(model)
    from twinpipe.hf.support import known_extras

    assert known_extras(parts) == []
    granite = _meta(_small("GraniteConfig"))
    assert known_extras(hf.model_parts(granite, untested=True)) == []


# ------------------------------------------------------------------------------ the self-check
def _custom(kind: str):
    """A Llama with a model_type of its own whose forward does ``kind`` (none: the same as Llama's)."""
    import transformers as tf
    from transformers.models.llama import modeling_llama as ml

    class Config(tf.LlamaConfig):
        model_type = f"custom_{kind}"

    class PostNormLayer(ml.LlamaDecoderLayer):
        def forward(self, hidden_states, **kwargs):
            kwargs.pop("hidden_states", None)
            attn, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
            hidden_states = hidden_states + self.input_layernorm(attn)
            return hidden_states + self.post_attention_layernorm(self.mlp(hidden_states))

    class Model(ml.LlamaModel):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            if kind == "postnorm":
                self.layers = torch.nn.ModuleList([PostNormLayer(config, i) for i in range(config.num_hidden_layers)])

        def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
            if kind == "scaled" and input_ids is not None:  # the embedding scale in the forward (Gemma before transformers 5)
                inputs_embeds, input_ids = self.embed_tokens(input_ids) * self.config.hidden_size ** 0.5, None
            return super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)

    class ForCausalLM(ml.LlamaForCausalLM):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            self.model = Model(config)

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if kind == "capped":
                out.logits = torch.tanh(out.logits / 2.0) * 2.0
            return out

    common = {k: v for k, v in hf_models.COMMON.items() if k != "experts_implementation"}
    extra = dict(sliding_window=3) if kind == "window" else {}
    config = Config(**dict(common, num_hidden_layers=2), intermediate_size=32, num_key_value_heads=2, **extra)
    torch.manual_seed(0)
    return ForCausalLM(config)


REFUSED = {
    "scaled": "the embeddings the first layer gets are scaled by 4 (sqrt(hidden_size), Gemma's normalizer), "
              "not model.embed_tokens(input_ids)",
    "capped": "its logits are changed, not lm_head(norm(h)) of the last layer's output (logit soft-capping? a logit scale?)",
    "postnorm": "model.layers[0] (PostNormLayer) gives another output than h + self_attn(input_layernorm(h)), then "
                "h + mlp(post_attention_layernorm(h)) (post-norm layers?",
    "window": "model.layers[0] gets another attention mask than the 'sliding_attention' one the stages make",
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_self_check_refuses_a_model_whose_forward_differs_saying_where(kind):
    model = _custom(kind)
    with pytest.raises(hf.UnsupportedModelError) as info:
        hf.build(model, "1f1b", 2, 0)
    message = str(info.value)
    assert message.startswith(f"model=ForCausalLM: model_type='custom_{kind}' is not one twinpipe.hf is tested on, and "
                              "on a small copy of it (hidden_size=16, 4 heads, 2 layers"), message
    assert "differ from the model's own: its forward does something twinpipe.hf's stages do not: " in message, message
    assert REFUSED[kind] in message, message
    assert hf.build(model, "1f1b", 2, 0, untested=True).layout  # the way out: no check, at the user's risk


def test_the_self_check_accepts_an_untested_architecture_that_fits_with_a_warning():
    from twinpipe.hf import self_check

    for model in (_custom("same"), _granite_neutral()):
        kind = model.config.model_type
        state = torch.random.get_rng_state()
        with pytest.warns(hf.UntestedModelWarning, match=rf"model_type={kind!r} is not one twinpipe.hf is tested on .*"
                                                          r"its stages gave the model's own logits and loss on a small "
                                                          r"copy of it \(hidden_size=16, 4 heads, 2 layers\)"):
            stages = hf.build(model, "1f1b", 2, 0)
        assert stages.layout == "E,t|t,L"
        assert torch.equal(torch.random.get_rng_state(), state)  # the check draws from a generator of its own
        assert self_check._key(model) in self_check._CACHE  # checked once per process


def _granite_neutral():
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(_small("GraniteConfig"))


def test_the_small_copy_keeps_every_layer_and_the_kind_of_attention():
    import transformers as tf

    from twinpipe.hf.self_check import shrunk_config

    big = tf.Qwen2MoeConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=28,
                            intermediate_size=11008, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                            use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    small = shrunk_config(big)
    got = {k: getattr(small, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                                         "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                                         "sliding_window", "num_experts")}
    assert got == dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=28,
                       intermediate_size=16, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       sliding_window=3, num_experts=big.num_experts)
    assert small.layer_types == big.layer_types and big.hidden_size == 4096  # the user's config is left alone


# ------------------------------------------------------------------------------ twinpipe train --model
def test_train_model_goes_through_the_guard(tmp_path, capsys):
    from twinpipe.train_command.cli import main as train_main

    granite = _small("GraniteConfig", embedding_multiplier=12.0)
    folder = tmp_path / "granite"
    granite.save_pretrained(folder)
    fits = tmp_path / "fits"
    _small("GraniteConfig", num_hidden_layers=3).save_pretrained(fits)  # not the one checked above (once per process)
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "ok.npy", (np.arange(400) % 60 + 1).astype(np.uint16))
    common = ["--data", str(tmp_path / "ok.npy"), "--out", str(tmp_path / "out"), "--steps", "1", "--schedule", "1f1b",
              "--pp", "1", "--seq-len", "8", "--batch-size", "2"]
    code = train_main(["--model", str(folder), *common])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(r"--model='.*granite': model=GraniteForCausalLM: its forward does what twinpipe.hf's stages do not: "
                     r"an embedding multiplier \(Granite\): config.embedding_multiplier=12.0$", err.strip()), err
    import argparse

    from twinpipe.train_command import cli
    from twinpipe.train_command.model import check_ep, check_model

    parser = argparse.ArgumentParser()
    cli._add_arguments(parser)
    args = parser.parse_args(["--model", str(fits), *common])
    args.ep = check_ep(args)  # as the command's checks do first
    info = check_model(args, 1, cli._defaults())
    err = capsys.readouterr().err
    assert err.startswith("twinpipe train: warning: model=GraniteForCausalLM: model_type='granite' is not one twinpipe.hf "
                          "is tested on (") and err.count("\n") == 1, err
    assert info.config.model_type == "granite" and json.loads((fits / "config.json").read_text())["model_type"] == "granite"


def test_a_config_without_num_hidden_layers_gets_every_layer():
    """Some configs (Gemma4's assistant) have no ``num_hidden_layers``: the layers are model.layers,
    not an AttributeError."""
    import types

    model = hf_models.model("llama", layers=2)
    model.config = types.SimpleNamespace(model_type="llama", vocab_size=hf_models.VOCAB)
    assert len(hf.model_parts(model).layers) == 2
