"""The dashboard: a static page and its script (gateway/ui), which poll GET /system/overview."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from gateway.state import ApiError

router = APIRouter()

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page runs on the origin where the browser holds the admin's Basic credentials: it may load
# only its own script and style (no inline ones, nothing from elsewhere), talk only to this gateway,
# and not be framed by another site (clickjacking); no file of it is read as another type (nosniff).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
}


@router.get("/ui", include_in_schema=False)
async def page() -> FileResponse:
    """The dashboard (admin credentials: the browser asks for them once)."""
    return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=HEADERS)


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in FILES:
        raise ApiError(404, f"/ui/{name} is not part of the dashboard; open /ui")
    return FileResponse(UI_DIR / name, media_type=FILES[name], headers=HEADERS)


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse("/ui")
