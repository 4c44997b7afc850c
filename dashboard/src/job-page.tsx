// One job: its state, live charts, events, files, configuration, log and controls.
// Mounted per job id (keyed by it), so moving to another job starts from nothing, and every
// poll and stream of the previous one is stopped by the effects' cleanups.

import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import { api, ApiError, type JobEvent, isQuiet, message, readEvents } from "./api";
import { Artifacts } from "./artifacts";
import { Chart, type SeriesSpec } from "./chart";
import { CopyId } from "./copy-id";
import { bytes, duration, elapsed, gpus, num, progressShare, progressText } from "./format";
import { LogView } from "./log-view";
import { UUID_PATTERN } from "./route";
import { addToTimeline, Timeline, TIMELINE_TYPES } from "./timeline";
import { type Artifact, type Job, type Metric, type MetricsPage, TERMINAL } from "./types";

const REFRESH_MS = 2000;
const CHART_POINTS = 1000; // a job's history is charted from at most this many steps (SQL downsamples)
const EVENT_PAGES = 20; // the timeline reads at most this many pages of 1000 past events
const PAUSABLE = new Set(["queued", "running"]);

// The event stream names DPO's measures as stored (rewards_chosen); GET .../metrics as TRL does.
const TRL_NAMES: Record<string, string> = {
  rewards_chosen: "rewards/chosen",
  rewards_rejected: "rewards/rejected",
  rewards_accuracies: "rewards/accuracies",
  rewards_margins: "rewards/margins",
  eval_rewards_accuracies: "eval_rewards/accuracies",
};

const CHARTS: { id: string; title: string; series: SeriesSpec[]; log?: boolean; optional?: boolean }[] = [
  { id: "loss-chart", title: "Loss", series: [{ key: "loss", label: "loss" }, { key: "eval_loss", label: "eval_loss" }], log: true },
  { id: "lr-chart", title: "Learning rate", series: [{ key: "learning_rate", label: "learning rate" }], log: true },
  { id: "speed-chart", title: "Tokens per second", series: [{ key: "tokens_per_second", label: "tokens/s" }] },
  { id: "grad-norm-chart", title: "Gradient norm", series: [{ key: "grad_norm", label: "grad norm" }], log: true },
  {
    id: "rewards-chart",
    title: "Rewards",
    series: [
      { key: "rewards/chosen", label: "chosen" },
      { key: "rewards/rejected", label: "rejected" },
      { key: "rewards/margins", label: "margins" },
    ],
    optional: true,
  },
  {
    id: "accuracy-chart",
    title: "Reward accuracy",
    series: [
      { key: "rewards/accuracies", label: "train" },
      { key: "eval_rewards/accuracies", label: "eval" },
    ],
    optional: true,
  },
];

function asMetric(data: Record<string, unknown>): Metric {
  const metric: Record<string, number | null> = {};
  for (const [name, value] of Object.entries(data)) metric[TRL_NAMES[name] ?? name] = typeof value === "number" ? value : null;
  return metric as Metric;
}

type Load = { state: "loading" } | { state: "found"; job: Job } | { state: "missing" } | { state: "error"; message: string };

/** The job, polled until it ends; "missing" (and no more polls) for an unknown id. */
function useJob(id: string, valid: boolean): [Load, (job: Job) => void, () => void] {
  const [load, setLoad] = useState<Load>(valid ? { state: "loading" } : { state: "missing" });
  const [tick, setTick] = useState(0);
  useEffect(() => {
    if (!valid) return;
    const abort = new AbortController();
    let timer = 0;
    const poll = async () => {
      try {
        const job = await api<Job>(`/jobs/${id}`, { signal: abort.signal });
        setLoad({ state: "found", job });
        if (!TERMINAL.has(job.status)) timer = window.setTimeout(poll, REFRESH_MS);
      } catch (e) {
        if (e instanceof ApiError && e.status === 404) setLoad({ state: "missing" }); // and stop polling
        else if (!isQuiet(e)) {
          setLoad((old) => (old.state === "found" ? old : { state: "error", message: message(e) }));
          timer = window.setTimeout(poll, REFRESH_MS);
        }
      }
    };
    void poll();
    return () => {
      clearTimeout(timer);
      abort.abort();
    };
  }, [id, valid, tick]);
  return [load, (job) => setLoad({ state: "found", job }), () => setTick((n) => n + 1)];
}

