"""Thin CLI: `python data_prep/prepare.py --input train.jsonl --data-root DATA --model MODEL --output OUT`.

Same as `eogym-sft prepare`; the work is in `eogym_sft.prepare`.
"""

from eogym_sft.cli import main

if __name__ == "__main__":
    import sys

    main(["prepare", *sys.argv[1:]])
