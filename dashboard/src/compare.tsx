// Several jobs side by side (#/compare?jobs=<id>,<id>): each measure's curves of every job on one
// chart, a legend per job, and the hyperparameters that differ between them (and the model).
// Each job's history is read downsampled by the server (GET /jobs/<id>/metrics?points=N), and
// read again every few seconds while any of them still runs.

import { useEffect, useMemo, useState } from "preact/hooks";
import { api, ApiError, isQuiet, message } from "./api";
import { Chart, type SeriesSpec } from "./chart";
import { CopyId } from "./copy-id";
import { shortId } from "./format";
import { jobHash, UUID_PATTERN } from "./route";
import { type Job, type Metric, type MetricsPage, TERMINAL } from "./types";

const POINTS = 500; // per job and chart: enough for a chart's width, whatever the run's length
const REFRESH_MS = 5000;
export const MAX_COMPARED = 10;
// Ten lines that stay apart on a light and a dark background.
const PALETTE = ["#1e88e5", "#e53935", "#43a047", "#fb8c00", "#8e24aa", "#00acc1", "#c0ca33", "#6d4c41", "#d81b60", "#757575"];

interface Measure {
  id: string;
  title: string;
  key: string; // as GET /jobs/<id>/metrics names it (TRL's names for DPO's: rewards/margins)
  log?: boolean;
  optional?: boolean; // charted only when some job has it
}

const MEASURES: Measure[] = [
  { id: "compare-loss", title: "Loss", key: "loss", log: true },
  { id: "compare-eval-loss", title: "Eval loss", key: "eval_loss", log: true },
  { id: "compare-lr", title: "Learning rate", key: "learning_rate", log: true },
  { id: "compare-speed", title: "Tokens per second", key: "tokens_per_second" },
  { id: "compare-rewards-margins", title: "Reward margins", key: "rewards/margins", optional: true },
  { id: "compare-rewards-accuracy", title: "Reward accuracy", key: "rewards/accuracies", optional: true },
  { id: "compare-rewards-chosen", title: "Chosen reward", key: "rewards/chosen", optional: true },
  { id: "compare-rewards-rejected", title: "Rejected reward", key: "rewards/rejected", optional: true },
];

interface Run {
  job: Job;
  metrics: Metric[];
}

type Loaded = { id: string; run: Run } | { id: string; missing: true } | { id: string; error: string };

async function loadRun(id: string, signal: AbortSignal): Promise<Loaded> {
  if (!UUID_PATTERN.test(id)) return { id, missing: true };
  try {
    const [job, page] = await Promise.all([
      api<Job>(`/jobs/${id}`, { signal }),
      api<MetricsPage>(`/jobs/${id}/metrics?points=${POINTS}&limit=${POINTS}`, { signal }),
    ]);
    return { id, run: { job, metrics: page.data } };
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) return { id, missing: true };
    if (isQuiet(e)) throw e;
    return { id, error: message(e) };
  }
}

function useRuns(ids: string[]): Loaded[] | null {
  const [loaded, setLoaded] = useState<Loaded[] | null>(null);
  const key = ids.join(",");
  useEffect(() => {
    const abort = new AbortController();
    let timer = 0;
    const load = async () => {
      try {
        const answers = await Promise.all(ids.map((id) => loadRun(id, abort.signal)));
        setLoaded(answers);
        if (answers.some((a) => "run" in a && !TERMINAL.has(a.run.job.status))) timer = window.setTimeout(load, REFRESH_MS);
      } catch {
        // an abort (the view changed), or a 401 the key form handles
      }
    };
    void load();
    return () => {
      clearTimeout(timer);
      abort.abort();
    };
    // eslint-disable-next-line react-hooks/exhaustive-deps -- the ids are the key
  }, [key]);
  return loaded;
}

/** One chart's rows: each job's value of `key` as column job<i>, on the union of their steps. */
function overlay(runs: Run[], key: string): Metric[] {
  const byStep = new Map<number, Metric>();
  runs.forEach((run, i) => {
    for (const metric of run.metrics) {
      const value = metric[key];
      if (typeof value !== "number") continue;
      let row = byStep.get(metric.step);
      if (!row) byStep.set(metric.step, (row = { step: metric.step } as Metric));
      row[`job${i}`] = value;
    }
  });
  return [...byStep.values()].sort((a, b) => a.step - b.step);
}

function label(job: Job): string {
  return `${job.name || "unnamed"} ${shortId(job.id)}`;
}

function flatten(value: unknown, prefix: string, into: Map<string, string>): void {
  if (value !== null && typeof value === "object" && !Array.isArray(value)) {
    for (const [name, inner] of Object.entries(value)) flatten(inner, prefix ? `${prefix}.${name}` : name, into);
  } else {
    into.set(prefix, typeof value === "string" ? value : JSON.stringify(value));
  }
}

