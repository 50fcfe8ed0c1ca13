"""The machinery shared by every architecture: weight rules, the architecture registry, checks.

An architecture is described once, by a list of ``Rule``s that each map some Hugging Face
tensors to some of our parameters and back (one rule may fuse or split tensors, as GPT-2's
``c_attn`` does for query/key/value). Both directions come from the same table, so import and
export cannot drift apart, and the round trip HF -> ours -> HF is exact by construction
(transposes and reshapes only; a dtype change happens once, at the end).

Our parameters are addressed by ``/``-joined paths (``layer_0/attention/query/kernel``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from transformers_jax.config import ConfigError, ModelConfig
from transformers_jax.convert.hf_files import ConversionError
from transformers_jax.registry import MLPS, WANTED, Registry, Switch, type_problem

Arrays = tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class Rule:
    """``hf`` tensors <-> ``ours`` parameters; ``to_ours(*hf) -> ours`` and ``to_hf(*ours) -> hf``
    (tuples in the order of the names)."""

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: Callable[..., Arrays]
    to_hf: Callable[..., Arrays]


def copy(hf: str, ours: str) -> Rule:
    """Same array on both sides (embedding tables, norm scales and biases)."""
    return Rule((hf,), (ours,), lambda x: (x,), lambda x: (x,))


def reshape(hf: str, ours: str, hf_shape: tuple[int, ...], our_shape: tuple[int, ...]) -> Rule:
    """Same data, different shape (a ``[H * D]`` bias that we keep as ``[H, D]``)."""
    return Rule(
        (hf,), (ours,), lambda x: (x.reshape(our_shape),), lambda x: (x.reshape(hf_shape),)
    )


def linear(hf: str, ours: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Rule:
    """A ``torch.nn.Linear`` weight ``[out, in]`` <-> our kernel ``[*in_shape, *out_shape]``."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    return Rule(
        (hf,),
        (ours,),
        lambda w: (w.T.reshape(*in_shape, *out_shape),),
        lambda k: (k.reshape(n_in, n_out).T,),
    )


def conv1d(hf: str, ours: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Rule:
    """A GPT-2 ``Conv1D`` weight, stored ``[in, out]`` (already our layout) <-> our kernel."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    return Rule(
        (hf,),
        (ours,),
        lambda w: (w.reshape(*in_shape, *out_shape),),
        lambda k: (k.reshape(n_in, n_out),),
    )


def dense(hf: str, ours: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
          weight: Callable[..., Rule] = linear) -> list[Rule]:
    """A projection with a bias (BERT, GPT-2): ``{hf}weight`` in the ``weight`` rule's layout
    (``linear`` or ``conv1d``) and ``{hf}bias`` <-> ``{ours}kernel`` and ``{ours}bias``."""
    return [weight(hf + "weight", ours + "kernel", in_shape, out_shape),
            copy(hf + "bias", ours + "bias")]


def layer_norm(hf: str, ours: str) -> list[Rule]:
    """A LayerNorm with a bias: ``{hf}weight``, ``{hf}bias`` <-> ``{ours}scale``, ``{ours}bias``."""
    return [copy(hf + "weight", ours + "scale"), copy(hf + "bias", ours + "bias")]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one Hugging Face model type maps onto this project.

    - ``model_type``: the ``model_type`` of its ``config.json``;
    - ``hf_classes``: ``architectures`` entries accepted on import (the first is written on
      export);
    - ``config_from_hf(hf_config) -> ModelConfig`` raising ``ConversionError`` for anything
      that cannot be expressed exactly; ``config_to_hf(config, base) -> dict`` the reverse
      (``base`` is the original ``config.json`` when the run came from one, so fields we do not
      model, such as token ids, survive a round trip);
    - ``rules(config, hf_config)``: the weight table (``hf_config``: the ``config.json`` read
      or written, for numbers ModelConfig does not hold); ``prefixes``: state-dict prefixes to
      strip on import
      (``transformer.`` for ``GPT2LMHeadModel``); ``export_prefix``: the one written back
      (except on names starting with one of ``top_level``, such as the LM head's);
      ``ignore``: a regex of buffers that are not weights (e.g. cached rotary frequencies),
      or of parts that do not change the outputs we reproduce (BERT's pooler);
    - ``tied_heads``: output-projection names that a checkpoint may store although they are
      tied to the input embedding (unused when ``tie_embeddings``);
    - ``tied_aliases``: ``{name: (other names, ...)}``: tensors that ``transformers`` ties
      together with the embeddings, so a checkpoint may store any of the names (used when
      ``tie_embeddings``; the first found wins);
    - ``rename``: a function of one state-dict name for old spellings (``gamma``/``beta``);
    - ``hf_auto``: the ``transformers`` auto class that loads the exported model;
    - ``refine(config, hf_config, tensors) -> config``: settle what only the weights tell (T5
      stores a separate head or not whatever its config says).
    """

    model_type: str
    hf_classes: tuple[str, ...]
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig, dict | None], dict]
    rules: Callable[[ModelConfig, dict], list[Rule]]
    prefixes: tuple[str, ...] = ()
    export_prefix: str = ""
    top_level: tuple[str, ...] = ("lm_head.",)  # names written without export_prefix
    ignore: str | None = None
    tied_heads: tuple[str, ...] = ("lm_head.weight",)
    tied_aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    rename: Callable[[str], str] | None = None
    hf_auto: str = "AutoModelForCausalLM"
    refine: Callable[[ModelConfig, dict, Mapping[str, np.ndarray]], ModelConfig] | None = None


