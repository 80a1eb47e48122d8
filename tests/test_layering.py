"""Layers import downward only (DESIGN "Layout"): ``kernels/`` imports nothing from ``tritonlm`` above it, and
``modules/`` reaches up only for the config (read from the source files' import statements)."""

import ast
from pathlib import Path

import pytest

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


def test_modules_reach_up_only_for_kernels():
    upward = []
    for f in sorted((REPO / "modules").rglob("*.py")):
        depth = len(f.relative_to(REPO / "modules").parts) - 1  # (modules/parts/x.py: one package below modules/)
        upward += [(str(f.relative_to(REPO)), name) for level, name in _imports(f)
                   if (level >= 2 + depth and name.split(".")[0] != "kernels")
                   or (level == 0 and name.split(".")[0] == "tritonlm" and not name.startswith("tritonlm.kernels"))]
    assert upward == []  # e.g. sampling is modules.sampling, not tritonlm.generate; the config is modules.config


def test_parts_import_no_backend_and_no_config():
    """A part spec is built from its own fields: it reads neither the flat config nor a backend namespace (the
    component class comes from the namespace ``build`` is given)."""
    found = [(f.name, name) for f in sorted((REPO / "modules" / "parts").glob("*.py")) for _, name in _imports(f)
             if name and name.split(".")[-1] in ("config", "reference", "fused", "model", "kernels")]
    assert found == []


#: what a generic module must not say: the part kinds' components and the config's per-kind layer predicates
_PART_KIND_WORDS = ("MultiHeadSelfAttention", "MultiHeadLatentAttention", "GatedDeltaNet", "MoEFFN", "SwiGLU(",
                    "is_linear_layer", "is_moe_layer", 'attention == "mla"', 'attention != "mla"', "linear_layers")


def _code_without_docstrings(source: str) -> str:
    """The source's code as ``ast.unparse`` writes it: no comments, no docstrings (which may name the kinds)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node) is not None:
            node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree).replace("'", '"')


@pytest.mark.parametrize("path", ["modules/model.py", "tritonlm/accounting.py"])
def test_assembly_and_accounting_name_no_part_kind(path):
    """The model assembly and the accounting ask each layer's parts (``layer_mixer`` / ``layer_mlp``); a new mixer
    changes neither file."""
    code = _code_without_docstrings((REPO / path).read_text(encoding="utf-8"))
    assert [w for w in _PART_KIND_WORDS if w in code] == []


def test_the_assembly_holds_no_sampling_loop():
    """Generation (the sampling loop, the paged cache of a ragged batch) is modules/generation.py's: model.py only
    forwards ``generate`` to it."""
    names = {name for _, name in _imports(REPO / "modules" / "model.py")}
    assert not names & {"sampling", "cache.PagedKVCache"}
    code = _code_without_docstrings((REPO / "modules" / "model.py").read_text(encoding="utf-8"))
    assert [w for w in ("sample_next", "constrain_logits", "PagedKVCache") if w in code] == []


def test_checkpoint_layer_names_ask_the_parts():
    """hf/checkpoint.py's layer loop names no mixer or MLP kind either (the config comparison in ``_differences``
    may read the config's fields)."""
    tree = ast.parse((REPO / "tritonlm" / "hf" / "checkpoint.py").read_text(encoding="utf-8"))
    functions = {n.name: ast.unparse(n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ("layer_names", "state_from_hf", "state_to_hf"):
        body = functions[name].replace("'", '"')
        assert [w for w in _PART_KIND_WORDS if w in body] == [], name


#: where each import root's files live
_PACKAGES = {"tritonlm": REPO / "tritonlm", "tritonlm.kernels": REPO / "kernels", "tritonlm.modules": REPO / "modules"}


def _module_name(path: Path) -> str:
    for package, root in sorted(_PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if path.is_relative_to(root):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join([package, *parts])
    raise ValueError(path)


def _graph() -> dict[str, set[str]]:
    """Module -> the tritonlm modules it imports (function-level imports too; ``from . import x`` names x)."""
    files = {_module_name(f): f for root in _PACKAGES.values() for f in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[:len(base) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    edges.add(full if full in files else target)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other, directly or through others. Edges into the three top packages'
    ``__init__`` (which re-export their children) and into a module's own parent packages are not followed."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen and nxt not in _PACKAGES and not start.startswith(nxt + "."):
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {name: reach(name) for name in graph if name not in _PACKAGES}
    return sorted((a, b) for a in reached for b in reached[a] if b in reached and a in reached[b] and a < b)


def test_no_import_cycles_between_modules():
    graph = _graph()
    assert _cycles(graph) == []
    # the check sees one: the model reaching back into a backend namespace (as it once did for KVCache)
    graph["tritonlm.modules.model"].add("tritonlm.modules.reference")
    assert ("tritonlm.modules.model", "tritonlm.modules.reference") in _cycles(graph)


def test_memory_counting_uses_no_private_report_helper():
    names = [name for _, name in _imports(REPO / "tritonlm" / "memory.py")]
    assert "kernel_report" not in names


def test_train_holds_the_loop_and_only_the_cli_imports_it():
    """Tokenizer lookup, data preparation and loading for generation live below the training loop; the loop's
    module is the CLI's to import (``tritonlm._base`` is the bottom every module may use)."""
    graph = _graph()
    assert sorted(name for name, edges in graph.items() if "tritonlm.train" in edges) == ["tritonlm.cli"]
    assert graph["tritonlm._base"] <= {"tritonlm.kernels", "tritonlm.modules", "tritonlm.modules.model"}
    for low in ("tritonlm.tokenizer", "tritonlm.data", "tritonlm.generate"):
        assert "tritonlm.train" not in graph[low] and "tritonlm.cli" not in graph[low], low
