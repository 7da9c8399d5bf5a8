"""``python -m polar_train.train ...`` and ``accelerate launch -m polar_train.train ...``."""

import sys

from ..cli import program

program(["train", *sys.argv[1:]])
