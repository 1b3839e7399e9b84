"""Data flows one way: every import between rooms runs downward, and no modules import
each other in a circle. Read from the source with `ast` (imports inside functions and
under TYPE_CHECKING count too: a circle is a circle however it is spelled).

    layer 0   schemas/  infra/                 wire formats; local infrastructure
    layer 1   gpu_runtime/  common/            the model runtime; settings and clients
    layer 2   batcher/  ingest/  results/      the data plane's rooms, side by side
    layer 3   worker/  modelfiles/             the one assembler of layer 2; the model
                                               files people bring (GGUF, the bundled
                                               SmolLM2, the tiny model's teaching)
    layer 4   sluice/                          what `import sluice` means: SDK, control plane
    layer 5   gateway/  demo/                  the faces over the SDK, side by side
    layer 6   bench/                           the harness (runs the gateway and workers)
    layer 7   cli/ (and sluice.__main__)       the command line, outermost

A room may import rooms of lower layers only: never one beside it, never one above.
Top-level packages never import each other in a circle either.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS: dict[str, int] = {
    "schemas": 0, "infra": 0,
    "gpu_runtime": 1, "common": 1,
    "batcher": 2, "ingest": 2, "results": 2,
    "worker": 3, "modelfiles": 3,
    "sluice": 4,
    "gateway": 5, "demo": 5,
    "bench": 6,
    "cli": 7,
}
# Modules that belong to another room than their package's: `python -m sluice` is the
# command line, named after the distribution.
MEMBERS = {"sluice.__main__": "cli"}


def room_of(module: str) -> str | None:
    """The most specific room a dotted module name belongs to."""
    if module in MEMBERS:
        return MEMBERS[module]
    best = None
    for room in LAYERS:
        if (module == room or module.startswith(room + ".")) and (
                best is None or len(room) > len(best)):
            best = room
    return best


def modules() -> dict[str, Path]:
    found = {}
    for top in {room.split(".")[0] for room in LAYERS}:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a package's submodule when named)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports the module; `from pkg import name`, the package.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def test_every_import_between_rooms_runs_downward() -> None:
    wrong = []
    for module, targets in graph().items():
        source = room_of(module)
        for target in targets:
            room = room_of(target)
            if room is None or room == source or source is None:
                continue
            if LAYERS[room] >= LAYERS[source]:
                way = "sideways" if LAYERS[room] == LAYERS[source] else "upward"
                wrong.append(f"{module} -> {target} ({source} -> {room}, {way})")
    assert not wrong, "imports against the flow:\n" + "\n".join(sorted(wrong))


def test_no_modules_import_each_other_in_a_circle() -> None:
    circles = circles_in(graph())
    assert not circles, f"modules importing each other in a circle: {circles}"


def test_no_top_level_packages_import_each_other_in_a_circle() -> None:
    """`sluice` -> `benchmarks` -> `sluice` was one: a package's rooms may not reach a
    package that reaches back, even when each room's own arrow runs downward."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph().items():
        packages.setdefault(top_of(module), set()).update(top_of(t) for t in targets)
    edges = {top: targets - {top} for top, targets in packages.items()}
    assert not circles_in(edges), f"packages importing each other: {circles_in(edges)}"


def top_of(module: str) -> str:
    """A module's top-level package, where a member of another room counts as that room's."""
    return (MEMBERS.get(module) or module).split(".")[0]


def circles_in(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return circles


def test_the_rule_sees_a_wrong_import() -> None:
    """The checks are not vacuous: the graph holds the imports it must judge."""
    edges = graph()
    assert "results.writer" in edges and "common.topics" in edges["results.producer"]
    assert room_of("cli.worker_cmd") == "cli" and room_of("sluice.__main__") == "cli"
    assert "gateway.app" in edges and "sluice.client" in edges["gateway.app"]
    assert room_of("sluice.client") == "sluice"
    assert LAYERS[room_of("ingest.consumer")] == LAYERS[room_of("results.writer")]
