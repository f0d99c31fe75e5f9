"""Runs from a clone read the clone's files, not the editable install's.

An editable install (pip install -e .) maps autopar.passes and autopar.cost_models to the
working tree it was made from, whatever comes first on sys.path; a soak or a sweep run
from a clone would then mix the clone's autopar/ with the working tree's passes/ (and
pick up every edit made there while it runs). With this folder on PYTHONPATH and
AUTOPAR_ROOT naming the clone, Python's start-up points those maps at the clone:

    AUTOPAR_ROOT=/tmp/clone PYTHONPATH=/tmp/clone/bench/isolate:/tmp/clone python bench/soak.py ...
"""

import os
import sys

_root = os.environ.get("AUTOPAR_ROOT")
_finders = [m for name, m in sys.modules.items() if name.startswith("__editable___autopar")]
for _finder in _finders if _root else ():
    _mapping = getattr(_finder, "MAPPING", {})
    _base = os.path.dirname(_mapping.get("autopar", ""))
    for _name, _path in list(_mapping.items()):
        _mapping[_name] = os.path.join(_root, os.path.relpath(_path, _base))
