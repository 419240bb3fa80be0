"""Every ```python block of the documentation runs, and the API reference lists every public name.

How blocks run (docs/**/*.md, and README.md as one more page):

- The unmarked blocks of one page run in order in one fresh process, sharing their names
  (a later block uses what an earlier one defined), in a temporary directory. The process
  is forked from a server that has imported torch and the modules of its first optimizer
  step (about 4 s that every page would otherwise pay again). Blocks keep their page's line numbers,
  so a traceback points into the Markdown file.
- A block preceded by ``<!-- mpi: N -->`` is a complete script, run alone with
  ``mpiexec -n N``; with ``<!-- mpi: N, fails -->`` the job must end with a non-zero
  status and the fail-fast report (the fail-fast example). ``, expect: TEXT`` after either
  form (``<!-- mpi: 2, expect: CollectiveMismatchError -->``) also requires TEXT in the
  job's output: use it where a block prints what the page says it prints. A failing block
  with ``expect`` needs TEXT instead of the fail-fast report (a stall report, for the
  examples of docs/hangs.md).
- A block preceded by ``<!-- skip: reason -->`` is shown, never run: code for GPUs,
  Horovod or torchrun. Commands and output use ```bash / ```text fences.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import distutils_ml as dml

from mpirun import mpi_env, mpiexec, requires_mpi

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGE_TIMEOUT_S = 120
MPI_TIMEOUT_S = 120

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>mpi|skip)\s*:\s*(?P<value>.*?)\s*-->\s*$")
_MPI_VALUE = re.compile(r"^(?P<n>\d+)(?P<fails>\s*,\s*fails)?(?:\s*,\s*expect\s*:\s*(?P<expect>\S.*))?$")

# Imports torch and what its first optimizer step imports (about 4 s together) but runs no
# kernel (forked children would inherit half-initialized BLAS state and crash), then, for
# each request line [page, blocks, cwd, log], forks a child that runs the page's blocks in
# one fresh namespace, writing to the log; answers with the child's exit status.
_SERVER = r"""
import atexit, faulthandler, json, os, sys, traceback
import torch
import torch._dynamo  # what the first optimizer step imports
import distutils_ml

def run(page, blocks):
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile("\n" * line + code, page, "exec"), namespace)
        print(f"docs block {page}:{line + 1} ok", flush=True)

for request in sys.stdin:
    page, blocks, cwd, log = json.loads(request)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(cwd)
        faulthandler.enable()
        status = 0
        try:
            run(page, blocks)
        except BaseException:
            traceback.print_exc()
            status = 1
        atexit._run_exitfuncs()  # what a normal exit runs (MPI_Finalize after a singleton init)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), flush=True)
