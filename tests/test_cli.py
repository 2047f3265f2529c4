"""The ``eogym-sft`` parser: every command listed, only the chosen one's flags built, defaults in --help."""

from __future__ import annotations

import argparse
import dataclasses
import json
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


def command_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser([command])
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


@pytest.mark.parametrize("command", ["prepare", "validate", "evaluate", "rollout"])
def test_each_flag_is_a_config_field_with_the_fields_default(command):
    """No second declaration: every field of the command's configs is one flag, its dest the field's name and its
    default and help the field's own; the flags that are no field are the command's own switches."""
    from eogym_sft.config import ImageConfig
    from eogym_sft.data.prepare import PrepConfig
    from eogym_sft.evaluation.run_args import EvalConfig, RolloutConfig, ValidateConfig

    configs = {"prepare": (ImageConfig, PrepConfig), "validate": (ValidateConfig,), "evaluate": (EvalConfig,), "rollout": (RolloutConfig,)}
    actions = {a.dest: a for a in command_parser(command)._actions if a.dest != "help"}
    fields = [f for config in configs[command] for f in dataclasses.fields(config) if f.metadata.get("flag") is not False]
    for f in fields:
        assert actions[f.name].default == field_default(f) and actions[f.name].help == f.metadata["help"], f.name
        assert actions[f.name].required == (field_default(f) is None and f.metadata.get("required", f.default is dataclasses.MISSING))
    own = {
        "prepare": {"input", "model", "output", "num_proc", "allow_drops", "overwrite"},
        "validate": set(),
        "evaluate": {"no_progress"},
        "rollout": {"no_progress", "policy_url", "policy_model", "policy_config"},
    }
    assert set(actions) - {f.name for f in fields} == own[command]


def test_flags_build_the_config_without_a_mapping(tmp_path):
    from eogym_sft.config import config_from_args
    from eogym_sft.evaluation.run_args import RolloutConfig

    argv = ["rollout", "--model", "m", "--data", "a.jsonl", "b.jsonl", "--output", "o", "--no-base", "--adapter", "sft=runs/a",
            "--pass-k", "1", "2", "--samples", "2", "--temperature", "0.5", "--tools", "crop,http", "--tool-url", "http://127.0.0.1:9/t",
            "--no-cuda-graphs", "--max-length", "4096"]
    cfg = config_from_args(RolloutConfig, build_parser(argv).parse_args(argv))
    assert (cfg.include_base, cfg.adapters, cfg.ks, cfg.tools, cfg.cuda_graphs, cfg.max_episode_tokens, cfg.data) == (
        False, ["sft=runs/a"], [1, 2], ["crop", "http"], False, 4096, ["a.jsonl", "b.jsonl"])
    assert (cfg.judge_timeout, cfg.judge_retries, cfg.tool_images, cfg.limit) == (60.0, 3, "produced", None)


def test_a_flag_is_never_taken_by_its_prefix(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["rollout", "--model", "m", "--data", "d.jsonl", "--output", "o", "--max-turn", "3"])
    assert stop.value.code == 2 and "unrecognized arguments: --max-turn 3" in capsys.readouterr().err


@pytest.mark.parametrize("command, flags, message", [
    ("validate", ["--batch-size", "0"], "batch_size must be at least 1"),
    ("evaluate", ["--batch-size", "0"], "batch_size must be at least 1, got 0"),
    ("rollout", ["--slots", "0"], "max_turns, slots and max_episode_tokens must be at least 1"),
])
def test_a_config_error_is_one_line_and_debug_shows_its_traceback(tmp_path, command, flags, message):
    (tmp_path / "d.jsonl").write_text("{}\n")
    argv = [command, "--model", "m", "--data", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "out"), *flags]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == f"eogym-sft {command}: {message} (--debug or EOGYM_DEBUG=1 shows the traceback)"
    with pytest.raises(ValueError, match=f"^{message}$"):
        main(["--debug", *argv])


