"""The attention package's import graph is acyclic, and args.py is a leaf (read from the source with ast)."""

from __future__ import annotations

import ast
import pathlib

import megatron_longctx

PACKAGE = pathlib.Path(megatron_longctx.__file__).parent
ATTENTION = PACKAGE / "attention"


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(folder: pathlib.Path) -> dict[str, set[str]]:
    """Module -> package modules it imports (any import: top level, in functions, under TYPE_CHECKING)."""
    modules = {_module(p): p for p in folder.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                targets |= {f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


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


def test_attention_imports_have_no_cycle():
    graph = import_graph(ATTENTION)
    assert "megatron_longctx.attention.api" in graph["megatron_longctx.attention"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_args_is_a_leaf():
    deps = import_graph(ATTENTION)["megatron_longctx.attention.args"]
    assert deps == set(), deps


def test_the_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


if __name__ == "__main__":  # print the graph: python -m tests.attention.test_imports
    graph = import_graph(ATTENTION)
    for name in sorted(graph):
        print(f"{name.removeprefix('megatron_longctx.attention.') or '__init__'} -> "
              f"{sorted(d.removeprefix('megatron_longctx.attention.') for d in graph[name])}")
    print("cycle:", find_cycle(graph))
