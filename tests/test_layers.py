"""The layer order written in ``kvrl/__init__.py`` holds: no module imports a higher layer."""

import ast
import re
from pathlib import Path

import kvrl

ROOT = Path(kvrl.__file__).parent


def layers() -> dict[str, int]:
    """Component name -> layer number, from the table in kvrl's docstring."""
    table = {}
    for number, names in re.findall(r"^\s*(\d+)\. ((?:[a-z_]+ )*[a-z_]+)\s{2,}", kvrl.__doc__, re.M):
        table.update(dict.fromkeys(names.split(), int(number)))
    return table


def component(module: str) -> str:
    """kvrl.engines.vllm.runtime -> engines; kvrl.runlog -> runlog."""
    return module.split(".")[1]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every kvrl import in a file, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "kvrl" else [f"kvrl.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(line, name) for line, name in found if name.startswith("kvrl.")]


def test_the_table_names_every_component():
    table = layers()
    assert table["kernels"] == 1 and table["run"] == max(table.values())
    here = {
        p.stem if p.is_file() else p.name
        for p in ROOT.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert here <= set(table), here - set(table)


def test_no_module_imports_a_higher_layer():
    table = layers()
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        source = ".".join(("kvrl", *path.relative_to(ROOT).with_suffix("").parts))
        if source == "kvrl.__init__":
            continue
        for line, target in imports(path):
            if table[component(target)] > table[component(source)]:
                wrong.append(
                    f"{path.relative_to(ROOT.parent)}:{line} ({component(source)}, layer "
                    f"{table[component(source)]}) imports {target} (layer {table[component(target)]})"
                )
    assert not wrong, "imports that run up the layers of kvrl/__init__.py:\n" + "\n".join(wrong)


def test_the_check_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvrl.workers.controller import Controller\n")
    assert imports(bad) == [(2, "kvrl.workers.controller")]
    assert layers()[component("kvrl.workers.controller")] > layers()["policies"]


def module_name(path: Path) -> str:
    """kvrl/engines/vllm/runtime.py -> kvrl.engines.vllm.runtime; kvrl/envs/__init__.py -> kvrl.envs."""
    return ".".join(("kvrl", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The kvrl modules a file imports outside its functions and classes, ``if TYPE_CHECKING:``
    blocks included (a circle a type checker walks is still a circle); ``from pkg import mod``
    counts as importing ``pkg.mod``. Imports inside a function run late, when both modules
    are loaded, and do not count."""
    found = set()
    pending = list(ast.parse(path.read_text(), str(path)).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.If, ast.Try)):
            pending += [
                *node.body,
                *node.orelse,
                *getattr(node, "finalbody", []),
                *(s for h in getattr(node, "handlers", []) for s in h.body),
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & modules


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of the graph, each once, as the path from its least module back to it."""
    circles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for target in graph[node]:
                if target == start:
                    circles.append(path + [start])
                elif target > start and target not in path:
                    stack.append((target, path + [target]))
    return circles


def test_no_import_circle():
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: module_imports(path, set(paths)) for name, path in paths.items()}
    circles = import_circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_check_catches_a_circle_through_type_checking(tmp_path):
    """heads.py imported runtime's plan types for its annotations while runtime imported heads."""
    a = tmp_path / "a.py"
    a.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvrl.b import Plan\n"
        "def f():\n    from kvrl.c import g\n"
    )
    assert module_imports(a, {"kvrl.b", "kvrl.c"}) == {"kvrl.b"}
    assert import_circles({"kvrl.a": {"kvrl.b"}, "kvrl.b": {"kvrl.a"}}) == [["kvrl.a", "kvrl.b", "kvrl.a"]]


KERNEL_PARTS = {"reference": ("reference",), "cpu": ("reference", "cpu"), "cuda": ("reference", "cuda")}


def kernel_imports_outside(path: Path, part: str) -> list[tuple[int, str]]:
    """The kvrl imports of a module of kvrl/kernels/<part>/ that leave what the part may use."""
    may = [f"kvrl.kernels.{p}" for p in KERNEL_PARTS[part]]
    return [(line, t) for line, t in imports(path) if not any(t == m or t.startswith(m + ".") for m in may)]


def test_the_kernels_specification_stands_alone():
    """kvrl/kernels/reference is the specification: it imports nothing of the accelerators or of
    the dispatch; the CPU accelerator and the GPU kernels import the reference and themselves."""
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
        for part in KERNEL_PARTS
        for path in sorted((ROOT / "kernels" / part).rglob("*.py"))
        for line, target in kernel_imports_outside(path, part)
    ]
    assert not wrong, "kernel imports across parts:\n" + "\n".join(wrong)


def test_the_kernels_check_catches_a_reference_importing_the_accelerator(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kvrl.kernels.reference.scores import TORCH\nfrom kvrl.kernels import dispatch\n"
        "def f():\n    from kvrl.kernels.cpu import native\n"
    )
    assert kernel_imports_outside(bad, "reference") == [(2, "kvrl.kernels"), (4, "kvrl.kernels.cpu")]
    assert kernel_imports_outside(bad, "cpu") == [(2, "kvrl.kernels")]


def documented_layers(text: str) -> dict[str, int]:
    """Component name -> layer number, from a markdown table whose rows read ``| 3 | `cache` | ... |``."""
    table = {}
    for number, names in re.findall(r"^\| (\d+) \| ([^|]+) \|", text, re.M):
        table.update(dict.fromkeys(re.findall(r"`([a-z_]+)`", names), int(number)))
    return table


def test_the_architecture_page_shows_the_same_layers():
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    assert documented_layers(page) == layers(), "docs/architecture.md's layer table differs from kvrl/__init__.py's"


def test_the_layer_comparison_sees_a_moved_component():
    page = "| 11 | `gate`, `plan` | ... |\n| 12 | `jobs`, `config` | ... |\n"
    assert documented_layers(page) == {"gate": 11, "plan": 11, "jobs": 12, "config": 12}
    assert documented_layers(page) != {**documented_layers(page), "jobs": 11}


# ---- import circles, counting the imports inside functions ------------------------------------


def module_imports_anywhere(path: Path, modules: set[str]) -> set[str]:
    """As :func:`module_imports`, with the imports inside functions and classes too: a lazy import
    breaks a circle at load time, not the dependency."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & modules


def test_no_import_circle_counting_imports_inside_functions():
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: module_imports_anywhere(path, set(paths)) for name, path in paths.items()}
    circles = import_circles(graph)
    assert not circles, "import circles through imports inside functions:\n" + "\n".join(
        " -> ".join(c) for c in circles
    )


def test_the_check_counts_an_import_inside_a_function(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from kvrl.b import g\n")
    assert module_imports(a, {"kvrl.b"}) == set()
    assert module_imports_anywhere(a, {"kvrl.b"}) == {"kvrl.b"}