interface Live {
  metrics: Metric[];
  events: JobEvent[];
  truncated: boolean;
  artifacts: Artifact[];
}

/** The charts' steps, the timeline and the files: the history once, then the event stream. */
function useLive(id: string, active: boolean, onStatus: () => void): Live {
  const [metrics, setMetrics] = useState<Metric[]>([]);
  const [events, setEvents] = useState<JobEvent[]>([]);
  const [truncated, setTruncated] = useState(false);
  const [artifacts, setArtifacts] = useState<Artifact[]>([]);
  const onStatusRef = useRef(onStatus);
  onStatusRef.current = onStatus;

  useEffect(() => {
    if (!active) return;
    const abort = new AbortController();
    const signal = abort.signal;
    const steps = new Map<number, Metric>(); // a resumed attempt reports a step again: it replaces it
    let frame = 0;
    const addStep = (metric: Metric) => {
      steps.set(metric.step, metric);
      if (!frame) {
        // Redrawn at most once a frame: a replayed history arrives as hundreds of events at once.
        frame = requestAnimationFrame(() => {
          frame = 0;
          setMetrics([...steps.values()].sort((a, b) => a.step - b.step));
        });
      }
    };
    const loadArtifacts = () =>
      api<{ data: Artifact[] }>(`/jobs/${id}/artifacts`, { signal }).then((a) => setArtifacts(a.data), () => undefined);

    const onEvent = (event: JobEvent) => {
      if (event.type === "metric") addStep(asMetric(event.data));
      else if (TIMELINE_TYPES.has(event.type)) setEvents((old) => addToTimeline(old, event));
      if (event.type === "status") onStatusRef.current();
      if (event.type === "checkpoint" || event.type === "artifact" || event.type === "status") void loadArtifacts();
    };

    const run = async () => {
      const history = await api<MetricsPage>(`/jobs/${id}/metrics?points=${CHART_POINTS}&limit=${CHART_POINTS}`, { signal });
      history.data.forEach(addStep);
      const cursor = history.event_cursor;
      // The past events up to the metrics' cursor, then the stream from there: none twice, none lost.
      let timeline: JobEvent[] = [];
      let after = 0;
      for (let page = 0; page < EVENT_PAGES && after < cursor; page += 1) {
        const answer = await api<{ data: JobEvent[]; next_cursor: number | null }>(
          `/jobs/${id}/events?after=${after}&limit=1000`,
          { signal },
        );
        answer.data.filter((e) => e.id <= cursor).forEach((e) => (timeline = addToTimeline(timeline, e)));
        if (answer.next_cursor === null) break;
        after = answer.next_cursor;
        if (page === EVENT_PAGES - 1 && after < cursor) setTruncated(true);
      }
      setEvents(timeline);
      void loadArtifacts();
      let streamCursor = cursor;
      while (!signal.aborted) {
        streamCursor = await readEvents(id, streamCursor, signal, onEvent).catch((e) => {
          if (isQuiet(e) || (e instanceof ApiError && e.status === 404)) throw e;
          return streamCursor; // cut: resume from the last event seen
        });
        const job = await api<Job>(`/jobs/${id}`, { signal });
        if (TERMINAL.has(job.status)) return; // the server ends the stream after the terminal status
        await new Promise((resolve) => setTimeout(resolve, 1000));
      }
    };
    run().catch(() => undefined); // an abort, or a 404 the job's poll reports

    return () => {
      abort.abort();
      cancelAnimationFrame(frame);
    };
  }, [id, active]);

  return { metrics, events, truncated, artifacts };
}

