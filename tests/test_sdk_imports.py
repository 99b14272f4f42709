"""The SDK stands alone: the trainer's and the engines' modules import nothing from ``sparrowd.daemon``."""

from __future__ import annotations

import ast
from pathlib import Path

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


def test_the_sdk_imports_nothing_from_the_daemon():
    assert len(SDK) > 4
    for path in SDK:
        bad = sorted(n for n in _imported(path) if n == "sparrowd.daemon" or n.startswith("sparrowd.daemon."))
        assert not bad, f"{path.relative_to(ROOT.parent)} imports {bad}"


def test_the_scan_sees_relative_imports():
    names = _imported(ROOT / "daemon" / "auth.py")
    assert "sparrowd.daemon.membership" in names and "sparrowd.client" in names
