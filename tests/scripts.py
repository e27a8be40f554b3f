"""Loading the scripts of ``examples/`` and ``benchmarks/`` in tests, as modules."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"


def load_script(path: Path):
    """The script at ``path`` as a module (its ``__name__`` is the file's stem, so its
    ``if __name__ == "__main__"`` block does not run), registered in ``sys.modules`` as
    dataclasses need."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def undocumented_options(module, monkeypatch) -> list[str]:
    """The options of the script's ``parse_args`` that have no help text."""
    parsers = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        module.parse_args([])
    monkeypatch.undo()
    (parser,) = parsers
    return [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()
    ]