@pytest.mark.parametrize("flags, message", [
    (["--limit", "0"], "--limit must be at least 1 (leave it out to read every row), got 0"),
    (["--judge-url", "ftp://judge.example/v1"], "'ftp://judge.example/v1' is not an http:// or https:// URL with a host"),
    (["--judge-url", "http://127.0.0.1:9/v1", "--judge-timeout", "0"], "the judge's timeout must be a positive number of seconds, got 0.0"),
    (["--tools", "crop,http", "--tool-url", "file:///etc/passwd"], "'file:///etc/passwd' is not an http:// or https:// URL with a host"),
])
def test_rollout_refuses_a_bad_setting_before_it_writes_anything(data_root, row_factory, flags, message):
    """Refused after run.json was written, the corrected rerun would be refused as a run of other settings."""
    data = data_root / "q.jsonl"
    data.write_text(json.dumps(row_factory()) + "\n")
    out = data_root / "out"
    argv = ["rollout", "--model", "m", "--data", str(data), "--data-root", str(data_root), "--output", str(out), "--no-progress", *flags]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == f"eogym-sft rollout: {message} (--debug or EOGYM_DEBUG=1 shows the traceback)"
    assert not out.exists()


def test_help_and_refusals_of_validate_evaluate_and_rollout_import_no_torch(tmp_path):
    """Their --help and a refused command (missing --data, taken --output, bad setting, wrong adapter) answer
    before torch is imported: at once, not after 10-20 s of imports."""
    (tmp_path / "d.jsonl").write_text("{}\n")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/other"}))
    data, missing, taken = str(tmp_path / "d.jsonl"), str(tmp_path / "missing.jsonl"), str(tmp_path / "taken")
    runs = [
        ["rollout", "--help"], ["evaluate", "--help"], ["validate", "--help"],
        ["rollout", "--model", "m", "--data", missing, "--output", "out"],
        ["rollout", "--model", "m", "--data", data, "--output", taken],
        ["rollout", "--model", "m", "--data", data, "--output", "out", "--limit", "0"],
        ["rollout", "--model", "m", "--data", missing, "--output", "out", "--policy-url", "http://127.0.0.1:9/v1/chat/completions",
         "--policy-model", "p"],
        ["rollout", "--model", "m", "--data", data, "--output", taken, "--policy-url", "http://127.0.0.1:9/v1/chat/completions",
         "--policy-model", "p"],
        ["evaluate", "--model", "m", "--data", missing, "--output", "out"],
        ["evaluate", "--model", "m", "--data", data, "--output", taken],
        ["validate", "--model", "m", "--data", missing, "--output", "out.json"],
        ["validate", "--model", "org/m", "--adapter", str(tmp_path / "adapter"), "--data", data, "--output", "out.json"],
    ]
    code = (
        "import json, sys\n"
        "from eogym_sft.cli import main\n"
        f"for argv in json.loads({json.dumps(json.dumps(runs))}):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as stop:\n"
        "        print('exit', str(stop.code).split(':')[0], 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    exits = [line for line in done.stdout.splitlines() if line.startswith("exit ")]  # the rest is --help's text
    assert exits == ["exit 0 False"] * 3 + [f"exit eogym-sft {argv[0]} False" for argv in runs[3:]], done.stderr


def test_a_broken_torchvision_is_one_line_naming_the_versions_and_the_fix(tmp_path):
    """A torchvision built for another torch raises while transformers imports it; the command says so in one
    line instead of an 85-line traceback that blames one of transformers' models."""
    import importlib.metadata

    fake = tmp_path / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    done = subprocess.run([sys.executable, "-m", "eogym_sft.cli", "tiny-model", "--output", str(tmp_path / "tiny")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": f"{tmp_path / 'site'}:{REPO}", "PATH": "/usr/bin:/bin"})
    installed = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("torch", "torchvision", "transformers"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "eogym-sft tiny-model: importing torchvision failed (RuntimeError: operator torchvision::nms does not exist); "
        f"installed: {installed}. torch and torchvision must be a matching pair: reinstall both from one index, e.g. on CPU "
        '`pip install "torch>=2.10,<2.15" torchvision --index-url https://download.pytorch.org/whl/cpu` (README, the CPU route), '
        "then `pip install -e .` (--debug or EOGYM_DEBUG=1 shows the traceback)"
    )
    assert not (tmp_path / "tiny").exists()


NUMBER_FLAGS_OF = {  # every command with number flags, and what it needs besides to parse
    "prepare": ["--input", "i.jsonl", "--model", "m", "--output", "o"],
    "tiny-model": ["--output", "o"],
    "validate": ["--model", "m", "--data", "d", "--output", "o"],
    "evaluate": ["--model", "m", "--data", "d", "--output", "o"],
    "rollout": ["--model", "m", "--data", "d", "--output", "o"],
    "demo": [],
    "make-task": ["--output", "o", "--rows", "1"],
    "view": ["run"],
    "plan": ["--gpu-memory", "80GB"],
}


def number_actions(command: str) -> list[argparse.Action]:
    return [a for a in command_parser(command)._actions if a.option_strings and getattr(a.type, "__name__", None) in ("int", "float")]


def test_every_number_flag_of_every_command_is_checked_at_parse_time():
    """No flag takes a bare ``int``/``float`` (which let ``inf``, ``nan`` and ``-1`` through to a traceback later):
    each is :func:`eogym_sft.config.number`, refusing them as it parses."""
    assert set(NUMBER_FLAGS_OF) == {c for c in COMMANDS if number_actions(c)}
    for command in NUMBER_FLAGS_OF:
        for action in number_actions(command):
            assert action.type.__qualname__ == "number.<locals>.convert", (command, action.dest)
            for bad in ("nan", "inf", "-inf", "-1", "1e400", "x"):
                with pytest.raises(argparse.ArgumentTypeError):
                    action.type(bad)
            if action.default not in (None, argparse.SUPPRESS):
                assert action.type(str(action.default)) == action.default, (command, action.dest)


@pytest.mark.parametrize("command, flag, value, message", [
    ("view", "--port", "99999", "argument --port: must be from 0 to 65535, got 99999"),
    ("view", "--image-budget-mb", "inf", "argument --image-budget-mb: must be a finite number, got inf"),
    ("view", "--serve-seconds", "nan", "argument --serve-seconds: must be a finite number, got nan"),
    ("rollout", "--slots", "-1", "argument --slots: must be at least 0, got -1"),
    ("rollout", "--limit", "-1", "argument --limit: must be at least 0, got -1"),
    ("rollout", "--judge-retries", "-1", "argument --judge-retries: must be at least 0, got -1"),
    ("rollout", "--judge-timeout", "inf", "argument --judge-timeout: must be a finite number, got inf"),
    ("rollout", "--top-p", "1.5", "argument --top-p: must be from 0 to 1.0, got 1.5"),
    ("evaluate", "--temperature", "nan", "argument --temperature: must be a finite number, got nan"),
    ("validate", "--held-out-fraction", "2", "argument --held-out-fraction: must be from 0 to 1.0, got 2"),
    ("prepare", "--num-proc", "0", "argument --num-proc: must be at least 1, got 0"),
    ("prepare", "--max-pixels", "-5", "argument --max-pixels: must be at least 0, got -5"),
    ("make-task", "--rows", "-3", "argument --rows: must be at least 1, got -3"),
    ("demo", "--steps", "1e9", "argument --steps: not a whole number: '1e9'"),
    ("demo", "--learning-rate", "inf", "argument --learning-rate: must be a finite number, got inf"),
])
def test_an_out_of_range_flag_is_one_line_at_parse_time(capsys, command, flag, value, message):
    with pytest.raises(SystemExit) as stop:
        main([command, *NUMBER_FLAGS_OF[command], f"{flag}={value}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == f"eogym-sft {command}: {message} (--help lists the flags)\n"


def test_a_policy_config_value_of_the_wrong_type_is_one_line(tmp_path):
    from eogym_sft.agent.policy_server import policy_servers

    url = "http://127.0.0.1:9/v1/chat/completions"
    for config, message in [
        ('{"deadline_s": Infinity}', "policy setting deadline_s must be a finite number, got inf"),
        ('{"deadline_s": NaN}', "policy setting deadline_s must be a finite number, got nan"),
        ('{"concurrency": "8"}', "policy setting concurrency must be a whole number, got '8'"),
        ('{"retries": true}', "policy setting retries must be a whole number, got True"),
        ('{"body": [1]}', "policy setting body must be a mapping, got [1]"),
        ('{"backoff_s": -1}', "policy concurrency and max_response_bytes must be >= 1, retries and backoff_s >= 0, deadline_s > 0"),
    ]:
        with pytest.raises(ValueError) as caught:
            policy_servers([url], ["p"], [config])
        assert str(caught.value) == message
