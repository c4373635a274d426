"""The package's imports go downward only, and no two modules import each other, however indirectly.

Read from the source (ast), not by importing: every import counts, at module level, inside a function or under
TYPE_CHECKING, since each of them is a dependency of the module that writes it. The order is
docs/architecture.md's (section 4); a module may import its own tier and the tiers below it.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanoserve"

# Lowest first. A name is a top-level module or package of nanoserve ("__init__" is the package's own face).
TIERS: list[tuple[str, ...]] = [
    # Plain modules and self-contained feature packages, under them all.
    ("utils", "outputs", "sampling_params", "config", "args", "tools", "structured", "assets",
     # a checkpoint's quantization_config, read with config.json
     "quantization.scheme", "quantization.detect", "quantization.mxfp4", "quantization.w4_scheme",
     "quantization.w4_detect",
     "spec_decode.config"),  # speculative_config, checked with EngineArgs
    ("kernels", "distributed"),
    ("layers",),
    ("model", "quantization", "spec_decode"),  # spec_decode: proposals and rejection sampling over the sampler
    ("worker",),
    ("engine",),
    ("runtime", "chat_engine"),
    ("llm", "__init__"),
    ("server", "bench"),
    ("router",),  # in front of servers: it reuses the server's gate, errors and streaming
    ("cli",),
]
TIER = {name: rank for rank, names in enumerate(TIERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The nanoserve modules `path` imports anywhere in its body (a name imported from a package counts as its
    submodule where one exists)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def tier_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if ".".join(parts[1:3]) in TIER:  # a module placed apart from its package
        return TIER[".".join(parts[1:3])]
    if top not in TIER:
        raise AssertionError(f"{module}: not in any tier of {__name__}.TIERS; place it (docs/architecture.md)")
    return TIER[top]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_imports_go_downward_only():
    upward = [f"{module} imports {dep}, which sits above it" for module, deps in import_graph().items()
              for dep in sorted(deps) if tier_of(dep) > tier_of(module)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "\n".join(" <-> ".join(component) for component in found)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder(graph, expected):
    assert cycles(graph) == expected
