"""The import rule of the design (../shared/DESIGN.md, "Layers and the import rule"), checked over
every import statement of the package, the ones inside functions included: no module imports
another that imports it back (directly or around a loop); nothing below `cli/` imports it; `sim/`
and `engine/` never import each other and neither imports `bench/`; `kv/` and `sched/` reach
neither torch nor the engine, whatever they import in between."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sloserve"


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = module_files()


def _resolve(name: str) -> str:
    """The package module a dotted import names (an attribute's module, a module, or a package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(name: str) -> tuple[set[str], set[str]]:
    """(package modules, outside top-level packages) that module `name` imports anywhere in its code."""
    inside, outside = set(), set()
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, `level` - 1 packages up
                anchor = package.split(".")
                base = ".".join(anchor[:len(anchor) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "sloserve":
                resolved = _resolve(target)
                if resolved and resolved != name:
                    inside.add(resolved)
            elif target:
                outside.add(target.split(".")[0])
    return inside, outside


GRAPH = {name: imports_of(name) for name in MODULES}


def reach(start: str) -> set[str]:
    """Every package module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()][0]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def in_layer(module: str, layer: str) -> bool:
    return module == f"sloserve.{layer}" or module.startswith(f"sloserve.{layer}.")


def test_no_module_imports_one_that_imports_it_back():
    loops = sorted(name for name in MODULES if name in reach(name))
    assert not loops, f"modules on an import loop: {loops}"


def test_nothing_below_the_cli_imports_it():
    for name in MODULES:
        if not in_layer(name, "cli"):
            bad = sorted(m for m in GRAPH[name][0] if in_layer(m, "cli"))
            assert not bad, f"{name} imports {bad}"


def test_the_shared_vocabulary_imports_nothing_else_of_sloserve():
    for name in MODULES:
        if in_layer(name, "core"):
            bad = sorted(m for m in reach(name) if not in_layer(m, "core") and m != "sloserve")
            assert not bad, f"{name} reaches {bad}"


def test_the_executors_stay_apart_and_below_bench():
    for name in MODULES:
        for layer, banned in (("sim", ("engine", "bench")), ("engine", ("sim", "bench"))):
            if in_layer(name, layer):
                bad = sorted(m for m in GRAPH[name][0] if any(in_layer(m, b) for b in banned))
                assert not bad, f"{name} imports {bad}"


def test_kv_and_sched_reach_neither_torch_nor_the_engine():
    for name in MODULES:
        if in_layer(name, "kv") or in_layer(name, "sched"):
            reached = reach(name) | {name}
            assert not any(in_layer(m, "engine") for m in reached), (name, sorted(reached))
            assert not any("torch" in GRAPH[m][1] for m in reached), name


def test_the_graph_counts_imports_inside_functions():
    """What the checks above rest on: imports made inside a function count as the module's own."""
    assert "sloserve.evaluation.decisions" in GRAPH["sloserve.cli.evaluate"][0]  # inside cmd_evaluate
    assert "transformers" in GRAPH["sloserve.engine.structured"][1]  # inside hf_view
    assert "sloserve.core.types" in GRAPH["sloserve.sched.scheduler"][0]
    assert sum(len(inside) for inside, _ in GRAPH.values()) > 500
