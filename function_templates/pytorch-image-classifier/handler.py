"""gpufaas function: classify images with a ResNet (ImageNet preprocessing, top-k classes).

Inputs (one of):
    {"image": "<base64 PNG/JPEG>", "top_k": 5}
    {"images": ["<base64>", ...], "top_k": 5}
    {"pixels": [[[...]]], "layout": "CHW" | "HWC"}   one image (CHW, HWC or HW) or a batch (NCHW / NHWC);
                                                     integers are 0..255, floats 0..1
    the raw bytes of one PNG/JPEG (a request body that is not JSON)
Output:
    {"predictions": [[{"class": 281, "label": "...", "score": 0.83}, ... top_k], ... one list per image]}

PNG/JPEG decoding needs Pillow; without it only "pixels" is accepted. Each image is resized to
224 x 224 (bilinear, antialiased) and normalised with the ImageNet mean and std.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812  the conventional name
from resnet import build_model, config_from_state_dict

try:  # on a gpufaas node: weights from its host model pool (mapped on cpu, pinned copies on cuda)
    from gpufaas.weights import load_file
except ImportError:  # elsewhere (your own tests): the same tensors, read from the file
    from safetensors.torch import load_file

PACKAGE_DIR = Path(os.environ.get("GPUFAAS_PACKAGE_DIR") or Path(__file__).resolve().parent)
WEIGHTS_FILE = "weights.safetensors"
LABELS_FILE = "labels.txt"
IMAGE_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_TOP_K = 5
MAX_IMAGES = 64  # per call: bounds the activations' memory (batch 64 at 224 x 224 is ~1 GB on a GPU)
MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest image decoded (width x height): a PNG of a few hundred KB can hold 12,000 x 12,000
pixels, whose float copy (1.7 GB) failed the call with an allocator error, not a 400."""


@dataclass
class Classifier:
    """What `load` returns and `predict` receives."""

    model: torch.nn.Module
    labels: list[str]
    device: torch.device
    dtype: torch.dtype
    implementation: str


def load(device: str) -> Classifier:
    """Read `weights.safetensors` onto `device` ("cpu", "cuda:0", ...) and build the network around it."""
    target = torch.device(device)
    weights = PACKAGE_DIR / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(
            f"{weights} not found: run `python make_weights.py` in {PACKAGE_DIR} to write random weights, "
            "or save your trained model's state dict there with safetensors (see README.md)"
        )
    state = load_file(weights, device=str(target))
    config = config_from_state_dict(state)
    # Build on the meta device (no memory, no random init) and adopt the loaded tensors as they are.
    with torch.device("meta"):
        model, implementation = build_model(config)
    for name, buffer in model.state_dict().items():
        if name.endswith("num_batches_tracked") and name not in state:  # absent from some exports
            state[name] = torch.zeros_like(buffer, device=target)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{weights} does not fit {implementation} with {config}: {exc}") from None
    model.eval()
    # Which of the two networks this is (torchvision's or resnet.py's): the node's log has it (`gpufaas logs`).
    print(f"{WEIGHTS_FILE}: built {implementation} ({config.num_classes} classes) on {target}", file=sys.stderr)
    return Classifier(
        model=model,
        labels=_read_labels(config.num_classes),
        device=target,
        dtype=next(model.parameters()).dtype,
        implementation=implementation,
    )


def warmup(classifier: Classifier) -> None:
    """Once after `load`, before any request: a first forward pass at one image, which on a GPU
    pays cuDNN's algorithm choice and the kernels' loading (200-300 ms on an H100), so no caller does.
    A CPU has no such cost: nothing to do there."""
    if classifier.device.type != "cuda":
        return
    with torch.inference_mode():
        image = torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE, device=classifier.device, dtype=classifier.dtype)
        classifier.model(image)
    if classifier.device.type == "cuda":
        torch.cuda.synchronize(classifier.device)


def predict(classifier: Classifier, inputs: object) -> dict[str, object] | list[dict[str, object]]:
    """One call's answer; with `max_batch_size` > 1 in stack.yml, `inputs` is the list of the
    merged calls' inputs (a call's own input is never a JSON list here) and the answer a list of
    theirs, in order: all their images go through the network in one pass."""
    if isinstance(inputs, list):
        return _classify(classifier, [_parse_inputs(one, len(classifier.labels)) for one in inputs])
    return _classify(classifier, [_parse_inputs(inputs, len(classifier.labels))])[0]


def _classify(classifier: Classifier, requests: list[tuple[list[torch.Tensor], int]]) -> list[dict[str, object]]:
    """The answer to each of `requests` (its images and top_k), the images of all in one batch."""
    batch = torch.stack([_preprocess(image, classifier.device) for images, _ in requests for image in images])
    with torch.inference_mode():
        logits = classifier.model(batch.to(classifier.dtype))
        probabilities = torch.softmax(logits.float(), dim=1).split([len(images) for images, _ in requests])
    answers: list[dict[str, object]] = []
    for (_, top_k), part in zip(requests, probabilities, strict=True):
        scores, classes = part.topk(top_k, dim=1)
        ranked = [
            [{"class": c, "label": classifier.labels[c], "score": s} for c, s in zip(cs, ss, strict=True)]
            for cs, ss in zip(classes.tolist(), scores.tolist(), strict=True)
        ]
        answers.append({"predictions": ranked})
    return answers


# --- inputs ------------------------------------------------------------------------------------


