"""The gateway's settings, declared once: `python -m gateway`'s flags and environment
(GPUFAAS_GATEWAY_*), and what the local cluster passes it."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.artifacts import MAX_BATCH_BYTES
from gateway.http import HEAD_TIMEOUT_S, KEEP_ALIVE_TIMEOUT_S, MAX_HEAD_BYTES, HttpLimits
from gpufaas.packages import DEFAULT_MAX_UNPACKED_MB
from gpufaas.settings import DaemonSettings, host_and_port

PROG = "python -m gateway"
DESCRIPTION = "gpufaas HTTP gateway"


class GatewaySettings(DaemonSettings):
    """Everything `python -m gateway` takes."""

    model_config = SettingsConfigDict(env_prefix="GPUFAAS_GATEWAY_")

    host: str = Field(default="127.0.0.1", description="address to bind")
    port: int = Field(default=8080, ge=0, le=65535, description="port to bind")
    state_dir: Path = Field(description="where uploaded packages are kept")
    public_url: str | None = Field(
        default=None, description="URL other hosts reach this gateway at (default: http://HOST:PORT)"
    )
    scheduler: str | None = Field(default=None, description="scheduler address host:port (default: look it up in etcd)")
    blob_listen: str | None = Field(
        default=None,
        description="where the blob server listens: uploads from `gpufaas deploy`, fetches by nodes "
        "(default: HOST, any port)",
    )
    blob_advertise: str | None = Field(
        default=None,
        description="the blob server's URL for nodes and the CLI "
        "(default: http://the --public-url host:the bound port)",
    )
    max_payload_mb: float = Field(
        default=16.0, gt=0, allow_inf_nan=False, description="invocation body limit (413 above)"
    )
    max_unpacked_mb: int = Field(
        default=DEFAULT_MAX_UNPACKED_MB, gt=0, description="largest size a package may unpack to (413 at upload above)"
    )
    admin_password_file: Path | None = Field(
        default=None,
        description="the password of user `admin`, for /system/* and /metrics (mode 0600; required unless --insecure)",
    )
    invoke_token_file: Path | None = Field(
        default=None,
        description="a bearer token that may call any function "
        "(mode 0600; default: only admin may call non-public ones)",
    )
    max_header_kb: int = Field(
        default=MAX_HEAD_BYTES // 1024, description="largest request line and headers, in KiB (431 above)"
    )
    header_timeout_s: float = Field(
        default=HEAD_TIMEOUT_S,
        description="a request's headers must arrive within this after its first byte (408 and closed past it)",
    )
    keep_alive_timeout_s: float = Field(
        default=KEEP_ALIVE_TIMEOUT_S, description="a connection with no request under way is closed after this"
    )

    with_scheduler: bool = Field(
        default=False,
        description="run a scheduler in this process too (its flags, `python -m scheduler`'s, after `-- scheduler`; "
        "it takes this gateway's etcd, credentials and TLS flags unless they say otherwise): while it leads, this "
        "gateway reaches it in memory, not over a socket; other gateways and the nodes reach it as any scheduler",
    )
    with_node: bool = Field(
        default=False,
        description="run a node (GPU manager) in this process too (its flags, `python -m gpu_manager`'s, after "
        "`-- node`; it takes this gateway's etcd, credentials and TLS flags unless they say otherwise): this "
        "gateway and a scheduler in this process reach it in memory; the rest of the cluster as any node",
    )

    public_cert_file: Path | None = Field(
        default=None,
        description="serve the public port over HTTPS with this certificate chain (PEM; one a client trusts, "
        "not the cluster CA's) and --public-key-file (default: plain HTTP)",
    )
    public_key_file: Path | None = Field(
        default=None, description="the private key of --public-cert-file (PEM, mode 0600)"
    )

    @field_validator("scheduler", "blob_listen")
    @classmethod
    def _host_and_port(cls, address: str | None) -> str | None:
        return host_and_port(address)

    @model_validator(mode="after")
    def _limits_valid(self) -> GatewaySettings:
        self.http_limits  # noqa: B018 (its ValueError says what is wrong)
        if (self.public_cert_file is None) != (self.public_key_file is None):
            raise ValueError("--public-cert-file and --public-key-file go together: pass both or neither")
        if self.port == 0 and self.public_url is None:
            # The default public URL would name port 0: registered in etcd for the CLI to dial, and
            # the gateway's blob holder name, the same for every such gateway of the host.
            raise ValueError("--port 0 (any free port) needs --public-url: the URL that reaches the port bound")
        return self

    @property
    def http_limits(self) -> HttpLimits:
        largest_body_bytes = max(
            self.max_unpacked_mb * 1024 * 1024, int(self.max_payload_mb * 1024 * 1024), MAX_BATCH_BYTES
        )
        return HttpLimits(
            self.max_header_kb * 1024,
            self.header_timeout_s,
            self.keep_alive_timeout_s,
            largest_body_bytes=largest_body_bytes,
        )
