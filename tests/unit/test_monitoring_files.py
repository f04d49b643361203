"""deploy/monitoring agrees with the daemons: every series the Grafana dashboard queries is one a
daemon really exports (names listed from the real registries), with the labels its queries group,
match and name in legends by, its panels are well formed, and
the Prometheus scrape config reaches each daemon with the credential that daemon asks for."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from gateway.stats import FunctionStats
from gpu_manager.metrics import NodeMetrics
from gpu_manager.pool import WorkerPool
from gpufaas.credentials import ADMIN_PASSWORD_FILE, METRICS_TOKEN_FILE
from scheduler.metrics import SchedulerMetrics
from tests.builders import make_scheduler

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "gpufaas-dashboard.json"
PROMETHEUS = MONITORING / "prometheus.yml"
CREDENTIALS_DIR = "/run/gpufaas"
# Series Prometheus makes itself for every target (not any daemon's).
PROMETHEUS_SERIES = {"up"}
# Labels Prometheus gives every series it scrapes (the target's).
TARGET_LABELS = {"job", "instance"}
# What a PromQL expression names that is not a series: functions (followed by "("), aggregation
# and matching keywords, and the label lists of by/without/on/ignoring/group_*.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_MATCHER_LABEL = re.compile(r'([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*"')
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")


def labels_of(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Series name -> the label names it carries (a histogram's buckets `le` too), whether or not
    it has samples yet: as declared (a metric's or a collector's family's label names), or seen."""
    declared = {
        name: set(getattr(collector, "_labelnames", ()))
        for collector, names in registry._collector_to_names.items()
        for name in names
    }
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    found: dict[str, set[str]] = {}
    for family in registry.collect():
        names = set(getattr(family, "_labelnames", ())) | declared.get(family.name, set())
        names |= {label for sample in family.samples for label in sample.labels} - {"le"}
        for suffix in suffixes[family.type]:
            found[family.name + suffix] = names | ({"le"} if suffix == "_bucket" else set())
    return found


@pytest.fixture(scope="module")
def daemon_labels() -> dict[str, dict[str, set[str]]]:
    """Each daemon's series, with the label names of each."""

    async def no_package(digest: str) -> tuple[Path, float]:
        raise LookupError(digest)

    async def node_registry() -> CollectorRegistry:  # a pool needs a running loop; it starts nothing here
        pool = WorkerPool("emulated", gpus={"gpu0": 0}, fetch_package=no_package)
        return NodeMetrics(pool, node="n0").registry

    return {
        "gateway": labels_of(GatewayMetrics(FunctionStats(), lambda: 0).registry),
        "scheduler": labels_of(SchedulerMetrics(make_scheduler("lalb-o3")).registry),
        "gpu-manager": labels_of(asyncio.run(node_registry())),
    }


