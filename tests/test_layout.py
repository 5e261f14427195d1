"""The package's layout, read from the source with ast: imports point down the layers (attention and kernels
never import Megatron; memory never imports the Megatron integration; the main job and the benchmark sit on
top), there is no import loop, even through imports inside functions, and attention/args.py is a leaf."""

from __future__ import annotations

import ast
import pathlib

import megatron_longctx

PACKAGE = pathlib.Path(megatron_longctx.__file__).parent
ATTENTION = PACKAGE / "attention"


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_nodes(tree: ast.Module, deferred: bool) -> list[ast.AST]:
    """The import statements of a module; without ``deferred``, only those that run when it is imported
    (module level, under ``if``/``try``/``with``/``class``; not inside a function)."""
    if deferred:
        return list(ast.walk(tree))
    found: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph(folder: pathlib.Path, deferred: bool = True) -> dict[str, set[str]]:
    """Module -> package modules it imports (``deferred``: any import: top level, in functions, under
    TYPE_CHECKING; else only the imports that run when the module is imported)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if folder != PACKAGE and folder not in path.parents:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text()), deferred):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                targets |= {f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return {name: {t for t in targets if t in graph} for name, targets in graph.items()}


# What each part of the package may import (imports inside functions included). Nothing below job/,
# bench/ and bridge/ imports them; the CLI reaches them by module name.
ALLOWED = {
    "cp_algorithms": set(),  # the CP algorithms by name: a leaf table everyone may read
    "kernels": set(),
    "attention": {"kernels", "cp_algorithms"},
    "config": {"cp_algorithms"},
    "procs": set(),
    "patching": set(),
    "data": set(),
    "memory": {"config", "kernels", "procs", "patching"},
    "plan": {"config", "cp_algorithms"},
    "megatron": {"attention", "config", "cp_algorithms", "kernels", "memory", "procs", "patching"},
    "launch": {"megatron"},
    "bridge": {"config", "megatron"},
    "job": {"config", "cp_algorithms", "data", "megatron", "memory", "patching", "plan", "procs"},
    "bench": {"__init__", "attention", "cli", "config", "cp_algorithms", "data", "kernels", "megatron", "memory",
              "patching", "plan", "procs"},
    "cli": set(),
    "__main__": {"cli"},
    "__init__": set(),
}
NO_MEGATRON = ("kernels", "attention", "config", "cp_algorithms", "procs", "patching", "plan")  # never import Megatron itself


def part(module: str) -> str:
    """``megatron_longctx.memory.offload`` -> ``memory``; the package's own ``__init__`` -> ``__init__``."""
    return (module.split(".") + ["__init__"])[1]


def upward_imports(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for each import from one part into another that ``allowed`` does not list."""
    return sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                  if part(target) != part(name) and part(target) not in allowed.get(part(name), set()))


def megatron_imports(folder_or_file: pathlib.Path) -> list[str]:
    """``"file: module"`` for each import of Megatron (``megatron.*``, anywhere in the file)."""
    files = [folder_or_file] if folder_or_file.is_file() else sorted(folder_or_file.rglob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n == "megatron" or n.startswith("megatron.")]
    return found


def test_imports_point_down_the_layers():
    graph = import_graph(PACKAGE)
    assert {part(name) for name in graph} <= set(ALLOWED), sorted({part(n) for n in graph} - set(ALLOWED))
    assert upward_imports(graph, ALLOWED) == []


def test_the_lower_layers_never_import_megatron():
    for name in NO_MEGATRON:
        path = PACKAGE / name if (PACKAGE / name).is_dir() else PACKAGE / f"{name}.py"
        assert path.exists(), path
        assert megatron_imports(path) == []


def test_the_layer_checks_see_a_violation():
    graph = {"megatron_longctx.memory.offload": {"megatron_longctx.megatron.spec", "megatron_longctx.config"},
             "megatron_longctx.megatron.spec": set(), "megatron_longctx.config": set()}
    assert upward_imports(graph, ALLOWED) == ["megatron_longctx.memory.offload -> megatron_longctx.megatron.spec"]
    assert megatron_imports(PACKAGE / "megatron" / "attention_spec.py")  # the integration does import Megatron


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def loops(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                out.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_package_imports_have_no_cycle():
    graph = import_graph(PACKAGE, deferred=False)
    assert {"megatron_longctx.config", "megatron_longctx.memory", "megatron_longctx.attention.api"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_config_is_below_every_feature():
    graph = import_graph(PACKAGE)
    assert graph["megatron_longctx.config"] <= {"megatron_longctx.cp_algorithms"}, graph["megatron_longctx.config"]
    assert graph["megatron_longctx.cp_algorithms"] == set()
    assert "megatron_longctx.config" in graph["megatron_longctx.memory"]


def test_package_has_no_loop_even_through_imports_inside_functions():
    graph = import_graph(PACKAGE)
    assert {"megatron_longctx.megatron.cpu_compat", "megatron_longctx.megatron.launch"} <= set(graph)
    assert loops(graph) == [], [sorted(c) for c in loops(graph)]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_attention_imports_have_no_cycle():
    graph = import_graph(ATTENTION)
    assert "megatron_longctx.attention.api" in graph["megatron_longctx.attention"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_args_is_a_leaf():
    deps = import_graph(ATTENTION)["megatron_longctx.attention.args"]
    assert deps == set(), deps


def test_the_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert loops({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [{"a", "b"}]


if __name__ == "__main__":  # print the graph: python -m tests.attention.test_imports
    graph = import_graph(ATTENTION)
    for name in sorted(graph):
        print(f"{name.removeprefix('megatron_longctx.attention.') or '__init__'} -> "
              f"{sorted(d.removeprefix('megatron_longctx.attention.') for d in graph[name])}")
    print("attention cycle (any import):", find_cycle(graph))
    print("package loops through imports inside functions:", [sorted(c) for c in loops(import_graph(PACKAGE))])
    print("cycle:", find_cycle(import_graph(PACKAGE, deferred=False)))
