"""``python -m polar_train ...``: the ``polar-train`` command."""

from polar_train.cli import program

program()
