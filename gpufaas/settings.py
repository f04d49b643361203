"""Daemon settings declared once: a typed model per daemon, from which its command line, its
environment variables and the launchers' argv are derived.

A daemon's settings are a pydantic-settings model (`DaemonSettings` and a subclass per daemon):
each field has a type, a default, a description (its `--help` line) and its constraints. From
the model come:

- the command line: `--field-name VALUE` for each field (`json_schema_extra={"flag": ...}`
  names another flag), `--x/--no-x` for a bool, and the knobs of an embedded dataclass (the
  scheduler's `PolicyConfig`) flattened, each from the dataclass's own `Annotated` field;
- the environment: `<env_prefix>FIELD_NAME` (`GPUFAAS_SCHEDULER_POLICY`), and for a knob of an
  embedded dataclass `<env_prefix>FIELD__KNOB`; a flag wins over the environment;
- the argv a launcher passes (`to_argv`: every value that differs from its default), so that the
  local cluster, `gpufaas up`, compose and k8s use the flags the daemon parses, checked by it.

A value the model refuses is a usage error naming the flag (`--prestage-nodes must be >= 0`).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, Self

from pydantic import AfterValidator, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as UnreadableEnvironment

from gpufaas.keys import DEFAULT_ROOT, Keys

LogLevel = Literal["debug", "info", "warning", "error"]


class SettingsError(ValueError):
    """Flags (or values) a daemon would refuse; the message says what is wrong, by flag."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line option of a settings model: `path` is the field's place in the model
    (`("policy_config", "max_num_skips")` for a knob of an embedded dataclass)."""

    path: tuple[str, ...]
    flag: str
    info: FieldInfo

    @property
    def dest(self) -> str:
        return ".".join(self.path)

    @property
    def default(self) -> Any:
        return self.info.get_default(call_default_factory=True)


def _extra(info: FieldInfo, key: str) -> str | None:
    extra = info.json_schema_extra
    value = extra.get(key) if isinstance(extra, dict) else None
    return value if isinstance(value, str) else None


def _scalar(annotation: Any) -> Any:
    """`int | None` -> int: the type a flag's value is read as."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = (arg for arg in typing.get_args(annotation) if arg is not type(None))
        return inner
    return annotation


def options_of(model: type[BaseSettings]) -> list[Option]:
    """Every option of `model`, in declaration order; an embedded dataclass's fields each become
    one, read from the dataclass's own declaration (`Annotated[T, Field(...)]` or a plain type)."""
    found: list[Option] = []
    for name, info in model.model_fields.items():
        embedded = info.annotation
        if isinstance(embedded, type) and dataclasses.is_dataclass(embedded):
            hints = typing.get_type_hints(embedded, include_extras=True)
            for knob in dataclasses.fields(embedded):
                knob_info = FieldInfo.from_annotated_attribute(hints[knob.name], knob.default)
                flag = _extra(knob_info, "flag") or "--" + knob.name.replace("_", "-")
                found.append(Option((name, knob.name), flag, knob_info))
        else:
            found.append(Option((name,), _extra(info, "flag") or "--" + name.replace("_", "-"), info))
    return found


class _Parser(argparse.ArgumentParser):
    """argparse that raises `SettingsError` instead of exiting when `raising` (a launcher checking
    flags it will pass on)."""

    raising = False

    def error(self, message: str) -> NoReturn:
        if self.raising:
            raise SettingsError(message)
        super().error(message)


