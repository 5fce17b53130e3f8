"""The import layering of DESIGN.md section 2 inside revtriton/ops: no import cycles, counting the
imports inside functions too (a cycle hidden in a function still ties the modules together)."""
import ast
import os

OPS = os.path.join(os.path.dirname(__file__), "..", "revtriton", "ops")


def ops_imports():
    """{module: set of sibling ops modules it imports (anywhere in the file)}."""
    modules = {f[:-3] for f in os.listdir(OPS) if f.endswith(".py") and f != "__init__.py"}
    graph = {}
    for name in modules:
        tree = ast.parse(open(os.path.join(OPS, name + ".py")).read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(alias.name for alias in node.names)
        graph[name] = deps & modules
    return graph


def cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_ops_modules_import_without_cycles():
    graph = ops_imports()
    assert {"gemm", "fused_mlp", "mlp", "reference", "dispatch"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    assert graph["reference"] == set()  # the bottom: pure torch


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = ops_imports()
    graph["reference"] = graph["reference"] | {"mlp"}  # mlp -> reference -> mlp
    assert cycle(graph) is not None
