// tuneq dashboard: plain JavaScript, no build step, no CDN (the service may have no internet).
//
// Two views, chosen by the URL hash: "#/" lists jobs, "#/jobs/<id>" shows one job.
// Every call goes to the same /jobs API any client uses. When auth is on, a 401 shows a form
// for an API key, which is kept in localStorage and sent as "Authorization: Bearer <key>".
//
// Live charts read /jobs/<id>/events/stream (Server-Sent Events) with fetch() and a
// ReadableStream rather than EventSource, because EventSource cannot send an Authorization
// header. The stream replays the job's history from the cursor, so one reader fills the charts
// with past steps and then follows new ones; it reconnects from the last event id if cut.
"use strict";

const KEY_STORAGE = "tuneq.apiKey";
const REFRESH_MS = 2000; // job list, job row, checkpoints and log tail are polled at this pace
const LOG_TAIL_LINES = 100;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
// Whom the Pause button pauses; a paused job's button resumes it instead.
const PAUSABLE = new Set(["queued", "running"]);

const $ = (selector) => document.querySelector(selector);

class Unauthorized extends Error {}

// ---- API access -------------------------------------------------------------------------

function authHeaders() {
  const key = localStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { Accept: "application/json", ...authHeaders(), ...(options.headers || {}) },
  });
  if (response.status === 401) {
    showKeyForm();
    throw new Unauthorized(path);
  }
  if (!response.ok) {
    let detail = response.statusText;
    try {
      detail = JSON.stringify((await response.json()).detail);
    } catch (_) {
      // not JSON: keep the status text
    }
    throw new Error(`${response.status} ${detail}`);
  }
  return response.json();
}

function showKeyForm() {
  $("#key-form").hidden = false;
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
  $("#key-form").hidden = true;
  route(); // retry the current view with the new key
});

function notice(text) {
  $("#notice").textContent = text || "";
}

// Errors from a poll are shown, not thrown: the next poll may well succeed.
function report(error) {
  if (error instanceof Unauthorized || (error && error.name === "AbortError")) return;
  notice(String(error && error.message ? error.message : error));
}

// ---- Small formatting helpers -------------------------------------------------------------

function age(iso) {
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 60) return `${Math.floor(seconds)}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)}h`;
  return `${Math.floor(seconds / 86400)}d`;
}

function progress(job) {
  if (job.total_steps) return `${job.step}/${job.total_steps} (${Math.floor((100 * job.step) / job.total_steps)}%)`;
  return `step ${job.step}`;
}

// A job's ranks: num_gpus, or "nodes×GPUs per node" for a multi-node job.
function gpus(job) {
  return job.num_nodes > 1 ? `${job.num_nodes}×${job.num_gpus}` : String(job.num_gpus);
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function setStatus(element, status) {
  element.textContent = status;
  element.className = `status status-${status}`;
}

// ---- Charts: a polyline in an SVG, no library ----------------------------------------------

const SVG_NS = "http://www.w3.org/2000/svg";
const MAX_MARKERS = 200; // beyond this, dots would only hide the line
const CHART_POINTS = 500; // a job's history is charted from at most this many steps (GET .../metrics?points=)

// One series, or several over one axis (labels: one each, named in a legend).
class LineChart {
  constructor(svg, labels = [""]) {
    this.svg = svg;
    this.labels = labels;
    // Per series, step -> value; a resumed attempt reports a step again and replaces it.
    this.series = labels.map(() => new Map());
    this.pending = false;
  }

  // The points of every series.
  get size() {
    return this.series.reduce((n, values) => n + values.size, 0);
  }

  add(step, value, series = 0) {
    if (typeof value !== "number" || !Number.isFinite(value)) return;
    this.series[series].set(step, value);
    // Redraw at most once per frame: a replayed history arrives as hundreds of events at once.
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => {
        this.pending = false;
        this.draw();
      });
    }
  }

  draw() {
    const width = 420;
    const height = 200;
    const pad = { left: 56, right: 8, top: 8, bottom: 20 };
    const lines = this.series.map((values) => [...values.entries()].sort((a, b) => a[0] - b[0]));
    const points = lines.flat();
    this.svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    this.svg.replaceChildren();
    // The count of drawn points, for people reading the DOM and for the browser test.
    this.svg.dataset.points = String(points.length);
    if (!points.length) return;

    const steps = points.map((p) => p[0]);
    const ys = points.map((p) => p[1]);
    const [x0, x1] = [Math.min(...steps), Math.max(...steps)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (y0 === y1) {
      // A flat series (a constant learning rate) still needs a visible range.
      const delta = Math.abs(y0) * 0.1 || 1;
      y0 -= delta;
      y1 += delta;
    }
    const x = (s) => pad.left + ((s - x0) / (x1 - x0 || 1)) * (width - pad.left - pad.right);
    const y = (v) => height - pad.bottom - ((v - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);

    const el = (name, attributes, text) => {
      const node = document.createElementNS(SVG_NS, name);
      for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
      if (text !== undefined) node.textContent = text;
      this.svg.appendChild(node);
      return node;
    };
    el("line", { class: "axis", x1: pad.left, y1: height - pad.bottom, x2: width - pad.right, y2: height - pad.bottom });
    el("line", { class: "axis", x1: pad.left, y1: pad.top, x2: pad.left, y2: height - pad.bottom });
    el("text", { x: pad.left - 4, y: pad.top + 8, "text-anchor": "end" }, y1.toPrecision(3));
    el("text", { x: pad.left - 4, y: height - pad.bottom, "text-anchor": "end" }, y0.toPrecision(3));
    el("text", { x: pad.left, y: height - 6 }, `step ${x0}`);
    el("text", { x: width - pad.right, y: height - 6, "text-anchor": "end" }, `step ${x1}`);
    lines.forEach((line, i) => {
      if (!line.length) return;
      const series = `series-${i}`;
      el("polyline", { class: `line ${series}`, points: line.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(" ") });
      if (line.length <= MAX_MARKERS) {
        for (const [s, v] of line) el("circle", { class: `point ${series}`, cx: x(s).toFixed(1), cy: y(v).toFixed(1), r: 2 });
      }
      if (this.labels.length > 1) {
        el("text", { class: `legend ${series}`, x: width - pad.right, y: pad.top + 8 + 12 * i, "text-anchor": "end" }, this.labels[i]);
      }
    });
  }
}

// A measure of a step under either spelling: GET .../metrics answers a DPO job's under TRL's
// names (rewards/chosen), the event stream carries them as ingested (rewards_chosen).
function measure(step, name) {
  const value = step[name];
  return value === undefined ? step[name.replace("/", "_")] : value;
}

// ---- Server-Sent Events over fetch() ------------------------------------------------------

// Calls onEvent with each event's parsed JSON (an EventPublic: id, type, data, created_at)
// until the server ends the stream (after the job's terminal status) or signal aborts.
// Returns the last event id seen, so a caller can resume from it.
async function readEvents(jobId, after, signal, onEvent) {
  const response = await fetch(`/jobs/${jobId}/events/stream?after=${after}`, {
    headers: { Accept: "text/event-stream", ...authHeaders() },
    signal,
  });
  if (response.status === 401) {
    showKeyForm();
    throw new Unauthorized("events");
  }
  if (!response.ok || !response.body) throw new Error(`event stream: ${response.status}`);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let cursor = after;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return cursor;
    // sse-starlette ends lines with \r\n; a blank line ends each event.
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue; // a ": ping" comment keeps the connection open; nothing to do
      const event = JSON.parse(data);
      cursor = event.id;
      onEvent(event);
    }
  }
}

