"""How far two training runs with the same settings and seed end apart: adapters and loss curves.

    python bench/determinism.py RUN_A RUN_B --json determinism.json

Each run is a recipe ``output_dir``. It compares ``adapter_model.safetensors`` tensor by tensor (max
absolute difference, and the largest weight for scale) and the logged ``loss``, ``grad_norm`` and
``eval_loss`` step by step (from the newest checkpoint's ``trainer_state.json``). On CPU two runs are
bit-identical (tests/test_recipe.py); on a GPU this measures what nondeterminism remains
(``bash bench/h200_session.sh determinism``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

CURVES = ("loss", "grad_norm", "eval_loss")


def newest_state(run: Path) -> dict:
    checkpoints = sorted(run.glob("checkpoint-*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    if not checkpoints:
        raise FileNotFoundError(f"{run}: no checkpoint-* folder")
    return json.loads((checkpoints[-1] / "trainer_state.json").read_text())


def curve(history: list[dict], key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in history if key in h}


def compare_runs(a: str | Path, b: str | Path) -> dict:
    """Max absolute differences between two runs' adapters (overall and per tensor) and logged curves."""
    from safetensors.torch import load_file

    a, b = Path(a), Path(b)
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    if wa.keys() != wb.keys():
        raise ValueError(f"{a} and {b} hold different adapter tensors")
    per_tensor = {name: (wa[name].float() - wb[name].float()).abs().max().item() for name in sorted(wa)}
    ha, hb = newest_state(a)["log_history"], newest_state(b)["log_history"]
    curves = {}
    for key in CURVES:
        ca, cb = curve(ha, key), curve(hb, key)
        steps = sorted(set(ca) & set(cb))
        diffs = [abs(ca[s] - cb[s]) for s in steps]
        curves[key] = {"steps": steps, "a": [ca[s] for s in steps], "b": [cb[s] for s in steps], "max_abs_diff": max(diffs, default=None)}
    return {
        "runs": [str(a), str(b)],
        "adapter": {
            "tensors": len(per_tensor),
            "tensors_differing": sum(d > 0 for d in per_tensor.values()),
            "max_abs_diff": max(per_tensor.values()),
            "max_abs_weight": max(t.float().abs().max().item() for t in wa.values()),
            "worst_tensors": dict(sorted(per_tensor.items(), key=lambda kv: -kv[1])[:5]),
        },
        "curves": curves,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs=2, help="two recipe output_dirs")
    parser.add_argument("--json", default=None, help="where to write the result")
    parser.add_argument("--label", default=None, help="a note stored with the result (e.g. the settings)")
    args = parser.parse_args(argv)
    result = {"bench": "determinism", "label": args.label, **compare_runs(*args.runs)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
