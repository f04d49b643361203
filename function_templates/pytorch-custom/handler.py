"""gpufaas function: a tiny MLP, the smallest complete handler to start your own from.

Inputs:  {"inputs": [[x1, x2, x3, x4], ...]}   rows of IN_FEATURES numbers
Output:  {"outputs": [[y1, y2, y3], ...]}       one row of OUT_FEATURES numbers per input row

The contract (README.md has it in full): the worker imports this file with its directory as the
working directory and first on sys.path, calls `load(device)` once, `warmup(model)` once if it is
defined, and `predict(model, inputs)` per request, one at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

try:  # on a gpufaas node: weights from its host model pool (mapped on cpu, pinned copies on cuda)
    from gpufaas.weights import load_file
except ImportError:  # elsewhere (your own tests): the same tensors, read from the file
    from safetensors.torch import load_file

# The package directory: the worker sets GPUFAAS_PACKAGE_DIR (and the cwd) to it.
PACKAGE_DIR = Path(os.environ.get("GPUFAAS_PACKAGE_DIR") or Path(__file__).resolve().parent)
WEIGHTS_FILE = "weights.safetensors"
IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 32, 3
MAX_ROWS = 4096  # per call


def build_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT_FEATURES))


def load(device: str) -> nn.Module:
    """Once per worker process. `device` is "cuda:0", "cuda:1", ... on a GPU node, "cpu" on a CPU one."""
    weights = PACKAGE_DIR / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(
            f"{weights} not found: run `python make_weights.py` in {PACKAGE_DIR} to write random weights, "
            "or save your trained model's state dict there with safetensors (see README.md)"
        )
    model = build_model()
    # The tensors arrive on the device; assign=True adopts them without a copy.
    model.load_state_dict(load_file(weights, device=device), assign=True)
    return model.eval()


def warmup(model: nn.Module) -> None:
    """Optional: run once after `load`, before any request (its first inference's one-off costs,
    cuDNN's and cuBLAS's set-up on a GPU, are paid here and not by a caller). A CPU has none to
    pay: nothing to do there, and a load that does nothing is a cheaper miss."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return
    with torch.inference_mode():
        model(torch.zeros(1, IN_FEATURES, device=device))
    torch.cuda.synchronize(device)


def predict(model: nn.Module, inputs: object) -> dict[str, object] | list[dict[str, object]]:
    """Per request. `inputs` is the JSON body decoded, or the raw bytes when the body is not JSON.
    Return a dict/list (sent as JSON), a str (text) or bytes (as they are); tensors become lists.
    A NaN or an infinity in a JSON result fails the call (JSON cannot carry them): use None or a str.
    A ValueError refuses the input (HTTP 400, its message the error); any other exception is an HTTP 500.

    With `max_batch_size` > 1 in stack.yml, `inputs` is the list of the merged calls' inputs and
    the answer a list of their outputs, in order (a call's own input is never a JSON list here):
    their rows go through the model in one pass."""
    if isinstance(inputs, list):
        rows = [_rows(one) for one in inputs]
        outputs = _forward(model, torch.cat(rows)).split([len(x) for x in rows])
        return [{"outputs": part.tolist()} for part in outputs]
    return {"outputs": _forward(model, _rows(inputs)).tolist()}


def _rows(inputs: object) -> torch.Tensor:
    """One call's rows: a float32 tensor of shape (rows, IN_FEATURES); ValueError saying what to send."""
    expected = f'expected a JSON object {{"inputs": [[...{IN_FEATURES} numbers], ...]}}'
    if isinstance(inputs, bytes | bytearray):  # a body that is not JSON (or declared another type)
        try:
            json.loads(inputs)
        except ValueError as exc:  # where it went wrong: a typo'd body arrives here, not as JSON
            raise ValueError(f"{expected}; the body is not valid JSON: {exc}") from None
    if not isinstance(inputs, dict) or "inputs" not in inputs:
        raise ValueError(expected)
    try:
        x = torch.tensor(inputs["inputs"], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"'inputs' must be a list of rows of {IN_FEATURES} numbers ({exc})") from None
    if x.dim() != 2 or x.shape[1] != IN_FEATURES or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"'inputs' must be 1 to {MAX_ROWS} rows of {IN_FEATURES} numbers, got shape {list(x.shape)}")
    finite = torch.isfinite(x).all(dim=1)
    if not finite.all():  # NaN in would be NaN out, which JSON cannot carry
        row = int((~finite).nonzero()[0])
        raise ValueError(f"'inputs' must be finite numbers within float32's range (±3.4e38); row {row} is not")
    return x


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(x.to(device))