"""


@dataclass(frozen=True)
class Block:
    """One fenced code block: its page, the line of its first code line (0-based), its code."""

    page: str
    line: int
    code: str
    mpi: int = 0
    fails: bool = False
    expect: str = ""
    skip: str = ""

    def __str__(self) -> str:
        return f"{self.page}:{self.line + 1}"


def _blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, with the marker on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT))
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence)}\s*$", lines[end]):
            end += 1
        language = opening["info"].split()[0] if opening["info"].split() else ""
        if language == "python":
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            marker = _MARKER.match(lines[i - 1]) if i > 0 else None
            mpi, fails, expect, skip = 0, False, "", ""
            if marker and marker["kind"] == "mpi":
                value = _MPI_VALUE.match(marker["value"])
                if value is None:
                    raise ValueError(
                        f"{page}:{i}: bad marker {lines[i - 1].strip()!r}; "
                        "allowed: <!-- mpi: N -->, <!-- mpi: N, fails -->, either with ', expect: TEXT' after it"
                    )
                mpi, fails, expect = int(value["n"]), bool(value["fails"]), value["expect"] or ""
            elif marker:
                skip = marker["value"] or "marked skip"
            found.append(Block(page, i + 1, code, mpi, fails, expect, skip))
        i = end + 1
    return found


PAGES = [
    *sorted(p for p in DOCS.rglob("*.md") if not any(part.startswith("_") for part in p.parts)),
    ROOT / "README.md",
]
BLOCKS = [b for p in PAGES for b in _blocks(p)]
PAGE_BLOCKS = {
    page: blocks
    for page in sorted({b.page for b in BLOCKS})
    if (blocks := [b for b in BLOCKS if b.page == page and not b.mpi and not b.skip])
}
MPI_BLOCKS = [b for b in BLOCKS if b.mpi]


def _env() -> dict[str, str]:
    """The test jobs' MPI settings (root allowed, no libfabric probe), one torch thread per process."""
    env = mpi_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_blocks_are_found_and_counted() -> None:
    skipped = [b for b in BLOCKS if b.skip]
    print(
        f"{len(BLOCKS)} python blocks in {len(PAGES)} pages: {sum(map(len, PAGE_BLOCKS.values()))} run in "
        f"{len(PAGE_BLOCKS)} page sessions, {len(MPI_BLOCKS)} under mpiexec, {len(skipped)} skipped"
    )
    assert len(PAGE_BLOCKS) >= 5, sorted(PAGE_BLOCKS)
    assert len(MPI_BLOCKS) >= 1
    assert any(b.expect for b in MPI_BLOCKS), "no <!-- mpi: N, expect: TEXT --> block"
    assert "README.md" in PAGE_BLOCKS, "README.md's python block is not collected"


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("2", (2, False, "")),
        ("2, fails", (2, True, "")),
        ("2, expect: CollectiveMismatchError", (2, False, "CollectiveMismatchError")),
        ("3 , fails , expect:  ValueError: bad batch", (3, True, "ValueError: bad batch")),
        ("2, expect:", None),
        ("2, fail", None),
        ("two", None),
    ],
)
def test_mpi_marker_forms(value: str, parsed: tuple[int, bool, str] | None) -> None:
    m = _MPI_VALUE.match(value)
    assert (m and (int(m["n"]), bool(m["fails"]), m["expect"] or "")) == parsed
    assert sum(map(len, PAGE_BLOCKS.values())) + len(MPI_BLOCKS) > 20


@pytest.fixture(scope="module")
def page_server() -> Iterator[subprocess.Popen[str]]:
    """The process that forks one child per page (see _SERVER); killed with its children at the end."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    yield server
    assert server.stdin is not None
    server.stdin.close()
    try:
        server.wait(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.parametrize("page", sorted(PAGE_BLOCKS))
def test_page_blocks_run(page: str, page_server: subprocess.Popen[str], tmp_path: Path) -> None:
    assert page_server.stdin is not None and page_server.stdout is not None
    log = tmp_path / "output.log"
    blocks = [(b.line, b.code) for b in PAGE_BLOCKS[page]]
    page_server.stdin.write(json.dumps([page, blocks, str(tmp_path), str(log)]) + "\n")
    page_server.stdin.flush()
    ready, _, _ = select.select([page_server.stdout], [], [], PAGE_TIMEOUT_S)
    if not ready:
        os.killpg(page_server.pid, signal.SIGKILL)
        pytest.fail(f"{page}: still running after {PAGE_TIMEOUT_S} s\n{log.read_text()[-8000:]}")
    answer = page_server.stdout.readline()
    output = log.read_text() if log.exists() else ""
    assert answer.strip() == "0", f"{page}: a block failed (exit status {answer.strip()!r})\n{output[-8000:]}"
    assert output.count("docs block ") == len(blocks), output[-8000:]


@requires_mpi
@pytest.mark.parametrize("block", MPI_BLOCKS, ids=str)
def test_mpi_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text("\n" * block.line + block.code, encoding="utf-8")
    exe = mpiexec()
    assert exe is not None
    cmd = [exe, "-n", str(block.mpi)]
    if block.mpi > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    cmd += [sys.executable, str(script)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=MPI_TIMEOUT_S, check=False
    )
    output = proc.stdout + proc.stderr
    if block.fails:
        assert proc.returncode != 0, f"{block}: the job should have failed\n{output[-8000:]}"
        if not block.expect:
            assert "distutils_ml: uncaught exception on rank" in output, output[-8000:]
    else:
        assert proc.returncode == 0, f"{block}: the job failed\n{output[-8000:]}"
    assert block.expect in output, f"{block}: {block.expect!r} is not in the output\n{output[-8000:]}"


def test_api_reference_lists_every_public_name() -> None:
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^:::\s+distutils_ml\.(\w+)\s*$", api, flags=re.MULTILINE))
    constants = {"SUM", "PROD", "MAX", "MIN", "AVG"}  # ReduceOp members, described under ReduceOp
    missing = sorted(set(dml.__all__) - constants - documented)
    assert not missing, f"docs/api.md has no '::: distutils_ml.NAME' block for {missing}"
    unknown = sorted(documented - set(dml.__all__))
    assert not unknown, f"docs/api.md documents names that distutils_ml does not export: {unknown}"


API_NAMES = re.findall(r"^:::\s+distutils_ml\.(\w+)\s*$", (DOCS / "api.md").read_text(encoding="utf-8"), re.MULTILINE)


@pytest.mark.parametrize("name", API_NAMES)
def test_docstring_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``>>>`` examples the API reference shows run as doctests, in a world of one.

    Each object's examples (its methods' too) share one namespace holding ``dml``, ``np``,
    ``torch`` and ``backend`` (a ``LocalBackend`` world of one), in a temporary directory.
    """
    import doctest

    import numpy as np
    import torch

    monkeypatch.chdir(tmp_path)
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    tests = [t for t in finder.find(getattr(dml, name), f"dml.{name}", module=False) if "._" not in t.name]
    globs = {"dml": dml, "np": np, "torch": torch, "backend": dml.LocalBackend()}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in sorted(tests, key=lambda t: t.lineno or 0):
        test.globs = globs
        out = lambda text: pytest.fail(f"dml.{name}: a docstring example failed:\n{text}")  # noqa: E731
        runner.run(test, out=out, clear_globs=False)
    assert runner.tries == sum(len(t.examples) for t in tests)


