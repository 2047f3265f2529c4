"""What every command checks before it writes or loads: one policy for outputs, one for adapters.

* Outputs (:func:`check_output`, the one rule of every command): a command refuses to write into a non-empty
  output (folder, or an existing file) unless the user passes ``--overwrite``; nothing is replaced silently. An
  output that is one of the command's inputs, resolves to one (a symlink, a hard link), or is a folder holding
  one, is refused even with ``--overwrite`` (:func:`refuse_output_over_input`): writing it would destroy what is
  being read. So is an output over a file or folder that belongs to a run of another kind (a rollout's log or
  rank log, a checkpoint, an adapter's config: :data:`RUN_RECORDS` says how a folder is known as a run's), or
  over an existing file inside an input folder, unless the command recognises it as its own earlier output.
* Adapters: an adapter is used only on the base model it was trained on. ``adapter_config.json``
  records that base (``base_model_name_or_path``) as the trainer was given it: a hub id, or a local
  folder (absolute, or relative to where training ran). See :func:`same_base`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from pathlib import Path

# A local copy of a hub snapshot: .../models--ORG--NAME/snapshots/REVISION
HUB_CACHE_RE = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def refuse_nonempty_output(path: str | Path, overwrite: bool, command: str) -> None:
    """Raise ``FileExistsError`` if ``path`` is an existing file or a non-empty folder and not ``overwrite``."""
    path = Path(path)
    taken = path.is_file() or (path.is_dir() and any(path.iterdir()))
    if taken and not overwrite:
        raise FileExistsError(f"{command}: {path} exists and is not empty: pick another output or pass --overwrite")


def refuse_output_over_input(output: str | Path, inputs, command: str) -> None:
    """Raise ``FileExistsError`` if ``output`` is, or resolves to, one of ``inputs`` (a symlink or hard link
    included), or is a folder that holds one of them."""
    out = Path(output).resolve()
    for given in inputs:
        source = Path(given).resolve()
        same = out == source or (out.exists() and source.exists() and os.path.samefile(out, source))
        if same or out in source.parents:
            where = "is" if same else "holds"
            raise FileExistsError(
                f"{command}: the output {output} {where} the input {given}: writing it would destroy the input; pick "
                "another output"
            )


def check_file_name(name: str) -> str:
    """``name`` if it names a file inside a folder (``make-task --name``), else ``ValueError``: a flag that
    names a file in a folder is a name, never a path (``../x``, ``/abs``, ``a/b`` would write elsewhere)."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{name!r} is a path, not a file name: give a name without / or \\, not . or ..")
    return name


def file_name(text: str) -> str:
    """:func:`check_file_name` as an argparse ``type``: refused as the flag is parsed, in one line."""
    import argparse

    try:
        return check_file_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# The file by which each kind of run folder is known (written by the command or trainer that makes it). A file
# belongs to the run of the nearest folder above it (two levels up: a checkpoint-N/, a prepared/dataset/) holding one.
RUN_RECORDS = {
    "run.json": "rollout",
    "results.jsonl": "evaluation",
    "eogym_run.json": "training run",
    "trainer_state.json": "training run",
    "adapter_config.json": "adapter",
    "manifest.jsonl": "prepared dataset",
}


def run_owning(path: str | Path) -> tuple[str, Path, str] | None:
    """``(kind, run folder, its record's name)`` of the run ``path`` belongs to (itself, for a run's folder), or
    None."""
    path = Path(path)
    folders = ([path] if path.is_dir() and not path.is_symlink() else []) + [path.parent, path.parent.parent]
    for folder in folders:
        for record, kind in RUN_RECORDS.items():
            if (folder / record).is_file():
                return kind, folder, record
    return None


def check_output(output: str | Path, command: str, overwrite: bool, kind: str, inputs=(), own=None) -> None:
    """The one output rule (``FileExistsError`` naming why): ``output`` (a file or folder that ``command`` writes,
    a ``kind`` of output) is never one of ``inputs``, a link, or a folder holding an input; if it exists and is not
    an empty folder it needs ``overwrite``, and even then it may not belong to a run of another kind, nor be an
    existing file inside an input folder, unless ``own(output)`` recognises it as this command's earlier output."""
    path = Path(output)
    refuse_output_over_input(path, inputs, command)
    if path.is_symlink():
        raise FileExistsError(f"{command}: {path} is a symbolic link: an output is never written through one; pick "
                              "another output")
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    refuse_nonempty_output(path, overwrite, command)
    if own is not None and path.is_file() and own(path):
        return
    owner = run_owning(path)
    if owner and owner[0] != kind:
        raise FileExistsError(
            f"{command}: {path} belongs to the {owner[0]} in {owner[1]} (it holds {owner[2]}): an output never "
            "replaces a run's files, even with --overwrite; pick another output"
        )
    folders = [Path(p).resolve() for p in inputs if Path(p).is_dir()]
    if path.is_file() and any(folder in path.resolve().parents for folder in folders):
        raise FileExistsError(f"{command}: {path} is a file of an input folder this command reads: pick another "
                              "output")


