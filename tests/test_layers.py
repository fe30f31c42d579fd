"""The package's layers: imports run one way, `sharding` -> `models` -> `sampling` -> `drafters`
-> `rl` -> `jobs` (the simulator, `sim`, reads `sampling` and `drafters`), and no two modules
import each other, directly or through others. Read from the source (every import statement,
those inside functions too), so nothing is imported to check it."""

import ast
import graphlib
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "specjax"
# a part imports its own modules and those of parts in lower layers; the shared top-level
# modules sit below every part
LAYER = {"errors": 0, "config_tree": 1, "optim": 2, "sharding": 2, "models": 3, "sampling": 4,
         "drafters": 5, "sim": 6, "rl": 6, "jobs": 7}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str) -> set[str]:
  """The package's modules that module `name` imports (`from X import y` counts X.y where that
  is a module, else X)."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        kept = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(kept + ([base] if base else []))
      found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                for a in node.names}
  return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def part(module: str) -> str:
  return module.split(".")[1] if "." in module else ""


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
  """Imports of a part in the same or a higher layer than the importer's."""
  return [(a, b) for a, deps in graph.items() for b in deps
          if part(a) and part(b) and part(a) != part(b) and LAYER[part(b)] >= LAYER[part(a)]]


def circle(graph: dict[str, set[str]]) -> list[str] | None:
  """A circle of plain modules (a package's `__init__` re-exports its modules: left out)."""
  plain = {m: {d for d in deps if MODULES[d].name != "__init__.py"}
           for m, deps in graph.items() if MODULES[m].name != "__init__.py"}
  try:
    graphlib.TopologicalSorter(plain).prepare()
  except graphlib.CycleError as e:
    return e.args[1]
  return None


def test_every_part_has_a_layer():
  assert {part(m) for m in MODULES if part(m)} <= set(LAYER)


def test_no_import_runs_back_up_the_layers():
  assert upward(GRAPH) == []


def test_no_import_circle_between_modules():
  assert circle(GRAPH) is None


def test_the_checks_see_an_import_that_breaks_them():
  """Controls: one import up the layers, or one that closes a circle, is found."""
  up = {**GRAPH, "specjax.models.decoder": GRAPH["specjax.models.decoder"] | {"specjax.rl.loop"}}
  assert upward(up) == [("specjax.models.decoder", "specjax.rl.loop")]
  batch = "specjax.sampling.engine.batch"
  assert "specjax.sampling.engine.paged_state" in GRAPH[batch]
  closed = {**GRAPH, "specjax.sampling.engine.paged_state":
            GRAPH["specjax.sampling.engine.paged_state"] | {batch}}
  assert circle(closed) is not None