# -- What the pages must say (issue 11, item 18: docs that promised too much or mapped wrongly) ----------------


def _text(relative: str) -> str:
    return (ROOT / relative).read_text(encoding="utf-8")


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated chunks of a page (table rows and list items stay with their neighbours)."""
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _table_rows(text: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of every two-column Markdown table row (cells may hold escaped pipes)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 2 and not set(cells[0]) <= set("-: "):
            rows.append((cells[0], cells[1]))
    return rows


def _admonitions(text: str) -> list[str]:
    """The bodies (title line included) of the page's ``!!!`` admonitions."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("!!! "):
            body = [line]
            for nxt in lines[i + 1 :]:
                if nxt.strip() and not nxt.startswith("    "):
                    break
                body.append(nxt)
            found.append("\n".join(body))
    return found


MIGRATION = ["docs/migration/ddp.md", "docs/migration/horovod.md", "docs/migration/lux.md"]


def test_readme_sends_users_only_to_what_the_package_ships() -> None:
    readme = _text("README.md")
    assert "../shared" not in readme and "DESIGN.md" not in readme, "README points outside the repository"
    assert "(docs/contract.md)" in readme and "(docs/hangs.md)" in readme


def test_every_page_is_in_the_nav_and_the_new_pages_are_linked() -> None:
    config = _text("mkdocs.yml")
    nav = config[config.index("\nnav:") : config.index("\nmarkdown_extensions:")]
    listed = set(re.findall(r":\s*\"?([\w/.-]+\.md)\"?\s*$", nav, flags=re.MULTILINE))
    pages = {str(p.relative_to(DOCS)) for p in PAGES if p.is_relative_to(DOCS)}
    assert pages == listed, f"not in the nav: {sorted(pages - listed)}; in the nav, no file: {sorted(listed - pages)}"
    assert "(hangs.md)" in _text("docs/reliability.md")
    assert "contract.md" in _text("docs/migration/ddp.md") + _text("docs/migration/lux.md")


def test_bit_equality_with_ddp_is_claimed_for_two_ranks_only() -> None:
    claims = [
        (page, para)
        for page in PAGES
        for para in _paragraphs(page.read_text(encoding="utf-8"))
        if re.search(r"bitwise|bit[- ]for[- ]bit|bit-identical|bit-equal", para, flags=re.IGNORECASE)
        and re.search(r"\bDDP\b|DistributedDataParallel", para)
    ]
    assert claims, "no page compares the parameters with DDP's any more"
    for page, para in claims:
        assert re.search(r"2 ranks|two ranks", para), f"{page.name}: a DDP equality claim without '2 ranks':\n{para}"
    ddp = _text("docs/migration/ddp.md")
    assert "3 or 4 ranks" in ddp and "order" in ddp


def test_sampler_rows_keep_the_samplers_shuffle() -> None:
    for page in ("docs/migration/horovod.md", "docs/migration/ddp.md"):
        rows = [(a, b) for a, b in _table_rows(_text(page)) if "DistributedSampler(" in a]
        assert rows, page
        for sampler, ours in rows:
            if "shuffle=False" not in sampler:  # DistributedSampler shuffles unless told otherwise
                assert "shuffle=True" in ours, f"{page}: {sampler} maps to a container that does not shuffle"
        assert any("set_epoch" in a and "set_epoch" in b for a, b in _table_rows(_text(page))), page