# OS faults a user fixes (space, permissions, a read-only mount): one line naming the file, no traceback.
USER_OS_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                            errno.ENAMETOOLONG})


class BrokenInstall(RuntimeError):
    """torch, torchvision or transformers cannot be imported: an install to repair, not a bug of ours."""


class GPUOutOfMemory(RuntimeError):
    """A CUDA out-of-memory error in a run, told as the setting to lower (the CUDA error is its ``__cause__``)."""


# What to lower when CUDA runs out of memory mid-run despite the sizing at start, by a word of the command's name
# (the SFT trainer names its own settings: GPUOutOfMemory). Each sized itself to the memory free at start.
OUT_OF_MEMORY_ADVICE = {
    "validate": "pass a smaller --batch-size than the one its memory plan line chose",
    "evaluate": "pass a smaller --batch-size than the one its memory plan line chose",
    "rollout": "pass fewer --slots than its memory plan line chose, or a smaller --max-episode-tokens",
    "grpo": "lower per_device_train_batch_size or max_episode_tokens, or set rollout_cache_gib below the logged KV "
            "cache; `eogym-sft plan --config recipes/eo_gym_4b_grpo.yaml --gpu-memory SIZE` shows what fits",
}


def out_of_memory_line(command: str) -> str:
    """One line for a CUDA out-of-memory error that reached ``command``'s top: what to lower."""
    advice = next((text for word, text in OUT_OF_MEMORY_ADVICE.items() if word in command),
                  "lower its batch size or lengths")
    return ("CUDA out of memory (the GPU had less free memory than when the run sized itself, or another process "
            f"took some): {advice}")


def _cuda_out_of_memory(err: BaseException) -> bool:
    torch = sys.modules.get("torch")  # not imported: no CUDA error can have come
    return torch is not None and isinstance(err, torch.OutOfMemoryError)


def user_error_types() -> tuple[type[BaseException], ...]:
    """What a user's input or setup causes (a bad flag value, a missing file, a taken output, a refused URL,
    a broken install): shown as one line. Anything else is a bug and keeps its traceback."""
    from .net import NetError

    return (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
            NetError, BrokenInstall,
            GPUOutOfMemory)


TORCH_STACK = ("torch", "torchvision", "transformers")
CPU_ROUTE = 'pip install "torch>=2.10,<2.15" torchvision --index-url https://download.pytorch.org/whl/cpu'


def check_torch_stack() -> None:
    """Import torch, torchvision and transformers now, so that a broken install (most often a torchvision built
    for another torch) is :class:`BrokenInstall` naming the installed versions and the fix, not a traceback
    from deep inside transformers that blames one of its models."""
    import importlib
    import importlib.metadata
    import importlib.util

    for name in TORCH_STACK:
        if name == "torchvision" and importlib.util.find_spec(name) is None:
            continue  # not installed: transformers runs without it
        try:
            importlib.import_module(name)
        except Exception as err:  # torchvision raises RuntimeError for operators its torch lacks
            installed = []
            for package in TORCH_STACK:
                try:
                    installed.append(f"{package} {importlib.metadata.version(package)}")
                except importlib.metadata.PackageNotFoundError:
                    installed.append(f"{package} not installed")
            cause = (str(err).strip().splitlines() or [""])[0][:200]
            raise BrokenInstall(
                f"importing {name} failed ({type(err).__name__}: {cause}); installed: {', '.join(installed)}. torch "
                f"and torchvision must be a matching pair: reinstall both from one index, e.g. on CPU `{CPU_ROUTE}` "
                "(README, the CPU route), then `pip install -e .`"
            ) from err


class ModelUnreachable(FileNotFoundError):
    """A ``--model`` that is no local folder and cannot be fetched: offline, or the hub does not answer."""


def check_model_source(name: str, connect_timeout_s: float = 3.0) -> None:
    """Fail at once, with the hint that offline the model must be a local folder, when ``name`` is neither a
    folder nor in the hub cache and the hub is off (``HF_HUB_OFFLINE``) or unreachable; otherwise the hub
    client retries for minutes before it says so."""
    import socket
    import urllib.parse

    if Path(name).exists():
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except ValueError:  # not even shaped like a hub id
        raise ModelUnreachable(f"--model {name}: no such folder, and not a hub id (org/name)") from None
    hint = "offline, --model must be a local folder (a downloaded snapshot, or one written by `eogym-sft tiny-model`)"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelUnreachable(f"--model {name}: no such folder and not in the hub cache, and HF_HUB_OFFLINE is set: "
                               f"{hint}")
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=connect_timeout_s).close()
    except OSError as err:
        raise ModelUnreachable(f"--model {name}: no such folder, and {endpoint.hostname} cannot be reached ({err}): "
                               f"{hint}") from None


