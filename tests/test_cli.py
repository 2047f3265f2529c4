"""The ``eogym-sft`` parser: every command listed, only the chosen one's flags built, defaults in --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eogym_sft.cli import COMMANDS, build_parser, chosen_command, main

REPO = Path(__file__).resolve().parents[1]


def test_help_and_a_refused_command_import_neither_torch_nor_transformers():
    """What keeps ``eogym-sft --help`` and an early refusal fast: no heavy import before the command runs."""
    code = (
        "import sys\n"
        "from eogym_sft.cli import main\n"
        "for argv in (['--help'], ['prepare', '--input', 'missing.jsonl', '--model', 'm', '--output', 'out']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as stop:\n"
        "        print('exit', stop.code)\n"
        "print('heavy', sorted(m for m in ('torch', 'transformers', 'trl', 'deepspeed') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "heavy []", done.stdout + done.stderr
    assert "exit 0" in lines and "exit eogym-sft prepare: no such input file: missing.jsonl" in lines
    assert all(name in done.stdout for name in COMMANDS)


def test_only_the_chosen_command_gets_its_flags_and_help_shows_defaults(capsys):
    assert chosen_command(["--help"]) is None and chosen_command(["prepare", "--input", "x"]) == "prepare"
    with pytest.raises(SystemExit):
        build_parser(["prepare", "--help"]).parse_args(["prepare", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes
    assert "(default: 8192)" in out and "(default: 1003520)" in out and "(default: split)" in out
    args = build_parser(["tiny-model", "--output", "o"]).parse_args(["tiny-model", "--output", "o"])
    assert (args.command, args.output, args.seed, args.dtype) == ("tiny-model", "o", 0, "float32")


def test_an_unknown_command_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train-everything"])
    assert stop.value.code == 2 and "invalid choice: 'train-everything'" in capsys.readouterr().err
