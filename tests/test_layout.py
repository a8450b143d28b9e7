"""The package's shape as docs/architecture.md draws it: every module one idea of at most 400 lines, imports that
flow one way through the layers (entrypoints → orchestrator → stages → engine, voices → models, connectors,
audio, config), no import cycle between modules, and a README.md in every package folder. Read from the source (ast), so lazy and TYPE_CHECKING imports count
too: a dependency is a dependency wherever the import statement sits."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "omni_tts"
MAX_LINES = 400
# higher imports lower, never the other way; one rank may import within itself
LAYERS = {"entrypoints": 4, "orchestrator": 3, "stages": 2, "engine": 1, "voices": 1,
          "models": 0, "connectors": 0, "audio": 0, "config": 0}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str | None:
    """The module an import names: itself, or the package it is an attribute of."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """The omni_tts modules `module` imports (explicitly; a parent package's __init__ is not counted)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for n in names if n.startswith("omni_tts") and (target := resolve(n)) not in
                     (None, module) and not module.startswith(target + "."))
    return found


GRAPH = {module: imports(module) for module in MODULES}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_is_at_most_400_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_imports_flow_down_the_layers():
    upward = sorted(f"{a} → {b}" for a, targets in GRAPH.items() for b in targets
                    if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))
    assert upward == []


def test_no_import_cycle():
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                cycles.append(" → ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("bad,expected", [
    ("a = 1\n", set()),
    ("from omni_tts.engine.talker_engine import TalkerEngine\n", {"omni_tts.engine.talker_engine"}),
    ("from ..engine import chunker\n", {"omni_tts.engine.chunker"}),
])
def test_the_import_reader_sees_absolute_and_relative_imports(tmp_path, bad, expected):
    """The checks above are only as good as this reader: a module under models/ that imports the engine layer."""
    probe = PACKAGE / "models" / "_layout_probe.py"
    probe.write_text(bad)
    try:
        MODULES["omni_tts.models._layout_probe"] = probe
        assert imports("omni_tts.models._layout_probe") == expected
    finally:
        del MODULES["omni_tts.models._layout_probe"]
        probe.unlink()


def test_a_module_name_means_one_thing():
    """One name, one idea: a module's file name is used once in the package (`protocol`, `config`, `lifecycle` each
    meant two things once). The model families are the exception, each with the same parts (its `model`, its
    `checkpoint_config`, its `random_model`)."""
    places: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if path.name not in ("__init__.py", "__main__.py") and not module.startswith("omni_tts.models."):
            places.setdefault(path.stem, []).append(module)
    assert {name: found for name, found in places.items() if len(found) > 1} == {}


def test_every_package_folder_says_what_it_holds():
    """Each package folder has a README.md: what is there and what it may import."""
    folders = {path.parent for path in PACKAGE.rglob("__init__.py")}
    assert sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "README.md").is_file()) == []


def test_the_api_never_imports_the_command_line():
    """Within the top layer `cli/` starts `api/`, never the other way: the app serves the same under any bootstrap."""
    assert sorted(f"{a} → {b}" for a, targets in GRAPH.items() for b in targets
                  if a.startswith("omni_tts.entrypoints.api") and b.startswith("omni_tts.entrypoints.cli")) == []