@contextlib.contextmanager
def user_errors(command: str, debug: bool = False):
    """Turn a user error into ``SystemExit("<command>: <message>")``: one line, no traceback, exit status 1. So
    are OS faults a user fixes (disk full, read-only, no permission: :data:`USER_OS_ERRNOS`, naming the file) and
    a CUDA out-of-memory error (:func:`out_of_memory_line`);
    a closed stdout (``| head``) exits 1 quietly, Ctrl-C with one line and status 130. ``debug`` (or
    ``EOGYM_DEBUG=1``) lets the exception through with its traceback."""
    debug = debug or os.environ.get("EOGYM_DEBUG", "") not in ("", "0")
    try:
        yield
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's last flush
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{command}: interrupted (outputs written so far are whole; a rollout's rerun continues it)",
              file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # stdout closed early (``| head``): the outputs are written; say nothing more on it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # else the interpreter's last flush of stdout fails again at exit
        raise SystemExit(1) from None
    except user_error_types() as err:
        if debug:
            raise
        raise SystemExit(_one_line(command, str(err))) from None
    except OSError as err:
        if debug or err.errno not in USER_OS_ERRNOS:
            raise
        where = f"{err.filename}: " if err.filename else ""
        raise SystemExit(_one_line(command, f"{where}{os.strerror(err.errno)}")) from None
    except RuntimeError as err:
        if debug or not _cuda_out_of_memory(err):
            raise
        raise SystemExit(_one_line(command, out_of_memory_line(command))) from None


def _one_line(command: str, message: str) -> str:
    message = message if message.startswith(command) else f"{command}: {message}"
    return f"{message} (--debug or EOGYM_DEBUG=1 shows the traceback)"


def model_key(name_or_path: str) -> str:
    """What identifies a base model: a hub id ``org/name`` (also for a folder of the hub cache), else the
    resolved local folder."""
    text = str(name_or_path).rstrip("/")
    cached = HUB_CACHE_RE.search(text)
    if cached:
        return f"{cached['org']}/{cached['name']}"
    if Path(text).is_dir():
        return str(Path(text).resolve())
    return text


def same_base(trained_on: str, model: str) -> bool:
    """Whether ``model`` is the base ``trained_on`` names.

    The same hub id or the same folder (after resolving, and reading hub-cache snapshots as their hub
    id) match; two different hub ids do not. A folder named like a hub id's model (``/models/Qwen3-VL-4B-Instruct`` for
    ``Qwen/Qwen3-VL-4B-Instruct``) and two paths with the same last component (a relative path recorded
    where training ran) match too: the name is all that identifies a copy moved between machines.
    """
    a, b = model_key(trained_on), model_key(model)
    if a == b:
        return True
    if _looks_like_hub_id(a) and _looks_like_hub_id(b):
        return False  # two hub ids: another organisation's model of the same name is another model
    return Path(a).name.lower() == Path(b).name.lower()


def _looks_like_hub_id(key: str) -> bool:
    return re.fullmatch(r"[\w.-]+/[\w.-]+", key) is not None and not Path(key).exists()


def adapter_base(adapter_dir: str | Path) -> str | None:
    """The base model an adapter was trained on, from its ``adapter_config.json``."""
    config = Path(adapter_dir) / "adapter_config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{adapter_dir}: no adapter_config.json (not a PEFT adapter folder)")
    return read_json_object(config, "a PEFT adapter's config").get("base_model_name_or_path")


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object in the file ``path``, or ``ValueError``/``FileNotFoundError`` naming the file and what it should
    be."""
    from .safe_json import loads_object

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({what})")
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path}: empty, not {what} (JSON): a run killed while writing it? Remove it or pass "
                         "--overwrite")
    return loads_object(data, str(path), what)


def check_adapter_base(adapter_dir: str | Path, model: str, allow_other_base: bool = False) -> None:
    """Refuse an adapter trained on another base than ``model``, naming both."""
    trained_on = adapter_base(adapter_dir)
    # unrecorded (built in memory): nothing to check
    if not trained_on or allow_other_base or same_base(trained_on, model):
        return
    raise ValueError(
        f"adapter {adapter_dir} was trained on {trained_on!r} but --model is {model!r}: pass the base it was "
        "trained on (or --allow-other-base if they are the same weights under another name)"
    )


def run_recipe(name: str, main, argv: list[str]) -> None:
    """Run a recipe's ``main(argv)`` as the CLI runs a command: a user error (a bad setting, a missing file, a
    broken install) is one line and exit status 1; a bare ``--debug`` (no value: transformers' ``--debug OPTION``
    keeps its meaning) or ``EOGYM_DEBUG=1`` shows the traceback."""
    debug = [i for i, word in enumerate(argv)
             if word == "--debug" and (i + 1 == len(argv) or argv[i + 1].startswith("--"))]
    argv = [word for i, word in enumerate(argv) if i not in debug]
    with user_errors(name, bool(debug)):
        check_torch_stack()
        main(argv)
