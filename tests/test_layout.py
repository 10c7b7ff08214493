"""The library's layout: its packages form one stack with no import cycle, the library never
imports the experiments, and no module outgrows one job."""
import ast
import os
from collections import defaultdict

from absl.testing import absltest

from cli_helpers import REPO

LIBRARY = "loka_jax"
MAX_LINES = 600
# Each package imports only those listed after it: the order docs/ARCHITECTURE.md draws.
STACK = ("dispatch", "probe", "parallel", "train", "plan", "models", "mods", "data", "kernels",
         "precision")


def _modules():
  """{dotted module name: path} of every module under loka_jax/."""
  found = {}
  for root, _, files in os.walk(os.path.join(REPO, LIBRARY)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
  return found


def _imports(module: str, path: str, modules):
  """The loka_jax modules `module` imports, at any level (a function-level import that dodges
  a cycle is still one), and whether it imports the experiments."""
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  targets, experiments = set(), False
  with open(path) as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      # `from package import module` names the module; any other name is the package's.
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
               for a in node.names]
    else:
      continue
    for name in names:
      experiments |= name.split(".")[0] == "experiments"
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name and name != module:
        targets.add(name)
  return targets, experiments


def _package(module: str, modules) -> str:
  """The package of loka_jax a module belongs to; "" for the top-level modules (the public
  API in loka_jax/__init__.py and the shared helpers beside it, such as timing and jsonio)."""
  parts = module.split(".")
  if len(parts) < 2:
    return ""
  top = f"{LIBRARY}.{parts[1]}"
  return parts[1] if modules[top].endswith("__init__.py") else ""


class LayoutTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    cls.modules = _modules()
    cls.graph, cls.into_experiments = {}, []
    for module, path in cls.modules.items():
      cls.graph[module], experiments = _imports(module, path, cls.modules)
      if experiments:
        cls.into_experiments.append(module)

  def test_the_library_never_imports_the_experiments(self):
    self.assertEqual(self.into_experiments, [])

  def test_packages_import_only_packages_below_them(self):
    rank = {name: i for i, name in enumerate(STACK)}
    upward = defaultdict(set)
    for module, targets in self.graph.items():
      here = _package(module, self.modules)
      for target in targets:
        there = _package(target, self.modules)
        if here and there and here != there:
          self.assertIn(here, rank, f"{module}: package {here} is not in the stack")
          self.assertIn(there, rank, f"{target}: package {there} is not in the stack")
          if rank[there] < rank[here]:
            upward[f"{here} -> {there}"].add(f"{module} imports {target}")
    self.assertEqual(dict(upward), {})

  def test_no_module_import_cycle(self):
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
      index[node] = low[node] = len(index)
      stack.append(node)
      on_stack.add(node)
      for nxt in self.graph.get(node, ()):
        if nxt not in index:
          visit(nxt)
          low[node] = min(low[node], low[nxt])
        elif nxt in on_stack:
          low[node] = min(low[node], index[nxt])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        # A package's __init__ importing its own modules is not a cycle of modules.
        if len([m for m in component if not self.modules[m].endswith("__init__.py")]) > 1:
          cycles.append(sorted(component))

    for module in sorted(self.graph):
      if module not in index:
        visit(module)
    self.assertEqual(cycles, [])

  def test_no_module_outgrows_one_job(self):
    long = {}
    for module, path in self.modules.items():
      with open(path) as f:
        lines = sum(1 for _ in f)
      if lines > MAX_LINES:
        long[module] = lines
    self.assertEqual(long, {})


if __name__ == "__main__":
  absltest.main()
