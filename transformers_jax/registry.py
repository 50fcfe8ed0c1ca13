"""Tiny name -> object registries behind every string switch in the config.

Adding a scheme is one function plus one ``@REGISTRY.register("name")`` line; looking up an
unknown name raises an error that lists the valid ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """Raised when a switch names something no registry entry provides."""


class Registry(Generic[T]):
    """A mapping from names to implementations, with errors that list the choices."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid choices: {', '.join(self.names())}"
            ) from None

    def check(self, name: str, field: str) -> None:
        """Raise a config-style error naming ``field`` if ``name`` is not registered."""
        if name not in self._entries:
            raise UnknownNameError(
                f"{field}={name!r} is not a known {self.kind}; "
                f"valid choices: {', '.join(self.names())}"
            )

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
