"""The import graph of fedrun's modules: no cycles, and nothing below the CLI imports the CLI, the Optuna sweeper or
an engine (imports inside functions count: a cycle deferred to call time is still a cycle)."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
TOP = ("fedrun.cli", "fedrun.__main__", "hydra_plugins")  # the edge: composes and runs everything below it
ENGINES = ("fedrun.engine", "fedrun.async_engine")  # run the parts; no part reaches back into them


def module_graph() -> dict[str, set[str]]:
    """Module -> the fedrun modules it imports anywhere in its code."""
    modules = {}
    for path in [*(ROOT / "fedrun").rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name imported from a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                    graph[name].add(target)
    return graph


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_fedrun_s_imports_have_no_cycle():
    graph = module_graph()
    assert {"fedrun.engine", "fedrun.study", "fedrun.cli.sweeps", "fedrun.sweepdir"} <= set(graph)
    assert cycles(graph) == []


def test_nothing_below_the_cli_imports_the_cli_the_sweeper_or_an_engine():
    upward = sorted(
        (module, target)
        for module, targets in module_graph().items()
        for target in targets
        if not within(module, TOP) and (within(target, TOP) or (target in ENGINES and module not in ENGINES))
    )
    assert upward == []


def mlflow_importers(root: Path = ROOT) -> list[str]:
    """The modules of fedrun and hydra_plugins under ``root`` that import MLflow anywhere in their code (inside
    functions too)."""
    found = []
    for path in sorted([*(root / "fedrun").rglob("*.py"), *(root / "hydra_plugins").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name == "mlflow" or name.startswith("mlflow.") for name in names):
                found.append(".".join(path.relative_to(root).with_suffix("").parts))
                break
    return found


def test_the_mlflow_finder_sees_imports_at_any_depth(tmp_path):
    package = tmp_path / "fedrun"
    package.mkdir()
    (tmp_path / "hydra_plugins").mkdir()
    (package / "tracking.py").write_text("import mlflow\n")
    (package / "deep.py").write_text("def f():\n    if True:\n        from mlflow.entities import Metric\n")
    (package / "aliased.py").write_text("import os, mlflow.tracking as t\n")
    (package / "clean.py").write_text("import mlflow_like\nfrom fedrun.tracking import retried\n")
    (tmp_path / "hydra_plugins" / "plugin.py").write_text("class P:\n    def m(self):\n        import mlflow\n")
    assert mlflow_importers(tmp_path) == ["fedrun.aliased", "fedrun.deep", "fedrun.tracking", "hydra_plugins.plugin"]


def test_only_the_tracking_layer_imports_mlflow():
    importers = mlflow_importers()
    assert "fedrun.tracking" in importers  # the finder still sees the one module that does
    assert [module for module in importers if module != "fedrun.tracking"] == []


def test_the_synchronous_engines_run_stays_within_100_lines():
    """The round's shape is read in one screenful or two (the house rule: engine.run had grown to 116 lines)."""
    tree = ast.parse((ROOT / "fedrun" / "engine.py").read_text())
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    assert run.end_lineno - run.lineno + 1 <= 100
