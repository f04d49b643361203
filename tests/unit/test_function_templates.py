"""Function templates: each one's files, its weights script and its handler, run the way a worker runs it (CPU)."""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import itertools
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from gpu_manager.worker import decode_inputs, encode_result

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "function_templates"
CUSTOM, IMAGE, TEXT = "pytorch-custom", "pytorch-image-classifier", "pytorch-text-classifier"
TEMPLATES = [CUSTOM, IMAGE, TEXT]
REQUIRED_FILES = ["handler.py", "make_weights.py", "README.md", "template.yml", "stack.yml"]
VALID_INPUT: dict[str, Any] = {
    CUSTOM: {"inputs": [[1, 2, 3, 4]]},
    IMAGE: {"pixels": torch.arange(3 * 8 * 8).reshape(3, 8, 8).remainder(256).tolist(), "top_k": 3},
    TEXT: {"text": "A wonderful, moving film"},
}

_module_ids = itertools.count()


@dataclass
class Deployed:
    """A template copied to its own directory, with weights, its handler imported and loaded."""

    directory: Path
    handler: ModuleType
    model: object

    def call(self, body: object) -> Any:
        """`body` through the worker's decoding, `predict` and the worker's encoding, as JSON again."""
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        result, _ = encode_result(self.handler.predict(self.model, decode_inputs(payload)))
        return json.loads(result)


def copy_template(template: str, destination: Path) -> Path:
    return Path(shutil.copytree(TEMPLATES_DIR / template, destination, ignore=shutil.ignore_patterns("__pycache__")))


def make_weights_command(directory: Path, *args: str) -> list[str]:
    return [sys.executable, str(directory / "make_weights.py"), *args]