function Summary({ job, now }: { job: Job; now: number }) {
  const share = progressShare(job);
  const seconds = elapsed(job, now);
  const speed = job.latest_metrics?.tokens_per_second;
  const facts: [string, string][] = [
    ["Progress", `${progressText(job)}${share !== null ? ` (${Math.floor(share * 100)}%)` : ""}`],
    ["Elapsed", seconds === null ? "–" : duration(seconds)],
    ["ETA", job.status === "running" && job.eta_seconds !== null ? duration(job.eta_seconds) : "–"],
    ["Tokens/s", job.status === "running" && typeof speed === "number" ? num(speed) : "–"],
    ["Loss", num(job.latest_metrics?.loss)],
    ["Epoch", num(job.epoch)],
    ["Tokens seen", num(job.tokens_seen)],
    ["GPUs", gpus(job)],
    ["Attempts", `${job.attempts} (${job.pauses} paused, ${job.handbacks} handed back)`],
    ["Model", job.model],
    ["Dataset", job.dataset],
  ];
  if (job.phase) facts.splice(1, 0, ["Phase", `${job.phase.name}: ${job.phase.done}/${job.phase.total}`]);
  return (
    <>
      {share !== null && <progress class="job-progress" max={1} value={share} aria-label={`Progress ${Math.floor(share * 100)}%`} />}
      <dl class="facts" id="job-facts">
        {facts.map(([name, value]) => (
          <div>
            <dt>{name}</dt>
            <dd id={`fact-${name.toLowerCase().replace(/[^a-z]+/g, "-")}`}>{value}</dd>
          </div>
        ))}
      </dl>
    </>
  );
}

function Controls({ job, onChange }: { job: Job; onChange: (job: Job) => void }) {
  const dialog = useRef<HTMLDialogElement>(null);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);
  const act = async (action: string) => {
    setBusy(true);
    setError(null);
    try {
      onChange(await api<Job>(`/jobs/${job.id}/${action}`, { method: "POST" }));
    } catch (e) {
      if (!isQuiet(e)) setError(message(e));
    } finally {
      setBusy(false);
    }
  };
  const paused = job.status === "paused";
  const ended = TERMINAL.has(job.status);
  return (
    <div class="controls">
      <button type="button" id="pause-button" disabled={busy || (!paused && !PAUSABLE.has(job.status))} onClick={() => act(paused ? "resume" : "pause")}>
        {paused ? "Resume" : "Pause"}
      </button>
      <button type="button" id="cancel-button" class="danger" disabled={busy || ended || job.status === "cancelling"} onClick={() => dialog.current?.showModal()}>
        Cancel
      </button>
      {error && (
        <span class="error" role="alert">
          {error}
        </span>
      )}
      <dialog ref={dialog} id="cancel-dialog" aria-labelledby="cancel-dialog-title">
        <form method="dialog">
          <h2 id="cancel-dialog-title">Cancel {job.name ?? job.id}?</h2>
          <p>Training stops and cannot be resumed; its checkpoints so far are kept.</p>
          <div class="controls">
            <button value="keep" autofocus>
              Keep running
            </button>
            <button type="button" id="cancel-confirm" class="danger" onClick={() => (dialog.current?.close(), act("cancel"))}>
              Cancel job
            </button>
          </div>
        </form>
      </dialog>
    </div>
  );
}

