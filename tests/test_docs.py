"""Every ```python block of docs/*.md, and of README.md after its first block (which
tests/test_readme.py runs under torchrun), runs here, as a reader would run it; so does
every ```bash block marked `shell` (the others are install commands CI runs itself).

A comment on the line before a block says how it runs:

    (none)                      with the other plain blocks in one subprocess, each block in
                                a fresh namespace and folder (offline plans of tiny or
                                meta-device models, a few seconds each; slow set)
    <!-- run: slow -->          the same, in the slow set (an offline plan of many seconds)
    <!-- run: torchrun 2 -->    under `python -m autopar run --nproc 2`, all such blocks in one job
                                (one torchrun start-up), each in a fresh namespace and folder
                                (slow set)
    <!-- run: shell -->         a ```bash block, under `bash -e` in a fresh folder (slow set)
    <!-- run: skip: REASON -->  not run: its test is skipped with REASON (a GPU, a 70B model)

Also: docs/api.md is what docs/gen_api.py writes, and every relative link between the
pages points at a file that exists.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(?:<!-- run: (?P<marker>[^\n]*?) -->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)```", re.S)
KINDS = ("fast", "slow", "torchrun 2", "shell", "skip")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the block's first code line
    kind: str  # one of KINDS
    reason: str  # a skip's reason, else ""
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if path == DOCS / "api.md":
            continue  # generated: its blocks are signatures
        text, pythons = path.read_text(), 0
        for m in BLOCK.finditer(text):
            marker, lang = (m.group("marker") or "").strip(), m.group("lang")
            if lang == "bash" and not marker:
                continue  # install and test commands, which CI runs itself
            pythons += lang == "python"
            if path == ROOT / "README.md" and lang == "python" and pythons == 1:
                continue  # tests/test_readme.py runs it under torchrun
            kind, _, reason = (marker or "fast").partition(":")
            kind = kind.strip()
            if (lang == "bash") != (kind == "shell"):
                kind = f"{kind} ({lang})"  # a shell marker on python or the reverse: refused below
            line = text.count("\n", 0, m.start("code")) + 1
            found.append(Block(str(path.relative_to(ROOT)), line, kind, reason.strip(), m.group("code")))
    return found


ALL = blocks()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "AUTOPAR_LOG")}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])}


# runs each block in a fresh namespace and folder; reports every failure, then exits 1
RUNNER = r"""
import json, os, sys, time, traceback
failed = []
for i, (where, code) in enumerate(json.load(open(sys.argv[1]))):
    folder = os.path.join(sys.argv[2], f"block{i}")
    os.makedirs(folder)
    os.chdir(folder)
    t0 = time.perf_counter()
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(where)
        print(f"FAILED {where}:\n{traceback.format_exc()}", file=sys.stderr)
    print(f"docs block {where}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def _run_in_one_process(chosen: list[Block], tmp_path: pathlib.Path) -> None:
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps([(b.where, b.code) for b in chosen]))
    done = subprocess.run([sys.executable, "-c", RUNNER, str(listing), str(tmp_path)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    timings = "\n".join(line for line in done.stderr.splitlines() if line.startswith("docs block "))
    print(timings)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_every_block_has_a_known_marker():
    bad = [f"{b.where}: {b.kind!r}" for b in ALL if b.kind not in KINDS or (b.kind == "skip") != bool(b.reason)]
    assert not bad, f"markers must be one of {KINDS} (a skip with its reason): {bad}"
    assert any(b.kind == "fast" for b in ALL)


@pytest.mark.slow  # 25 s of offline plans: the quick set checks markers, links and api.md
def test_fast_blocks(tmp_path):
    _run_in_one_process([b for b in ALL if b.kind == "fast"], tmp_path)


@pytest.mark.slow  # offline plans of many seconds
def test_slow_blocks(tmp_path):
    chosen = [b for b in ALL if b.kind == "slow"]
    if not chosen:
        pytest.skip("no block is marked slow")
    _run_in_one_process(chosen, tmp_path)


# every rank runs the blocks in one order, each in its folder (the same on every rank);
# a failing block ends the job at once (its peers would wait in a collective), naming it
TORCHRUN_RUNNER = r"""
import json, os, sys, time, traceback
import torch.distributed as dist
for i, (where, code, runs) in enumerate(json.load(open(sys.argv[1]))):
    folder = os.path.join(sys.argv[2], f"block{i}")
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    for run in range(runs):
        t0 = time.perf_counter()
        try:
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
        except BaseException:
            print(f"FAILED {where} (run {run + 1}) on rank {os.environ['RANK']}:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            os._exit(1)
        if dist.is_initialized():
            dist.barrier()
        with open(os.path.join(sys.argv[2], f"ran-{os.environ['RANK']}.txt"), "a") as ran:
            ran.write(f"{where} (run {run + 1}): {time.perf_counter() - t0:.1f} s\n")
"""


@pytest.mark.slow  # one torchrun job of 2 ranks
def test_torchrun_blocks(tmp_path):
    chosen = [b for b in ALL if b.kind == "torchrun 2"]
    # a resuming block runs twice: the second run resumes
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps([(b.where, b.code, 2 if "resume(" in b.code else 1) for b in chosen]))
    runner = tmp_path / "runner.py"
    runner.write_text(TORCHRUN_RUNNER)
    done = subprocess.run([sys.executable, "-m", "autopar", "run", "--nproc", "2", str(runner), str(listing),
                           str(tmp_path)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    runs = sum(2 if "resume(" in b.code else 1 for b in chosen)
    for rank in (0, 1):  # every block ran on both ranks
        ran = (tmp_path / f"ran-{rank}.txt").read_text().splitlines()
        print(f"rank {rank}:", *ran, sep="\n  ")
        assert len(ran) == runs, ran


@pytest.mark.slow  # CLI subprocesses, each planning
@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "shell"], ids=lambda b: b.where)
def test_shell_block(block, tmp_path):
    env = _env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # `python` is this one
    done = subprocess.run(["bash", "-e", "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{block.where}:\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "skip"], ids=lambda b: b.where)
def test_skipped_block(block):
    pytest.skip(f"{block.where} is not run here: {block.reason}")


def test_the_api_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    assert (DOCS / "api.md").read_text() == gen_api.render(), "docs/api.md is out of date: run python docs/gen_api.py"


def test_links_between_pages_resolve():
    broken = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    linked = set(re.findall(r"\(docs/([\w-]+\.md)\)", (ROOT / "README.md").read_text()))
    assert linked == {p.name for p in DOCS.glob("*.md")}, "every docs page is linked from the README"