def test_horovod_table_covers_gradient_predivide_factor() -> None:
    rows = dict(_table_rows(_text("docs/migration/horovod.md")))
    assert any("gradient_predivide_factor" in k for k in rows)
    assert "## `gradient_predivide_factor`" in _text("docs/migration/horovod.md")


def test_ddp_page_explains_the_module_prefix_and_local_gradients() -> None:
    ddp = _text("docs/migration/ddp.md")
    assert "consume_prefix_in_state_dict_if_present" in ddp and "`module.`" in ddp
    for sampler, ours in _table_rows(ddp):
        if "clip_grad_norm_" in sampler or "unscale_" in sampler:
            assert "opt.synchronize()" in ours, sampler


def test_len_of_the_loader_dataset_is_said_to_be_the_share() -> None:
    for page in ("docs/data.md", "docs/migration/ddp.md", "docs/migration/horovod.md"):
        text = _text(page)
        assert "len(loader.dataset)" in text and "share" in text, page
    assert "dml.numobs" in _text("docs/data.md")


@pytest.mark.parametrize("page", ["docs/optimizer.md", *MIGRATION])
def test_reading_grad_after_backward_is_an_admonition(page: str) -> None:
    """Each page says loudly what .grad holds after backward(): the average, clipping/AMP need no opt.synchronize()."""
    loud = [a for a in _admonitions(_text(page)) if "opt.synchronize()" in a]
    assert loud, f"{page}: no admonition says whether opt.synchronize() is needed before reading .grad"
    body = "\n".join(loud)
    for word in ("clip", "GradScaler", "stall"):
        assert word in body, f"{page}: the admonition does not mention {word!r}"


def test_collectives_are_said_not_to_be_differentiable() -> None:
    assert "Not differentiable" in _text("docs/contract.md")
    assert "not differentiable" in _text("docs/migration/ddp.md")


def test_hang_page_maps_the_usual_causes() -> None:
    hangs = _text("docs/hangs.md")
    headings = re.findall(r"^## (.+)$", hangs, flags=re.MULTILINE)
    for cause in ("rank condition", "Uneven loops", "slow rank", "crashed rank", "exited", "threads", "options"):
        assert any(cause in h for h in headings), f"docs/hangs.md: no section on {cause!r}: {headings}"
    runs = [b for b in MPI_BLOCKS if b.page == "docs/hangs.md"]
    assert len(runs) >= 3 and all(b.fails and b.expect for b in runs), "the hang examples must run and fail as shown"


# -- What the pages must say about the features of issue 11 (items 15-17 and the core) ------------------------


def test_no_page_drops_the_padding_by_hand() -> None:
    # share[: len(share) - share.num_padded] breaks on a TensorDataset: pages use share.unpadded() instead.
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"-\s*\w+\.num_padded\s*\]", text), f"{page.name} slices the padding off by hand"
    data = _text("docs/data.md")
    assert ".unpadded()" in data and "dml.gather_unpadded(" in data and "dataset order" in data
    for page in ("docs/integration.md", "docs/testing.md"):
        assert "dml.gather_unpadded(" in _text(page), page


def test_exact_resume_recipe() -> None:
    reliability = _text("docs/reliability.md")
    for needed in ("generator=torch.Generator()", "dml.rng_state_all(backend)", "dml.set_rng_state_all(backend"):
        assert needed in reliability, needed
    assert not re.search(r"synchronize\(backend, dml\.rng_state\(\)", reliability), "one broadcast per rank"
    runs = [b for b in MPI_BLOCKS if b.page == "docs/reliability.md" and "set_rng_state_all" in b.code]
    assert runs and all("bitwise" in b.expect and "generator=torch.Generator()" in b.code for b in runs)


def test_buffers_and_the_optimizer_rules_are_documented() -> None:
    integration = _text("docs/integration.md")
    assert "dml.broadcast_buffers(backend" in integration and "SyncBatchNorm" in integration
    optimizer = _text("docs/optimizer.md")
    for needed in ("once per step", "`opt.zero_grad()`", "SparseAdam", "step(closure)", "ValueError"):
        assert needed in optimizer, needed
