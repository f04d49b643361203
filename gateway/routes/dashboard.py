"""The dashboard: a static page and its script (gateway/ui), which poll GET /system/overview."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from gateway.state import ApiError

router = APIRouter()

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


@router.get("/ui", include_in_schema=False)
async def page() -> FileResponse:
    """The dashboard (admin credentials: the browser asks for them once)."""
    return FileResponse(UI_DIR / "index.html", media_type="text/html", headers={"cache-control": "no-cache"})


@router.get("/ui/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in FILES:
        raise ApiError(404, f"/ui/{name} is not part of the dashboard; open /ui")
    return FileResponse(UI_DIR / name, media_type=FILES[name], headers={"cache-control": "no-cache"})


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse("/ui")
