"""dml.print: rank/time prefix, one line per call, rank 0 only on request."""

from __future__ import annotations

import re

import pytest

import distutils_ml as dml


def test_prefix_on_every_rank(capsys) -> None:
    dml.LocalBackend.spawn(3, lambda b: dml.print(b, "loss", 0.5, [1, 2]))
    lines = sorted(capsys.readouterr().out.splitlines())
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        assert re.fullmatch(rf"\[{rank}/3 \d\d:\d\d:\d\d\.\d{{3}}\] loss 0\.5 \[1, 2\]", line), line


def test_rank_zero_only(capsys) -> None:
    dml.LocalBackend.spawn(4, lambda b: dml.print(b, "hello", all_ranks=False))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1
    assert out[0].startswith("[0/4 ")


def test_sep_and_end_pass_through(capsys) -> None:
    b = dml.LocalBackend()
    dml.print(b, "a", "b", sep="-", end="!\n")
    assert capsys.readouterr().out.endswith("] a-b!\n")


PREFIX = r"\[(\d)/(\d) \d\d:\d\d:\d\d\.\d{3}\] "


class Writes:
    """A text file that records each write separately (a shared log of simulated ranks)."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushes += 1


def test_every_line_is_prefixed(capsys) -> None:
    b = dml.LocalBackend()
    dml.print(b, "table:\nrow 1\nrow 2", {"k": "v"}, sep="\n")
    lines = capsys.readouterr().out.split("\n")
    assert lines[-1] == ""  # end
    assert [re.sub(PREFIX, "", line, count=1) for line in lines[:-1]] == ["table:", "row 1", "row 2", "{'k': 'v'}"]
    assert all(re.match(PREFIX, line) for line in lines[:-1]), lines
    dml.print(b, "a\n", "b", sep="\n", end="")  # an empty line is a line too; end gets no prefix
    out = capsys.readouterr().out
    assert re.fullmatch(f"{PREFIX}a\n{PREFIX}\n{PREFIX}b", out), out


def test_one_write_per_call_on_concurrent_ranks() -> None:
    log = Writes()

    def body(backend: dml.Backend) -> None:
        for k in range(50):
            dml.print(backend, f"step {k}\nloss {k / 2}", "done", file=log, end=" .\n")

    dml.LocalBackend.spawn(4, body)
    assert len(log.writes) == 200 and log.flushes == 200
    for text in log.writes:
        m = re.fullmatch(f"{PREFIX}step (\\d+)\n{PREFIX}loss ([\\d.]+) done .\n", text)
        assert m and m[1] == m[4] and m[2] == m[5] == "4" and float(m[6]) == int(m[3]) / 2, text


def test_flush_false_and_bad_separators() -> None:
    log = Writes()
    dml.print(dml.LocalBackend(), "x", file=log, flush=False)
    assert len(log.writes) == 1 and log.flushes == 0
    for kwargs in ({"sep": 1}, {"end": b"\n"}):
        with pytest.raises(TypeError, match="allowed: None or a string"):
            dml.print(dml.LocalBackend(), "x", **kwargs)
