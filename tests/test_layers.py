"""The package's layers point one way: its import graph, read from the source (no imports run).

Every `import` / `from ... import` in every module of `dllm_jax` is an edge, wherever it is
written: at module level, inside a function (a deferred import still ties the two modules
together; deferring only hides a cycle from the interpreter) or under `TYPE_CHECKING`.
`from dllm_jax.x import y` is an edge to `dllm_jax.x.y` when `y` is a submodule, else to
`dllm_jax.x`; a name that a package loads lazily (`_lazy.attach`, a `_LAZY` / `_EXPORTS`
map in its `__init__.py`) is an edge to the submodule that defines it, since importing the
name imports that submodule. The map itself is no edge of the `__init__`: it imports
nothing until a name is used. A submodule's implicit import of its parent package is no edge.

  * no cycle among the package's modules (a cycle is reported with its path, file and line
    of each import), apart from the edges in ALLOWED_CYCLE_EDGES;
  * no cycle among its subpackages (`parallel`, `models`, `decoding`, ...; a top-level module
    such as `sampler` counts as one): the layers form a stack;
  * `parallel/` and `models/` import nothing from the layers above them (decoding, serving,
    training, study);
  * `parallel/` imports nothing from `models/` (models build on parallel, not the reverse).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = "dllm_jax"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Known cycles, each broken here by naming one of its edges (importer, imported). These are
# deferred (function-level) imports inside decoding/ that close a cycle; the aim is an empty
# list. Every entry must still exist and still close a cycle (the test checks both), so an
# entry is removed as soon as its cycle is gone.
ALLOWED_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset({
})

ABOVE_PARALLEL_AND_MODELS = ("dllm_jax.decoding", "dllm_jax.serving", "dllm_jax.training",
                             "dllm_jax.study", "studylib")


@dataclasses.dataclass(frozen=True)
class Import:
  target: str  # the module imported (a package means its __init__)
  line: int
  deferred: bool  # inside a function: runs when it is called, not when the module loads


def module_files() -> dict[str, Path]:
  """Module name -> file, for every module of the package (a package is its __init__.py)."""
  out = {}
  for path in sorted(ROOT.rglob("*.py")):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


MODULES = module_files()


def _is_package(name: str) -> bool:
  return MODULES.get(name, Path()).name == "__init__.py"


def lazy_names(name: str) -> dict[str, str]:
  """For a package: attribute -> submodule for the names its __init__ loads on first use
  (the str -> str | None dict literals at its module level, as `_lazy.attach` takes them)."""
  if not _is_package(name):
    return {}
  out = {}
  for node in ast.parse(MODULES[name].read_text()).body:
    value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    if not isinstance(value, ast.Dict):
      continue
    try:
      mapping = ast.literal_eval(value)
    except ValueError:
      continue
    if all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in
           mapping.items()):
      for attr, sub in mapping.items():
        if f"{name}.{sub or attr}" in MODULES:
          out[attr] = f"{name}.{sub or attr}"
  return out


def _absolute(module: str, level: int, name: str | None) -> str:
  """The absolute module a (possibly relative) `from` import names."""
  if not level:
    return name or ""
  base = module.split(".") if _is_package(module) else module.split(".")[:-1]
  base = base[:len(base) - (level - 1)]
  return ".".join(base + ([name] if name else []))


def imports(module: str) -> list[Import]:
  """Every import of a package module, wherever it is written, as package modules."""
  tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
  deferred_nodes = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      deferred_nodes.update(id(n) for n in ast.walk(node) if n is not node)
  found = []

  def add(target: str, node):
    # The deepest package module the dotted name reaches (`import dllm_jax.x.y` -> x.y).
    while target and target not in MODULES:
      target = target.rpartition(".")[0]
    if target:
      found.append(Import(target, node.lineno, id(node) in deferred_nodes))

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
          add(alias.name, node)
    elif isinstance(node, ast.ImportFrom):
      source = _absolute(module, node.level, node.module)
      if source != PACKAGE and not source.startswith(PACKAGE + "."):
        continue
      lazy = lazy_names(source)
      for alias in node.names:
        if f"{source}.{alias.name}" in MODULES:  # a submodule
          add(f"{source}.{alias.name}", node)
        elif alias.name in lazy:  # a lazily loaded name: its defining submodule
          add(lazy[alias.name], node)
        else:
          add(source, node)
  return found


def import_graph() -> dict[str, dict[str, Import]]:
  """importer -> {imported: the first such import}; self-imports of a package dropped."""
  graph = {}
  for module in MODULES:
    edges = {}
    for imp in imports(module):
      if imp.target != module:
        edges.setdefault(imp.target, imp)
    graph[module] = edges
  return graph


def cycles(graph: dict[str, dict[str, Import]],
           without=frozenset()) -> list[tuple[list[str], list[str]]]:
  """(one cycle: a path back to its start, every module of its knot) for each strongly
  connected component of more than one module, ignoring the edges in `without`."""
  adj = {m: sorted(t for t in graph[m] if (m, t) not in without) for m in graph}
  index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in adj[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(set(comp))

  for m in sorted(adj):
    if m not in index:
      visit(m)
  out = []
  for comp in comps:
    start = min(comp)
    # Shortest path start -> ... -> start inside the component (BFS).
    parents, frontier, end = {start: None}, [start], None
    while frontier and end is None:
      nxt = []
      for v in frontier:
        for w in adj[v]:
          if w not in comp:
            continue
          if w == start:
            end = v
            break
          if w not in parents:
            parents[w] = v
            nxt.append(w)
        if end is not None:
          break
      frontier = nxt
    path = [start]
    v = end
    while v is not None and v != start:
      path.insert(1, v)
      v = parents[v]
    out.append((path + [start], sorted(comp)))
  return sorted(out)


def describe(graph, found: tuple[list[str], list[str]]) -> str:
  cycle, knot = found
  steps = []
  if len(knot) > len(cycle) - 1:
    steps.append(f"  ({len(knot)} modules reach each other: {', '.join(knot)}; one cycle:)")
  for a, b in zip(cycle, cycle[1:]):
    imp = graph[a][b]
    where = MODULES[a].relative_to(ROOT.parent)
    steps.append(f"  {a} -> {b}  ({where}:{imp.line}{', deferred' if imp.deferred else ''})")
  return "\n".join(steps)


GRAPH = import_graph()


def test_the_graph_is_read():
  # A few edges the package certainly has, so an empty or misread graph cannot pass.
  assert "dllm_jax.parallel.mesh" in GRAPH["dllm_jax.models.transformer"]
  assert "dllm_jax.serving.lanes" in GRAPH["dllm_jax.serving.engine"]
  assert "dllm_jax.decoding.api" in GRAPH["dllm_jax.serving.engine"]
  assert len(MODULES) > 50


def test_no_import_cycles():
  found = cycles(GRAPH, without=ALLOWED_CYCLE_EDGES)
  assert not found, "import cycles (break each by moving the shared code down a layer or " \
      "passing it in):\n" + "\n\n".join(describe(GRAPH, c) for c in found)


def layer_of(module: str) -> str:
  """`dllm_jax.x.y...` -> `dllm_jax.x` (a subpackage or top-level module)."""
  return ".".join(module.split(".")[:2])


def test_no_cycles_between_subpackages():
  graph = {layer_of(m): {} for m in MODULES}
  where = {}
  for module, edges in GRAPH.items():
    for target, imp in edges.items():
      a, b = layer_of(module), layer_of(target)
      if a != b and b not in graph[a]:
        graph[a][b] = imp
        where[a, b] = f"{module} -> {target} ({MODULES[module].relative_to(ROOT.parent)}:" \
                      f"{imp.line})"
  found = cycles(graph)
  assert not found, "the subpackages import each other in a cycle:\n" + "\n\n".join(
      "\n".join(f"  {a} -> {b}: e.g. {where[a, b]}" for a, b in zip(c, c[1:]))
      for c, _ in found)


def test_allowed_cycle_edges_are_still_needed():
  for edge in sorted(ALLOWED_CYCLE_EDGES):
    importer, imported = edge
    assert imported in GRAPH.get(importer, {}), \
        f"{importer} no longer imports {imported}: drop the edge from ALLOWED_CYCLE_EDGES."
    assert cycles(GRAPH, without=ALLOWED_CYCLE_EDGES - {edge}), \
        f"{importer} -> {imported} closes no cycle now: drop it from ALLOWED_CYCLE_EDGES."


def _violations(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
  bad = []
  for module in sorted(MODULES):
    if module != prefix and not module.startswith(prefix + "."):
      continue
    for imp in imports(module):
      if any(imp.target == f or imp.target.startswith(f + ".") for f in forbidden):
        bad.append(f"{MODULES[module].relative_to(ROOT.parent)}:{imp.line} imports "
                   f"{imp.target}")
  return bad


@pytest.mark.parametrize("layer", ["dllm_jax.parallel", "dllm_jax.models"])
def test_lower_layers_import_nothing_above(layer):
  bad = _violations(layer, ABOVE_PARALLEL_AND_MODELS)
  assert not bad, f"{layer} must not import the layers above it:\n" + "\n".join(bad)


def test_parallel_imports_no_models():
  bad = _violations("dllm_jax.parallel", ("dllm_jax.models",))
  assert not bad, ("dllm_jax.parallel must not import dllm_jax.models (models use parallel; "
                   "take what the model provides, e.g. abstract params, as an argument):\n"
                   + "\n".join(bad))