/** A job's settings as "training.learning_rate" → "0.001", its DeepSpeed config as it ran. */
function settingsOf(job: Job): Map<string, string> {
  const settings = new Map<string, string>();
  flatten(
    {
      dataset: job.dataset,
      validation_dataset: job.validation_dataset,
      num_gpus: job.num_gpus,
      num_nodes: job.num_nodes,
      training: job.training,
      deepspeed: job.resolved_deepspeed_config ?? job.deepspeed_config,
    },
    "",
    settings,
  );
  return settings;
}

/** The model, then every setting whose value is not the same in all jobs. */
export function differingSettings(jobs: Job[]): [string, string[]][] {
  const each = jobs.map(settingsOf);
  const names = [...new Set(each.flatMap((s) => [...s.keys()]))].sort();
  const differing = names
    .map((name): [string, string[]] => [name, each.map((s) => s.get(name) ?? "–")])
    .filter(([, values]) => new Set(values).size > 1);
  return [["model", jobs.map((j) => j.model)], ...differing];
}

function Legend({ runs }: { runs: Run[] }) {
  return (
    <ul class="legend" id="compare-legend" aria-label="Jobs compared">
      {runs.map((run, i) => (
        <li data-job-id={run.job.id}>
          <span class="swatch" style={{ background: PALETTE[i % PALETTE.length] }} aria-hidden="true" />
          <a href={jobHash(run.job.id)}>{run.job.name || "unnamed"}</a> <CopyId id={run.job.id} />{" "}
          <span class={`status status-${run.job.status}`}>{run.job.status}</span>
        </li>
      ))}
    </ul>
  );
}

function Differences({ runs }: { runs: Run[] }) {
  const rows = differingSettings(runs.map((r) => r.job));
  return (
    <section aria-labelledby="differences-title">
      <h2 id="differences-title">Hyperparameters that differ</h2>
      <div class="table-scroll" tabIndex={0} role="region" aria-label="Differing hyperparameters">
        <table id="compare-table">
          <thead>
            <tr>
              <th scope="col">Setting</th>
              {runs.map((run) => (
                <th scope="col">{label(run.job)}</th>
              ))}
            </tr>
          </thead>
          <tbody>
            {rows.map(([name, values]) => (
              <tr data-setting={name}>
                <th scope="row">{name}</th>
                {values.map((value) => (
                  <td class="setting">{value}</td>
                ))}
              </tr>
            ))}
          </tbody>
        </table>
      </div>
      {rows.length === 1 && <p class="muted">Every other setting is the same.</p>}
    </section>
  );
}

function Charts({ runs }: { runs: Run[] }) {
  const seriesKey = runs.map((r) => label(r.job)).join("|");
  const series = useMemo(
    (): SeriesSpec[] => runs.map((run, i) => ({ key: `job${i}`, label: label(run.job), color: PALETTE[i % PALETTE.length] })),
    // eslint-disable-next-line react-hooks/exhaustive-deps -- the labels are the key
    [seriesKey],
  );
  const charts = MEASURES.map((m) => ({ ...m, rows: overlay(runs, m.key) })).filter((m) => !m.optional || m.rows.length);
  return (
    <section aria-labelledby="compare-charts-title">
      <h2 id="compare-charts-title">Metrics</h2>
      <p class="muted">Drag across a chart to zoom in, double-click to zoom out.</p>
      <div class="charts">
        {charts.map((c) => (
          <Chart key={c.id} id={c.id} title={c.title} rows={c.rows} series={series} logOption={c.log} />
        ))}
      </div>
    </section>
  );
}

export function Compare({ ids }: { ids: string[] }) {
  const shown = ids.slice(0, MAX_COMPARED);
  const loaded = useRuns(shown);
  const runs = (loaded ?? []).flatMap((l) => ("run" in l ? [l.run] : []));
  const problems = (loaded ?? []).flatMap((l) =>
    "missing" in l ? [`No job ${l.id} here.`] : "error" in l ? [`Job ${l.id}: ${l.error}`] : [],
  );
  return (
    <main id="compare-view">
      <p class="crumbs">
        <a href="#/jobs">Jobs</a> / compare
      </p>
      <h1>Compare {shown.length} jobs</h1>
      {ids.length < 2 && <p class="muted">Tick two or more jobs in the <a href="#/jobs">jobs list</a>, then press Compare.</p>}
      {ids.length > MAX_COMPARED && <p class="muted">Showing the first {MAX_COMPARED} of {ids.length} jobs.</p>}
      {problems.length > 0 && (
        <ul class="error" id="compare-problems" role="alert">
          {problems.map((p) => (
            <li>{p}</li>
          ))}
        </ul>
      )}
      {loaded === null && <p role="status">Loading…</p>}
      {runs.length > 0 && (
        <>
          <Legend runs={runs} />
          <Charts runs={runs} />
          <Differences runs={runs} />
        </>
      )}
    </main>
  );
}
