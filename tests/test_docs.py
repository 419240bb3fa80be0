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
from collections.abc import Callable, Iterator
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


def _mpiexec_block(
    block: Block, code: str, ranks: int, directory: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``code`` (a block's, run from the block's line: tracebacks name the page's lines) under ``mpiexec -n ranks``, in
    ``directory``."""
    script = directory / "block.py"
    script.write_text("\n" * block.line + code, encoding="utf-8")
    exe = mpiexec()
    assert exe is not None
    cmd = [exe, "-n", str(ranks), *(["--oversubscribe"] if ranks > (os.cpu_count() or 1) else [])]
    return subprocess.run(
        [*cmd, sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=directory,
        env=_env(),
        timeout=timeout,
        check=False,
    )


@requires_mpi
@pytest.mark.parametrize("block", MPI_BLOCKS, ids=str)
def test_mpi_block_runs(
    block: Block, tmp_path: Path, recipe_jobs: Callable[[int], subprocess.CompletedProcess[str]]
) -> None:
    if block == _recipe_block():  # run once with the cuts that test_the_recipe_resumes_bitwise... appends to it
        proc = recipe_jobs(block.mpi)
        output = proc.stdout + proc.stderr
        assert block.expect in output, f"{block}: {block.expect!r} is not in the output\n{output[-8000:]}"
        if "resumed bitwise at steps" not in output:
            pytest.fail(f"{block}: ran, but the cuts run after it in the same job failed (see the test of the recipe)")
        assert proc.returncode == 0, f"{block}: the job failed\n{output[-8000:]}"
        return
    proc = _mpiexec_block(block, block.code, block.mpi, tmp_path, MPI_TIMEOUT_S)
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


# -- One checkpoint recipe, and it resumes bitwise (issue 13, item 14) -----------------------------------------

RECIPE = "reliability.md#exact-resume"
_ONE_RANKS_RNG = re.compile(r"[\"']rng[\"']\s*:\s*dml\.rng_state\(\)|set_rng_state\(\s*(?:ckpt|checkpoint|dml\.load)")
CHECKPOINT_API = ("save", "load", "rng_state", "set_rng_state", "rng_state_all", "set_rng_state_all")


def _recipe_block() -> Block:
    (block,) = [b for b in MPI_BLOCKS if b.page == "docs/reliability.md" and "set_rng_state_all" in b.code]
    return block


def test_the_recipe_says_what_to_save_and_which_loaders_need_a_generator() -> None:
    text = " ".join(_text("docs/reliability.md").split())
    section = text[text.index("### Exact resume") : text.index("## When a process dies")]
    for needed in (
        "the other pages link here",
        '"sched": sched, "scaler": scaler',
        '"step": step',
        "the LR scheduler, the `GradScaler`",
        "the same on every rank and in every run",
        "**the training loader resumed mid-epoch**",
        "**any loader with `persistent_workers=True`**",
        "Not `dml.rng_state()` alone",
    ):
        assert needed in section, f"the exact-resume recipe does not say {needed!r}"
    code = _recipe_block().code
    for needed in ("lr_scheduler", "GradScaler", 'state["step"]', "generator=torch.Generator()", "stop_at"):
        assert needed in code, f"the recipe's example has no {needed!r}"


CHECKPOINT_PAGES = [
    page
    for page in PAGE_BLOCKS.keys() | {b.page for b in MPI_BLOCKS}
    if any(
        re.search(r"dml\.save\(", b.code) and re.search(r"[\"']opt[\"']\s*:", b.code) for b in BLOCKS if b.page == page
    )
]


@pytest.mark.parametrize("page", sorted(CHECKPOINT_PAGES))
def test_every_checkpoint_example_is_the_recipe_or_links_to_it(page: str) -> None:
    """A page whose example saves an optimizer with dml.save is the recipe's, or links to the recipe."""
    text = _text(page)
    assert page == "docs/reliability.md" or f"{RECIPE})" in text.replace("../", ""), f"{page}: no link to {RECIPE}"


def test_checkpoints_save_every_ranks_rng_state() -> None:
    """No page, README or docstring saves one rank's RNG state in a checkpoint, and the API points to the recipe."""
    for page in PAGES:
        found = _ONE_RANKS_RNG.search(page.read_text(encoding="utf-8"))
        assert not found, f"{page.name}: {found[0]!r} saves or restores one rank's RNG state; use dml.rng_state_all"
    for name in CHECKPOINT_API:
        doc = " ".join(getattr(dml, name).__doc__.split())
        found = _ONE_RANKS_RNG.search(doc)
        assert not found, f"dml.{name}'s docstring: {found[0]!r}; use dml.rng_state_all / dml.set_rng_state_all"
        assert "Exact resume" in doc, f"dml.{name}'s docstring does not point to the exact-resume recipe"
        if name != "rng_state_all":
            assert "rng_state_all" in doc, f"dml.{name}'s docstring does not mention dml.rng_state_all"
    api = _text("docs/api.md")
    assert f"({RECIPE})" in api and "dml.rng_state_all(backend)" in api


def _call_arguments(code: str, opening: int) -> str:
    """The text between the parenthesis at ``opening`` and the one that closes it."""
    depth = 0
    for i in range(opening, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[opening + 1 : i]
    raise AssertionError(f"unbalanced parentheses after {code[opening : opening + 80]!r}")


def test_resume_examples_give_their_loaders_a_generator_and_link_the_recipe() -> None:
    for block in BLOCKS:
        for call in re.finditer(r"StatefulDataLoader\(", block.code):
            arguments = _call_arguments(block.code, call.end() - 1)
            assert "generator=" in arguments, f"{block}: StatefulDataLoader({arguments}) has no generator of its own"
    data = _text("docs/data.md")
    assert f"({RECIPE})" in data and "(reliability.md#checkpoints)" not in data
    for page in ("docs/integration.md", "docs/contract.md", "docs/migration/ddp.md", "docs/migration/horovod.md"):
        assert RECIPE in _text(page), f"{page}: no link to {RECIPE}"


_RESUME_AT_EVERY_STOP = """
per_epoch = len(build()["loader"])
stops = sorted({1, per_epoch, per_epoch + 1, 2 * per_epoch - 1, whole[1] - 1})
for stop in stops:
    train(build(), stop_at=stop)
    assert same(train(resume("checkpoint.pt")), whole), f"resumed at step {stop}: not the uninterrupted run"
dml.print(backend, f"resumed bitwise at steps {stops} of {whole[1]}", all_ranks=False)
"""


@pytest.fixture(scope="module")
def recipe_jobs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], subprocess.CompletedProcess[str]]:
    """The recipe's block with _RESUME_AT_EVERY_STOP after it, on ``ranks`` ranks, run at the first ask: on the
    block's own 2 ranks, test_mpi_block_runs reads the block's part of the same job."""
    jobs: dict[int, subprocess.CompletedProcess[str]] = {}

    def job(ranks: int) -> subprocess.CompletedProcess[str]:
        if ranks not in jobs:
            block, directory = _recipe_block(), tmp_path_factory.mktemp(f"recipe-{ranks}")
            jobs[ranks] = _mpiexec_block(block, block.code + _RESUME_AT_EVERY_STOP, ranks, directory, MPI_TIMEOUT_S * 2)
        return jobs[ranks]

    return job


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_recipe_resumes_bitwise_wherever_it_is_cut(
    ranks: int, recipe_jobs: Callable[[int], subprocess.CompletedProcess[str]]
) -> None:
    """The recipe's example, cut short at the first step, at epoch boundaries and mid-epoch, then resumed,
    ends bitwise where the uninterrupted run ends (parameters, step, learning rate, loss scale)."""
    proc = recipe_jobs(ranks)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the recipe did not resume bitwise on {ranks} ranks\n{output[-8000:]}"
    assert "resumed bitwise at steps" in output, output[-8000:]


def test_buffers_and_the_optimizer_rules_are_documented() -> None:
    integration = _text("docs/integration.md")
    assert "dml.broadcast_buffers(backend" in integration and "SyncBatchNorm" in integration
    optimizer = _text("docs/optimizer.md")
    for needed in ("once per step", "`opt.zero_grad()`", "SparseAdam", "step(closure)", "ValueError"):
        assert needed in optimizer, needed


# -- Every figure of the benchmark pages comes from a result file (issue 13, item 13) --------------------------
#
# A paragraph "Result file: `benchmarks/results/NAME.json`" (or "Result files: ...", optionally "as of commit
# `HASH`" for a file that later runs overwrote) names the files of the tables after it; one that starts with
# "No result file" says that the figures after it were not kept. Either holds until the next heading of its
# level or above, or the next such paragraph. Every table of a benchmark page that shows a measurement lies
# under one, and every table under a "Result file" is recomputed from its files, cell by cell.

RESULTS = "benchmarks/results"
BENCH_PAGES = sorted(str(p.relative_to(ROOT)) for p in (DOCS / "benchmarks").glob("*.md"))
_HEADING = re.compile(r"^(#{1,6})\s")
_X, _TO, _MINUS = "\u00d7", "\u2013", "\u2212"  # the multiplication sign, en dash and minus of the pages
_MEASURED = re.compile(rf"\d\s*(?:ms|us|µs|%|{_X})|\b\d+\.\d+\b")
_FIGURE = re.compile(r"(?P<num>[-+]?\d+(?:\.\d+)?)(?:\s*(?P<unit>ms|us|µs|MiB|s)\b)?")
_UNIT_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}