ARCHITECTURES: Registry[Architecture] = Registry("Hugging Face architecture")


def supported_classes() -> list[str]:
    return sorted(c for name in ARCHITECTURES for c in ARCHITECTURES.get(name).hf_classes)


def architecture_for(hf_config: dict) -> tuple[Architecture, str]:
    """The architecture of a ``config.json`` and the HF class name it names."""
    classes = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if len(classes) > 1:
        raise ConversionError(
            f"architectures={classes}: a checkpoint of several classes is ambiguous; keep one"
        )
    if model_type not in ARCHITECTURES:
        raise ConversionError(
            f"model_type={model_type!r} (architectures={classes}) is not supported; supported "
            f"architectures: {', '.join(supported_classes())}"
        )
    arch = ARCHITECTURES.get(model_type)
    name = classes[0] if classes else arch.hf_classes[0]
    if name not in arch.hf_classes:
        raise ConversionError(
            f"architectures=[{name!r}] is not supported (its head or task differs from a plain "
            f"language model); supported architectures: {', '.join(supported_classes())}"
        )
    return arch, name


# Reading the config ----------------------------------------------------------------------------


class HFConfig:
    """``config.json`` with the Hugging Face class defaults filled in, for strict checks."""

    def __init__(self, raw: dict, defaults: Mapping[str, Any], model_type: str):
        self.raw, self.defaults, self.model_type = raw, defaults, model_type

    def __getitem__(self, key: str) -> Any:
        if key in self.raw and self.raw[key] is not None:
            value = self.raw[key]
            self._check_type(key, value)
            return value
        return self.defaults.get(key)

    def _check_type(self, key: str, value: Any) -> None:
        """A value of another type than the class default (``"n_embd": false``) is refused
        here, naming the Hugging Face field, not later under the ModelConfig field it maps to."""
        default = self.defaults.get(key)
        kind = next((k for k in WANTED if type(default) is k), None)  # bool is not an int here
        problem = None if kind is None else type_problem(kind, value)
        if problem is not None:
            raise unsupported(self.model_type, key, value,
                              f"{problem}, as the class default {default!r}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self[key]
        return default if value is None else value

    def require(self, key: str, allowed: Any, why: str) -> None:
        """Fail naming the field and value unless ``self[key]`` is one of ``allowed``."""
        allowed = allowed if isinstance(allowed, tuple | list) else (allowed,)
        if self[key] not in allowed:
            raise unsupported(self.model_type, key, self[key], why)


def unsupported(model_type: str, field: str, value: Any, why: str) -> ConversionError:
    return ConversionError(
        f"{model_type} config field {field}={value!r} cannot be converted: {why}"
    )


def convertible_mlps(*, gated: bool | None = None) -> tuple[str, ...]:
    """The registered MLPs whose activation has a Hugging Face name (of one gating, or any)."""
    return tuple(name for name, kind in MLPS.items()
                 if kind.hf_names and (gated is None or kind.gated == gated))


def _mlp_names_text(gated: bool) -> str:
    return "; ".join(f"{name} ({', '.join(MLPS.get(name).hf_names)})"
                     for name in convertible_mlps(gated=gated))


def mlp_from_hf(model_type: str, field: str, act: str, *, gated: bool,
                value: str | None = None) -> str:
    """Our MLP of that gating whose activation Hugging Face calls ``act`` (its ``hf_names`` in
    the MLP registry), or an error naming ``field`` (and its ``value``, if not ``act``) and what
    converts."""
    for name, kind in MLPS.items():
        if kind.gated == gated and act in kind.hf_names:
            return name
    kind = "gated" if gated else "non-gated"
    raise unsupported(model_type, field, act if value is None else value,
                      f"no {kind} MLP registered in nn/activations.py computes it; the {kind} "
                      f"ones that convert, with their Hugging Face names: {_mlp_names_text(gated)}")


def mlp_to_hf(config: ModelConfig, arch: str, *, gated: bool | None, why: str) -> str:
    """Export check and name: ``config.mlp`` must convert (and be of that gating, unless None);
    returns the Hugging Face name of its activation."""
    require_ours(config, arch, "mlp", convertible_mlps(gated=gated), why)
    return config.mlp.hf_names[0]


def build_config(model_type: str, **fields: Any) -> ModelConfig:
    """``ModelConfig(**fields)``, with a config error reported as a conversion error."""
    try:
        return ModelConfig(**fields)
    except ConfigError as err:
        raise ConversionError(
            f"the {model_type} config.json maps to a ModelConfig this project rejects: {err}"
        ) from err


def require_ours(config: ModelConfig, arch: str, field: str, allowed: Any, why: str) -> None:
    """Export check: ``config.<field>`` (dotted into a switch, e.g. ``position.fraction``; a
    switch itself by name) must be one of ``allowed``."""
    value: Any = config
    for part in field.split("."):
        value = getattr(value, part)
    if isinstance(value, Switch):  # a switch is required by its registered name
        value = value.name
    allowed = allowed if isinstance(allowed, tuple | list) else (allowed,)
    if value not in allowed:
        raise ConversionError(
            f"cannot export to Hugging Face {arch}: {field}={value!r} has no {arch} equivalent "
            f"({why})"
        )


# ``{ModelConfig field: (value, why)}``: what an architecture fixes, stated once for both
# directions. A single value is set on import and required on export; a tuple of values is an
# export check only (the import reads that field, e.g. the MLP, from the HF config).
Layout = Mapping[str, tuple[Any, str]]


def pinned(layout: Layout, **settings: dict[str, Any]) -> dict[str, Any]:
    """The fields an import sets outright: the single values of ``layout``; a switch's entry
    with the ``settings`` the Hugging Face config gives it (``norm={"eps": 1e-6}``)."""
    fields = {field: value for field, (value, _) in layout.items() if not isinstance(value, tuple)}
    for field, given in settings.items():
        fields[field] = {"name": fields[field], **given}
    return fields


def require_layout(config: ModelConfig, arch: str, layout: Layout) -> None:
    """Export check: every field of ``layout`` has its value (or one of its tuple), in order."""
    for field, (allowed, why) in layout.items():
        require_ours(config, arch, field, allowed, why)


def require_plain_attention(config: ModelConfig, arch: str, name: str, *,
                            fixed_head_dim: bool = True) -> None:
    """Export checks shared by BERT, GPT-2 and T5, whose attention has none of our extras: a
    key/value head per query head, heads ``d_model / n_heads`` wide (unless not
    ``fixed_head_dim``: T5's ``d_kv`` is free), no q/k norm, no logit soft-capping. ``name``
    is the architecture as the messages spell it."""
    require_ours(config, arch, "n_kv_heads", (None, config.n_heads), f"{name} has no GQA")
    if fixed_head_dim:
        require_ours(config, arch, "head_dim", (None, config.d_model // config.n_heads),
                     f"{name} heads are d_model / n_heads wide")
    require_ours(config, arch, "qk_norm", False, f"{name} does not normalise q and k")
    for field in ("attn_logit_softcap", "final_logit_softcap"):
        require_ours(config, arch, field, None, f"{name} does not soft-cap logits")


# Applying the rules ----------------------------------------------------------------------------


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in params.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, path + "/"))
        else:
            out[path] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def strip_prefix(tensors: Mapping[str, np.ndarray], prefixes: tuple[str, ...]):
    """Drop the first prefix that starts any key (a head model's keys share it)."""
    out = {}
    for name, array in tensors.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        out[name] = array
    return out


