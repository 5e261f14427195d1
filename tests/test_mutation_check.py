"""scripts/mutation_check.py stays applicable: every mutation's ``find`` occurs exactly once in its file
(the check itself runs by hand; see the script)."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_mutation_applies_exactly_once():
    spec = importlib.util.spec_from_file_location("mutation_check", os.path.join(ROOT, "scripts", "mutation_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    names = [m.name for m in module.MUTATIONS]
    assert len(names) == len(set(names))
    counts = {m.name: module.source_count(m, ROOT) for m in module.MUTATIONS}
    assert counts == dict.fromkeys(names, 1), "a mutation no longer matches its source: update scripts/mutation_check.py"
    assert all(m.find != m.replace for m in module.MUTATIONS)
