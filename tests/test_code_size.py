"""One concern per file, about 400 lines at most, and small functions (the project's style, habit 1): no module of
maxctx/ over MAX_MODULE_LINES lines, no function or method over MAX_FUNCTION_LINES lines, no package (the top of
maxctx/ included) over MAX_PACKAGE_MODULES modules.

A module's size is its line count. A function's size is every line from its `def` to its last line, docstring
included (nested functions count in their enclosing function, and once more on their own).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_PACKAGE_MODULES = 16  # its own modules beside __init__.py; a subpackage is counted on its own
# Known offenders, each with the reason it stays ("path" for a module, "path:function" for a function); a test
# keeps the list to current offenders only.
ALLOWED: set[str] = set()


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the function's `def` (its first decorator) to its last line."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return node.end_lineno - first + 1


def functions(node: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function under `node`, methods as Class.method, nested ones as outer.inner."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{child.name}", child
            yield from functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from functions(child, f"{prefix}{child.name}.")
        else:
            yield from functions(child, prefix)


def offenders() -> dict[str, int]:
    """Every module and function over its limit: "path" or "path:function" -> lines."""
    found = {}
    for path in sorted((ROOT / "maxctx").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found[name] = len(text.splitlines())
        for qualname, node in functions(ast.parse(text)):
            if body_lines(node) > MAX_FUNCTION_LINES:
                found[f"{name}:{qualname}"] = body_lines(node)
    return found


def test_modules_and_functions_are_small():
    over = {name: lines for name, lines in offenders().items() if name not in ALLOWED}
    assert not over, (f"over {MAX_MODULE_LINES} lines per module or {MAX_FUNCTION_LINES} lines per function: "
                      f"{over}; split by concern")


def test_the_allow_list_holds_only_current_offenders():
    assert ALLOWED <= set(offenders()), f"no longer over the limit, remove from ALLOWED: {ALLOWED - set(offenders())}"


def test_the_counts_can_fail():
    source = "def f():\n    \"\"\"doc\n    more\"\"\"\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 2)
    assert body_lines(ast.parse(source).body[0]) == MAX_FUNCTION_LINES + 1
    assert body_lines(ast.parse("@decorated\ndef g():\n    pass\n").body[0]) == 3


def package_sizes() -> dict[str, int]:
    """Modules directly in each package of maxctx/ (its folder's .py files but __init__.py), by folder."""
    return {init.parent.relative_to(ROOT).as_posix(): len(list(init.parent.glob("*.py"))) - 1
            for init in (ROOT / "maxctx").rglob("__init__.py")}


def test_packages_stay_small():
    # The top of maxctx/ holds the entry points and the layers' single modules; a concern with several modules is a
    # package (attention/, checkpoint/, plan/, ...), and a package that grows past the bound splits into subpackages
    # (attention/kernels/ and attention/cp/).
    over = {name: count for name, count in package_sizes().items() if count > MAX_PACKAGE_MODULES}
    assert not over, f"over {MAX_PACKAGE_MODULES} modules in a package: {over}; split it into subpackages"
    assert package_sizes()["maxctx"] >= 10 and "maxctx/attention/kernels" in package_sizes()
