"""Name -> object registries behind every switch of the config, and the base of switch values.

Every switch value (a positional scheme, a mask kind, an attention implementation, a RoPE
scaling, a norm and where it sits, an MLP, a model family) is one registered object that
carries its own settings and the hooks the model calls; code outside it never tests its name.
Adding one is one class decorated with ``@REGISTRY.register("name")``, in its own file, and
one import line in ``builtins.py``; looking up an unknown name raises an error that lists the
valid ones. The built-in entries' modules import no JAX, so that a config is built and checked
without it: a hook imports the maths it calls (JAX, Flax, a kernel's module) when it runs.

This module is the machinery only: it imports nothing of the project and no JAX, and loads no
module by name. The registries of the config's switches are declared at the bottom, empty;
``builtins.py``, in a layer above every module holding an entry, gives each one the function
that imports its built-in entries (``Registry.fill_from``), which runs the first time the
registry is read. So importing ``config.py`` imports no model code, and the import contracts
see every edge from the catalogue to the entries.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says which field and how to fix it.
    (Defined here, the bottom layer, so that switch entries can raise it; ``config`` exports
    it.)"""


class UnknownNameError(ValueError):
    """Raised when a switch names something no registry entry provides."""


class Registry(Generic[T]):
    """A mapping from names to implementations, with errors that list the choices."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fill: Callable[[], object] | None = None
        self._entries: dict[str, T] = {}
        # Set by the loading module where a config may name only some entries (tokenizers
        # restored with a converted run, never built): entry -> None if a config may name it,
        # else why not.
        self.refusal: Callable[[T], str | None] = lambda entry: None

    def fill_from(self, load: Callable[[], object]) -> None:
        """Call ``load`` (a function importing the modules that register the built-in entries,
        given by ``builtins.py``) the first time the registry is read, not before: what a
        command imports stays what it uses."""
        self._fill = load

    def _ensure_loaded(self) -> None:
        if self._fill is not None:
            load, self._fill = self._fill, None  # before loading: an entry's module may read us
            try:
                load()
            except BaseException:  # an entry's module failed to import: try again next read
                self._fill = load
                raise

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            if isinstance(obj, type) and issubclass(obj, Switch):
                obj.registered_name = name
                obj.registry = self
            self._entries[name] = obj
            return obj

        return add

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def get(self, name: str) -> T:
        self._ensure_loaded()
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; {self._hint(name)}valid choices: "
                f"{', '.join(self.names())}"
            ) from None

    def check(self, name: str, field: str) -> None:
        """Raise a config-style error naming ``field`` if ``name`` is not registered."""
        self._ensure_loaded()
        if name not in self._entries:
            raise UnknownNameError(
                f"{field}={name!r} is not a known {self.kind}; {self._hint(name)}"
                f"valid choices: {', '.join(self.names())}"
            )

    def _hint(self, name: Any) -> str:
        near = difflib.get_close_matches(str(name), list(self._entries), n=1, cutoff=0.6)
        return f"did you mean {near[0]!r}? " if near else ""

    def select(self, name: str, field: str) -> T:
        """The entry of ``name`` for config field ``field``: a ``ConfigError`` naming the field,
        the reason and the names a config may use, if it is unknown or ``refusal`` refuses it."""
        self._ensure_loaded()
        why = "not known" if name not in self._entries else self.refusal(self._entries[name])
        if why is not None:
            raise ConfigError(f"{field}={name!r}: {why}; valid choices: "
                              f"{', '.join(self.selectable())}")
        return self._entries[name]

    def selectable(self) -> tuple[str, ...]:
        """The names a config may use (every entry ``refusal`` admits), sorted."""
        return self.names_where(lambda entry: self.refusal(entry) is None)

    def names(self) -> list[str]:
        self._ensure_loaded()
        return sorted(self._entries)

    def names_where(self, keep: Callable[[T], bool]) -> tuple[str, ...]:
        """The names of the entries for which ``keep(entry)`` holds, sorted."""
        return tuple(name for name, entry in self.items() if keep(entry))

    def items(self) -> list[tuple[str, T]]:
        return [(name, self._entries[name]) for name in self.names()]

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


@dataclasses.dataclass(frozen=True)
class Switch:
    """Base of a registered switch value that carries its own settings (a frozen dataclass).

    A config holds an instance. ``name`` is the registered name (set by ``Registry.register``,
    and a field so that ``dataclasses.asdict`` writes it to JSON). On the command line
    ``--model.position=t5`` picks the entry with its defaults and
    ``--model.position.num_buckets=16`` sets one of its fields; in JSON it is
    ``{"name": "t5", "num_buckets": 16, ...}``. A field that is itself a switch declares its
    registry in its metadata (``switch_field(REGISTRY, "default")``).

    Construction never fails on defaults; ``check(model_config)`` refuses what cannot work.
    """

    name: str = dataclasses.field(default="", init=False)
    registered_name: ClassVar[str] = ""
    registry: ClassVar[Registry | None] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.registered_name)
        resolve_switch_fields(self)
        check_field_types(self, f"{self.registry.kind if self.registry else 'switch'} "
                                f"{self.registered_name}: ")

    def check(self, config: Any) -> None:
        """Refuse, with a ``ConfigError`` naming the field, a model config it cannot serve."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        def is_default(f: dataclasses.Field) -> bool:
            value = getattr(self, f.name)
            if isinstance(value, Switch):  # the field's default is the name of an entry
                return str(value) == f.default
            return value == f.default

        changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if f.init and not is_default(f)]
        return self.name + (f"({', '.join(changed)})" if changed else "")