@pytest.fixture(scope="module")
def daemon_series(daemon_labels: dict[str, dict[str, set[str]]]) -> dict[str, set[str]]:
    return {daemon: set(series) for daemon, series in daemon_labels.items()}


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression selects."""
    stripped = _RANGE.sub("", _MATCHERS.sub("", _LABEL_LIST.sub("", re.sub(r'"[^"]*"', "", expr))))
    return {
        name
        for name, call in _IDENTIFIER.findall(stripped)
        if not call and name not in _KEYWORDS and not re.fullmatch(r"\d\w*", name)
    }


def test_the_promql_reader_finds_series_and_nothing_else() -> None:
    expr = (
        'sum by (le, model) (rate(a_total{cache="hit", x=~"y|z"}[$__rate_interval])) '
        "/ on (gpu) group_left (model) histogram_quantile(0.95, b_bucket[5m]) - max(c) offset 1h"
    )
    assert series_in(expr) == {"a_total", "b_bucket", "c"}


def labels_in(expr: str) -> tuple[set[str], set[str]]:
    """The label names a PromQL expression uses (grouping, matching, matchers), and those it
    keeps by its `by` lists (empty: none)."""

    def names(lists: list[str]) -> set[str]:
        return {name.strip() for group in lists for name in group.split(",") if name.strip()}

    used = names(_LABEL_LISTS.findall(expr))
    for matchers in _MATCHERS.findall(expr):
        used |= set(_MATCHER_LABEL.findall(matchers))
    return used, names(_BY.findall(expr))


def test_the_promql_reader_finds_labels() -> None:
    expr = 'sum by (le, model) (rate(a_total{cache="hit", x=~"y|z"}[5m])) / on (gpu) group_left (model) max(c)'
    assert labels_in(expr) == ({"le", "model", "cache", "x", "gpu"}, {"le", "model"})


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside
    return found


def test_the_dashboard_queries_only_series_the_daemons_export(daemon_series: dict[str, set[str]]) -> None:
    every = set().union(*daemon_series.values()) | PROMETHEUS_SERIES
    queried: set[str] = set()
    for panel in panels(load_dashboard()):
        for target in panel.get("targets", []):
            names = series_in(target["expr"])
            assert names, f"panel {panel['title']!r}: {target['expr']!r} selects no series"
            assert names <= every, f"panel {panel['title']!r} queries series no daemon exports: {names - every}"
            queried |= names
    # And the other way: each daemon has something on the dashboard.
    for daemon, names in daemon_series.items():
        assert names & queried, f"nothing of the {daemon}'s metrics is on the dashboard"


def test_the_dashboard_groups_and_filters_by_labels_the_series_carry(
    daemon_labels: dict[str, dict[str, set[str]]],
) -> None:
    """A label a query groups by, matches on or names in its legend is one its series carry (or
    the target's): a renamed label leaves a panel empty, or one line where there were several."""
    carried: dict[str, set[str]] = {name: set() for name in PROMETHEUS_SERIES}
    for series in daemon_labels.values():
        for name, labels in series.items():
            carried.setdefault(name, set()).update(labels)
    for panel in panels(load_dashboard()):
        for target in panel.get("targets", []):
            expr, where = target["expr"], f"panel {panel['title']!r}: {target['expr']!r}"
            known = TARGET_LABELS.union(*(carried.get(name, set()) for name in series_in(expr)))
            used, kept = labels_in(expr)
            assert used <= known, f"{where} uses labels its series lack: {sorted(used - known)}"
            legend = set(_LEGEND_LABEL.findall(target.get("legendFormat", "")))
            assert legend <= known, f"{where}: the legend names labels its series lack: {sorted(legend - known)}"
            if kept:  # aggregated: only what `by` keeps is left for the legend
                assert legend <= kept, f"{where}: the legend names labels the `by` drops: {sorted(legend - kept)}"


def test_the_dashboard_is_a_grafana_dashboard_with_unique_panel_ids_on_a_prometheus_datasource() -> None:
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {[i for i, n in Counter(ids).items() if n > 1]}"
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": f"${{{variable['name']}}}"}, panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert panel["targets"] and len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_prometheus_scrapes_every_daemon_with_the_credential_it_asks_for(daemon_series: dict[str, set[str]]) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(daemon_series)  # the dashboard's `job` labels are these names
    credential = {
        "gateway": ADMIN_PASSWORD_FILE,  # gateway/auth.py: /metrics is an admin route
        "scheduler": METRICS_TOKEN_FILE,  # gpufaas.metrics.MetricsServer
        "gpu-manager": METRICS_TOKEN_FILE,
    }
    for name, job in jobs.items():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert job["authorization"].get("type", "Bearer") == "Bearer"
        assert job["authorization"]["credentials_file"] == f"{CREDENTIALS_DIR}/{credential[name]}"
        targets = [t for group in job["static_configs"] for t in group["targets"]]
        assert targets and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets), targets
    gpu_managers = {t.split(":")[0] for g in jobs["gpu-manager"]["static_configs"] for t in g["targets"]}
    assert gpu_managers == {"gpu-manager-0", "gpu-manager-1"}  # docker-compose.yml's services
    for panel in panels(load_dashboard()):
        for target in panel.get("targets", []):
            for job in re.findall(r'job\s*=~?\s*"([^"]*)"', target["expr"]):
                assert set(job.split("|")) <= set(jobs), f"panel {panel['title']!r} names a job {job!r}"
