"""The house rules of the layout: imports run one way, and reading logs never loads torch.

    shared <- stage1_extract, stage2_train     (the stages never import each other)
    inside stage2_train: data <- model <- train; observe stands alone; serve on top; commands composes
    the stages <- testkit <- bench, tests      (clients: bench never imports tests, nothing imports bench
                                                but tests of a bench script)
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# room -> the project modules it may import (prefix match); every import, lazy ones included.
ALLOWED = {
    "shared": ("shared",),
    "stage1_extract": ("shared", "stage1_extract"),
    "stage2_train.data": ("shared", "stage2_train.data"),
    "stage2_train.model": ("shared", "stage2_train.data", "stage2_train.model"),
    "stage2_train.train": ("shared", "stage2_train.data", "stage2_train.model", "stage2_train.observe", "stage2_train.train"),
    "stage2_train.observe": ("shared", "stage2_train.observe"),
    "stage2_train.serve": ("shared", "stage2_train.data", "stage2_train.model", "stage2_train.train", "stage2_train.serve"),
    "stage2_train.commands": ("shared", "stage2_train"),
    "stage2_train.__main__": ("shared", "stage2_train"),
    # The clients of the library: tiny builders, the benchmarks, the tests.
    "testkit": ("shared", "stage1_extract", "stage2_train", "testkit"),
    "bench": ("shared", "stage1_extract", "stage2_train", "testkit", "bench"),
    "tests": ("shared", "stage1_extract", "stage2_train", "testkit", "bench", "tests"),
}
PROJECT = ("shared", "stage1_extract", "stage2_train", "testkit", "bench", "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PROJECT}


def room_of(module: str) -> str | None:
    return max((room for room in ALLOWED if module == room or module.startswith(room + ".")), key=len, default=None)


def test_every_module_belongs_to_a_room():
    for path in sorted(REPO.glob("*/**/*.py")):
        module = module_name(path)
        if module.split(".")[0] in PROJECT and module != "stage2_train":
            assert room_of(module) is not None, module


def test_docs_rooms_names_every_module_of_the_library():
    """docs/rooms.md is where a reader finds a module: a module it does not name is one nobody finds."""
    rooms_md = (REPO / "docs" / "rooms.md").read_text()
    unnamed = []
    for room in ("shared", "stage1_extract", "stage2_train", "testkit"):
        for path in sorted((REPO / room).rglob("*.py")):
            named = re.search(rf"[`/]({re.escape(path.name)}|{re.escape(path.stem)})`", rooms_md)
            if path.name != "__init__.py" and not named:
                unnamed.append(str(path.relative_to(REPO)))
    assert unnamed == []


def test_imports_run_one_way():
    violations = []
    for path in sorted(REPO.glob("*/**/*.py")):
        module = module_name(path)
        room = room_of(module)
        if room is None:
            continue
        for imported in project_imports(path):
            if imported == "stage2_train":  # the bare package (its __init__ is empty)
                continue
            if not any(imported == ok or imported.startswith(ok + ".") for ok in ALLOWED[room]):
                violations.append(f"{module} imports {imported}")
    assert violations == []


@pytest.mark.parametrize("module", ["stage2_train.observe.doctor", "stage2_train.observe.report", "stage2_train.observe.metrics"])
def test_reading_logs_loads_no_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'zarr', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


RUNTIME_PROBE = """
import sys
from {entry}.__main__ import main
code = main({argv!r})
stages = sorted({{m.split('.')[0] for m in sys.modules if m.split('.')[0] in ('stage1_extract', 'stage2_train')}})
heavy = sorted(m for m in ('torch', 'zarr', 'transformers', 'accelerate') if m in sys.modules)
print(code, stages, heavy)
"""


@pytest.mark.parametrize(
    "entry, argv, stages, heavy",
    [
        # check loads the config only: its own stage, never the other one
        ("stage1_extract", ["check", "--quiet"], ["stage1_extract"], []),
        ("stage2_train", ["check", "--quiet"], ["stage2_train"], []),
        # the doctor reads a log: no torch, nothing of stage 1
        ("stage2_train", ["doctor", "LOG"], ["stage2_train"], []),
    ],
)
def test_at_run_time_a_stage_loads_nothing_of_the_other(tmp_path, entry, argv, stages, heavy):
    """The import rules above read `import` statements; this runs the entry points and looks at
    sys.modules, so an import by string (config sections, plugins) cannot hide a dependency."""
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(f'{{"kind": "train", "step": {s}, "loss": 1.0, "elapsed_s": {s}}}\n' for s in range(1, 40)))
    argv = [str(log) if a == "LOG" else a for a in argv]
    code = RUNTIME_PROBE.format(entry=entry, argv=argv)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exit_code, loaded, loaded_heavy = done.stdout.strip().splitlines()[-1].split(" ", 2)
    assert exit_code in ("0", "1") and eval(loaded) == stages
    if heavy is not None:
        assert eval(loaded_heavy) == heavy


def test_every_stage_module_stays_readable_in_one_sitting():
    """Issue 32's bound: a module of a stage is at most 450 lines (the trainer 500); past it, it
    splits at a seam (the detectors' spikes and drops, the dry run's step view, ...)."""
    limits = {"stage2_train/train/trainer.py": 500}
    over = [f"{path.relative_to(REPO)}: {n} lines" for room in ("stage1_extract", "stage2_train") for path in sorted((REPO / room).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > limits.get(str(path.relative_to(REPO)), 450)]
    assert over == []