def _expected(annotation: Any) -> tuple[tuple[type, ...], bool] | None:
    """``(accepted scalar types, None allowed)`` for an int/float/bool/str annotation, or None
    for any other (tuples, switches: checked elsewhere)."""
    allow_none = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        allow_none = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            return None
        annotation = args[0]
    if annotation in (int, float, bool, str):
        return (annotation,), allow_none
    return None


def check_field_types(obj: Any, prefix: str = "") -> None:
    """Refuse, with a ``ConfigError`` naming the field, a value of the wrong type for an
    int/float/bool/str field (``"8"`` for an int, ``2.5`` for an int, ``1`` for a bool) and a
    float that is not finite (``nan``, ``inf``): what the comparisons of the checks below
    would otherwise turn into a ``TypeError`` or let through."""
    try:
        hints = typing.get_type_hints(type(obj))
    except Exception:  # an annotation that cannot be resolved here: nothing to check
        return
    for f in dataclasses.fields(obj):
        if not f.init or "registry" in f.metadata or f.name not in hints:
            continue
        expected = _expected(hints[f.name])
        if expected is None:
            continue
        (kind,), allow_none = expected
        value = getattr(obj, f.name)
        if value is None and allow_none:
            continue
        problem = "expected " + WANTED[kind] if value is None else type_problem(kind, value)
        if problem is not None:
            raise ConfigError(f"{prefix}{f.name}={value!r}: {problem}"
                              + (" or None" if allow_none and problem.startswith("expected")
                                 else ""))


WANTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def type_problem(kind: type, value: Any) -> str | None:
    """What is wrong with ``value`` for a field of ``kind`` (int, float, bool or str), or None:
    a bool is not a number, 2.5 is not an integer, a number must be finite."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            return "must be a finite number"
    else:
        ok = isinstance(value, str)
    return None if ok else "expected " + WANTED[kind]


def switch_field(registry: Registry, default: str) -> Any:
    """A dataclass field holding a switch of ``registry`` (``default``: an entry name)."""
    return dataclasses.field(default=default, metadata={"registry": registry})


def resolve_switch_fields(obj: Any, prefix: str = "") -> None:
    """Turn names or JSON dicts in ``obj``'s switch fields into switch instances, in place."""
    for f in dataclasses.fields(obj):
        registry = f.metadata.get("registry")
        if registry is not None:
            value = resolve(registry, getattr(obj, f.name), prefix + f.name)
            object.__setattr__(obj, f.name, value)


def check_known_fields(cls: type, data: dict, prefix: str, owner: str) -> None:
    """Refuse JSON-like ``data`` with keys that are not init fields of the dataclass ``cls``
    (``owner`` names it in the message, ``prefix`` the keys)."""
    fields = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown field(s) {[prefix + k for k in unknown]}: {owner} has no such field; "
            f"valid fields: {', '.join(fields) or 'none'}")


def resolve(registry: Registry, value: Any, field: str) -> Switch:
    """A switch value from a name (the entry's defaults), a JSON dict with ``name``, or an
    instance (returned as it is)."""
    if isinstance(value, Switch):
        registry.check(value.name, field)
        return value
    if isinstance(value, str):
        registry.check(value, field)
        return registry.get(value)()
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        registry.check(value["name"], field)
        cls = registry.get(value["name"])
        rest = {k: v for k, v in value.items() if k != "name"}  # the name is not an argument
        check_known_fields(cls, rest, f"{field}.", f"{field}={value['name']}")
        return cls(**rest)  # nested switches resolve in __post_init__
    raise ConfigError(
        f"{field}={value!r}: expected a {registry.kind} name ({', '.join(registry.names())}) "
        'or {"name": ..., <its fields>}'
    )


# The registries of the config's switches; ``builtins.py`` says where their entries are.
POSITIONS: Registry = Registry("position scheme")
ROPE_SCALINGS: Registry = Registry("RoPE scaling")
MASKS: Registry = Registry("mask kind")
ATTENTION: Registry = Registry("attention implementation")
NORMS: Registry = Registry("norm")
NORM_PLACEMENTS: Registry = Registry("norm placement")
MLPS: Registry = Registry("mlp")
FAMILIES: Registry = Registry("model family")
TOKENIZERS: Registry = Registry("tokenizer")
