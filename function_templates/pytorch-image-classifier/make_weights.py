"""Write deterministic random weights for handler.py: `python make_weights.py [--seed 0] [--out weights.safetensors]`.

The same seed (and shape flags) always gives the same file, byte for byte; nothing is downloaded.
Random weights make the function runnable end to end, not useful: see README.md to bring a
trained model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from resnet import ResNetConfig, parse_layers, random_state_dict
from safetensors.torch import save_file

LABELS_FILE = Path(__file__).resolve().parent / "labels.txt"


def default_num_classes() -> int:
    """One class per line of labels.txt (1000 without it)."""
    if not LABELS_FILE.is_file():
        return 1000
    return sum(1 for line in LABELS_FILE.read_text(encoding="utf-8").splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", type=Path, default=Path("weights.safetensors"), help="output file")
    parser.add_argument("--layers", default="2,2,2,2", help="BasicBlocks per stage (default 2,2,2,2: ResNet-18)")
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage (default 64)")
    parser.add_argument("--num-classes", type=int, default=None, help="classes (default: the lines of labels.txt)")
    args = parser.parse_args(argv)

    config = ResNetConfig(
        layers=parse_layers(args.layers), width=args.width, num_classes=args.num_classes or default_num_classes()
    )
    state = random_state_dict(config, args.seed)
    # One metadata key only: safetensors writes several in a per-process random order, and the
    # file must be the same bytes for the same seed.
    info = {"arch": "resnet-basicblock", "layers": list(config.layers), "width": config.width, "seed": args.seed}
    save_file(state, str(args.out), metadata={"config": json.dumps(info, sort_keys=True)})
    num_values = sum(t.numel() for name, t in state.items() if not name.endswith("num_batches_tracked"))
    size_mb = args.out.stat().st_size / 1e6
    print(f"wrote {args.out}: {num_values:,} values (weights and BatchNorm statistics), {size_mb:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
