"""Functions: `gpufaas new` (from a template), `deploy`, `invoke`, `ls`, `describe` and `rm`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from gpufaas.cli.base import GatewayOpt, app, console, err_console, table_console, user_errors
from gpufaas.cli.client import GatewayClient, gateway_url, is_count, is_number, is_text, running_cluster_url
from gpufaas.errors import GpufaasError

INVOKE_GRACE_S = 30.0  # past the longest a call may run: the gateway's own answer (a 504) comes first


@app.command()
def new(
    name: Annotated[str | None, typer.Argument(help="The new function's name.", show_default=False)] = None,
    template: Annotated[
        str, typer.Option("--template", "-t", help="A template from `gpufaas new --list`.")
    ] = "pytorch-custom",
    directory: Annotated[Path, typer.Option("--dir", help="Where to create it (a stack.yml goes there too).")] = Path(
        "."
    ),
    list_templates: Annotated[bool, typer.Option("--list", help="List the templates and exit.")] = False,
) -> None:
    """Create a function from a template (handler, weights, and an entry in stack.yml)."""
    import shutil
    import subprocess

    from gpufaas.functions import NAME_PATTERN

    templates = _templates()
    if list_templates:
        for template_name, path in sorted(templates.items()):
            console.print(f"{template_name:28} {_template_meta(path).get('description', '')}")
        return
    if name is None:
        raise typer.BadParameter("give the new function's name (or --list for the templates)", param_hint="NAME")
    if not NAME_PATTERN.fullmatch(name):
        raise typer.BadParameter("use lower-case letters, digits and '-' (at most 63)", param_hint="NAME")
    if template not in templates:
        raise typer.BadParameter(
            f"unknown template {template!r}; templates: {', '.join(sorted(templates))}", param_hint="--template"
        )
    target = directory / name
    if target.exists():
        raise typer.BadParameter(f"{target} already exists", param_hint="NAME")
    source = templates[template]
    # What this command makes, removed again if any step fails: the function's directory and the
    # folders above it that did not exist (a stack.yml it had not finished is never left half written).
    made = target
    while not made.parent.exists():
        made = made.parent
    with user_errors():
        _stack_without(directory / "stack.yml", name)  # said before the copy and the weights, not after
    try:
        with user_errors():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "stack.yml", "template.yml"))
            if (target / "make_weights.py").exists():
                done = subprocess.run(
                    [sys.executable, "make_weights.py"], cwd=target, capture_output=True, text=True, check=False
                )
                if done.returncode != 0:
                    raise GpufaasError(_weights_failure(template, done.stderr))
            stack_path = _add_to_stack(directory / "stack.yml", name, template, _template_meta(source))
    except BaseException:
        shutil.rmtree(made, ignore_errors=True)
        raise
    console.print(
        f"created {target} from {template} and added it to {stack_path}; deploy with `gpufaas deploy -f {stack_path}`",
        markup=False,  # (paths: '[/x]' in one, read as markup, was a traceback once the function was made)
    )


def _stack_without(stack_path: Path, name: str) -> dict[str, Any]:
    """The stack file at `stack_path` (a new one if absent), which must not have function `name`."""
    import yaml

    # The running local cluster's gateway; none running: no gateway, so `deploy` finds the local
    # cluster's (or the default) when it runs, not a port guessed now.
    running = running_cluster_url()
    provider = {"name": "gpufaas", **({"gateway": running} if running else {})}
    stack: dict[str, Any] = {"version": 1.0, "provider": provider, "functions": {}}
    if stack_path.exists():
        try:
            stack = yaml.safe_load(stack_path.read_text(encoding="utf-8")) or stack
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise GpufaasError(f"cannot read {stack_path}: {exc}") from None
        if not isinstance(stack, dict) or not isinstance(stack.setdefault("functions", {}), dict):
            raise GpufaasError(f"{stack_path} is not a stack file (no functions mapping)")
        if name in stack["functions"]:
            raise GpufaasError(
                f"{stack_path} has a function {name!r} already (its next deploy would be this template's); "
                "choose another name, or remove it from the stack file first"
            )
    return stack


def _add_to_stack(stack_path: Path, name: str, template: str, meta: Mapping[str, Any]) -> Path:
    """Add function `name` (from `template`, with its template.yml `meta`) to the stack file at
    `stack_path`, made if absent; written whole or not at all. Returns `stack_path`."""
    import yaml

    stack = _stack_without(stack_path, name)  # (read again: it may have changed since `new` checked)
    entry = {
        "template": template,
        "handler": f"./{name}",
        "gpu": meta.get("gpu", "any"),
        "memory_mb": int(meta.get("memory_mb", 1024)),
        "batch_size": int(meta.get("batch_size", 32)),
        "timeout_s": float(meta.get("timeout_s", 60)),
        "labels": {},
        "environment": {},
    }
    text = _appended(stack_path, stack, name, entry)
    if text is None:  # no stack file yet, or one whose functions cannot simply be added to
        stack["functions"][name] = entry
        text = yaml.safe_dump(stack, sort_keys=False)
    partial = stack_path.with_name(f".{stack_path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text)
        partial.replace(stack_path)
    finally:
        partial.unlink(missing_ok=True)
    return stack_path


def _appended(stack_path: Path, stack: dict[str, Any], name: str, entry: dict[str, Any]) -> str | None:
    """The stack file's text with function `name` (`entry`) added at its end, the rest as the
    user wrote it (comments, anchors, `1.10`: written out again from the YAML's values they
    were lost, REV: 1.10 becoming 1.1); None where that cannot be done (no file; `functions`
    not the last key, or not a block mapping), checked by reading the result back."""
    import yaml

    try:
        text = stack_path.read_text(encoding="utf-8")
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(root, yaml.MappingNode) or not root.value:
        return None
    last_key, functions = root.value[-1]
    if last_key.value != "functions" or not isinstance(functions, yaml.MappingNode) or functions.flow_style:
        return None
    if not functions.value:
        return None
    indent = " " * functions.value[0][0].start_mark.column
    block = yaml.safe_dump({name: entry}, sort_keys=False)
    appended = text + ("" if text.endswith("\n") else "\n") + "".join(indent + line for line in block.splitlines(True))
    try:
        read_back = yaml.safe_load(appended)
    except yaml.YAMLError:
        return None
    return appended if read_back == {**stack, "functions": {**stack["functions"], name: entry}} else None


@app.command()
def deploy(
    file: Annotated[Path, typer.Option("-f", "--file", help="The stack file.")] = Path("stack.yml"),
    gateway: GatewayOpt = None,
    only: Annotated[list[str] | None, typer.Option("--filter", help="Deploy only these functions.")] = None,
) -> None:
    """Upload what the gateway lacks of each function's handler directory (files it holds already,
    such as unchanged weights, are not sent again), then register or update the functions."""
    from rich.filesize import decimal  # (76 bytes, 12.3 kB, 1.2 GB: in MB, a handler alone read "0.0 MB")

    from gpufaas.cli import uploads
    from gpufaas.cli.stack import load_stack
    from gpufaas.packages import DigestCache

    with user_errors():
        stack = load_stack(file)
        client = GatewayClient(gateway_url(gateway, stack.gateway))
        selected = [f for f in stack.functions if not only or f.name in only]
        unknown = sorted(set(only or []) - {f.name for f in stack.functions})
        if unknown:  # (a typo beside a right name: the rest were deployed, and it silently not)
            known = ", ".join(f.name for f in stack.functions) or "none"
            raise GpufaasError(f"--filter {', '.join(unknown)}: no such function in {file} (it has: {known})")
        if not selected:
            raise GpufaasError(f"no function in {file} matches --filter {', '.join(only or [])}")
        for function in selected:
            if not (function.handler / "handler.py").is_file():
                raise GpufaasError(f"{file}: functions.{function.name}.handler: {function.handler} has no handler.py")
        scanned = uploads.scan([(f.name, f.handler) for f in selected], DigestCache(_digest_cache_path()))
        for package in scanned:  # said: a weights file linked in would be missing when the function loads
            if package.links:
                err_console.print(
                    f"[yellow]warning[/]: {package.name}: left out symbolic link(s) {escape(', '.join(package.links))}"
                    " (a package holds no links; copy the files in to send them)"
                )
        try:
            with _transfer_progress("uploading") as progress:
                report = uploads.upload(client, scanned, progress=progress)
        except KeyboardInterrupt:
            err_console.print("interrupted: what was sent stays on the gateway; deploy again to send the rest")
            raise typer.Exit(code=130) from None
        for function, package in zip(selected, scanned, strict=True):
            registered = report.packages[package.manifest.digest]
            if registered.get("warning"):  # e.g. no second gateway holds it: it is not yet durable
                err_console.print(f"[yellow]warning[/]: {function.name}: {escape(str(registered['warning']))}")
            spec = function.spec(str(registered["digest"]))
            response = client.request("POST", "/system/functions", json=spec)
            if response.status_code == 409:
                response = client.request("PUT", "/system/functions", json=spec)
            answer = client.ok(response)
            if not isinstance(answer, dict) or "model" not in answer:
                raise client.not_a_gateway(response, "a deployed function")
            layer = registered.get("requirements") or []
            extra = escape(f", requirements: {', '.join(layer)}") if layer else ""  # pip's extras: [torch]
            console.print(
                f"deployed [bold]{function.name}[/] (model {escape(str(answer['model']))}, "
                f"{decimal(package.manifest.unpacked_bytes)} in {len(package.manifest.files)} file(s){extra})"
            )
        why = "takes plain HTTP only" if client.url.startswith("https:") else "is not reachable from here"
        how = f" (through its API: its blob server {why})" if report.via_api else ""
        console.print(
            f"sent {decimal(report.bytes_sent)} in {report.blobs_sent} blob(s); the gateway had the rest{how}"
        )


def _digest_cache_path() -> Path:
    """Where `deploy` remembers the digests of files it hashed (XDG cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpufaas" / "digests.json"


@contextmanager
def _transfer_progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar of bytes on stderr when it is a terminal (nothing otherwise)."""
    if not err_console.is_terminal:
        yield lambda sent, total: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(
        TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=err_console
    ) as progress:
        task = progress.add_task(what, total=None)

        def update(sent: int, total: int) -> None:
            progress.update(task, completed=sent, total=total)

        yield update


def _function_name(name: str) -> str:
    """A function's name as the gateway's routes take it: anything else (`..`, `/`) could steer
    the request, with the admin's credential, to another route."""
    from gpufaas.functions import NAME_PATTERN

    if not NAME_PATTERN.fullmatch(name):  # (match: its $ takes a name ending in a newline)
        raise typer.BadParameter(
            f"{name!r} is not a function name: lower-case letters, digits and '-' (at most 63)", param_hint="NAME"
        )
    return name


@app.command()
def invoke(
    name: Annotated[str, typer.Argument(help="The function to call.", callback=_function_name)],
    data: Annotated[
        str | None, typer.Option("--data", "-d", help="The request body (else --file, else stdin).")
    ] = None,
    file: Annotated[Path | None, typer.Option("--file", help="Read the request body from a file.")] = None,
    content_type: Annotated[
        str | None, typer.Option(help="Content type (default: JSON if the body parses as JSON).")
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Also print the X-* headers.")] = False,
    gateway: GatewayOpt = None,
) -> None:
    """Call a function; the result goes to stdout."""
    with user_errors():
        if data is not None:
            body = data.encode("utf-8", "surrogateescape")  # an argument not UTF-8: its bytes, as given
        elif file is not None:
            try:
                body = file.read_bytes()
            except OSError as exc:
                raise GpufaasError(f"cannot read {file}: {exc}") from None
        elif not sys.stdin.isatty():
            body = sys.stdin.buffer.read()
        else:
            body = b""
        if content_type is None:
            try:
                json.loads(body or b"null")
                content_type = "application/json"
            except (ValueError, UnicodeDecodeError):
                content_type = "application/octet-stream"
        from gpufaas.functions import MAX_TIMEOUT_S

        # As long as a call may run (its function's timeout_s, at most MAX_TIMEOUT_S), and the
        # gateway's answer after: a CLI that gave up earlier lost a result still computed.
        client = GatewayClient(gateway_url(gateway), timeout_s=MAX_TIMEOUT_S + INVOKE_GRACE_S)
        response = client.request("POST", f"/function/{name}", content=body, headers={"content-type": content_type})
        if verbose:
            for header, value in response.headers.items():
                if header.lower().startswith("x-"):
                    err_console.print(f"{header}: {value}", markup=False, highlight=False)
        if response.status_code != 200:
            client.ok(response)
        sys.stdout.buffer.write(response.content)
        if not response.content.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()


# What `ls` shows of each function (what the gateway's GET /system/functions has).
LISTED = {
    "name": is_text,
    "memory_mb": is_count,
    "batch_size": is_count,
    "timeout_s": is_number,
    "gpu": is_text,
    "invocationCount": is_count,
    "replicas": is_count,
}


@app.command("ls")
def list_functions(gateway: GatewayOpt = None) -> None:
    """List the deployed functions."""
    with user_errors():
        client = GatewayClient(gateway_url(gateway))
        functions = client.rows(client.request("GET", "/system/functions"), "a list of functions", LISTED)
    table = Table(title_justify="left")
    for column in ("name", "memory (MB)", "batch", "timeout (s)", "GPU", "invocations", "replicas"):
        table.add_column(column, justify="left" if column in ("name", "GPU") else "right")
    for f in functions:
        table.add_row(
            escape(f["name"]),  # the gateway's words, not markup
            str(f["memory_mb"]),
            str(f["batch_size"]),
            f"{f['timeout_s']:g}",
            escape(f["gpu"]),
            str(f["invocationCount"]),
            str(f["replicas"]),
        )
    table_console().print(table)


@app.command()
def describe(name: Annotated[str, typer.Argument(callback=_function_name)], gateway: GatewayOpt = None) -> None:
    """Show one function: its spec, where it is cached, how often it ran."""
    with user_errors():
        client = GatewayClient(gateway_url(gateway))
        response = client.request("GET", f"/system/function/{name}")
        function = client.ok(response)
        if not isinstance(function, dict) or function.get("name") != name:
            raise client.not_a_gateway(response, f"function {name!r}")
    for key, value in function.items():  # the user's labels and environment: text, never markup ("[/INST]")
        # A value as the gateway (and a stack file) writes it: false, null, ["node0/gpu0"], not
        # Python's False, None, ['node0/gpu0'].
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        console.print(f"{key + ':':18} {shown}", markup=False, highlight=False)


@app.command()
def rm(name: Annotated[str, typer.Argument(callback=_function_name)], gateway: GatewayOpt = None) -> None:
    """Remove a deployed function."""
    with user_errors():
        client = GatewayClient(gateway_url(gateway))
        response = client.request("DELETE", "/system/functions", json={"functionName": name})
        answer = client.ok(response)
        if not isinstance(answer, dict) or answer.get("deleted") is not True:  # never "removed" unless it says so
            raise client.not_a_gateway(response, f"function {name!r} deleted")
    console.print(f"removed {name}")


def _templates() -> dict[str, Path]:
    try:
        from importlib import resources

        root = Path(str(resources.files("function_templates")))
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[2] / "function_templates"
    return {p.name: p for p in root.iterdir() if p.is_dir() and (p / "handler.py").exists()} if root.is_dir() else {}


# Modules a template's make_weights.py imports that come with an extra of gpufaas (the rest with gpufaas itself).
_EXTRA_OF_MODULE = {"torch": "worker", "numpy": "worker", "PIL": "worker"}


def _weights_failure(template: str, stderr: str) -> str:
    """One line for a template's make_weights.py that failed: what to install when a module is
    missing (the usual cause outside a dev install), else the script's last line of error."""
    import re

    missing = re.findall(r"(?:ModuleNotFoundError|ImportError): No module named '([\w.]+)'", stderr)
    if missing:
        module = missing[-1].split(".")[0]
        extra = _EXTRA_OF_MODULE.get(module)
        install = f"pip install 'gpufaas[{extra}]'" if extra else f"pip install {module}"
        return (
            f"the {template} template writes its weights with {module}, which this Python ({sys.executable}) "
            f"lacks: {install}, then run `gpufaas new` again"
        )
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "no message"
    return f"the {template} template's make_weights.py failed: {last}"


def _template_meta(path: Path) -> dict[str, Any]:
    import yaml

    try:
        meta = yaml.safe_load((path / "template.yml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return meta if isinstance(meta, dict) else {}
