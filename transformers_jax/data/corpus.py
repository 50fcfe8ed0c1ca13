"""Text sources: the embedded default corpus and the user's own files."""

from __future__ import annotations

import glob
import os


def default_corpus() -> str:
    """Python's own documentation topics (``pydoc_data``, ~465 KB of English), present on every
    CPython install, so the default run needs no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def default_documents() -> list[tuple[str, str]]:
    """The default corpus as documents: ``(topic name, text)`` per pydoc topic, sorted by name.

    ``"\n\n".join(text for _, text in default_documents()) == default_corpus()``.
    """
    from pydoc_data.topics import topics

    return [(key, topics[key]) for key in sorted(topics)]


def expand_paths(path: str) -> list[str]:
    """The files that ``path`` names (a file, a folder searched recursively, or a glob), sorted;
    hidden files in folders are skipped. A missing path is a ``FileNotFoundError``."""
    return _expand(path)


def _expand(path: str) -> list[str]:
    if any(ch in path for ch in "*?["):
        return sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
    if os.path.isdir(path):
        return sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(path)
            for name in names
            if not name.startswith(".")
        )
    if os.path.isfile(path):
        return [path]
    raise FileNotFoundError(
        f"--data {path!r}: no such file, folder or glob match; pass a text file, a folder of "
        "text files or a glob such as 'corpus/*.txt', or omit --data for the default corpus"
    )


def read_text(path: str | None) -> bytes:
    """The raw bytes of ``path`` (file, folder or glob; files joined by a blank line).

    Bytes, not str: the byte tokenizer needs no decoding, so undecodable input is never an error
    and nothing is silently dropped.
    """
    if path is None:
        return default_corpus().encode("utf-8")
    files = _expand(path)
    if not files:
        raise FileNotFoundError(f"--data {path!r} matched no files")
    parts = []
    for name in files:
        with open(name, "rb") as f:
            parts.append(f.read())
    data = b"\n\n".join(parts)
    if not data.strip():
        raise ValueError(f"--data {path!r}: the corpus is empty ({len(files)} file(s), no text)")
    return data