def _add_option(parser: argparse.ArgumentParser, option: Option, *, partial: bool) -> None:
    info = option.info
    kind = _scalar(info.annotation)
    text = info.description or ""
    default = option.default
    if isinstance(default, bool):
        text += f" (default: {'on' if default else 'off'})"
    elif default is not None and info.default_factory is None and not info.is_required():
        text += f" (default {default})"
    kwargs: dict[str, Any] = {"dest": option.dest, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        if typing.get_origin(kind) is Literal:
            kwargs["choices"] = typing.get_args(kind)
        else:
            kwargs["metavar"] = _extra(info, "metavar") or option.path[-1].upper()
            kwargs["type"] = kind if kind in (int, float, Path) else str
        kwargs["required"] = info.is_required() and not partial
    parser.add_argument(option.flag, **kwargs)


def _message(error: ErrorDetails, flags: dict[tuple[str, ...], str]) -> str:
    """One refused value, said by flag: `--claim-s must be <= 30`."""
    loc = tuple(str(part) for part in error["loc"])
    flag = flags.get(loc, "/".join(loc))
    ctx = error.get("ctx", {})
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if error["type"] in bounds:
        (bound,) = ctx.values()
        return f"{flag} must be {bounds[error['type']]} {bound:g}"
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"no setting {'.'.join(loc)} (from a flag, or a GPUFAAS_ environment variable naming it)"
    text = error["msg"].removeprefix("Value error, ")
    return text if not loc or loc not in flags else f"{flag}: {text}"


def _host_port(endpoint: str) -> str:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdecimal() or int(port) > 65535:
        raise ValueError(f"expected host:port, such as 127.0.0.1:2379; got {endpoint!r}")
    return endpoint


def host_and_port(address: str | None) -> str | None:
    """A field validator: `address` if it is host:port with a port of 0-65535 (None passes), else
    a ValueError saying so; refused at parse time, not by the bind or dial a daemon makes later."""
    host, sep, port = (address or "").rpartition(":")
    if address is not None and not (sep and host and port.isdecimal() and int(port) <= 65535):
        raise ValueError(f"expected host:port with a port of 0-65535, such as 127.0.0.1:0; got {address!r}")
    return address


def is_loopback(host: str) -> bool:
    """Whether `host` (an address's, "[::1]" too) names this machine's loopback: reached
    directly, never through an http(s)_proxy the environment names (as Go's clients, etcdctl
    among them, do), since a proxy for a corporate network cannot reach it."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _key_root(root: str) -> str:
    Keys(root)  # its ValueError says what a key root must be; refused here, not when a daemon starts
    return root


class DaemonSettings(BaseSettings):
    """What every gpufaas daemon takes: its etcd, its credentials, its logging."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        validate_by_name=True,
        env_nested_delimiter="__",
        env_prefix="GPUFAAS_",
        env_ignore_empty=True,  # GPUFAAS_SECRET_FILE= means unset, as it always did
    )

    etcd: Annotated[str, AfterValidator(_host_port)] = Field(
        default="127.0.0.1:2379", description="etcd client endpoint host:port"
    )
    root: Annotated[str, AfterValidator(_key_root)] = Field(default=DEFAULT_ROOT, description="etcd key root")
    log_level: LogLevel = Field(
        default="info",
        description="the least severe log lines written (what a node's workers print, a function's output, is "
        "written at info whatever this is)",
    )
    secret_file: Path | None = Field(
        default=None,
        validation_alias="GPUFAAS_SECRET_FILE",
        description="the cluster secret every daemon shares, mode 0600 (or $GPUFAAS_SECRET_FILE; "
        "`gpufaas up` makes STATE/secrets/cluster-secret)",
    )
    etcd_password_file: Path | None = Field(
        default=None,
        validation_alias="GPUFAAS_ETCD_PASSWORD_FILE",
        description="etcd's root password, mode 0600 (or $GPUFAAS_ETCD_PASSWORD_FILE): the daemon "
        "authenticates to etcd as root, and turns etcd's authentication on if it is off. Without it "
        "etcd must be reachable by the daemons only (loopback, or a network of their own)",
    )
    insecure: bool = Field(
        default=False,
        description="no credentials and no TLS on any interface: development on a machine nobody else uses",
    )
    tls_dir: Path | None = Field(
        default=None,
        validation_alias="GPUFAAS_TLS_DIR",
        description="the cluster CA and the daemons' certificates (or $GPUFAAS_TLS_DIR): links to the other daemons "
        "are TLS, both ends checked (default: the secret file's directory's tls/, where `python -m "
        "gpufaas.credentials` makes them; without one, links are not encrypted and the daemon says so)",
    )
    tls: bool = Field(
        default=True,
        description="TLS on the links to the other daemons where the TLS files are there; --no-tls: plain links even "
        "so (a network that is private already, or measuring what TLS costs)",
    )
    etcd_tls: bool = Field(
        default=False,
        description="reach etcd over TLS, showing this daemon's certificate from the TLS directory (etcd started "
        "with the cluster's etcd certificate and --client-cert-auth)",
    )

    # --- the command line, derived ------------------------------------------------------------
    @classmethod
    def parser(
        cls, prog: str, description: str, *, partial: bool = False, raising: bool = False
    ) -> argparse.ArgumentParser:
        """The daemon's argparse parser, one option per field (`partial`: none required;
        `raising`: a usage error raises `SettingsError` instead of exiting)."""
        parser = _Parser(prog=prog, description=description)
        parser.raising = raising
        for option in options_of(cls):
            _add_option(parser, option, partial=partial)
        return parser

    @classmethod
    def from_namespace(cls, parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> Self:
        """The settings the parsed flags (over the environment) give; a refused value is
        `parser.error` naming its flag."""
        values: dict[str, Any] = {}
        for dest, value in vars(namespace).items():
            head, _, knob = dest.partition(".")
            if knob:
                values.setdefault(head, {})[knob] = value
            else:
                values[head] = value
        try:
            return cls(**values)
        except ValidationError as exc:
            parser.error(cls.refusal(exc))
        except UnreadableEnvironment as exc:  # a GPUFAAS_ variable of a structured setting: not JSON
            parser.error(f"{exc}: check the GPUFAAS_ environment variables")

    @classmethod
    def refusal(cls, exc: ValidationError) -> str:
        """What the model refused, by flag: `--claim-s must be <= 30; --prestage-nodes must be >= 0`."""
        flags = {option.path: option.flag for option in options_of(cls)}
        return "; ".join(_message(error, flags) for error in exc.errors())

    @classmethod
    def from_args(cls, argv: Sequence[str] | None, prog: str, description: str) -> Self:
        """`python -m DAEMON`'s settings from its flags (`argv`; None: sys.argv)."""
        parser = cls.parser(prog, description)
        return cls.from_namespace(parser, parser.parse_args(argv))

    def with_flags(self, flags: Sequence[str]) -> Self:
        """These settings with `flags` (as the daemon takes them) on top; `SettingsError` if the
        daemon would refuse them."""
        parser = self.parser(type(self).__name__, "", partial=True, raising=True)
        given = vars(parser.parse_args(list(flags)))
        kept = {
            option.dest: self.value(option)
            for option in options_of(type(self))
            if option.path[0] in self.model_fields_set and option.dest not in given
        }
        return self.from_namespace(parser, argparse.Namespace(**kept, **given))

    def value(self, option: Option) -> Any:
        value: Any = self
        for part in option.path:
            value = getattr(value, part)
        return value

    def to_argv(self) -> list[str]:
        """The flags that give the daemon these settings: each value that was set (given or read
        from the environment) or differs from its default; the daemon takes the rest from its own
        defaults. A knob of an embedded dataclass: where it differs from its default."""
        argv: list[str] = []
        for option in options_of(type(self)):
            value = self.value(option)
            was_set = len(option.path) == 1 and option.path[0] in self.model_fields_set
            if value == option.default and not (was_set and value is not None):
                continue
            if isinstance(value, bool):
                argv.append(option.flag if value else "--no-" + option.flag.removeprefix("--"))
            elif value is None:
                raise SettingsError(f"{option.flag}: no flag says None (its default is {option.default})")
            else:
                argv += [option.flag, str(value)]
        return argv


class MetricsSettings(DaemonSettings):
    """A daemon that serves Prometheus metrics (the scheduler, a node)."""

    metrics_listen: str | None = Field(
        default=None,
        json_schema_extra={"metavar": "HOST:PORT"},
        description="serve Prometheus metrics at http://HOST:PORT/metrics, asking for the cluster's metrics token "
        "(`python -m gpufaas.credentials --metrics-token SECRETS_DIR`) as a bearer token (default: none)",
    )

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_host_and_port(cls, address: str | None) -> str | None:
        return host_and_port(address)
