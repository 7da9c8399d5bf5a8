"""What the package runs from where it is installed: the capture addon script, ``polar-train`` and
``mitmdump``.

Why not paths beside this file: a wheel has no repository around it. ``setup.cfg`` installs the
checkout's ``addons/`` as the package ``polar_train.addons`` (an editable install maps that name
back to the checkout), and the commands run with the interpreter that runs this one: a console
script next to it is absent under ``pip install --user`` or ``python -m polar_train.cli``.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

ADDON_SCRIPT_NAME = "polar_capture.py"


class NotInstalled(Exception):
    """A file or command the installation should hold is missing: its message says what to do."""


def addon_script() -> Path:
    """The capture addon script, for ``mitmdump -s``."""
    try:
        path = Path(str(resources.files("polar_train.addons").joinpath(ADDON_SCRIPT_NAME)))
    except ModuleNotFoundError:  # an editable install made before setup.cfg mapped addons/
        path = Path(__file__).resolve().parents[1] / "addons" / ADDON_SCRIPT_NAME
    if not path.is_file():
        raise NotInstalled(f"the capture addon script is missing ({path}): reinstall polar-train "
                           "(pip install polar-train, or pip install -e . in a checkout)")
    return path


def polar_train_command() -> list[str]:
    """``polar-train`` run by this interpreter, so the child uses this very installation."""
    return [sys.executable, "-m", "polar_train.cli"]


def mitmdump_command() -> list[str]:
    """``mitmdump``: the console script beside this interpreter, else mitmproxy's entry point run
    by this interpreter. Not one on ``PATH``: it may belong to a Python that lacks this package."""
    beside = Path(sys.executable).parent / "mitmdump"
    if beside.is_file():
        return [str(beside)]
    return [sys.executable, "-c", "import sys; from mitmproxy.tools.main import mitmdump; sys.exit(mitmdump())"]