def _parse_inputs(inputs: object, num_classes: int) -> tuple[list[torch.Tensor], int]:
    """The images (C x H x W tensors: uint8 0..255 or float 0..1) and top_k of a request."""
    if isinstance(inputs, bytes | bytearray):
        return [_decode_image(bytes(inputs), "the request body")], DEFAULT_TOP_K
    if not isinstance(inputs, dict):
        raise ValueError(_usage(f"got a JSON {type(inputs).__name__}"))
    given = [key for key in ("image", "images", "pixels") if key in inputs]
    if len(given) != 1:
        raise ValueError(_usage(f"got keys {sorted(inputs)}" if not given else f"got several of {given}"))
    top_k = inputs.get("top_k", DEFAULT_TOP_K)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_classes:
        raise ValueError(f"'top_k' must be a whole number from 1 to {num_classes}, got {top_k!r}")
    if "image" in inputs:
        images = [_decode_base64(inputs["image"], "'image'")]
    elif "images" in inputs:
        values = inputs["images"]
        if not isinstance(values, list) or not values:
            raise ValueError("'images' must be a non-empty list of base64-encoded PNG/JPEG images")
        _check_count(len(values))
        images = [_decode_base64(value, f"'images'[{i}]") for i, value in enumerate(values)]
    else:
        images = _parse_pixels(inputs["pixels"], inputs.get("layout"))
    return images, top_k


def _usage(problem: str) -> str:
    return (
        'expected a JSON object with one of "image" (base64 PNG/JPEG), "images" (a list of them) or '
        f'"pixels" (a CHW or HWC array), or the raw bytes of a PNG/JPEG; {problem}'
    )


def _check_count(count: int) -> None:
    if count > MAX_IMAGES:
        raise ValueError(f"at most {MAX_IMAGES} images per call, got {count}: split the batch")


def _decode_base64(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a base64 string, got a JSON {type(value).__name__}")
    if value.startswith("data:") and "," in value:  # a data URL: data:image/png;base64,....
        value = value.split(",", 1)[1]
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{what} is not valid base64 ({exc})") from None
    return _decode_image(data, what)


def _decode_image(data: bytes, what: str) -> torch.Tensor:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError(
            f"cannot decode {what}: decoding PNG/JPEG needs Pillow, which this function's environment lacks; "
            'send raw pixels instead, {"pixels": [...]} as a CHW or HWC array, or install pillow'
        ) from None
    try:
        with Image.open(io.BytesIO(data)) as opened:  # reads the header only: the size before the pixels
            width, height = opened.size
            image = opened.convert("RGB") if width * height <= MAX_IMAGE_PIXELS else None
    except Image.DecompressionBombError as exc:  # past Pillow's own limit: refused before its size is read
        raise ValueError(f"{what} is too large to decode ({exc}): resize it to at most 4096 x 4096") from None
    except UnidentifiedImageError:  # its message names only Pillow's BytesIO object, at an address
        raise ValueError(f"{what} is not an image Pillow can read (PNG/JPEG expected): not an image format") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{what} is not an image Pillow can read (PNG/JPEG expected): {exc}") from None
    if image is None:
        raise ValueError(
            f"{what} is {width} x {height} pixels, over {MAX_IMAGE_PIXELS} (4096 x 4096): resize it "
            f"(the network sees {IMAGE_SIZE} x {IMAGE_SIZE})"
        )
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(image.height, image.width, 3).permute(2, 0, 1)


def _parse_pixels(value: object, layout: object) -> list[torch.Tensor]:
    if layout not in (None, "CHW", "HWC"):
        raise ValueError(f'\'layout\' must be "CHW" or "HWC", got {layout!r}')
    try:
        array = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"'pixels' must be a rectangular array of numbers ({exc})") from None
    if array.dtype == torch.bool or array.is_complex():
        raise ValueError("'pixels' must hold numbers: integers 0..255 or floats 0..1")
    shape = list(array.shape)
    if array.dim() == 2:  # H x W: one grayscale image
        array, layout = array[None, None], "CHW"
    elif array.dim() == 3:  # one image
        array = array.unsqueeze(0)
    if array.dim() != 4 or min(array.shape) == 0:
        raise ValueError(f"'pixels' must be HW, CHW, HWC, NCHW or NHWC, got shape {shape}")
    _check_count(array.shape[0])
    if layout is None:  # channels first, unless only the last axis can be the channels
        layout = "CHW" if array.shape[1] in (1, 3) or array.shape[-1] not in (1, 3) else "HWC"
    if layout == "HWC":
        array = array.permute(0, 3, 1, 2)
    if array.shape[1] not in (1, 3):
        raise ValueError(f"'pixels' must have 1 or 3 channels, got shape {shape} read as {layout}")
    if array.dtype.is_floating_point:
        if not torch.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise ValueError("float 'pixels' must lie in [0, 1]; send integers for 0..255")
    elif array.min() < 0 or array.max() > 255:
        raise ValueError("integer 'pixels' must lie in 0..255")
    else:
        array = array.to(torch.uint8)
    return list(array.unbind(0))


# --- preprocessing and labels ------------------------------------------------------------------


def _preprocess(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    """C x H x W (uint8 or float 0..1, 1 or 3 channels) -> normalised float 3 x 224 x 224 on `device`."""
    x = image.to(device)
    x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
    if x.shape[0] == 1:
        x = x.expand(3, -1, -1)
    if x.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        x = F.interpolate(x[None], size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True)[0]
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(3, 1, 1)
    return (x - mean) / std


def _read_labels(num_classes: int) -> list[str]:
    path = PACKAGE_DIR / LABELS_FILE
    if not path.is_file():
        return [f"class_{i}" for i in range(num_classes)]
    labels = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(labels) != num_classes:
        raise ValueError(
            f"{path} has {len(labels)} labels but the model has {num_classes} classes: "
            "write one label per line in class order, or delete the file to use class_0, class_1, ..."
        )
    return labels