@dataclass(frozen=True)
class BenchTable:
    """One Markdown table of a benchmark page, with the files its marker paragraph names."""

    page: str
    line: int  # 1-based, of the header row
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    marker: str  # "result", "none" or "" (no marker above it)
    files: tuple[str, ...] = ()
    commit: str = ""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _cells(line: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1])


def _bench_tables(page: str) -> list[BenchTable]:
    lines = _text(page).splitlines()
    tables: list[BenchTable] = []
    stack: list[tuple[int, str, tuple[str, ...], str]] = []  # (heading level, kind, files, commit)
    level, i, fenced = 0, 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else _HEADING.match(line)
        if heading:
            level = len(heading[1])
            stack = [m for m in stack if m[0] < level]
        elif not fenced and (line.startswith(("Result file:", "Result files:", "No result file"))):
            end = i
            while end + 1 < len(lines) and lines[end + 1].strip():
                end += 1
            text = " ".join(lines[i : end + 1])
            stack = [m for m in stack if m[0] < level]
            if text.startswith("No result file"):
                stack.append((level, "none", (), ""))
            else:
                files = tuple(re.findall(r"`(benchmarks/results/[\w.-]+\.json)`", text))
                commit = re.search(r"commit `([0-9a-f]{7,40})`", text)
                assert files, f"{page}:{i + 1}: a 'Result file' paragraph names no `benchmarks/results/*.json`"
                missing = [f for f in files if not commit and not (ROOT / f).is_file()]
                assert not missing, f"{page}:{i + 1}: no such result file: {missing}"
                stack.append((level, "result", files, commit[1] if commit else ""))
            i = end
        elif not fenced and line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            end = i + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            kind, files, commit = stack[-1][1:] if stack else ("", (), "")
            rows = tuple(_cells(r) for r in lines[i + 2 : end])
            tables.append(BenchTable(page, i + 1, _cells(line), rows, kind, files, commit))
            i = end - 1
        i += 1
    return tables