function Nodes({ job }: { job: Job }) {
  if (!job.nodes.length) return null;
  return (
    <section aria-labelledby="nodes-title">
      <h2 id="nodes-title">Nodes</h2>
      <div class="table-scroll" tabIndex={0} role="region" aria-label="Nodes table">
        <table id="nodes-table">
          <thead>
            <tr>
              <th scope="col">Node</th>
              <th scope="col">Worker</th>
              <th scope="col">Address</th>
              <th scope="col">Ranks</th>
              <th scope="col">State</th>
              <th scope="col">Error</th>
            </tr>
          </thead>
          <tbody>
            {job.nodes.map((node) => (
              <tr data-node-rank={node.node_rank}>
                <td>{node.node_rank}</td>
                <td>{node.worker_id ?? "–"}</td>
                <td>{node.address ?? "–"}</td>
                <td>{`${node.ranks[0]}-${node.ranks[1]}`}</td>
                <td>{node.state}</td>
                <td class="error">{node.error_message ?? ""}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
    </section>
  );
}

function Configuration({ job, events }: { job: Job; events: JobEvent[] }) {
  const plan = [...events].reverse().find((e) => e.type === "plan");
  const blocks: [string, unknown][] = [
    [`DeepSpeed config${job.deepspeed_config_chosen ? " (chosen by tuneq)" : ""}${job.resolved_deepspeed_config ? ", resolved" : ""}`, job.resolved_deepspeed_config ?? job.deepspeed_config],
    ["Training options", job.training],
    ["Plan", plan?.data],
    ["Dataset", job.dataset_stats],
  ];
  return (
    <section aria-labelledby="config-title">
      <h2 id="config-title">Configuration</h2>
      {blocks
        .filter(([, value]) => value)
        .map(([title, value]) => (
          <details>
            <summary>{title}</summary>
            <pre class="json" tabIndex={0}>
              {JSON.stringify(value, null, 2)}
            </pre>
          </details>
        ))}
    </section>
  );
}

function useNow(ms: number): number {
  const [now, setNow] = useState(Date.now());
  useEffect(() => {
    const timer = setInterval(() => setNow(Date.now()), ms);
    return () => clearInterval(timer);
  }, [ms]);
  return now;
}

export function JobPage({ id }: { id: string }) {
  const valid = UUID_PATTERN.test(id);
  const [load, setJob, reload] = useJob(id, valid);
  const live = useLive(id, load.state === "found", reload);
  const now = useNow(1000);
  const charts = useMemo(
    () => CHARTS.filter((c) => !c.optional || live.metrics.some((m) => c.series.some((s) => typeof m[s.key] === "number"))),
    [live.metrics],
  );

  if (load.state === "missing") {
    return (
      <main id="job-view">
        <h1 id="job-title">Job not found</h1>
        <p id="job-missing" role="alert">
          No job <code>{id}</code> here{valid ? "" : " (a job id is a UUID)"}. <a href="#/jobs">All jobs</a>
        </p>
      </main>
    );
  }
  if (load.state !== "found") {
    return (
      <main id="job-view">
        <h1 id="job-title">Job {id}</h1>
        <p role="status">{load.state === "error" ? load.message : "Loading…"}</p>
      </main>
    );
  }
  const job = load.job;
  const logArtifact = live.artifacts.find((a) => a.kind === "log");
  return (
    <main id="job-view" data-job-id={job.id}>
      <p class="crumbs">
        <a href="#/jobs">Jobs</a> / <CopyId id={job.id} />
      </p>
      <h1 id="job-title">{job.name || "unnamed job"}</h1>
      <div class="job-head">
        <span id="job-status" class={`status status-${job.status}`}>
          {job.status}
        </span>
        <Controls job={job} onChange={setJob} />
      </div>
      {job.error && (
        <p id="job-error" class="error" role="alert">
          {job.error.code}: {job.error.message}
        </p>
      )}
      <Summary job={job} now={now} />
      <section aria-labelledby="charts-title">
        <h2 id="charts-title">Metrics</h2>
        <p class="muted">Drag across a chart to zoom in, double-click to zoom out.</p>
        <div class="charts">
          {charts.map((c) => (
            <Chart key={c.id} id={c.id} title={c.title} rows={live.metrics} series={c.series} logOption={c.log} />
          ))}
        </div>
      </section>
      <Nodes job={job} />
      <Timeline events={live.events} truncated={live.truncated} />
      <Artifacts jobId={job.id} artifacts={live.artifacts} />
      <Configuration job={job} events={live.events} />
      <LogView jobId={job.id} logArtifact={logArtifact} />
      <p class="muted">{bytes(live.artifacts.reduce((n, a) => n + a.size, 0))} in the artifact store.</p>
    </main>
  );
}