// ---- Views --------------------------------------------------------------------------------

let current = null; // the view now shown: { stop() } so navigating away ends its timers and stream

async function showJobs() {
  $("#jobs-view").hidden = false;
  const body = $("#jobs-table tbody");
  const refresh = async () => {
    const jobs = await api("/jobs?limit=100");
    notice("");
    body.replaceChildren(
      ...jobs.data.map((job) => {
        const row = document.createElement("tr");
        row.dataset.jobId = job.id;
        const link = document.createElement("a");
        link.href = `#/jobs/${job.id}`;
        link.textContent = job.name || job.id.slice(0, 8);
        const cells = [link, job.status, gpus(job), job.model, progress(job), age(job.created_at)];
        cells.forEach((content, i) => {
          const cell = document.createElement("td");
          cell.className = ["job", "status", "gpus", "model", "progress", "age"][i];
          if (content instanceof Node) cell.appendChild(content);
          else cell.textContent = content;
          if (i === 1) setStatus(cell, content);
          if (i === 2 && job.num_nodes > 1) cell.title = `${job.num_nodes} nodes × ${job.num_gpus} GPUs each`;
          if (i === 3) cell.title = job.model;
          row.appendChild(cell);
        });
        return row;
      }),
    );
  };
  const timer = setInterval(() => refresh().catch(report), REFRESH_MS);
  current = { stop: () => clearInterval(timer) };
  await refresh().catch(report);
}

// The nodes of a multi-node job's current attempt, one row each; the section is hidden
// while there are none (a one-node job, or a gang not placed yet).
function renderNodes(nodes) {
  $("#job-nodes").hidden = !nodes.length;
  $("#nodes-table tbody").replaceChildren(
    ...nodes.map((node) => {
      const row = document.createElement("tr");
      row.dataset.nodeRank = node.node_rank;
      const [first, last] = node.ranks;
      const cells = [node.node_rank, node.worker_id, node.address, `${first}-${last}`, node.state, node.error_message || ""];
      cells.forEach((content, i) => {
        const cell = document.createElement("td");
        cell.className = ["node", "worker", "address", "ranks", "state", "error"][i];
        cell.textContent = String(content);
        row.appendChild(cell);
      });
      return row;
    }),
  );
}

