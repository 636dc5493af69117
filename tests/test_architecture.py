"""The architecture holds: one registry, no import cycles, no private reach-ins.

Read from the source with ``ast`` (nothing is imported to check imports):

* every module-level or function-level import between gshard modules forms a
  graph without cycles (``from pkg import mod`` is an edge to ``pkg.mod``);
* no gshard module imports a ``_private`` name of another module, reads one as
  ``module._name``, or imports a private module (``_core``, ``_api``) from
  outside the package that owns it;
* gshard imports nothing from ``jax._src``;
* every primitive in the registry states a partition rule, and ``coverage``
  classifies a primitive exactly as the interpreter dispatches it;
* modules stay small.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import gshard
from gshard.coverage import classify
from gshard.spmd import registry
from gshard.spmd.partition.generic import generic_rule, safe_rule
from gshard.spmd.partition.interpret import partition_rule_for

ROOT = pathlib.Path(gshard.__file__).parent
MAX_LINES = 520


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT.parent).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _package_of(name: str) -> str:
  path = MODULES[name]
  return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _imports(name: str):
  """(imported module, imported names or None, line) for each gshard import."""
  tree = ast.parse(MODULES[name].read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "gshard":
          yield alias.name, None, node.lineno
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split(".")[0] == "gshard":
        yield node.module, [a.name for a in node.names], node.lineno


def _edges(name: str) -> set[str]:
  out = set()
  for module, names, _ in _imports(name):
    for n in names or [None]:
      target = f"{module}.{n}" if n and f"{module}.{n}" in MODULES else module
      if target in MODULES and target != name:
        out.add(target)
  return out


def test_no_import_cycles():
  graph = {m: _edges(m) for m in MODULES}
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        cycle = stack[stack.index(n):] + [n]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if n not in state:
        visit(n)
    stack.pop()
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)


def test_no_private_names_across_modules():
  bad = []
  for name in MODULES:
    own_package = _package_of(name)
    aliases = {}
    for module, names, line in _imports(name):
      leaf = module.rsplit(".", 1)[-1]
      if leaf.startswith("_") and module.rsplit(".", 1)[0] != own_package \
          and module != name:
        bad.append(f"{name}:{line} imports the private module {module}")
      for n in names or ():
        target = f"{module}.{n}"
        if n.startswith("_") and target not in MODULES:
          bad.append(f"{name}:{line} imports the private name {n} from {module}")
        if target in MODULES:
          aliases[n] = target
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module in MODULES:
        for a in node.names:
          if f"{node.module}.{a.name}" in MODULES:
            aliases[a.asname or a.name] = f"{node.module}.{a.name}"
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
          and node.value.id in aliases):
        bad.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
  assert not bad, "\n".join(bad)


def test_no_jax_private_imports():
  bad = []
  for name, path in MODULES.items():
    for node in ast.walk(ast.parse(path.read_text())):
      mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
              else [node.module] if isinstance(node, ast.ImportFrom) else [])
      bad += [f"{name}:{node.lineno} imports {m}" for m in mods
              if m and m.startswith("jax._src")]
  assert not bad, "\n".join(bad)


def test_every_registered_primitive_states_a_partition_rule():
  assert len(registry.table) > 100
  for name, entry in registry.table.items():
    assert callable(entry.sharding), name
    assert entry.partition in (registry.GENERIC, registry.SAFE) or callable(entry.partition), \
        name
    with pytest.raises(ValueError, match="partition must be"):
      registry.register("bogus_primitive", entry.sharding, partition="sometimes")
  assert "bogus_primitive" not in registry.table


class _Eqn:
  def __init__(self, name):
    self.primitive = type("Primitive", (), {"name": name})()


@pytest.mark.parametrize("name", sorted(registry.table) + ["composite"])
def test_coverage_reads_the_table_the_interpreter_dispatches_on(name):
  rule = partition_rule_for(_Eqn(name))
  kind, rule_name = classify(name)
  if rule is generic_rule:
    assert kind == "generic"
  elif rule is safe_rule:
    assert kind == "safe path"
  else:
    assert kind == "specific"
    assert rule_name == getattr(getattr(rule, "func", rule), "__name__")


def test_modules_are_small():
  big = {name: n for name, path in MODULES.items()
         if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert not big, big
