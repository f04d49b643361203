"""gpufaas function: classify short texts (hashing tokenizer, EmbeddingBag + Linear).

Inputs:  {"text": "..."}  or  {"texts": ["...", ...]}  (or a plain-text request body, or a JSON string)
Output:  {"predictions": [{"label": "positive", "scores": {"negative": 0.1, "neutral": 0.2, "positive": 0.7}}, ...]}
         one entry per text, in order; the scores of each text sum to 1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

try:  # on a gpufaas node: weights from its host model pool (mapped on cpu, pinned copies on cuda)
    from gpufaas.weights import load_file
except ImportError:  # elsewhere (your own tests): the same tensors, read from the file
    from safetensors.torch import load_file
from text_model import HashingTokenizer, TextClassifier, TokenizerConfig

PACKAGE_DIR = Path(os.environ.get("GPUFAAS_PACKAGE_DIR") or Path(__file__).resolve().parent)
WEIGHTS_FILE = "weights.safetensors"
LABELS_FILE = "labels.txt"
MAX_TEXTS = 1024  # per call
MAX_TEXT_CHARS = 100_000  # per text: bounds the tokenizer's time


@dataclass
class Model:
    """What `load` returns and `predict` receives."""

    network: TextClassifier
    tokenizer: HashingTokenizer
    labels: list[str]
    device: torch.device


def load(device: str) -> Model:
    """Read `weights.safetensors` onto `device` ("cpu", "cuda:0", ...)."""
    target = torch.device(device)
    weights = PACKAGE_DIR / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(
            f"{weights} not found: run `python make_weights.py` in {PACKAGE_DIR} to write random weights, "
            "or save your trained model's state dict there with safetensors (see README.md)"
        )
    state = load_file(weights, device=str(target))
    with safe_open(weights, framework="pt") as file:  # the header only: the metadata
        config = json.loads((file.metadata() or {}).get("config", "{}"))
    missing = {"embedding.weight", "fc.weight", "fc.bias"} - state.keys()
    if missing:
        raise ValueError(f"{weights} is not a text classifier's state dict: missing {sorted(missing)}")
    num_buckets, embedding_dim = state["embedding.weight"].shape
    num_classes = state["fc.weight"].shape[0]
    # Built on the CPU and then handed the loaded tensors (assign=True: no copy). Not on the meta
    # device: EmbeddingBag's random init there takes a slow path that imports ~1 s of torch.
    network = TextClassifier(num_buckets, embedding_dim, num_classes)
    try:
        network.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(f"{weights} does not fit TextClassifier: {exc}") from None
    network.eval()
    tokenizer = HashingTokenizer(TokenizerConfig(num_buckets=num_buckets, ngrams=int(config.get("ngrams", 2))))
    return Model(network=network, tokenizer=tokenizer, labels=_read_labels(num_classes), device=target)


def predict(model: Model, inputs: object) -> dict[str, object] | list[dict[str, object]]:
    """One call's answer; with `max_batch_size` > 1 in stack.yml, `inputs` is the list of the
    merged calls' inputs (a call's own input is never a JSON list here) and the answer a list of
    theirs, in order: all their texts go through the network in one pass."""
    if not isinstance(inputs, list):
        return {"predictions": _classify(model, _parse_inputs(inputs))}
    calls = [_parse_inputs(one) for one in inputs]
    predictions = iter(_classify(model, [text for texts in calls for text in texts]))
    return [{"predictions": [next(predictions) for _ in texts]} for texts in calls]


def _classify(model: Model, texts: list[str]) -> list[dict[str, object]]:
    """Each text's label and scores, all texts in one pass."""
    ids: list[int] = []
    offsets: list[int] = []
    for text in texts:
        offsets.append(len(ids))
        ids.extend(model.tokenizer.ids(text))
    with torch.inference_mode():
        logits = model.network(
            torch.tensor(ids, dtype=torch.long, device=model.device),
            torch.tensor(offsets, dtype=torch.long, device=model.device),
        )
        probabilities = torch.softmax(logits.float(), dim=1)
        best = probabilities.argmax(dim=1).tolist()
    return [
        {"label": model.labels[b], "scores": dict(zip(model.labels, row, strict=True))}
        for b, row in zip(best, probabilities.tolist(), strict=True)
    ]


def _parse_inputs(inputs: object) -> list[str]:
    if isinstance(inputs, str):  # a JSON string
        return _check_texts([inputs])
    if isinstance(inputs, bytes | bytearray):  # a body that is not JSON: the text itself
        if not inputs:  # no body at all is a mistake, not an empty text ({"text": ""} is one)
            raise ValueError('the request body is empty: send {"text": "..."}, {"texts": [...]} or the text itself')
        try:
            return _check_texts([bytes(inputs).decode("utf-8")])
        except UnicodeDecodeError:
            raise ValueError("the request body is neither JSON nor UTF-8 text") from None
    if not isinstance(inputs, dict) or ("text" in inputs) == ("texts" in inputs):
        raise ValueError('expected a JSON object with "text" (a string) or "texts" (a list of strings)')
    if "text" in inputs:
        text = inputs["text"]
        if not isinstance(text, str):
            raise ValueError(f"'text' must be a string, got a JSON {type(text).__name__}")
        return _check_texts([text])
    texts = inputs["texts"]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("'texts' must be a non-empty list of strings")
    return _check_texts(texts)


def _check_texts(texts: list[str]) -> list[str]:
    if len(texts) > MAX_TEXTS:
        raise ValueError(f"at most {MAX_TEXTS} texts per call, got {len(texts)}: split the batch")
    for i, text in enumerate(texts):
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"text {i} has {len(text)} characters; at most {MAX_TEXT_CHARS}")
    return texts


def _read_labels(num_classes: int) -> list[str]:
    path = PACKAGE_DIR / LABELS_FILE
    if not path.is_file():
        return [f"class_{i}" for i in range(num_classes)]
    labels = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(labels) != num_classes:
        raise ValueError(
            f"{path} has {len(labels)} labels but the model has {num_classes} classes: "
            "write one label per line in class order (then `python make_weights.py` for matching random weights)"
        )
    if len(set(labels)) != len(labels):
        raise ValueError(f"{path} repeats a label: the scores are keyed by label, so each must be unique")
    return labels
