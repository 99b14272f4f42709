"""The house's rules: the SDK (the trainer's and the engines' modules), the pure core and the
simulator import nothing from ``sparrowd.daemon``; nothing but the command imports ``sparrowd.cli``;
no module is over 800 lines, no class over 500."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sparrowd

ROOT = Path(sparrowd.__file__).parent
SDK = [*(ROOT / f for f in ("publisher.py", "snapshot.py", "publishing.py", "client.py")),
       *sorted((ROOT / "integrations").glob("*.py"))]


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (function bodies too), as an absolute name."""
    package = "sparrowd" + "".join("." + p for p in path.parent.relative_to(ROOT).parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


PURE = [*sorted((ROOT / "codec").glob("*.py")), *sorted((ROOT / "swarm").glob("*.py")),
        *sorted((ROOT / "bench" / "sim").glob("*.py"))]


@pytest.mark.parametrize("group", ["sdk", "pure"])
def test_the_sdk_the_pure_core_and_the_simulator_import_nothing_from_the_daemon(group):
    paths = SDK if group == "sdk" else PURE
    assert len(paths) > 4
    for path in paths:
        bad = sorted(n for n in _imported(path) if n == "sparrowd.daemon" or n.startswith("sparrowd.daemon."))
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {bad}"


def test_the_scan_sees_relative_imports():
    names = _imported(ROOT / "daemon" / "auth.py")
    assert "sparrowd.daemon.membership" in names and "sparrowd.client" in names


def test_nothing_but_the_command_imports_the_command():
    """sparrowd.cli is the top of the house: the library, the daemon and the benchmarks start a
    daemon as ``python -m sparrowd.cli.main``, never by importing it."""
    cli = ROOT / "cli"
    paths = [p for p in ROOT.rglob("*.py") if cli not in p.parents and "vendor" not in p.parts]
    assert len(paths) > 50 and (cli / "main.py").exists()
    for path in paths:
        bad = sorted(n for n in _imported(path) if n == "sparrowd.cli" or n.startswith("sparrowd.cli."))
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {bad}"


def test_no_module_is_over_800_lines_and_no_class_over_500():
    files = [p for p in ROOT.rglob("*.py") if "vendor" not in p.parts]
    assert len(files) > 50
    for path in files:
        text = path.read_text()
        assert text.count("\n") < 800, f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines"
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= 500, f"{path.relative_to(ROOT.parent)}: class {node.name} is {size} lines"
