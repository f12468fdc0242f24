"""This folder holds scripts/evaluate.py, which, with the folder first on sys.path (Python puts a script's
own folder there), would be imported in place of the `evaluate` library. Importing this module first
takes the folder off sys.path."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [entry for entry in sys.path if str(Path(entry or ".").resolve()) != _HERE]
