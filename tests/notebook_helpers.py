"""Running the notebooks in the notebook tests (`from notebook_helpers import ...`): a python3
kernel, a notebook executed at tiny size on the CPU, and its outputs of one kind."""
import tempfile

import nbclient
import nbformat
from jupyter_client.kernelspec import KernelSpecManager

from cli_helpers import cpu_env


def ensure_python3_kernel() -> None:
  """A fresh CI machine after `pip install -e .[test]` may lack the python3 kernelspec."""
  if "python3" not in KernelSpecManager().find_kernel_specs():
    from ipykernel import kernelspec
    kernelspec.install(user=True)


def outputs(nb, kind):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
          if o.get("output_type") == kind]


def run_tiny(path: str, cwd: str = tempfile.gettempdir(), **env):
  """The notebook at `path` executed at tiny size on the CPU: (notebook, its printed text)."""
  ensure_python3_kernel()
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": cwd}})
  client.execute(env=cpu_env(LOKA_NOTEBOOK_TINY="1", **env))
  return nb, "".join(o.get("text", "") for o in outputs(nb, "stream"))
