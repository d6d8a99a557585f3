"""Python packages a check or fixture script needs, installed once into
.plugins/python (beside the CPU plugin `make setup` installs) and imported
from there, so the scripts need nothing installed system-wide."""
import importlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(ROOT, ".plugins", "python")


def import_installed(module, packages, deps=True, purge=(), site=SITE):
    """`module` imported, after `pip install --target site packages` if it
    is not there yet (`deps`: with their dependencies; `purge`: the
    top-level modules a failed import may have left half-loaded)."""
    os.makedirs(site, exist_ok=True)
    if site not in sys.path:
        sys.path.insert(0, site)
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-warn-conflicts", *([] if deps else ["--no-deps"]), "--target", site, *packages],
        check=True,
        env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"),
    )
    # The failed import left its parent packages (and the packages it
    # imported before failing) and an empty listing of the folder cached.
    tops = {module.split(".")[0], *purge}
    for name in list(sys.modules):
        if name.split(".")[0] in tops:
            del sys.modules[name]
    importlib.invalidate_caches()
    return importlib.import_module(module)