def hf_to_ours(arch: Architecture, config: ModelConfig, hf_config: dict,
               tensors: Mapping[str, np.ndarray]):
    """Flat ``{our path: array}`` from a state dict; every tensor must be used or ignorable."""
    if arch.rename is not None:
        tensors = {arch.rename(name): value for name, value in tensors.items()}
    tensors = strip_prefix(tensors, arch.prefixes)
    if config.tie_embeddings:  # HF ties the head to the input embedding; a stored copy is unused
        for name in arch.tied_heads:
            tensors.pop(name, None)
        for name, others in arch.tied_aliases.items():
            found = [tensors.pop(other) for other in others if other in tensors]
            if name not in tensors and found:
                tensors[name] = found[0]
    ignore = re.compile(arch.ignore) if arch.ignore else None
    used: set[str] = set()
    out: dict[str, np.ndarray] = {}
    for rule in arch.rules(config, hf_config):
        missing = [name for name in rule.hf if name not in tensors]
        if missing:
            raise ConversionError(
                f"the {arch.model_type} checkpoint lacks {missing} (needed for "
                f"{list(rule.ours)}); is config.json the one saved with these weights?"
            )
        try:
            values = rule.to_ours(*(tensors[name] for name in rule.hf))
        except ValueError as err:  # a reshape that does not fit: config and weights disagree
            shapes = {name: tuple(tensors[name].shape) for name in rule.hf}
            raise ConversionError(
                f"weights {shapes} do not fit {list(rule.ours)} of the config: {err}"
            ) from err
        out.update(zip(rule.ours, values, strict=True))
        used.update(rule.hf)
    extra = sorted(n for n in tensors if n not in used and not (ignore and ignore.search(n)))
    if extra:
        shown = ", ".join(extra[:8]) + (f" and {len(extra) - 8} more" if len(extra) > 8 else "")
        raise ConversionError(
            f"the {arch.model_type} checkpoint has weights this converter does not map: {shown}; "
            "the model they belong to has parts this project's model lacks, so converting "
            "without them would change its outputs"
        )
    return out


