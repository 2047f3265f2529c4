"""One policy for outputs (refuse a non-empty one unless --overwrite) and adapters (only on their base)."""

from __future__ import annotations

import json
import os

import pytest

from eogym_sft.guards import (
    check_adapter_base,
    model_key,
    refuse_nonempty_output,
    same_base,
)


def test_a_non_empty_output_is_refused_unless_overwrite(tmp_path):
    refuse_nonempty_output(tmp_path / "new", overwrite=False, command="eogym-sft x")  # absent: fine
    (tmp_path / "empty").mkdir()
    refuse_nonempty_output(tmp_path / "empty", overwrite=False, command="eogym-sft x")  # empty folder: fine
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a.txt").write_text("x")
    (tmp_path / "report.json").write_text("{}")
    for taken in ("full", "report.json"):
        with pytest.raises(FileExistsError, match=rf"eogym-sft x: .*{taken} exists and is not empty: .*--overwrite"):
            refuse_nonempty_output(tmp_path / taken, overwrite=False, command="eogym-sft x")
        refuse_nonempty_output(tmp_path / taken, overwrite=True, command="eogym-sft x")


def test_which_bases_are_the_same(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "Qwen3-VL-4B-Instruct").mkdir(parents=True)
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-VL-4B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    local = str(tmp_path / "models" / "Qwen3-VL-4B-Instruct")
    assert model_key(str(snapshot)) == "Qwen/Qwen3-VL-4B-Instruct"
    assert model_key("models/Qwen3-VL-4B-Instruct/") == local
    same = [
        ("Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-4B-Instruct"),
        ("Qwen/Qwen3-VL-4B-Instruct", str(snapshot)),  # the hub cache's copy is the hub id
        ("models/Qwen3-VL-4B-Instruct", local),  # relative and absolute
        ("Qwen/Qwen3-VL-4B-Instruct", local),  # a local copy of the hub model, by name
        ("/scratch/elsewhere/tiny-qwen3-vl", "runs/demo/tiny-qwen3-vl"),  # a folder moved between machines
    ]
    other = [
        ("Qwen/Qwen3-VL-4B-Instruct", "Qwen/Qwen3-VL-8B-Instruct"),
        ("Qwen/Qwen3-VL-4B-Instruct", "someone/Qwen3-VL-4B-Instruct"),  # two hub ids: exact
        ("Qwen/Qwen3-VL-4B-Thinking", local),
    ]
    assert all(same_base(a, b) and same_base(b, a) for a, b in same)
    assert not any(same_base(a, b) or same_base(b, a) for a, b in other)