async function showJob(jobId) {
  $("#job-view").hidden = false;
  $("#job-title").textContent = `Job ${jobId}`;
  $("#checkpoints").replaceChildren();
  renderNodes([]); // not the previous job's nodes while this one loads
  $("#log-tail").textContent = "";
  const loss = new LineChart($("#loss-chart"));
  const lr = new LineChart($("#lr-chart"));
  // A DPO job's: shown once a step reports them.
  const rewards = new LineChart($("#rewards-chart"), ["chosen", "rejected", "margins"]);
  const accuracy = new LineChart($("#accuracy-chart"), ["train", "eval"]);
  [loss, lr, rewards, accuracy].forEach((chart) => chart.draw());
  $("#rewards-figure").hidden = true;
  $("#accuracy-figure").hidden = true;
  const addStep = (m) => {
    loss.add(m.step, m.loss);
    lr.add(m.step, m.learning_rate);
    ["rewards/chosen", "rewards/rejected", "rewards/margins"].forEach((name, i) => rewards.add(m.step, measure(m, name), i));
    accuracy.add(m.step, measure(m, "rewards/accuracies"), 0);
    accuracy.add(m.step, measure(m, "eval_rewards/accuracies"), 1);
    if (rewards.size) $("#rewards-figure").hidden = false;
    if (accuracy.size) $("#accuracy-figure").hidden = false;
  };
  const abort = new AbortController();
  let timer = null;
  let finished = false;

  const renderJob = (job) => {
    $("#job-title").textContent = `Job ${job.name || job.id}`;
    setStatus($("#job-status"), job.status);
    $("#job-progress").textContent = progress(job);
    $("#cancel-button").disabled = TERMINAL.has(job.status) || job.status === "cancelling";
    const paused = job.status === "paused";
    $("#pause-button").textContent = paused ? "Resume" : "Pause";
    $("#pause-button").dataset.action = paused ? "resume" : "pause";
    $("#pause-button").disabled = !paused && !PAUSABLE.has(job.status);
    $("#job-error").hidden = !job.error;
    $("#job-error").textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";
    renderNodes(job.nodes || []); // a server without multi-node jobs sends no nodes
    finished = TERMINAL.has(job.status);
  };

  const refresh = async () => {
    const [job, checkpoints, logs] = await Promise.all([
      api(`/jobs/${jobId}`),
      api(`/jobs/${jobId}/checkpoints`),
      api(`/jobs/${jobId}/logs?tail=${LOG_TAIL_LINES}`),
    ]);
    if (abort.signal.aborted) return;
    notice("");
    renderJob(job);
    $("#checkpoints").replaceChildren(
      ...checkpoints.data.map((c) => {
        const item = document.createElement("li");
        item.textContent = `step ${c.step} · ${c.kind} · ${bytes(c.bytes)} · ${c.uri}`;
        return item;
      }),
    );
    const log = $("#log-tail");
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = logs.lines.join("\n");
    if (atBottom) log.scrollTop = log.scrollHeight; // follow the tail unless the user scrolled up
    if (finished) clearInterval(timer); // nothing changes after the end: stop polling
  };

  // Step events feed the charts; the stream also says at once when the status changes.
  const onEvent = (event) => {
    if (event.type === "metric") {
      addStep(event.data);
    } else if (event.type === "status" || event.type === "checkpoint") {
      refresh().catch(report);
    }
  };

  // The history first, downsampled in SQL to at most CHART_POINTS rows however long the run;
  // then the live events from the cursor that page was read at, so nothing falls between.
  const follow = async () => {
    let cursor = 0;
    try {
      const history = await api(`/jobs/${jobId}/metrics?points=${CHART_POINTS}&limit=${CHART_POINTS}`);
      history.data.forEach(addStep);
      cursor = history.event_cursor;
    } catch (error) {
      if (error instanceof Unauthorized || abort.signal.aborted) return;
      report(error); // the stream from 0 fills the charts instead
    }
    while (!abort.signal.aborted) {
      try {
        cursor = await readEvents(jobId, cursor, abort.signal, onEvent);
        // The server ends the stream after the terminal status; otherwise it was cut: resume.
        if (finished) return;
      } catch (error) {
        if (error instanceof Unauthorized || abort.signal.aborted) return;
        report(error);
      }
      await new Promise((resolve) => setTimeout(resolve, 1000));
      if (finished) return;
    }
  };

  const changeJob = (button, action) => async () => {
    button.disabled = true;
    try {
      renderJob(await api(`/jobs/${jobId}/${action()}`, { method: "POST" }));
    } catch (error) {
      report(error);
    }
  };
  $("#cancel-button").onclick = changeJob($("#cancel-button"), () => "cancel");
  $("#pause-button").onclick = changeJob($("#pause-button"), () => $("#pause-button").dataset.action);

  timer = setInterval(() => refresh().catch(report), REFRESH_MS);
  current = {
    stop: () => {
      clearInterval(timer);
      abort.abort();
    },
  };
  await refresh().catch(report);
  follow();
}

function route() {
  if (current) current.stop();
  current = null;
  $("#jobs-view").hidden = true;
  $("#job-view").hidden = true;
  notice("");
  const match = location.hash.match(/^#\/jobs\/([0-9a-f-]+)$/i);
  if (match) showJob(match[1]);
  else showJobs();
}

window.addEventListener("hashchange", route);
route();
