"""Write deterministic random weights for handler.py: `python make_weights.py [--seed 0] [--out weights.safetensors]`.

The same seed always gives the same file, byte for byte; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from handler import build_model
from safetensors.torch import save_file


def random_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """A pure function of `seed`: the model's default initialisation, drawn from a seeded generator."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(seed)
        model = build_model()
    return {name: tensor.contiguous() for name, tensor in model.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", type=Path, default=Path("weights.safetensors"), help="output file")
    args = parser.parse_args(argv)

    state = random_state_dict(args.seed)
    save_file(state, str(args.out), metadata={"format": "pt"})
    print(f"wrote {args.out}: {sum(t.numel() for t in state.values()):,} parameters, seed {args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