def test_an_adapter_on_another_base_is_refused_naming_both(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-VL-8B-Instruct"}))
    with pytest.raises(ValueError, match=r"trained on 'Qwen/Qwen3-VL-8B-Instruct' but --model is 'Qwen/Qwen3-VL-4B-Instruct'"):
        check_adapter_base(tmp_path, "Qwen/Qwen3-VL-4B-Instruct")
    check_adapter_base(tmp_path, "Qwen/Qwen3-VL-4B-Instruct", allow_other_base=True)
    check_adapter_base(tmp_path, "Qwen/Qwen3-VL-8B-Instruct")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        check_adapter_base(tmp_path / "nowhere", "Qwen/Qwen3-VL-4B-Instruct")


def test_every_writing_command_refuses_a_non_empty_output(tmp_path):
    from eogym_sft.cli import main

    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("an earlier run")
    report = tmp_path / "report.json"
    report.write_text("{}")
    (tmp_path / "in.jsonl").write_text("")
    commands = {
        "prepare": ["prepare", "--input", str(tmp_path / "in.jsonl"), "--model", "m", "--output", str(used)],
        "tiny-model": ["tiny-model", "--output", str(used)],
        "validate": ["validate", "--model", "m", "--data", str(used), "--output", str(report)],
    }
    for name, argv in commands.items():
        with pytest.raises(SystemExit, match=rf"^eogym-sft {name}: .* exists and is not empty: .*--overwrite"):
            main(argv)
    assert (used / "keep.txt").read_text() == "an earlier run" and report.read_text() == "{}"


def test_validate_refuses_an_adapter_of_another_base(tmp_path):
    from eogym_sft.cli import main

    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-VL-8B-Instruct"}))
    argv = ["validate", "--model", "Qwen/Qwen3-VL-4B-Instruct", "--adapter", str(tmp_path / "adapter"), "--data", "d", "--output", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match=r"trained on 'Qwen/Qwen3-VL-8B-Instruct' but --model is 'Qwen/Qwen3-VL-4B-Instruct'"):
        main(argv)


def test_a_hub_id_offline_fails_at_once_with_the_hint(tmp_path, monkeypatch):
    import time

    from eogym_sft.cli import main

    (tmp_path / "rows.jsonl").write_text("{}\n")
    argv = ["prepare", "--input", str(tmp_path / "rows.jsonl"), "--model", "someorg/not-a-cached-model", "--output", str(tmp_path / "out")]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(SystemExit, match=r"^eogym-sft prepare: --model someorg/not-a-cached-model: .*HF_HUB_OFFLINE is set: "
                       r"offline, --model must be a local folder"):
        main(argv)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: as a machine with no network
    with pytest.raises(SystemExit, match=r"127\.0\.0\.1 cannot be reached .*offline, --model must be a local folder"):
        main(argv)
    assert time.monotonic() - start < 10  # not the hub client's minutes of retries


def test_an_output_that_is_or_holds_an_input_is_refused(tmp_path):
    from eogym_sft.guards import refuse_output_over_input

    data = tmp_path / "runs" / "data.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n")
    (tmp_path / "link.jsonl").symlink_to(data)
    refuse_output_over_input(tmp_path / "other.jsonl", [data], "eogym-sft x")
    refuse_output_over_input(tmp_path / "fresh", [data], "eogym-sft x")
    cases = {tmp_path / "link.jsonl": "is", data: "is", tmp_path / "runs": "holds", tmp_path: "holds"}
    for output, verb in cases.items():
        with pytest.raises(FileExistsError, match=f"^eogym-sft x: the output {output} {verb} the input {data}: writing it would destroy"):
            refuse_output_over_input(output, [data], "eogym-sft x")


def test_os_faults_a_user_fixes_are_one_line(tmp_path):
    import errno

    from eogym_sft.guards import user_errors

    for code, text in [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")]:
        with pytest.raises(SystemExit) as exit_:
            with user_errors("eogym-sft x"):
                raise OSError(code, os.strerror(code), str(tmp_path / "out" / "episodes.jsonl"))
        assert exit_.value.code == f"eogym-sft x: {tmp_path}/out/episodes.jsonl: {text} (--debug or EOGYM_DEBUG=1 shows the traceback)"
        assert exit_.value.__context__ is None or exit_.value.__suppress_context__  # no chained tracebacks
    with pytest.raises(OSError):  # a fault that is a bug keeps its traceback
        with user_errors("eogym-sft x"):
            raise OSError(errno.EBADF, "Bad file descriptor")


def test_a_read_only_output_is_one_line(tmp_path):
    import subprocess

    from eogym_sft.cli import main

    disk = tmp_path / "ro"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(disk)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        src = tmp_path / "episodes.jsonl"
        src.write_text(json.dumps({"id": "q:a:0", "messages": [], "stop_reason": "final_answer", "correct": True}) + "\n")
        with pytest.raises(SystemExit, match=rf"^eogym-sft episodes: {disk}/.*: Read-only file system \(--debug"):
            main(["episodes", "--input", str(src), "--output", str(disk / "kept.jsonl")])
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_closed_stdout_ends_quietly(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "episodes.jsonl"
    src.write_text(json.dumps({"id": "q:a:0", "messages": [], "stop_reason": "final_answer", "correct": True}) + "\n")
    read, write = os.pipe()
    os.close(read)  # `| head -1` that has already gone
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "eogym_sft.cli", "episodes", "--input", str(src), "--output", str(tmp_path / "kept.jsonl")]
    done = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, env=env, text=True)
    os.close(write)
    assert (done.returncode, done.stderr) == (1, "")
    assert (tmp_path / "kept.jsonl").is_file()  # the output was written before the report was cut off


