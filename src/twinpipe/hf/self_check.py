"""The numerical self-check for a causal LM whose architecture ``twinpipe.hf`` is not tested on.

``self_check(model)`` builds a small copy of ``model``: its config with the widths shrunk (hidden
size, heads, head and MLP sizes, MLA ranks) and every decoder layer kept (so that each kind of
layer is there), a sliding window of 3 where the config has one, float64, ``sdpa`` attention,
random weights. It runs one batch (a full row, a left-padded and a right-padded one, longer than
the window) through stages holding one item each (the embedding, each decoder layer, the norm and
head), one after the other in this process, and through the copy's own forward, both in training
mode from the same seed (a dropout one path skips shows). Logits and loss must agree within
``RTOL`` (relative to their largest magnitude); they are equal bit for bit in every model that fits.

When they differ it finds where (the model's own forward, in evaluation mode, with hooks on its
layers): the embeddings the first layer gets (a scale, as Gemma's?), a layer's mask or output
(post-norm layers? parallel attention and MLP? extra norms?), what follows the last layer (logit
soft-capping or scaling?), and raises ``UnsupportedModelError`` saying so. When they agree it
warns (``UntestedModelWarning``). The outcome is cached per model class and config, so that a
process checks a model, and warns, once.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch

from twinpipe.hf.stage import CausalLMLoss, HFStage, count_items
from twinpipe.hf.support import TESTED, ModelParts, UnsupportedModelError, UntestedModelWarning, _structure, known_extras

__all__ = ["model_parts", "self_check", "shrunk_config", "small_copy", "RTOL"]

RTOL = 1e-12  # largest |stages - model| / largest |model| accepted, in float64

# The widths of the small copy; the second is tried when the first cannot be built or run (a rotary
# dimension that must divide, a factor list of the head's size ...).
SIZES = (
    dict(hidden_size=32, heads=4, head_dim=8, intermediate=16, lora=8, rope=4, nope=4, v_head_dim=4),
    dict(hidden_size=128, heads=4, head_dim=32, intermediate=64, lora=32, rope=16, nope=16, v_head_dim=32),
)
MAX_PARAMETERS = 50_000_000  # a small copy larger than this is not built (the check must be quick)
WINDOW = 3  # the sliding window of the small copy: shorter than SEQ, so that a wrong mask shows
ROWS, SEQ = 3, 10

_CACHE: dict = {}  # (model class, config as JSON) -> None (passed) or the error's message


def model_parts(model, *, untested: bool = False) -> ModelParts:
    """``model``'s pieces, or an ``UnsupportedModelError`` naming what is missing or what differs.

    A model whose forward does more than the stages compute (an embedding or residual multiplier,
    logit soft-capping or scaling, norms besides the two of a pre-norm layer, dropout outside the
    attention and MLP modules) is refused, whatever its ``model_type``. A ``model_type`` not in
    ``TESTED`` is then checked numerically (``twinpipe.hf.self_check``: a small copy of the model,
    the stages against its own forward) and accepted with an ``UntestedModelWarning`` when they
    agree; ``untested=True`` skips that check (at the user's risk: its decoder layers must compute
    ``h + attn(norm1(h))`` then ``h + mlp(norm2(h))``, as every tested model's do).
    """
    parts = _structure(model)
    name = type(model).__name__
    extras = known_extras(parts)
    if extras:
        raise UnsupportedModelError(f"model={name}: its forward does what twinpipe.hf's stages do not: {'; '.join(extras)}")
    kind = getattr(parts.config, "model_type", None)
    if kind not in TESTED and not untested:
        self_check(model)  # raises UnsupportedModelError when they differ; warns (once) when they agree
    return parts


def self_check(model) -> str:
    """Check ``model``'s stages against its own forward on a small copy (module doc); returns how the
    copy was made (for the warning), or raises ``UnsupportedModelError`` naming what differs."""
    key = _key(model)
    if key is not None and key in _CACHE:
        outcome = _CACHE[key]
        if isinstance(outcome, UnsupportedModelError):
            raise UnsupportedModelError(str(outcome))
        return outcome
    try:
        outcome = _check(model)
    except UnsupportedModelError as error:
        if key is not None:
            _CACHE[key] = error
        raise
    if key is not None:
        _CACHE[key] = outcome
    warnings.warn(f"model={type(model).__name__}: model_type={getattr(model.config, 'model_type', None)!r} is not one "
                  f"twinpipe.hf is tested on ({', '.join(TESTED)}); its stages gave the model's own logits and loss on "
                  f"a small copy of it ({outcome}), so it is accepted: check your results", UntestedModelWarning,
                  stacklevel=2)
    return outcome


def _key(model):
    try:
        return f"{type(model).__module__}.{type(model).__qualname__}", model.config.to_json_string()
    except Exception:  # a config that does not serialise: no cache
        return None


def _check(model) -> str:
    name, kind = type(model).__name__, getattr(model.config, "model_type", None)
    failures = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny ops: one thread is fastest, and does not spin on a loaded machine
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return _sizes(model, name, kind, failures)
    finally:
        torch.set_num_threads(threads)


def _sizes(model, name: str, kind, failures: list) -> str:
    """Each size of ``SIZES`` (with ``sdpa``, else ``eager`` attention) until one builds and runs; its outcome."""
    for size, attention in ((size, attention) for size in SIZES for attention in ("sdpa", "eager")):
        try:
            tiny, how = small_copy(model, size, attention)
            # eager attention gives NaN on left-padded rows in float64 (a query with no key): right padding only
            batch = _batch(tiny.config, left=attention == "sdpa")
            reference = _model_outputs(tiny, *batch)
            if not torch.isfinite(reference[0]).all():
                raise ValueError("the model's own logits are not finite")
        except Exception as error:  # this size does not build or run: try the next
            failures.append(f"{attention}, hidden_size={size['hidden_size']}: {type(error).__name__}: {_first_line(error)}")
            continue
        try:
            parts = _structure(tiny)
            stages = _stages(parts)
            ours = _stage_outputs(tiny, parts, stages, *batch)
        except UnsupportedModelError:
            raise
        except Exception as error:
            raise UnsupportedModelError(f"model={name}: model_type={kind!r} is not one twinpipe.hf is tested on, and "
                                        f"its stages fail on a small copy of it ({how}): {type(error).__name__}: "
                                        f"{_first_line(error)}") from None
        differ = [f"{what} by {err:.3g} (relative)" for what, err in
                  (("logits", _error(ours[0], reference[0])), ("loss", _error(ours[1], reference[1]))) if not err <= RTOL]
        if not differ:
            return how
        where = _where(tiny, parts, stages, *batch)
        raise UnsupportedModelError(f"model={name}: model_type={kind!r} is not one twinpipe.hf is tested on, and on a "
                                    f"small copy of it ({how}) the stages' {' and '.join(differ)} differ from the "
                                    f"model's own: its forward does something twinpipe.hf's stages do not: {where}")
    raise UnsupportedModelError(f"model={name}: model_type={kind!r} is not one twinpipe.hf is tested on, and the self-check "
                                f"could not build and run a small copy of it ({'; '.join(failures)}); "
                                "pass untested=True to skip the check")


# ------------------------------------------------------------------------------ the small copy
def shrunk_config(config, size: dict | None = None, attention: str = "sdpa"):
    """A copy of ``config`` with the widths of ``size`` (default: the first of ``SIZES``) where it
    has larger ones, every layer kept, a sliding window of ``WINDOW``, ``attention``, the loop over
    experts."""
    size = SIZES[0] if size is None else size
    cfg = copy.deepcopy(config)

    def shrink(key, value):
        old = getattr(cfg, key, None)
        if type(old) is int and old > value:  # a width (a bool is not one)
            setattr(cfg, key, value)

    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    old_head_dim = getattr(cfg, "head_dim", None)
    rope_is_head = old_head_dim is not None and old_head_dim == getattr(cfg, "qk_rope_head_dim", None)  # MLA
    shrink("hidden_size", size["hidden_size"])
    shrink("num_attention_heads", size["heads"])
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0:
        new_heads = cfg.num_attention_heads
        # Keep the kind of attention: multi-head, multi-query, or grouped.
        cfg.num_key_value_heads = new_heads if kv >= heads else 1 if kv == 1 else max(d for d in range(1, new_heads) if new_heads % d == 0)
    shrink("head_dim", size["head_dim"])
    for key, value in list(vars(cfg).items()):
        if key.endswith("intermediate_size"):
            shrink(key, size["intermediate"])
    for key in ("q_lora_rank", "kv_lora_rank"):
        shrink(key, size["lora"])
    shrink("qk_rope_head_dim", size["rope"])
    shrink("qk_nope_head_dim", size["nope"])
    shrink("v_head_dim", size["v_head_dim"])
    if isinstance(getattr(cfg, "qk_head_dim", None), int):
        cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if rope_is_head:  # DeepSeek-V2/V3: head_dim is the rotary part of a head
        cfg.head_dim = cfg.qk_rope_head_dim
    if isinstance(getattr(cfg, "sliding_window", None), int) and cfg.sliding_window > 0:
        cfg.sliding_window = min(cfg.sliding_window, WINDOW)
    _shrink_rope_factors(cfg, old_head_dim, heads)
    cfg._attn_implementation = attention
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"  # the loop over experts: float64 on CPU (the same modules run either way)
    return cfg


def _shrink_rope_factors(cfg, old_head_dim, old_heads) -> None:
    """Per-frequency factor lists in the rotary parameters (Phi3's long RoPE) cut to the new rotary size."""
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict):
        return
    old = old_head_dim if isinstance(old_head_dim, int) else None
    new = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for table in [params, *[v for v in params.values() if isinstance(v, dict)]]:
        for key, value in list(table.items()):
            if isinstance(value, list) and value and all(isinstance(x, (int, float)) for x in value):
                factor = table.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
                half = max(1, int(new * factor) // 2)
                if old is None or len(value) != half:
                    table[key] = value[:half] if len(value) >= half else value + value[-1:] * (half - len(value))


def small_copy(model, size: dict, attention: str = "sdpa", seed: int = 0):
    """The model's class on ``shrunk_config``, float64 (every parameter and buffer), every parameter
    moved off its initial value (norm weights of ones, zero biases and routers would hide a missing
    term), from ``seed``; and how it was made, in words. ``twinpipe check`` trains such a copy."""
    cfg = shrunk_config(model.config, size, attention)
    with torch.device("meta"):  # its size first (parts a config does not shrink, such as a vision tower, may be large)
        count = sum(p.numel() for p in type(model)(cfg).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"the small copy would have {count:,} parameters (at most {MAX_PARAMETERS:,})")
    torch.manual_seed(seed)
    with torch.device("cpu"):  # not the meta device the model may have been built on
        tiny = type(model)(cfg).to(torch.float64)  # DeepSeek-V3's router too (transformers makes it float32)
    with torch.no_grad():
        for p in tiny.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    inner = tiny.model
    layers = len(inner.layers)
    how = (f"hidden_size={cfg.hidden_size}, {cfg.num_attention_heads} heads, {layers} layers"
           + (f", sliding window {cfg.sliding_window}" if isinstance(getattr(cfg, 'sliding_window', None), int) else "")
           + ("" if attention == "sdpa" else f", {attention} attention, right padding only"))
    return tiny.train(), how


def _batch(config, left: bool = True) -> tuple:
    """``(input_ids, attention_mask, labels)``: a full row, a left-padded one (or a right-padded one
    with ``left=False``) and a right-padded one."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, max(2, min(int(config.vocab_size), 1000)), (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if left:
        mask[1, :2] = 0
    else:
        mask[1, SEQ - 2:] = 0
    mask[2, SEQ - 3:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _model_outputs(tiny, ids, mask, labels) -> tuple:
    torch.manual_seed(2)
    out = tiny(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(count_items(labels)))
    return out.logits, out.loss


def _stages(parts) -> list:
    """One stage per item: the embedding, each decoder layer, the norm and head."""
    n = len(parts.layers)
    return [HFStage(parts, ["E"], 0)] + [HFStage(parts, ["t"], i) for i in range(n)] + [HFStage(parts, ["L"], n)]


def _stage_outputs(tiny, parts, stages, ids, mask, labels) -> tuple:
    torch.manual_seed(2)
    flow = (ids, mask)
    for stage in stages:
        out = stage(*flow)
        flow = out if isinstance(out, tuple) else (out,)
    logits, sums = flow[0], flow[1:]
    criterion = CausalLMLoss(tiny.loss_function, parts.config.vocab_size, parts.aux)
    loss = criterion(logits, *sums, labels, torch.full((ids.shape[0],), count_items(labels)))
    return logits, loss


def _error(ours, theirs) -> float:
    """Largest |ours - theirs| over the largest |theirs| (NaN anywhere: NaN)."""
    if ours is None or theirs is None or ours.shape != theirs.shape:
        return math.inf
    diff = (ours.double() - theirs.double()).abs()
    scale = theirs.double().abs().max().clamp_min(1e-300)
    return float(diff.max() / scale) if diff.numel() else 0.0


# ------------------------------------------------------------------------------ where they differ
def _where(tiny, parts, stages, ids, mask, labels) -> str:
    """The first place where the model's own forward (evaluation mode) and the stages part."""
    seen: dict = {}
    hooks = []
    for i, layer in enumerate(parts.layers):
        def before(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs.get("hidden_states")
            seen.setdefault(("in", i), (hidden, kwargs.get("attention_mask")))

        def after(module, args, kwargs, out, i=i):
            seen.setdefault(("out", i), out[0] if isinstance(out, tuple) else out)

        hooks += [layer.register_forward_pre_hook(before, with_kwargs=True),
                  layer.register_forward_hook(after, with_kwargs=True)]
    tiny.eval()
    try:
        logits = tiny(input_ids=ids, attention_mask=mask).logits
    finally:
        for hook in hooks:
            hook.remove()
    n = len(parts.layers)
    if n and ("in", 0) in seen:
        ours, theirs = parts.embed_tokens(ids), seen["in", 0][0]
        if _error(ours, theirs) > RTOL:
            hint = " (sqrt(hidden_size), Gemma's normalizer)" if _close(_scale(ours, theirs), math.sqrt(parts.config.hidden_size)) else ""
            return (f"the embeddings the first layer gets are {_how(ours, theirs)}{hint}, not model.embed_tokens(input_ids) "
                    "(an embedding scale or multiplier?)")
    for i in range(n):
        if ("in", i) not in seen or ("out", i) not in seen:
            return f"model.layers[{i}] is not called as a module with the hidden states (another layer loop?)"
        hidden, their_mask = seen["in", i]
        stage = stages[1 + i]
        hidden, ctx = stage.enter(hidden, mask)
        ours_mask = ctx.masks[parts.mask_kinds[i]]
        if not _same(ours_mask, their_mask):
            return (f"model.layers[{i}] gets another attention mask than the {parts.mask_kinds[i]!r} one the stages make "
                    "(a sliding window or layer types the stages do not read?)")
        layer = next(iter(stage.layers.values()))
        ours, theirs = layer(hidden, ctx), seen["out", i]
        if _error(ours, theirs) > RTOL:
            return (f"model.layers[{i}] ({type(parts.layers[i]).__name__}) gives another output than "
                    "h + self_attn(input_layernorm(h)), then h + mlp(post_attention_layernorm(h)) (post-norm layers? "
                    "extra norms? parallel attention and MLP? a residual multiplier?)")
    last = seen["out", n - 1] if n else parts.embed_tokens(ids)
    ours = parts.lm_head(parts.norm(last))
    if _error(ours, logits) > RTOL:
        return (f"its logits are {_how(ours, logits)}, not lm_head(norm(h)) of the last layer's output "
                "(logit soft-capping? a logit scale?)")
    return "not in evaluation mode: in training mode only (dropout or noise the stages skip?)"


def _scale(ours, theirs) -> float | None:
    """``c`` when ``theirs`` is ``c * ours`` (to 1e-9), else None."""
    big = ours.abs() > 1e-6 * ours.abs().max()
    if not big.any():
        return None
    ratio = theirs[big] / ours[big]
    c = float(ratio.median())
    return c if float((ratio - c).abs().max()) <= 1e-9 * abs(c) else None


def _how(ours, theirs) -> str:
    c = _scale(ours, theirs)
    return f"scaled by {c:.6g}" if c is not None else "changed"


def _close(a, b) -> bool:
    return a is not None and abs(a - b) <= 1e-9 * abs(b)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