def ours_to_hf(arch: Architecture, config: ModelConfig, hf_config: dict,
               flat: Mapping[str, np.ndarray]):
    """A state dict (names with ``export_prefix``) from flat ``{our path: array}``."""
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for rule in arch.rules(config, hf_config):
        values = rule.to_hf(*(flat[path] for path in rule.ours))
        for name, value in zip(rule.hf, values, strict=True):
            prefix = "" if name.startswith(arch.top_level) else arch.export_prefix
            out[prefix + name] = np.ascontiguousarray(value)
        used.update(rule.ours)
    extra = sorted(set(flat) - used)
    if extra:
        raise ConversionError(f"parameters with no {arch.model_type} equivalent: {extra}")
    return out


def example_inputs(config: ModelConfig, length: int = 8) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``build_model(config).init``/``apply`` on a dummy batch."""
    from transformers_jax.models import family_of

    tokens, kwargs = family_of(config).example_inputs(config, length)
    return (tokens,), kwargs


def param_shapes(config: ModelConfig) -> dict:
    """The unboxed parameter tree of ``build_model(config)`` as ``ShapeDtypeStruct``s."""
    import flax.linen as nn
    import jax

    from transformers_jax.models import build_model

    model = build_model(config)
    args, kwargs = example_inputs(config, length=min(8, config.max_len))
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))
    return nn.meta.unbox(variables["params"])


def check_against_model(config: ModelConfig, flat: Mapping[str, np.ndarray]) -> None:
    """The converted tree must be exactly the one ``build_model(config).init`` makes."""
    want = {k: tuple(v.shape) for k, v in flatten(param_shapes(config)).items()}
    have = {k: tuple(v.shape) for k, v in flat.items()}
    if want != have:
        problems = [f"missing {k} {want[k]}" for k in sorted(set(want) - set(have))]
        problems += [f"unexpected {k} {have[k]}" for k in sorted(set(have) - set(want))]
        problems += [
            f"{k}: converted {have[k]}, model wants {want[k]}"
            for k in sorted(set(want) & set(have))
            if want[k] != have[k]
        ]
        raise ConversionError(
            "the converted parameters do not match the model built from the converted config:\n  "
            + "\n  ".join(problems)
        )