def test_a_damaged_adapter_config_names_its_file(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": ')
    with pytest.raises(ValueError, match=rf"^{tmp_path}/adapter_config.json: not a PEFT adapter's config \(malformed_json"):
        check_adapter_base(tmp_path, "Qwen/Qwen3-VL-4B-Instruct")


def test_every_writing_command_refuses_an_output_over_its_input(tmp_path):
    from eogym_sft.cli import main

    used = tmp_path / "used"
    used.mkdir()
    data = used / "in.jsonl"
    data.write_text("{}\n")
    commands = {
        "evaluate": ["evaluate", "--model", "m", "--data", str(data), "--output", str(used), "--overwrite"],
        "validate": ["validate", "--model", "m", "--data", str(data), "--output", str(data), "--overwrite"],
        "episodes": ["episodes", "--input", str(data), "--output", str(data), "--overwrite"],
    }
    for name, argv in commands.items():
        refused = rf"^eogym-sft {name}: the output {used}\S* (is|holds) the input {data}: writing it would destroy"
        with pytest.raises(SystemExit, match=refused):
            main(argv)
    assert data.read_text() == "{}\n"


def test_prepare_never_writes_over_its_input(tmp_path):
    from eogym_sft.data.prepared import write_prepared

    data = tmp_path / "manifest.jsonl"
    data.write_text("{}\n")
    with pytest.raises(FileExistsError, match=f"^eogym-sft prepare: the output {tmp_path} holds the input {data}"):
        write_prepared(tmp_path, [], {"inputs": [str(data)]})
    assert data.read_text() == "{}\n"


def run_folders(root):
    """A rollout (with a rank log), a training run (with a checkpoint), an adapter, an evaluation: each known by its record."""
    rollout, training, adapter, evaluation = (root / n for n in ("rollout", "training", "adapter", "evaluation"))
    for folder in (rollout, training / "checkpoint-2", adapter, evaluation):
        folder.mkdir(parents=True)
    files = {
        rollout / "run.json": "{}", rollout / "episodes.rank0.jsonl": "{}\n", training / "eogym_run.json": "{}",
        training / "checkpoint-2" / "trainer_state.json": "{}", training / "checkpoint-2" / "optimizer.pt": "w",
        adapter / "adapter_config.json": "{}", evaluation / "results.jsonl": "{}\n", evaluation / "summary.json": "{}",
    }
    for path, text in files.items():
        path.write_text(text)
    return files


def test_check_output_refuses_a_runs_files_of_every_kind(tmp_path):
    from eogym_sft.guards import check_output

    files = run_folders(tmp_path)
    owners = {"rollout": ("rollout", "run.json"), "training": ("training run", "eogym_run.json"),
              "checkpoint-2": ("training run", "trainer_state.json"), "adapter": ("adapter", "adapter_config.json"),
              "evaluation": ("evaluation", "results.jsonl")}
    for path in files:
        kind, record = owners[path.parent.name]
        with pytest.raises(FileExistsError, match=f"^eogym-sft x: {path} belongs to the {kind} in {path.parent} \\(it holds {record}\\): "
                           "an output never replaces a run's files, even with --overwrite; pick another output$"):
            check_output(path, "eogym-sft x", True, "page")
        with pytest.raises(FileExistsError, match="exists and is not empty: pick another output or pass --overwrite"):
            check_output(path, "eogym-sft x", False, "page")
    check_output(tmp_path / "rollout", "eogym-sft x", True, "rollout")  # its own kind: --overwrite may start it over
    check_output(tmp_path / "evaluation", "eogym-sft x", True, "evaluation")
    with pytest.raises(FileExistsError, match="belongs to the evaluation in"):
        check_output(tmp_path / "evaluation", "eogym-sft x", True, "rollout")
    check_output(tmp_path / "rollout" / "new.html", "eogym-sft x", False, "page")  # a new file beside a run's: nothing lost
    check_output(files[tmp_path / "rollout" / "run.json"], "eogym-sft x", True, "page", own=lambda p: True)  # its own earlier output
    (tmp_path / "link.html").symlink_to(tmp_path / "elsewhere.html")
    with pytest.raises(FileExistsError, match="link.html is a symbolic link: an output is never written through one"):
        check_output(tmp_path / "link.html", "eogym-sft x", True, "page")
    assert all(path.read_text() == text for path, text in files.items())


def test_every_writing_command_refuses_a_runs_files_even_with_overwrite(tmp_path):
    """One rule for every command: no --output lands on a rollout's rank log, a checkpoint's file or an adapter's config."""
    from eogym_sft.cli import main

    files = run_folders(tmp_path / "runs")
    rollout, training, adapter = (tmp_path / "runs" / n for n in ("rollout", "training", "adapter"))
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    targets = [rollout / "episodes.rank0.jsonl", training / "checkpoint-2" / "optimizer.pt", adapter / "adapter_config.json"]
    file_commands = {
        "validate": lambda out: ["validate", "--model", "m", "--data", str(data), "--output", str(out)],
        "episodes": lambda out: ["episodes", "--input", str(data), "--output", str(out)],
        "view": lambda out: ["view", str(rollout), "--output", str(out)],
        "make-task": lambda out: ["make-task", "--output", str(out.parent), "--name", out.name, "--rows", "1"],
    }
    folder_commands = {
        "prepare": lambda out: ["prepare", "--input", str(data), "--model", "m", "--output", str(out)],
        "tiny-model": lambda out: ["tiny-model", "--output", str(out)],
        "evaluate": lambda out: ["evaluate", "--model", "m", "--data", str(data), "--output", str(out)],
        "rollout": lambda out: ["rollout", "--model", "m", "--data", str(data), "--output", str(out)],
    }
    cases = [(c, argv, t) for c, argv in file_commands.items() for t in targets]
    cases += [(c, argv, t) for c, argv in folder_commands.items() for t in (rollout, training, adapter) if not (c == "rollout" and t == rollout)]
    for command, argv, target in cases:
        with pytest.raises(SystemExit) as stop:
            main([*argv(target), "--overwrite"])
        assert f"belongs to the " in str(stop.value.code) and "even with --overwrite" in str(stop.value.code), (command, target, stop.value.code)
        assert str(stop.value.code).startswith(f"eogym-sft {command}: "), stop.value.code
    assert all(path.read_text() == text for path, text in files.items())


@pytest.mark.parametrize("command, advice", [
    ("eogym-sft validate", "pass a smaller --batch-size than the one its memory plan line chose"),
    ("eogym-sft evaluate", "pass a smaller --batch-size than the one its memory plan line chose"),
    ("eogym-sft rollout", "pass fewer --slots than its memory plan line chose, or a smaller --max-episode-tokens"),
    ("eo_gym_4b_grpo.py", "lower per_device_train_batch_size or max_episode_tokens, or set rollout_cache_gib below the "
                          "logged KV cache; `eogym-sft plan --config recipes/eo_gym_4b_grpo.yaml --gpu-memory SIZE` shows what fits"),
    ("eogym-sft demo", "lower its batch size or lengths"),
])
def test_a_cuda_out_of_memory_error_is_one_line_naming_what_to_lower(command, advice):
    """Every command sizes itself at start; an OOM that still comes (the GPU shared, fragmentation) ends the run in
    one line naming the setting to lower. A CUDA OOM cannot be raised on CPU: torch's own error type is raised."""
    import torch

    from eogym_sft.guards import user_errors

    with pytest.raises(SystemExit) as exit_:
        with user_errors(command):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert exit_.value.code == (f"{command}: CUDA out of memory (the GPU had less free memory than when the run sized "
                                f"itself, or another process took some): {advice} (--debug or EOGYM_DEBUG=1 shows the traceback)")
    with pytest.raises(torch.OutOfMemoryError):  # --debug: the traceback
        with user_errors(command, debug=True):
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="^a bug$"):  # any other RuntimeError keeps its traceback
        with user_errors(command):
            raise RuntimeError("a bug")


def test_an_out_of_memory_error_in_rollout_reaches_the_user_as_one_line(monkeypatch, tmp_path, tiny_model_dir, sample_dir,
                                                                          capsys):
    """The CLI's path: `eogym-sft rollout` on real inputs, its run raising CUDA's error where the decoder would."""
    import torch

    from eogym_sft.cli import main
    from eogym_sft.evaluation import rollout

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(rollout, "rollout", out_of_memory)
    with pytest.raises(SystemExit) as exit_:
        main(["rollout", "--model", str(tiny_model_dir), "--data", str(sample_dir / "eogym_sample.jsonl"),
              "--data-root", str(sample_dir), "--output", str(tmp_path / "out"), "--limit", "1"])
    assert str(exit_.value.code).startswith("eogym-sft rollout: CUDA out of memory (the GPU had less free memory ")
    assert "pass fewer --slots" in str(exit_.value.code)