BENCH_TABLES = [t for page in BENCH_PAGES for t in _bench_tables(page)]


def _result(name: str, commit: str = "") -> dict:
    """A result file of the working tree, or as committed in ``commit`` (a file later runs overwrote)."""
    if not commit:
        return json.loads((ROOT / name).read_text(encoding="utf-8"))
    try:
        shown = subprocess.run(
            ["git", "show", f"{commit}:{name}"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
        )
    except FileNotFoundError:
        pytest.skip("git is not installed: the result files of old commits cannot be read")
    if shown.returncode != 0:
        pytest.skip(f"commit {commit} is not in this checkout (a shallow clone?): {shown.stderr.strip()}")
    return json.loads(shown.stdout)


def _median(contenders: dict, name: str) -> float | None:
    import statistics

    return statistics.median(contenders[name]["times_s"]) if name in contenders else None


def _model_comm(allreduce: dict, nparams: int) -> float:
    """benchmarks/network.py's comm: the dml allreduce of the size nearest the gradients' bytes, scaled by bytes."""
    sizes = {int(k): v for k, v in allreduce["results"].items()}
    nbytes = nparams * 4
    above = [n for n in sizes if n >= nbytes]
    n = min(above) if above else max(sizes)
    return sizes[n]["dml_numpy"]["median_s"] * nbytes / n


def _link_tag(text: str) -> str:
    """``"1 Gbit/s, 1 ms"`` -> ``"1gbit_1"``, as benchmarks/network.py names its files."""
    m = re.search(r"(\d+) Gbit/s, ([\d.]+) ms", text)
    assert m, f"no link ('N Gbit/s, D ms') in {text!r}"
    return f"{m[1]}gbit_{m[2].replace('.', 'p')}"


def _step_expected(column: str, r: dict, comm: float | None) -> list[tuple[float | None, str]] | None:
    """What a step or sharded-state table's column shows for one model: (value, unit) per figure."""
    cs = r["contenders"]
    comp, dml, ddp = (_median(cs, k) for k in ("ideal_local", "dml", "ddp_gloo"))
    after, shard, zero, sdb = (_median(cs, k) for k in ("dml_after", "dml_shard", "zero_gloo", "dml_sdb"))
    shard_sdb = _median(cs, "dml_shard_sdb")

    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    col = column.replace("`", "").replace("*", "").lower()
    rules: dict[str, list[tuple[float | None, str]]] = {
        "compute only": [(comp, "s")],
        "dml step": [(dml, "s")],
        "dml step (overlap)": [(dml, "s")],
        "dml after": [(after, "s")],
        "dml, reduced after backward": [(after, "s")],
        "dml step, reduced after backward": [(after, "s")],
        "ddp (gloo)": [(ddp, "s")],
        "ddp (gloo) step": [(ddp, "s")],
        "ddp step": [(ddp, "s")],
        "dml / ddp": [(dml / ddp if dml and ddp else None, "")],
        "exposed comm dml": [(minus(dml, comp), "s")],
        "exposed comm dml after": [(minus(after, comp), "s")],
        "exposed comm after": [(minus(after, comp), "s")],
        "exposed comm ddp": [(minus(ddp, comp), "s")],
        "dml / max(compute, comm)": [(dml / max(comp, comm) if comm and dml and comp else None, "")],
        "dml_shard step": [(shard, "s")],
        "zero_gloo step": [(zero, "s")],
        "shard / dml": [(shard / dml if shard and dml else None, "")],
        "shard / zero": [(shard / zero if shard and zero else None, "")],
        "dml_sdb step": [(sdb, "s")],
        "dml_sdb / ddp": [(sdb / ddp if sdb and ddp else None, "")],
        "dml_shard / ddp": [(shard / ddp if shard and ddp else None, "")],
        "dml_sdb / max(compute, comm)": [(sdb / max(comp, comm) if comm and sdb and comp else None, "")],
        "dml_shard / max(compute, comm)": [(shard / max(comp, comm) if comm and shard and comp else None, "")],
        "dml_shard_sdb step": [(shard_sdb, "s")],
        "dml_shard_sdb / ddp": [(shard_sdb / ddp if shard_sdb and ddp else None, "")],
        "dml_shard / dml": [(shard / dml if shard and dml else None, "")],
        "dml_shard_sdb / dml": [(shard_sdb / dml if shard_sdb and dml else None, "")],
        "dml_shard_sdb / dml_shard": [(shard_sdb / shard if shard_sdb and shard else None, "")],
        "dml_shard_sdb / dml_sdb": [(shard_sdb / sdb if shard_sdb and sdb else None, "")],
        "dml_shard_sdb / max(compute, comm)": [
            (shard_sdb / max(comp, comm) if comm and shard_sdb and comp else None, "")
        ],
    }
    if col.startswith("state per rank"):
        return [(cs[k]["state_bytes_max_rank"] / 2**20, "MiB") for k in ("dml", "dml_shard", "zero_gloo")]
    return rules.get(col)


def _allreduce_expected(column: str, r: dict, rate_bit_s: float) -> list[tuple[float | None, str]] | None:
    """What an allreduce table's column shows for one size (benchmarks/network.py's allreduce_table)."""
    col = column.replace("`", "").lower()
    names = {"raw mpi4py": "mpi4py_numpy", "dml_numpy": "dml_numpy", "dml_torch": "dml_torch", "gloo": "gloo"}
    if col in names:
        return [(r[names[col]]["median_s"] if names[col] in r else None, "s")]
    if col in ("dml_numpy / raw", "dml_torch / raw"):
        c = r[col.split(" ")[0]]
        return [(c["ratio"], ""), (c["diff_us"] * 1e-6, "s")]
    if col in ("dml busbw / link", "raw busbw / link"):
        c = r["dml_numpy" if col.startswith("dml") else "mpi4py_numpy"]
        return [(c["busbw_GBps"] * 1e9 / (rate_bit_s / 8), "")]
    return None


def _check_cell(where: str, cell: str, expected: list[tuple[float | None, str]]) -> None:
    """The figures of ``cell`` are ``expected``, each within half a unit of its last printed digit."""
    text = cell.replace("**", "").replace("*", "").strip()
    if expected in ([(None, "s")], [(None, "")]):
        assert text == "-", f"{where}: {cell!r}, but the result file has no such value"
        return
    found = list(_FIGURE.finditer(text))
    assert len(found) == len(expected), f"{where}: {cell!r} shows {len(found)} figures; expected {len(expected)}"
    for m, (value, unit) in zip(found, expected, strict=True):
        assert value is not None, f"{where}: {cell!r}, but the result file has no such value"
        decimals = len(m["num"].split(".")[1]) if "." in m["num"] else 0
        shown, shown_unit = float(m["num"]), m["unit"] or ""
        if unit == "s":
            assert shown_unit in _UNIT_S, f"{where}: {cell!r}: {m[0]!r} should be a time"
            scale = _UNIT_S[shown_unit]
        else:
            assert shown_unit in ("", unit), f"{where}: {cell!r}: {m[0]!r} should be in {unit or 'no unit'}"
            scale = 1.0
        tolerance = 0.5 * 10.0**-decimals * scale * (1 + 1e-9)
        assert abs(shown * scale - value) <= tolerance, (
            f"{where}: {cell!r} shows {m[0]!r}; the result file gives {value / scale:.6g} {shown_unit}".rstrip()
        )


def test_benchmark_tables_are_found() -> None:
    checked = [t for t in BENCH_TABLES if t.marker == "result"]
    assert len(checked) >= 11, [str(t) for t in checked]
    assert {t.page for t in checked} >= {"docs/benchmarks/network.md", "docs/benchmarks/ddp.md"}


@pytest.mark.parametrize(
    "table", [t for t in BENCH_TABLES if _MEASURED.search(" ".join(map(" ".join, t.rows)))], ids=str
)
def test_every_benchmark_table_names_its_result_file(table: BenchTable) -> None:
    assert table.marker, (
        f"{table}: a table of measurements with no 'Result file: `benchmarks/results/....json`' paragraph above it "
        "(nor a 'No result file ...' one saying that its figures were not kept)"
    )


@pytest.mark.parametrize("table", [t for t in BENCH_TABLES if t.marker == "result"], ids=str)
def test_benchmark_table_figures_are_those_of_the_result_file(table: BenchTable) -> None:
    results = {name: _result(name, table.commit) for name in table.files}
    header = [h.replace("`", "").lower() for h in table.header]
    allreduce_files = [n for n in table.files if "allreduce" in n]
    step_files = [n for n in table.files if "allreduce" not in n]
    for row in table.rows:
        cells = dict(zip(header, row, strict=True))
        where = f"{table} ({row[0]})"
        if "raw mpi4py" in header:  # an allreduce table: one file, a row per size
            (name,) = allreduce_files
            rate = float(re.search(r"-(\d+)gbit", name)[1]) * 1e9
            size = re.fullmatch(r"(\d+) (KiB|MiB)", row[0])
            assert size, where
            nbytes = int(size[1]) << (10 if size[2] == "KiB" else 20)
            r = results[name]["results"][str(nbytes)]
            for column, cell in list(cells.items())[1:]:
                expected = _allreduce_expected(column, r, rate)
                assert expected is not None, f"{where}: no rule for the column {column!r}: add one to this test"
                _check_cell(f"{where}, {column}", cell, expected)
            continue
        # a step table: a row per model (and link, or number of ranks, when several files feed it)
        label = cells.get("model", row[0])
        model = re.match(r"(\w+)", label)[1]
        candidates = step_files
        # A before/after table names a run and its "-gloo" re-run: columns ending in ", before" read the first.
        befores = [n for n in step_files if n.replace(".json", "-gloo.json") in step_files]
        if befores:
            candidates = [n for n in step_files if n not in befores]
        if "link" in cells:
            tag = _link_tag(cells["link"])
            candidates = [n for n in candidates if re.search(rf"-{tag}(?:-|\.json)", n)]
        elif len(step_files) > 1:
            ranks = re.search(r",\s*(\d+)$", label)
            assert ranks, f"{where}: several result files, and the row names neither a link nor a number of ranks"
            candidates = [n for n in step_files if f"-{ranks[1]}ranks" in n]
        assert len(candidates) == 1, f"{where}: which of {step_files}? {candidates}"
        run = results[candidates[0]]["results"][model]
        params = re.search(r"\(([\d.]+) M\)", label)
        if params:
            _check_cell(f"{where}, parameters", params[1], [(run["nparams"] / 1e6, "")])
        comm = None
        if allreduce_files:
            pair = [n for n in allreduce_files if n.replace("allreduce", "ddp") == candidates[0]]
            assert pair, f"{where}: no allreduce file pairs with {candidates[0]} in {allreduce_files}"
            comm = _model_comm(results[pair[0]], run["nparams"])
        for column, cell in cells.items():
            if column in ("model", "model, w", "link"):
                continue
            if column.endswith(", before"):
                (before,) = [n for n in befores if n.replace(".json", "-gloo.json") == candidates[0]]
                expected = _step_expected(column.removesuffix(", before"), results[before]["results"][model], None)
                assert expected is not None, f"{where}: no rule for the column {column!r}: add one to this test"
                _check_cell(f"{where}, {column}", cell, expected)
                continue
            if column.startswith("after / before: "):
                (before,) = [n for n in befores if n.replace(".json", "-gloo.json") == candidates[0]]
                name = column.removeprefix("after / before: ")
                after_v = _step_expected(name, run, None)
                before_v = _step_expected(name, results[before]["results"][model], None)
                assert after_v and before_v, f"{where}: no rule for the column {name!r}"
                _check_cell(f"{where}, {column}", cell, [(after_v[0][0] / before_v[0][0], "")])
                continue
            expected = _step_expected(column, run, comm)
            assert expected is not None, f"{where}: no rule for the column {column!r}: add one to this test"
            _check_cell(f"{where}, {column}", cell, expected)


def _runs(name: str, commit: str = "") -> dict[str, dict[str, float]]:
    """A step result file: per model, each contender's median step (s), and ``nparams``."""
    runs = {}
    for model, r in _result(f"{RESULTS}/{name}", commit)["results"].items():
        cs = r["contenders"]
        runs[model] = {k: _median(cs, k) for k in cs} | {"nparams": r["nparams"]}
    return runs


def _span(values: list[float], digits: int = 2) -> str:
    """``"0.95 to 0.99"`` (an en dash between): the min-max of ``values``; one number when both ends print alike."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}{_TO}{high}"


def _pct(values: list[float]) -> str:
    return f"{_span([v * 100 for v in values], 0)} %"


def _ms(values: list[float], sep: str = " / ", digits: int = 0) -> str:
    return sep.join(f"{v * 1e3:.{digits}f}" for v in values)


def _ratio(runs: dict, a: str, b: str, models: tuple[str, ...] = ()) -> list[float]:
    return [r[a] / r[b] for m, r in runs.items() if not models or m in models]


def _comm(allreduce: dict, runs: dict) -> dict[str, float]:
    return {m: _model_comm(allreduce, r["nparams"]) for m, r in runs.items()}


def _load(name: str, commit: str = "", model: str = "") -> float:
    """The share of the machine that other processes used, over a job or over one model's part of it."""
    res = _result(f"{RESULTS}/{name}", commit)
    return (res["results"][model] if model else res)["foreign_load"]["foreign_share"]


def _network_claims() -> list[str]:
    """What docs/benchmarks/network.md says in its prose, recomputed from the result files it names."""
    one, ten = _runs("network-ddp-1gbit_1.json"), _runs("network-ddp-10gbit_0p1.json")
    b384, b1536 = _runs("network-ddp-1gbit_1-batch384.json"), _runs("network-ddp-1gbit_1-batch1536.json")
    adam1, adam10 = _runs("network-ddp-1gbit_1-adam.json"), _runs("network-ddp-10gbit_0p1-adam.json")
    old1, old10 = _runs("network-ddp-1gbit_1.json", "34ec407"), _runs("network-ddp-10gbit_0p1.json", "34ec407")
    mpi_overlap = _runs("network-ddp-1gbit_1.json", "bd5929d")["mlp25m"]
    ar1 = _result(f"{RESULTS}/network-allreduce-1gbit_1.json")
    c1, c10 = _comm(ar1, one), _comm(_result(f"{RESULTS}/network-allreduce-10gbit_0p1.json"), ten)
    c384 = _comm(_result(f"{RESULTS}/network-allreduce-1gbit_1-batch384.json"), b384)
    c1536 = _comm(_result(f"{RESULTS}/network-allreduce-1gbit_1-batch1536.json"), b1536)
    old_ar1 = _result(f"{RESULTS}/network-allreduce-1gbit_1.json", "34ec407")["results"]
    old_ar10 = _result(f"{RESULTS}/network-allreduce-10gbit_0p1.json", "34ec407")["results"]
    seg16 = _result(f"{RESULTS}/network-allreduce-1gbit_1-seg16M.json")["results"]
    big, small, mid = ("16777216", "67108864"), ("4096", "65536", "1048576"), ("1048576", "16777216", "67108864")
    dml_kinds = ("dml_numpy", "dml_torch")

    def busbw(res: dict, who: str, sizes: tuple[str, ...], rate: float) -> list[float]:
        return [res[s][who]["busbw_GBps"] * 8e9 / rate for s in sizes]

    def per_size(res: dict, who: tuple[str, ...], sizes: tuple[str, ...], key: str) -> list[float]:
        return [res[s][w][key] for s in sizes for w in who]

    def hidden(runs: dict, comm: dict, who: str) -> list[float]:
        return [1 - (r[who] - r["ideal_local"]) / comm[m] for m, r in runs.items()]

    def exposed(runs: dict, who: str, digits: int = 0, sep: str = " / ") -> str:
        return _ms([r[who] - r["ideal_local"] for r in runs.values()], sep, digits)

    at_rate = {m: r["nparams"] * 32 / 1e9 for m, r in one.items()}  # seconds for the gradients at 1 Gbit/s
    deep36, mlp25m = old1["deep36"], old1["mlp25m"]
    seg_diffs = per_size(seg16, dml_kinds, small, "diff_us")
    raw_small = per_size(seg16, ("mpi4py_numpy",), small, "median_s")
    slower = [r - 1 for r in per_size(old_ar1, dml_kinds, big, "ratio")]
    overlap_1gbit = (
        _ratio(one, "dml", "dml_after") + _ratio(b384, "dml", "dml_after") + _ratio(b1536, "dml", "dml_after")
    )
    adam_loads = [
        _load(n, model=m) for n in ("network-ddp-1gbit_1-adam.json", "network-ddp-10gbit_0p1-adam.json") for m in adam1
    ]
    limit1 = [r["dml"] / max(r["ideal_local"], c1[m]) for m, r in one.items()]
    limit1_rate = [r["dml"] / max(r["ideal_local"], at_rate[m]) for m, r in one.items()]
    limit10 = [r["dml"] / max(r["ideal_local"], c10[m]) for m, r in ten.items()]
    return [
        # the first runs (4 MiB segments), commit 34ec407
        f"Raw mpi4py reaches {_span(busbw(old_ar1, 'mpi4py_numpy', big, 1e9))} of the link's rate at 16{_TO}64 MiB",
        f"reached only {_span(busbw(old_ar1, 'dml_numpy', big, 1e9))} and was {_pct(slower)} slower than raw",
        f"16 of them at 64 MiB (+{old_ar1['67108864']['dml_numpy']['diff_us'] / 1e3:.0f} ms)",
        f"**{_span(busbw(seg16, 'dml_numpy', big, 1e9))} of the link** at 16 and 64 MiB, "
        f"{seg16['16777216']['dml_numpy']['ratio']:.2f}{_X} and {seg16['67108864']['dml_numpy']['ratio']:.2f}{_X} raw",
        f"library is {_span(per_size(seg16, dml_kinds, small, 'ratio'))}{_X} raw, {_MINUS}{-min(seg_diffs):.0f} to "
        f"+{max(seg_diffs):.0f} µs on calls of {_span([t * 1e3 for t in raw_small], 1)} ms",
        f"raw mpi4py moves {_span(busbw(old_ar10, 'mpi4py_numpy', big, 10e9))} of the link's rate",
        f"`dml.allreduce` is {_span(per_size(old_ar10, ('dml_torch',), mid, 'ratio'))}{_X} raw at 1{_TO}64 MiB on "
        f"torch tensors and {_span(per_size(old_ar10, ('dml_numpy',), mid, 'ratio'))}{_X} on NumPy arrays",
        f"foreign load, {_load('network-allreduce-10gbit_0p1.json', '34ec407') * 100:.0f} % of the machine",
        f"within {_span(_ratio(old10, 'dml', 'ddp_gloo'))}{_X} of DDP over gloo: compute is "
        f"{_pct(_ratio(old10, 'ideal_local', 'dml'))} of the step",
        f"our step costs {_span(_ratio(old1, 'dml', 'ideal_local', ('mlp2m', 'mlp25m')), 1)}{_X} compute on mlp2m "
        f"and mlp25m and **{deep36['dml'] / deep36['ideal_local']:.1f}{_X} on deep36**",
        f"{old1['mlp2m']['dml'] / old1['mlp2m']['ddp_gloo']:.2f}{_X} on mlp2m, "
        f"{mlp25m['dml'] / mlp25m['ddp_gloo']:.2f}{_X} on mlp25m",
        f"**{deep36['dml'] / deep36['ddp_gloo']:.2f}{_X} on deep36**",
        f"Exposed communication (step {_MINUS} compute) of ours is {exposed(old1, 'dml')} ms against DDP's "
        f"{exposed(old1, 'ddp_gloo')} ms",
        f"{at_rate['mlp25m']:.2f} s for mlp25m's {mlp25m['nparams'] * 4 / 1e6:.1f} MB of gradients at 1 Gbit/s, "
        f"where we take {mlp25m['dml']:.2f} s",
        # overlap over MPI, commit bd5929d
        f"Other processes used {_load('network-ddp-1gbit_1.json', 'bd5929d') * 100:.0f} %",
        f"on the 24 M model it cost {mpi_overlap['dml'] / mpi_overlap['dml_after']:.1f}{_X}",
        # the ring
        f"other processes used {_load('network-ddp-1gbit_1.json') * 100:.0f} % (1 Gbit/s) and "
        f"{_load('network-ddp-10gbit_0p1.json') * 100:.0f} % (10 Gbit/s)",
        "same run): " + ", ".join(f"{m} {c * 1e3:.0f} ms" for m, c in c1.items()),
        "comm: " + ", ".join(f"{m} {c * 1e3:.0f} ms" for m, c in c10.items()),
        f"slow, {busbw(ar1['results'], 'dml_numpy', big[1:], 1e9)[0]:.2f} of the link against raw mpi4py's "
        f"{busbw(ar1['results'], 'mpi4py_numpy', big[1:], 1e9)[0]:.2f}",
        f"take {at_rate['mlp25m']:.2f} s, and dml / max = {one['mlp25m']['dml'] / at_rate['mlp25m']:.2f}",
        f"Other processes used {_load('network-ddp-1gbit_1-batch384.json') * 100:.0f} % of the machine during it "
        f"({_load('network-ddp-1gbit_1-batch384.json', model='mlp25m') * 100:.0f} % during mlp25m's steps)",
        # the headline ranges: min-max of the rows they summarize
        f"({_span(_ratio(one, 'dml', 'ddp_gloo'))}{_X} at 1 Gbit/s, {_span(_ratio(ten, 'dml', 'ddp_gloo'))}{_X} at "
        "10 Gbit/s)",
        f"the two small models at 384 samples per rank ({_span(_ratio(b384, 'dml', 'ddp_gloo', ('mlp2m', 'deep36')))}"
        f"{_X})",
        f"for mlp25m at 384 samples per rank ({_span(_ratio(b384, 'dml', 'ddp_gloo', ('mlp25m',)))}{_X})",
        f"at 1536 samples per rank ({_span(_ratio(b1536, 'dml', 'ddp_gloo'))}{_X}, deep36 and mlp2m)",
        f"gradients take {_span([c * 1e3 for c in c1.values()], 0)} ms on the wire",
        f"against {_span([r['ideal_local'] * 1e3 for r in one.values()], 0)} ms of compute",
        f"{round(2**24 / one['mlp25m']['nparams'] * 100)} % of mlp25m's gradients are one 64 MiB tensor",
        f"this library hides {_pct(hidden(b384, c384, 'dml'))} of the communication (1 {_MINUS} exposed comm / comm) "
        f"and DDP {_pct(hidden(b384, c384, 'ddp_gloo'))}",
        f"and {_span(overlap_1gbit)}{_X} the after-backward path at every batch size",
        f"{_span(_ratio(ten, 'dml', 'dml_after'))}{_X} the after-backward path on every model",
        f"compute {_ms([r['ideal_local'] for r in b1536.values()], ' and ')} ms against "
        f"{_ms(list(c1536.values()), ' and ')} ms of communication",
        f"was {exposed(b1536, 'dml', 1)} ms for dml, {exposed(b1536, 'dml_after', 1)} ms after backward and "
        f"{exposed(b1536, 'ddp_gloo', 1)} ms for DDP",
        f"the step {_span(_ratio(b1536, 'dml', 'ddp_gloo'))}{_X} DDP's",
        f"`dml / max(compute, comm)` is {_span(limit1)} at 1 Gbit/s ({_span(limit1_rate)} with comm at the link's "
        "nominal rate",
        f"at 10 Gbit/s {_span(limit10)}, where",
        # the sharded optimizer with Adam
        f"at 1 Gbit/s it is {_span(_ratio(adam1, 'zero_gloo', 'dml_shard'), 1)}{_X} the sharded step",
        f"and is {_span(_ratio(adam1, 'dml_shard', 'dml'))}{_X} the unsharded step",
        f"`dml` step was {_span(_ratio(adam1, 'dml', 'ddp_gloo'))}{_X} DDP's at 1 Gbit/s and "
        f"{_span(_ratio(adam10, 'dml', 'ddp_gloo'))}{_X} at 10 Gbit/s",
        f"processes used {_pct(adam_loads)} of the machine during the steps",
    ]


def _shard_claims() -> list[str]:
    """What docs/benchmarks/ddp.md says about the sharded optimizer, from ddp-adam-shard-{2,3}ranks.json."""
    w2, w3 = _runs("ddp-adam-shard-2ranks.json"), _runs("ddp-adam-shard-3ranks.json")
    raw2, raw3 = (_result(f"{RESULTS}/ddp-adam-shard-{w}ranks.json")["results"] for w in (2, 3))
    both = [*w2.values(), *w3.values()]

    def state(raw: dict, who: str) -> str:
        return f"{raw['mlp25m']['contenders'][who]['state_bytes_max_rank'] / 2**20:.1f}"

    maxdiff = max(r["contenders"]["dml_shard"]["maxdiff_vs_ddp_gloo"] for r in raw3.values())
    mantissa, exponent = f"{maxdiff:.1e}".split("e")
    return [
        f"{_pct([r['foreign_load']['foreign_share'] for r in raw2.values()])} foreign load at W = 2",
        f"({state(raw2, 'dml_shard')} of {state(raw2, 'dml')} MiB at W = 2, {state(raw3, 'dml_shard')} at W = 3",
        f"whose 4096{_X}4096 weight is {round(2**24 / w2['mlp25m']['nparams'] * 100)} % of the model",
        f"**Time: {_span(_ratio({str(i): r for i, r in enumerate(both)}, 'dml_shard', 'dml'))}{_X} the unsharded "
        f"optimizer and {_span([r['dml_shard'] / r['zero_gloo'] for r in both])}{_X} `ZeroRedundancyOptimizer`**",
        f"hence {w2['deep36']['zero_gloo'] / w2['deep36']['ddp_gloo']:.1f}{_X} DDP there",
        f"maxdiff up to {mantissa}e{int(exponent)}",
    ]


def _index_claims() -> list[str]:
    """The across-two-nodes summary of docs/benchmarks/index.md, from the result files of network.md."""
    one, ten = _runs("network-ddp-1gbit_1.json"), _runs("network-ddp-10gbit_0p1.json")
    b384, b1536 = _runs("network-ddp-1gbit_1-batch384.json"), _runs("network-ddp-1gbit_1-batch1536.json")

    def span(runs: dict) -> str:
        return _span(_ratio(runs, "dml", "ddp_gloo"))

    return [
        f"the training step is {span(one)}{_X} DDP over gloo at 1 Gbit/s and {span(ten)}{_X} at 10 Gbit/s with 64 "
        f"samples per rank, but {span(b384)}{_X} with 384 samples per rank and {span(b1536)}{_X} with 1536 (1 Gbit/s)",
    ]


@pytest.mark.parametrize(
    ("page", "claims"),
    [
        ("docs/benchmarks/network.md", _network_claims),
        ("docs/benchmarks/ddp.md", _shard_claims),
        ("docs/benchmarks/index.md", _index_claims),
    ],
)
def test_benchmark_prose_quotes_the_result_files(page: str, claims: Callable[[], list[str]]) -> None:
    """Figures and headline ranges in the prose are those of the result files (a range: the min-max of its rows)."""
    text = " ".join(_text(page).split())
    missing = [c for c in claims() if " ".join(c.split()) not in text]
    assert not missing, f"{page} does not say (recomputed from the result files):\n" + "\n".join(missing)


def test_the_slurm_page_shows_the_templates_the_slurm_tests_submit() -> None:
    page, tests = _text("docs/slurm.md"), _text("tests/test_slurm.py")
    for name in ("train.sbatch", "train-gpu.sbatch"):
        assert f'--8<-- "examples/slurm/{name}"' in page, name  # included whole by pymdownx.snippets
        assert f'ROOT / "examples" / "slurm" / "{name}"' in tests, name
        assert "srun --mpi=pmix --kill-on-bad-exit=1" in (ROOT / "examples" / "slurm" / name).read_text()
    assert "srun --mpi=list" in page and "distutils-ml launch" in page
