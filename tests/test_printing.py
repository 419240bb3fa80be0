"""dml.print: rank/time prefix, one line per call, rank 0 only on request."""

from __future__ import annotations

import re

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
