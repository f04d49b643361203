// The gpufaas dashboard's script: polls GET /system/overview (same origin, the browser's
// credentials) and redraws the page from it. Everything is written with textContent.
"use strict";

const REFRESH_MS = 2000;
const TIMEOUT_MS = 10000;  // a request that hangs must not stop the polling

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function fill(tbody, rows, columns, emptyText) {
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", { class: "empty" }, el("td", { colspan: columns }, emptyText))]));
}

const short = (model) => model.split("@")[0];
const ms = (value) => (value === null || value === undefined ? "-" : value.toFixed(1));
const percent = (ratio) => (ratio === null || ratio === undefined ? "-" : `${(ratio * 100).toFixed(1)}%`);

function ago(seconds) {
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function chips(models, kind) {
  return el("div", { class: "chips" }, ...models.map((m) => el("span", { class: `chip ${kind}`, title: m }, short(m))));
}

function gpuCard(gpu) {
  const used = gpu.memory_used_mb, capacity = gpu.memory_capacity_mb;
  const share = capacity > 0 ? Math.min(100, (100 * used) / capacity) : 0;
  const filled = el("span");
  filled.style.width = `${share.toFixed(1)}%`;  // (CSSOM: the page's CSP refuses style attributes)
  const bar = el("div", { class: "bar", title: `${used} of ${capacity} MB planned` }, filled);
  return el(
    "article",
    { class: "gpu", "data-gpu": gpu.gpu },
    el("h3", {}, el("span", {}, gpu.gpu), el("span", { class: `status-${gpu.status}` }, gpu.status)),
    el("div", { class: "meta" }, `${gpu.gpu_type} · ${gpu.slots} slot(s) · local queue ${gpu.local_queue}`),
    bar,
    el("div", { class: "meta memory" }, `${used} / ${capacity} MB`),
    el("div", { class: "meta" }, `running (${gpu.running.length})`),
    chips(gpu.running, "running"),
    el("div", { class: "meta" }, "LRU list, most recent first"),
    chips(gpu.lru, "cached"),
    ...(gpu.host_tier.length ? [el("div", { class: "meta" }, "host tier"), chips(gpu.host_tier, "host")] : []),
  );
}

function render(overview) {
  const functions = overview.functions;
  const calls = functions.reduce((sum, f) => sum + f.calls, 0);
  const hits = functions.reduce((sum, f) => sum + f.hits, 0);
  const answered = functions.reduce((sum, f) => sum + f.hits + f.misses, 0);
  document.getElementById("policy").textContent = overview.policy;
  document.getElementById("gpu-count").textContent = overview.gpus.length;
  document.getElementById("call-count").textContent = calls;
  document.getElementById("hit-ratio").textContent = answered ? percent(hits / answered) : "-";
  document.getElementById("queue-length").textContent = overview.queue.length;
  document.getElementById("updated").textContent = new Date(overview.time_unix_s * 1000).toLocaleTimeString();

  const gpus = document.getElementById("gpus");
  gpus.replaceChildren(...(overview.gpus.length ? overview.gpus.map(gpuCard) : [el("p", { class: "empty" }, "no GPU has registered yet")]));

  fill(
    document.querySelector("#functions tbody"),
    functions.map((f) =>
      el(
        "tr",
        { "data-function": f.name, "data-calls": f.calls },
        el("td", { title: f.model }, f.name),
        el("td", {}, f.replicas),
        el("td", { class: "calls" }, f.calls),
        el("td", {}, f.hits),
        el("td", {}, f.misses),
        el("td", {}, percent(f.hit_ratio)),
        el("td", {}, ms(f.latency_ms && f.latency_ms.p50)),
        el("td", {}, ms(f.latency_ms && f.latency_ms.p95)),
        el("td", {}, ms(f.latency_ms && f.latency_ms.p99)),
        el("td", {}, f.errors),
      ),
    ),
    10,
    "no function is deployed",
  );

  document.getElementById("queue-summary").textContent = `(${overview.queue.length} / ${overview.queue.capacity})`;
  fill(
    document.querySelector("#queue tbody"),
    overview.queue.calls.map((c) => el("tr", {}, el("td", { title: c.model }, c.function), el("td", {}, `${c.waited_s.toFixed(2)} s`))),
    2,
    "empty",
  );
  fill(
    document.querySelector("#evictions tbody"),
    overview.evictions.map((e) =>
      el("tr", {}, el("td", {}, ago(overview.time_unix_s - e.time_unix_s)), el("td", {}, e.gpu), el("td", { title: e.model }, short(e.model)), el("td", {}, e.reason)),
    ),
    4,
    "none yet",
  );
}

async function refresh() {
  const problem = document.getElementById("problem");
  try {
    const response = await fetch("/system/overview", {
      headers: { accept: "application/json" },
      cache: "no-store",
      signal: AbortSignal.timeout(TIMEOUT_MS),
    });
    const json = (response.headers.get("content-type") || "").startsWith("application/json");
    const body = json ? await response.json() : {};
    if (!response.ok) throw new Error(body.error || `HTTP ${response.status} ${response.statusText}`);
    if (!json) throw new Error("the gateway did not answer with JSON");
    render(body);
    problem.hidden = true;
  } catch (error) {
    problem.textContent = `cannot read the cluster: ${error.message}`;
    problem.hidden = false;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
