"""Layers import downward only (DESIGN "Layout"): ``kernels/`` imports nothing from ``tritonlm`` above it, and
``modules/`` reaches up only for the config (read from the source files' import statements)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(relative level, module)`` of every import in ``path``, function-level imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            # `from .. import kernels` names its modules in the aliases
            found.extend([(node.level, node.module)] if node.module else
                         [(node.level, alias.name) for alias in node.names])
        elif isinstance(node, ast.Import):
            found.extend((0, alias.name) for alias in node.names)
    return found


def test_kernels_import_nothing_above_them():
    upward = [(str(f.relative_to(REPO)), level, name) for f in sorted((REPO / "kernels").rglob("*.py"))
              for level, name in _imports(f)
              if level >= 2 + (f.parent != REPO / "kernels")
              or (level == 0 and name.split(".")[0] == "tritonlm" and not name.startswith("tritonlm.kernels"))]
    assert upward == []


def test_modules_reach_up_only_for_the_config_and_kernels():
    allowed = {"config", "kernels"}
    upward = [(f.name, name) for f in sorted((REPO / "modules").glob("*.py")) for level, name in _imports(f)
              if level >= 2 and name.split(".")[0] not in allowed]
    assert upward == []  # e.g. sampling is modules.sampling, not tritonlm.generate


def test_memory_counting_uses_no_private_report_helper():
    names = [name for _, name in _imports(REPO / "tritonlm" / "memory.py")]
    assert "kernel_report" not in names
