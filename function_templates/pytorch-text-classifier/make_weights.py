"""Write deterministic random weights for handler.py: `python make_weights.py [--seed 0] [--out weights.safetensors]`.

The same seed (and shape flags) always gives the same file, byte for byte; nothing is downloaded.
Random weights make the function runnable end to end, not useful: see README.md to train or bring
your own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import save_file
from text_model import TokenizerConfig, random_state_dict

LABELS_FILE = Path(__file__).resolve().parent / "labels.txt"


def default_num_classes() -> int:
    """One class per line of labels.txt (3 without it: negative, neutral, positive)."""
    if not LABELS_FILE.is_file():
        return 3
    return sum(1 for line in LABELS_FILE.read_text(encoding="utf-8").splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", type=Path, default=Path("weights.safetensors"), help="output file")
    parser.add_argument("--buckets", type=int, default=32768, help="hash buckets (embedding rows, default 32768)")
    parser.add_argument("--dim", type=int, default=64, help="embedding size (default 64)")
    parser.add_argument("--ngrams", type=int, choices=(1, 2), default=2, help="1: words; 2: words and pairs")
    parser.add_argument("--num-classes", type=int, default=None, help="classes (default: the lines of labels.txt)")
    args = parser.parse_args(argv)

    tokenizer = TokenizerConfig(num_buckets=args.buckets, ngrams=args.ngrams)
    num_classes = args.num_classes or default_num_classes()
    state = random_state_dict(tokenizer.num_buckets, args.dim, num_classes, args.seed)
    # One metadata key only: safetensors writes several in a per-process random order, and the
    # file must be the same bytes for the same seed. The handler reads the tokenizer's settings here.
    info = {"ngrams": tokenizer.ngrams, "seed": args.seed}
    save_file(state, str(args.out), metadata={"config": json.dumps(info, sort_keys=True)})
    num_params = sum(t.numel() for t in state.values())
    size_mb = args.out.stat().st_size / 1e6
    print(f"wrote {args.out}: {num_params:,} parameters, {size_mb:.1f} MB, seed {args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