def make_weights(directory: Path, *args: str) -> None:
    done = subprocess.run(
        make_weights_command(directory, *args), cwd=directory, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def import_handler(directory: Path) -> ModuleType:
    """Import `directory/handler.py` as the worker does (cwd, sys.path and GPUFAAS_PACKAGE_DIR set to
    the directory), then put cwd, sys.path, the environment and sys.modules back as they were. The
    handler keeps its own references to its sibling modules."""
    before = set(sys.modules)
    name = f"template_handler_{next(_module_ids)}"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(directory)
        patch.setenv("GPUFAAS_PACKAGE_DIR", str(directory))
        patch.syspath_prepend(str(directory))
        spec = importlib.util.spec_from_file_location(name, directory / "handler.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # as the worker does: dataclasses look their module up there
        try:
            spec.loader.exec_module(module)
        finally:
            for added in set(sys.modules) - before:  # the handler and its siblings (resnet, text_model)
                origin = getattr(sys.modules[added], "__file__", None) or ""
                if origin.startswith(str(directory)):
                    del sys.modules[added]
    return module


@pytest.fixture(scope="module")
def deploy(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Deployed]:
    """One deployed copy per template, shared by this module's tests (weights and load once)."""
    deployed: dict[str, Deployed] = {}

    def get(template: str) -> Deployed:
        if template not in deployed:
            directory = copy_template(template, tmp_path_factory.mktemp("fn") / template)
            make_weights(directory)
            handler = import_handler(directory)
            deployed[template] = Deployed(directory, handler, handler.load("cpu"))
        return deployed[template]

    return get


# --- every template ---------------------------------------------------------------------------


def parse_simple_yaml(text: str) -> dict[str, Any]:
    """The YAML subset the template files use (nested mappings, scalars, `{}`), for when PyYAML is
    not installed; checked against PyYAML below when it is."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        key, _, value = line.strip().partition(":")
        while indent <= stack[-1][0]:
            stack.pop()
        parent = stack[-1][1]
        value = value.strip()
        if not value:
            parent[key] = child = {}
            stack.append((indent, child))
        elif value == "{}":
            parent[key] = {}
        elif value.startswith('"'):
            parent[key] = json.loads(value)
        else:
            try:
                parent[key] = int(value)
            except ValueError:
                try:
                    parent[key] = float(value)
                except ValueError:
                    parent[key] = value
    return root


def read_yaml(path: Path) -> dict[str, Any]:
    parsed = parse_simple_yaml(path.read_text(encoding="utf-8"))
    try:
        import yaml
    except ImportError:
        return parsed
    assert yaml.safe_load(path.read_text(encoding="utf-8")) == parsed
    return parsed


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_has_its_files_and_consistent_metadata(template: str) -> None:
    directory = TEMPLATES_DIR / template
    for name in REQUIRED_FILES:
        assert (directory / name).is_file(), f"{template} lacks {name}"
    meta = read_yaml(directory / "template.yml")
    assert meta["name"] == template
    assert isinstance(meta["description"], str) and meta["description"]
    assert meta["gpu"] == "any"
    for key in ("memory_mb", "batch_size", "timeout_s"):
        assert isinstance(meta[key], int) and meta[key] > 0, key

    stack = read_yaml(directory / "stack.yml")
    assert stack["version"] == 1.0
    assert stack["provider"] == {"name": "gpufaas", "gateway": "http://127.0.0.1:8080"}
    assert stack["functions"] == {
        "example": {
            "template": template,
            "handler": "./example",
            "gpu": "any",
            "memory_mb": meta["memory_mb"],
            "batch_size": meta["batch_size"],
            "timeout_s": meta["timeout_s"],
            "labels": {},
            "environment": {},
        }
    }


@pytest.mark.parametrize("template", TEMPLATES)
def test_stack_file_passes_the_cli_validation(template: str) -> None:
    pytest.importorskip("yaml", reason="gpufaas.cli.stack needs PyYAML")
    from gpufaas.cli.stack import load_stack

    path = TEMPLATES_DIR / template / "stack.yml"
    (function,) = load_stack(path).functions
    assert (function.name, function.template) == ("example", template)


def readme_calls(template: str) -> list[tuple[str, str]]:
    """(block, call) for every curl to `/function/` in the template README's bash blocks, each call
    one line (continuations joined), with the block it is in (for the shell function and variables
    the block defines)."""
    text = (TEMPLATES_DIR / template / "README.md").read_text(encoding="utf-8")
    found: list[tuple[str, str]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        joined = block.replace("\\\n", " ")
        found += [(joined, line) for line in joined.splitlines() if re.match(r"\s*curl .*/function/", line)]
    return found


@pytest.mark.parametrize("template", TEMPLATES)
def test_readme_calls_carry_the_invoke_token_and_declare_json(template: str) -> None:
    """A function's call needs a credential (401 without one), and curl's `-d` declares a form,
    which reaches the handler as raw bytes: a JSON body must say `content-type: application/json`."""
    calls = readme_calls(template)
    assert calls, f"{template}'s README shows no call"
    for block, call in calls:
        wrapped = re.search(r"^curl\(\) \{ command curl -H \"Authorization: Bearer", block, re.MULTILINE)
        assert wrapped or "Authorization: Bearer" in call, f"{template}: no credential: {call}"
        json_type = re.search(r"^J='content-type: application/json'", block, re.MULTILINE)
        declared = "content-type: application/json" in call or (json_type and '-H "$J"' in call)
        assert not re.search(r"-d ['\"]\{", call) or declared, f"{template}: JSON sent as a form: {call}"


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_imports_only_torch_safetensors_stdlib_and_its_own_modules(template: str) -> None:
    directory = TEMPLATES_DIR / template
    own = {path.stem for path in directory.glob("*.py")}
    # Imported inside try/except ImportError, with a fallback (gpufaas: its weights loader).
    optional = {"PIL", "torchvision", "gpufaas"}
    for path in directory.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            allowed = {"torch", "safetensors", "__future__"} | own | sys.stdlib_module_names
            if path.name != "make_weights.py":
                allowed |= optional
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


@pytest.mark.parametrize("template", TEMPLATES)
def test_make_weights_is_deterministic_per_seed(
    template: str, tmp_path: Path, deploy: Callable[[str], Deployed]
) -> None:
    fn = deploy(template)
    runs = {
        name: subprocess.Popen(
            make_weights_command(fn.directory, "--seed", seed, "--out", str(tmp_path / name)),
            cwd=fn.directory,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for name, seed in (("again.safetensors", "0"), ("other.safetensors", "1"))
    }
    for run in runs.values():
        assert run.wait(timeout=60) == 0, run.stderr.read() if run.stderr else ""
        if run.stderr:
            run.stderr.close()
    default = (fn.directory / "weights.safetensors").read_bytes()
    assert (tmp_path / "again.safetensors").read_bytes() == default  # the default seed is 0
    assert (tmp_path / "other.safetensors").read_bytes() != default


@pytest.mark.parametrize("template", TEMPLATES)
def test_predict_is_deterministic_and_json(template: str, deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(template)
    first = fn.call(VALID_INPUT[template])
    assert fn.call(VALID_INPUT[template]) == first
    # A second worker loading the same weights answers the same.
    output, content_type = encode_result(fn.handler.predict(fn.handler.load("cpu"), VALID_INPUT[template]))
    assert content_type == "application/json" and json.loads(output) == first


SECOND_INPUT: dict[str, Any] = {
    CUSTOM: {"inputs": [[0, -1, 5, 2], [3, 3, 3, 3]]},
    IMAGE: {"pixels": torch.zeros(2, 3, 4, 4).tolist(), "top_k": 1},
    TEXT: {"texts": ["dull", "fine enough"]},
}


def close_to(output: Any) -> Any:
    """`output` for a comparison whose floats may differ in their last digits (a batch of another size)."""
    if isinstance(output, dict):
        return {key: close_to(value) for key, value in output.items()}
    if isinstance(output, list):
        return [close_to(value) for value in output]
    return pytest.approx(output, rel=1e-4, abs=1e-6) if isinstance(output, float) else output


@pytest.mark.parametrize("template", TEMPLATES)
def test_predict_takes_a_merged_batch_and_answers_each_input(template: str, deploy: Callable[[str], Deployed]) -> None:
    # With max_batch_size > 1 the worker hands predict a list of the merged calls' inputs: every
    # template refused it ("expected a JSON object ..."), so every call of such a function was a 400.
    fn = deploy(template)
    inputs = [VALID_INPUT[template], SECOND_INPUT[template], VALID_INPUT[template]]
    merged = json.loads(encode_result(fn.handler.predict(fn.model, inputs))[0])
    assert merged == [close_to(fn.call(one)) for one in inputs]


@pytest.mark.parametrize("template", TEMPLATES)
def test_load_without_weights_says_to_run_make_weights(template: str, tmp_path: Path) -> None:
    directory = copy_template(template, tmp_path / template)
    handler = import_handler(directory)
    with pytest.raises(FileNotFoundError, match=r"weights\.safetensors not found: run `python make_weights\.py`"):
        handler.load("cpu")


# --- pytorch-custom -----------------------------------------------------------------------------


def test_custom_maps_each_row_to_three_outputs(deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(CUSTOM)
    rows = [[1, 2, 3, 4], [0, 0, 0, 0], [-1.5, 2.5, 0, 7]]
    outputs = fn.call({"inputs": rows})["outputs"]
    assert [len(row) for row in outputs] == [3, 3, 3]
    assert outputs[2] == pytest.approx(fn.call({"inputs": [rows[2]]})["outputs"][0], rel=1e-5)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # A typo'd JSON body arrives as bytes: the error said only what to send, not where it broke.
        (
            b'{"inputs": [[1, 2, 3, 4]',
            r"expected a JSON object .*; the body is not valid JSON: Expecting ',' delimiter",
        ),
        (b"\x00not json", "expected a JSON object"),
        ({"x": 1}, "expected a JSON object"),
        ({"inputs": [[1, 2, 3]]}, r"1 to 4096 rows of 4 numbers, got shape \[1, 3\]"),
        ({"inputs": [[1, 2], [3]]}, "must be a list of rows of 4 numbers"),
        ({"inputs": []}, "rows of 4 numbers"),
        # Not finite (JSON's NaN or 1e400, or past float32's range): the answer was NaN, which
        # is not JSON (a strict client's parser refuses the whole answer).
        ({"inputs": [[float("nan"), 1, 2, 3]]}, "'inputs' must be finite numbers"),
        ({"inputs": [[1, 2, 3, 4], [1e39, 0, 0, 0]]}, r"'inputs' must be finite numbers .*float32.*row 1"),
    ],
)
def test_custom_rejects_bad_input(body: object, message: str, deploy: Callable[[str], Deployed]) -> None:
    with pytest.raises(ValueError, match=message):
        deploy(CUSTOM).call(body)


# --- pytorch-image-classifier -----------------------------------------------------------------


def random_image(seed: int, height: int = 20, width: int = 28) -> torch.Tensor:
    """A 3 x H x W uint8 image."""
    return torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def png_base64(image: torch.Tensor) -> str:
    pil = pytest.importorskip("PIL.Image")
    height, width = image.shape[1:]
    picture = pil.frombytes("RGB", (width, height), bytes(image.permute(1, 2, 0).flatten().tolist()))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_image_classifier_answers_top_k_classes(deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(IMAGE)
    (ranked,) = fn.call({"pixels": random_image(0).tolist(), "top_k": 4})["predictions"]
    assert len(ranked) == 4
    assert all(set(entry) == {"class", "label", "score"} for entry in ranked)
    assert all(0 <= entry["class"] < 1000 and entry["label"] == f"class_{entry['class']}" for entry in ranked)
    scores = [entry["score"] for entry in ranked]
    assert scores == sorted(scores, reverse=True) and scores[-1] > 0 and scores[0] <= 1
    assert len({entry["class"] for entry in ranked}) == 4
    (everything,) = fn.call({"pixels": random_image(0).tolist(), "top_k": 1000})["predictions"]
    assert sum(entry["score"] for entry in everything) == pytest.approx(1.0, abs=1e-4)
    assert everything[:4] == ranked
    assert len(fn.call({"pixels": random_image(0).tolist()})["predictions"][0]) == 5  # the default top_k


def test_image_classifier_reads_pixel_layouts_and_ranges_alike(deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(IMAGE)
    image = random_image(1)
    chw = fn.call({"pixels": image.tolist()})
    assert fn.call({"pixels": image.permute(1, 2, 0).tolist()}) == chw  # HWC, guessed
    assert fn.call({"pixels": image.permute(1, 2, 0).tolist(), "layout": "HWC"}) == chw
    as_floats = fn.call({"pixels": (image.double() / 255).tolist()})["predictions"][0]
    assert [e["class"] for e in as_floats] == [e["class"] for e in chw["predictions"][0]]
    assert [e["score"] for e in as_floats] == pytest.approx([e["score"] for e in chw["predictions"][0]], rel=1e-4)
    gray = fn.call({"pixels": image[0].tolist()})["predictions"]  # H x W
    assert len(gray) == 1 and len(gray[0]) == 5


def test_image_classifier_batches(deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(IMAGE)
    images = [random_image(seed) for seed in range(3)]
    batch = fn.call({"pixels": torch.stack(images).tolist()})["predictions"]  # N x C x H x W
    assert len(batch) == 3
    for image, ranked in zip(images, batch, strict=True):
        (alone,) = fn.call({"pixels": image.tolist()})["predictions"]
        assert [e["class"] for e in ranked] == [e["class"] for e in alone]
        assert [e["score"] for e in ranked] == pytest.approx([e["score"] for e in alone], rel=1e-4)


def test_image_classifier_decodes_png_base64_and_raw_bodies(deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(IMAGE)
    images = [random_image(2), random_image(3, 40, 30)]
    encoded = [png_base64(image) for image in images]
    expected = [fn.call({"pixels": image.tolist()})["predictions"][0] for image in images]
    assert fn.call({"image": encoded[0]})["predictions"] == expected[:1]
    assert fn.call({"image": "data:image/png;base64," + encoded[0]})["predictions"] == expected[:1]
    assert fn.call(base64.b64decode(encoded[1]))["predictions"] == expected[1:]  # a raw PNG body
    both = fn.call({"images": encoded, "top_k": 5})["predictions"]
    assert [[e["class"] for e in ranked] for ranked in both] == [[e["class"] for e in ranked] for ranked in expected]


def test_image_classifier_without_pillow_accepts_only_pixels(
    deploy: Callable[[str], Deployed], monkeypatch: pytest.MonkeyPatch
) -> None:
    fn = deploy(IMAGE)
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` now raises ImportError
    with pytest.raises(ValueError, match=r"decoding PNG/JPEG needs Pillow.*send raw pixels instead"):
        fn.call({"image": base64.b64encode(b"\x89PNG...").decode()})
    assert len(fn.call({"pixels": random_image(0).tolist()})["predictions"]) == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("text", "expected a JSON object with one of .* got a JSON str"),
        ([1, 2, 3], "expected a JSON object with one of .* got a JSON int"),  # a list: merged calls' inputs
        ({"top_k": 3}, r"expected a JSON object with one of .* got keys \['top_k'\]"),
        ({"image": "x", "pixels": [[0]]}, "got several of"),
        ({"image": "%%%"}, "'image' is not valid base64"),
        ({"image": 7}, "'image' must be a base64 string"),
        ({"images": []}, "'images' must be a non-empty list"),
        ({"images": ["AAAA"] * 65}, "at most 64 images per call, got 65"),
        ({"pixels": [[[1, 2], [3]]]}, "'pixels' must be a rectangular array of numbers"),
        ({"pixels": [[[[[1]]]]]}, r"'pixels' must be HW, CHW, HWC, NCHW or NHWC, got shape \[1, 1, 1, 1, 1\]"),
        ({"pixels": [[[0] * 4] * 4] * 2}, r"must have 1 or 3 channels, got shape \[2, 4, 4\] read as CHW"),
        ({"pixels": [[[2.0] * 4] * 4] * 3}, r"float 'pixels' must lie in \[0, 1\]"),
        ({"pixels": [[[300] * 4] * 4] * 3}, r"integer 'pixels' must lie in 0\.\.255"),
        ({"pixels": [[True]]}, "'pixels' must hold numbers"),
        ({"pixels": [[0]], "layout": "NHWC"}, "'layout' must be"),
        ({"pixels": [[0]], "top_k": 0}, "'top_k' must be a whole number from 1 to 1000, got 0"),
        ({"pixels": [[0]], "top_k": 1001}, "'top_k' must be a whole number from 1 to 1000"),
    ],
)
def test_image_classifier_rejects_bad_input(body: object, message: str, deploy: Callable[[str], Deployed]) -> None:
    with pytest.raises(ValueError, match=message):
        deploy(IMAGE).call(body)


def test_image_classifier_rejects_a_body_that_is_not_an_image(deploy: Callable[[str], Deployed]) -> None:
    pytest.importorskip("PIL")
    # Pillow's message named its BytesIO object at an address ("cannot identify image file <_io...>").
    with pytest.raises(
        ValueError,
        match=r"the request body is not an image Pillow can read \(PNG/JPEG expected\): not an image format$",
    ):
        deploy(IMAGE).call(b"\x00 neither JSON nor an image")


def test_image_classifier_refuses_an_image_too_large_to_decode(deploy: Callable[[str], Deployed]) -> None:
    # 12,000 x 12,000 pixels in a 140 KB PNG: its float copy (1.7 GB) failed the call with an
    # allocator's RuntimeError (a 500), not a 400 saying what to send.
    image = pytest.importorskip("PIL.Image")
    buffer = io.BytesIO()
    image.new("L", (5000, 4000)).save(buffer, "PNG")
    with pytest.raises(ValueError, match=r"^the request body is 5000 x 4000 pixels, over 16777216 .*: resize it"):
        deploy(IMAGE).call(buffer.getvalue())

    # Over Pillow's own limit, refused at open: a PNG's header alone says so (20,000 x 20,000).
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 0, 0, 0, 0)) + chunk(b"IDAT", b"")
    with pytest.raises(ValueError, match=r"^the request body is too large to decode .*: resize it"):
        deploy(IMAGE).call(b"\x89PNG\r\n\x1a\n" + header)


def test_image_classifier_infers_the_network_from_the_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = copy_template(IMAGE, tmp_path / IMAGE)
    make_weights(directory, "--layers", "1,1", "--width", "8", "--num-classes", "10")
    handler = import_handler(directory)
    with pytest.raises(ValueError, match=r"labels\.txt has 1000 labels but the model has 10 classes"):
        handler.load("cpu")
    (directory / "labels.txt").write_text("".join(f"kind {i}\n" for i in range(10)))
    model = handler.load("cpu")
    assert model.implementation == "resnet.ResNet"  # not ResNet-18's shape: never torchvision's
    # Which network was built is told (the node's log: `gpufaas logs`); it was told nowhere.
    assert "built resnet.ResNet (10 classes) on cpu" in capsys.readouterr().err
    assert sum(p.numel() for p in model.model.parameters()) < 20_000
    (ranked,) = handler.predict(model, {"pixels": random_image(4).tolist(), "top_k": 10})["predictions"]
    assert sorted(entry["label"] for entry in ranked) == sorted(f"kind {i}" for i in range(10))


# --- pytorch-text-classifier ------------------------------------------------------------------


def test_text_classifier_scores_every_label(deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(TEXT)
    (prediction,) = fn.call({"text": "A wonderful, moving film"})["predictions"]
    assert set(prediction) == {"label", "scores"}
    scores = prediction["scores"]
    assert list(scores) == ["negative", "neutral", "positive"]
    assert sum(scores.values()) == pytest.approx(1.0, abs=1e-6)
    assert prediction["label"] == max(scores, key=scores.__getitem__)


def test_text_classifier_batches_and_takes_plain_text(deploy: Callable[[str], Deployed]) -> None:
    fn = deploy(TEXT)
    texts = ["great acting", "Dull and far too long.", ""]
    batch = fn.call({"texts": texts})["predictions"]
    assert len(batch) == 3
    for text, prediction in zip(texts, batch, strict=True):
        (alone,) = fn.call({"text": text})["predictions"]
        assert prediction["label"] == alone["label"]
        assert prediction["scores"] == pytest.approx(alone["scores"], rel=1e-5)
    for body in (b"great acting", "great acting"):  # a body that is not JSON; a JSON string
        (prediction,) = fn.call(body)["predictions"]
        assert prediction["label"] == batch[0]["label"]
        assert prediction["scores"] == pytest.approx(batch[0]["scores"], rel=1e-5)


def test_text_tokenizer_is_fixed_and_case_insensitive(deploy: Callable[[str], Deployed]) -> None:
    tokenizer = deploy(TEXT).model.tokenizer
    assert tokenizer.features("Hello, World!") == ["hello", "world", "hello world"]
    # BLAKE2b, not Python's per-process hash(): these ids are the same in every process and machine.
    assert tokenizer.ids("Hello, World!") == [13991, 12632, 1671]
    assert tokenizer.ids("HELLO world") == tokenizer.ids("hello, world")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, 'expected a JSON object with "text" .* or "texts"'),
        ({"text": "a", "texts": ["b"]}, 'expected a JSON object with "text"'),
        ([1], 'expected a JSON object with "text"'),
        ({"text": 5}, "'text' must be a string, got a JSON int"),
        ({"texts": []}, "'texts' must be a non-empty list of strings"),
        ({"texts": ["a", 1]}, "'texts' must be a non-empty list of strings"),
        ({"texts": ["a"] * 1025}, "at most 1024 texts per call, got 1025"),
        (b"\xff\xfe\x00", "the request body is neither JSON nor UTF-8 text"),
        # No body was classified as the empty text: a 200 answering what was never sent.
        (b"", r'the request body is empty: send \{"text": "..."\}'),
    ],
)
def test_text_classifier_rejects_bad_input(body: object, message: str, deploy: Callable[[str], Deployed]) -> None:
    with pytest.raises(ValueError, match=message):
        deploy(TEXT).call(body)
