"""The import graph of maxctx/: no cycle, and no import from a lower layer to a higher one (function-local imports
count too). The layers are the module map of the README's "Layout" section."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Lowest first; a module may import from its own layer and the ones before it. A package name covers its modules;
# every package (folder) is named, a subpackage on its own (test_every_folder_has_a_layer).
LAYERS = [
    ["maxctx", "maxctx.errors", "maxctx.datasets", "maxctx.compat", "maxctx.config"],
    # maxctx.model.shape: the model's sizes, parameter counts, FLOPs and bytes per dtype, without JAX, for the
    # FLOPs, the planner and the roofline below the rest of maxctx.model.
    ["maxctx.parallelism", "maxctx.storage", "maxctx.files", "maxctx.optimizer", "maxctx.metrics",
     "maxctx.model.shape", "maxctx.model.family", "maxctx.model.families", "maxctx.model.llama.family",
     "maxctx.model.qwen.family", "maxctx.model.qwen.hf_layout", "maxctx.model.olmo.family",
     "maxctx.model.olmo.hf_layout",
     "maxctx.model.llama.hf_layout", "maxctx.model.gemma.family", "maxctx.model.gemma.hf_layout",
     "maxctx.model.moe.family", "maxctx.model.moe.hf_layout", "maxctx.model.deepseek.family",
     "maxctx.model.deepseek.hf_layout",
     "maxctx.model.qwen35.family", "maxctx.model.qwen35.hf_layout", "maxctx.model.qwen3_next.family",
     "maxctx.model.qwen3_next.hf_layout", "maxctx.model.gpt_oss.family", "maxctx.model.gpt_oss.hf_layout"],
    ["maxctx.attention.kernels"],  # what one device computes
    ["maxctx.attention.cp"],  # context parallelism over the kernels
    ["maxctx.attention"],  # dispatch.py: picks kernel and strategy
    # maxctx.model.moe.experts: the expert strategy's bytes and memory as formulas (no JAX), which the roofline reads
    ["maxctx.plan", "maxctx.validate", "maxctx.loader", "maxctx.model.moe.experts"],
    ["maxctx.mesh", "maxctx.runtime", "maxctx.peers"],
    ["maxctx.model", "maxctx.model.llama", "maxctx.model.qwen", "maxctx.model.olmo",
     "maxctx.model.gemma", "maxctx.model.moe", "maxctx.model.deepseek", "maxctx.model.qwen35",
     "maxctx.model.qwen3_next", "maxctx.model.gpt_oss", "maxctx.data"],
    ["maxctx.train_step"],
    ["maxctx.checkpoint", "maxctx.evaluate"],
    ["maxctx.compile", "maxctx.train", "maxctx.convert", "maxctx.launch"],
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in (ROOT / "maxctx").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{name}: relative import; write `from maxctx...`")
            targets = ([f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                       and node.module else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for target in targets:
                while target and target not in modules:  # `from pkg import module` or `from module import name`
                    target = target.rpartition(".")[0]
                if target.startswith("maxctx") and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def layer_of(module: str) -> int:
    best = max(((i, prefix) for i, layer in enumerate(LAYERS) for prefix in layer
                if module == prefix or module.startswith(prefix + ".")), key=lambda x: len(x[1]), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and the README's Layout)"
    return best[0]


def folder_of(module: str, packages: set[str]) -> str:
    """The folder a module is checked as: its innermost package below maxctx, or itself at the top of maxctx."""
    parts = module.split(".")
    while len(parts) > 2 and ".".join(parts) not in packages:
        parts.pop()
    return ".".join(parts)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between folders. A package and its own subpackages are left out of each other's edges:
    a package's registry may list its subpackages' units while they build on its base."""
    packages = {m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").exists()}
    folders: dict[str, set[str]] = {}
    for module, deps in graph.items():
        mine = folder_of(module, packages)
        for dep in deps:
            theirs = folder_of(dep, packages)
            if not (mine.startswith(theirs + ".") or theirs.startswith(mine + ".") or mine == theirs):
                folders.setdefault(mine, set()).add(theirs)
        folders.setdefault(mine, set())
    return folders


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (its nodes, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1 on the DFS stack, 2 done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            found = visit(dep, path + [dep]) if dep not in state else []
            if found:
                return found
        state[node] = 2
        return []

    return next((found for module in sorted(graph) if module not in state
                 for found in [visit(module, [module])] if found), [])


def test_graph_is_read():
    graph = import_graph()
    assert "maxctx.attention.cp.strategies" in graph["maxctx.validate"]
    assert "maxctx.parallelism" in graph["maxctx.mesh"]


def test_no_import_cycle():
    found = cycle(import_graph())
    assert not found, "import cycle: " + " -> ".join(found)


def test_no_import_cycle_between_folders():
    # A module that imports a folder whose modules import it back ties the two folders into one layer, even where
    # no single module cycle exists (config.py and data/ did, through data/registry.py).
    found = cycle(folder_graph(import_graph()))
    assert not found, "import cycle between folders: " + " -> ".join(found)
    assert cycle({"maxctx.a": {"maxctx.b"}, "maxctx.b": {"maxctx.a"}}) == ["maxctx.a", "maxctx.b", "maxctx.a"]


def test_every_folder_has_a_layer():
    # A subpackage is its own layer (attention/kernels below attention/cp below attention/dispatch.py), never
    # left to its parent's.
    named = {prefix for layer in LAYERS for prefix in layer}
    folders = sorted(p.parent.relative_to(ROOT).as_posix().replace("/", ".")
                     for p in (ROOT / "maxctx").rglob("__init__.py"))
    assert set(folders) - named == set(), f"folders in no layer: {sorted(set(folders) - named)}; add them to LAYERS"


def test_no_upward_import():
    upward = [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
              for m, deps in sorted(import_graph().items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_parallelism_is_jax_free():
    source = (ROOT / "maxctx" / "parallelism.py").read_text()
    imported = {a.name.split(".")[0] for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(ast.parse(source))
                 if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"jax", "jaxlib", "numpy", "flax"}, imported


def test_config_checks_run_without_importing_jax():
    # Validation (the strategies' rules included) and the entry points' imports come before JAX: a bad config is
    # reported without paying for JAX's import. A fresh interpreter, since this one has JAX loaded.
    code = ("import sys; from maxctx import compile, train; from maxctx.loader import load_config; "
            "load_config(['configs/base.yml', 'cpu_devices=8', 'ici_context_parallelism=8', 'per_device_batch_size=1', "
            "'context_parallel_strategy=usp', 'base_num_query_heads=8', 'attention=splash', "
            "'max_target_length=4096']); "
            "assert train.main(['configs/base.yml', 'context_parallel_strategy=ulysses', 'cpu_devices=8', "
            "'ici_context_parallelism=8', 'base_num_query_heads=6']) == 2; "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'numpy')); "
            "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "not divisible by the A2A degree 8" in result.stderr
