"""``benchmarks/context_limits.py``'s search for the longest length that fits, on a fake
compiler (memory a function of the length): it finds the same answer as doubling every
length, whether or not the memory grows linearly, in fewer compiles where it does."""

import pytest

from tests.benchmark_modules import load_benchmark

GIB = 2**30


@pytest.fixture(scope="module")
def limits():
    return load_benchmark("context_limits")


def fake_compiler(limits, monkeypatch, bytes_at):
    compiled = []

    def fits_at(name, target_name, context, seq_len):
        compiled.append(seq_len)
        used = bytes_at(seq_len)
        return {"seq_len": seq_len, "fits": used <= 16 * GIB, "bytes_per_chip": used,
                "compile_s": 0.0, "command": f"len {seq_len}"}

    monkeypatch.setattr(limits, "fits_at", fits_at)
    return compiled


def by_doubling(bytes_at, start, ceiling):
    best, n = None, start
    while n <= ceiling and bytes_at(n) <= 16 * GIB:
        best, n = n, 2 * n
    return best


@pytest.mark.parametrize("bytes_at, most", [
    (lambda t: 4 * GIB + t * 40_000, 4),              # linear: 262,144 fit, 524,288 do not
    (lambda t: 2 * GIB + t * 2_000 + t * t // 4, 6),  # quadratic: the line's guess overshoots
    (lambda t: 15 * GIB + t * 100_000, 3),            # 8,192 fit, 16,384 do not
    (lambda t: 17 * GIB + t, 1),                      # nothing fits
    (lambda t: GIB + t, 3),                           # everything up to LONGEST fits
], ids=["linear", "quadratic", "tight", "none", "unbounded"])
def test_longest_matches_doubling(limits, monkeypatch, bytes_at, most):
    compiled = fake_compiler(limits, monkeypatch, bytes_at)
    row = limits.longest("llama-3.2-1b", "v5e:2x4", 1, 4096)
    expected = by_doubling(bytes_at, 4096, limits.LONGEST)
    assert row["longest"] == expected
    assert len(compiled) == len(set(compiled)) <= most  # no length compiled twice
    if expected is None:
        assert (row["first_failure"], row["limit"]) == (4096, "memory")
    elif expected == limits.LONGEST:
        assert (row["first_failure"], row["limit"]) == (None, "not reached")
    else:
        assert (row["first_failure"], row["limit"]) == (2 * expected, "memory")
    if expected is not None:
        assert row["bytes_per_chip"] == bytes_at(expected)
    assert [t["seq_len"] for t in row["tried"]] == sorted(compiled)


def test_longest_stops_at_the_position_table(limits, monkeypatch):
    """GPT-2's learned table ends at 1,024: one compile, and the table is the limit."""
    compiled = fake_compiler(limits, monkeypatch, lambda t: GIB)
    row = limits.longest("gpt2-xl", "v5e:2x4", 1, 4096)
    assert compiled == [1024]
    assert (row["longest"], row["limit"], row["first_failure"]) == (1024, "position table", None)
