// The jobs list: filtered, sorted and paged by the server (GET /jobs), with its state in the URL.
// Rows can be ticked (across pages and filters) and compared (#/compare).

import { useEffect, useState } from "preact/hooks";
import { api, isQuiet, message } from "./api";
import { CopyId } from "./copy-id";
import { age, duration, gpus, hyperparameters, num, progressShare, progressText } from "./format";
import { compareHash, jobHash, jobsHash } from "./route";
import { type Caller, type Job, type JobsPage, STATUSES } from "./types";

const PAGE_SIZE = 50;
const REFRESH_MS = 3000;
// created-after as the URL keeps it (relative, so a shared link keeps meaning "lately").
const SINCE: Record<string, number> = { "1h": 3600, "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400 };

function apiQuery(params: URLSearchParams): string {
  const query = new URLSearchParams();
  for (const name of ["owner", "status", "model", "name", "sort"]) {
    const value = params.get(name);
    if (value) query.set(name, value);
  }
  const since = SINCE[params.get("since") ?? ""];
  if (since) query.set("created_after", new Date(Date.now() - since * 1000).toISOString());
  const page = Math.max(1, Number(params.get("page")) || 1);
  query.set("skip", String((page - 1) * PAGE_SIZE));
  query.set("limit", String(PAGE_SIZE));
  return query.toString();
}

function navigate(params: URLSearchParams, changes: Record<string, string | null>): void {
  const next = new URLSearchParams(params);
  for (const [name, value] of Object.entries(changes)) {
    if (value) next.set(name, value);
    else next.delete(name);
  }
  if (!("page" in changes)) next.delete("page"); // a new filter or order starts at the first page
  location.hash = jobsHash(next);
}

function Filters({ params, admin }: { params: URLSearchParams; admin: boolean }) {
  // Text filters apply on submit (Enter), not on each key: each change is a new URL.
  const [model, setModel] = useState(params.get("model") ?? "");
  const [name, setName] = useState(params.get("name") ?? "");
  const [owner, setOwner] = useState(params.get("owner") ?? "");
  useEffect(() => {
    setModel(params.get("model") ?? "");
    setName(params.get("name") ?? "");
    setOwner(params.get("owner") ?? "");
  }, [params]);
  const submit = (event: Event) => {
    event.preventDefault();
    navigate(params, { model: model.trim(), name: name.trim(), ...(admin ? { owner: owner.trim() } : {}) });
  };
  return (
    <form class="filters" onSubmit={submit} role="search" aria-label="Filter jobs">
      <label>
        Status
        <select id="filter-status" value={params.get("status") ?? ""} onChange={(e) => navigate(params, { status: e.currentTarget.value })}>
          <option value="">any</option>
          {STATUSES.map((s) => (
            <option value={s}>{s}</option>
          ))}
        </select>
      </label>
      <label>
        Name
        <input id="filter-name" type="search" value={name} onInput={(e) => setName(e.currentTarget.value)} placeholder="part of a name" />
      </label>
      <label>
        Model
        <input id="filter-model" type="search" value={model} onInput={(e) => setModel(e.currentTarget.value)} placeholder="part of a model" />
      </label>
      {admin && (
        <label>
          Owner
          <input id="filter-owner" type="search" value={owner} onInput={(e) => setOwner(e.currentTarget.value)} placeholder="every owner" />
        </label>
      )}
      <label>
        Created
        <select id="filter-since" value={params.get("since") ?? ""} onChange={(e) => navigate(params, { since: e.currentTarget.value })}>
          <option value="">any time</option>
          {Object.keys(SINCE).map((s) => (
            <option value={s}>in the last {s}</option>
          ))}
        </select>
      </label>
      <button type="submit">Apply</button>
    </form>
  );
}

function SortHeader({ params, column, label }: { params: URLSearchParams; column: string; label: string }) {
  const sort = params.get("sort") ?? "-created_at";
  const active = sort.replace(/^-/, "") === column;
  const descending = sort.startsWith("-");
  const next = active ? (descending ? column : `-${column}`) : column === "created_at" ? `-${column}` : column;
  // Age sorts by created_at: newest first is the smallest age, so its arrow reads the other way.
  const ascendingLook = column === "created_at" ? descending : !descending;
  return (
    <th scope="col" aria-sort={active ? (ascendingLook ? "ascending" : "descending") : undefined}>
      <button type="button" class="sort" onClick={() => navigate(params, { sort: next === "-created_at" ? null : next })}>
        {label}
        {active ? (ascendingLook ? " ▲" : " ▼") : ""}
      </button>
    </th>
  );
}

function Progress({ job }: { job: Job }) {
  const share = progressShare(job);
  return (
    <span class="progress">
      {share !== null && (
        <progress max={1} value={share} aria-label={`${job.name ?? job.id}: ${Math.round(share * 100)}%`} />
      )}
      <span>{progressText(job)}</span>
    </span>
  );
}

interface RowProps {
  job: Job;
  admin: boolean;
  now: number;
  selected: boolean;
  onSelect: (id: string, on: boolean) => void;
}

function Row({ job, admin, now, selected, onSelect }: RowProps) {
  const running = job.status === "running";
  const speed = job.latest_metrics?.tokens_per_second;
  return (
    <tr data-job-id={job.id}>
      <td class="pick">
        <input
          type="checkbox"
          checked={selected}
          onChange={(e) => onSelect(job.id, e.currentTarget.checked)}
          aria-label={`Select ${job.name || "unnamed"} (${job.id.slice(0, 8)}) to compare`}
        />
      </td>
      <td class="job">
        <a href={jobHash(job.id)}>{job.name || "unnamed"}</a>
        <CopyId id={job.id} />
      </td>
      {admin && <td class="owner">{job.owner}</td>}
      <td class="status">
        <span class={`status status-${job.status}`}>{job.status}</span>
      </td>
      <td class="model" title={job.model}>
        {job.model}
      </td>
      <td class="gpus">{gpus(job)}</td>
      <td class="progress-cell">
        <Progress job={job} />
      </td>
      <td class="eta">{running && job.eta_seconds !== null ? duration(job.eta_seconds) : "–"}</td>
      <td class="speed">{running && typeof speed === "number" ? `${num(speed)} tok/s` : "–"}</td>
      <td class="hyper">
        {hyperparameters(job).map(([name, value]) => (
          <span class="hp">
            {name} <b>{value}</b>
          </span>
        ))}
      </td>
      <td class="age" title={job.created_at}>
        {age(job.created_at, now)}
      </td>
    </tr>
  );
}

export function JobsList({ params }: { params: URLSearchParams }) {
  const [page, setPage] = useState<JobsPage | null>(null);
  // An admin's key lists every owner's jobs: an Owner column and filter then.
  const [caller, setCaller] = useState<Caller | null>(null);
  const admin = caller?.admin ?? false;
  useEffect(() => {
    api<Caller>("/me").then(setCaller, () => setCaller(null));
  }, []);
  const [error, setError] = useState<string | null>(null);
  const [selected, setSelected] = useState<string[]>([]); // in the order ticked
  const query = apiQuery(params);
  const select = (id: string, on: boolean) =>
    setSelected((old) => (on ? [...old.filter((x) => x !== id), id] : old.filter((x) => x !== id)));

  useEffect(() => {
    const abort = new AbortController();
    const load = () =>
      api<JobsPage>(`/jobs?${query}`, { signal: abort.signal }).then(
        (answer) => {
          setPage(answer);
          setError(null);
        },
        (e) => isQuiet(e) || setError(message(e)),
      );
    load();
    const timer = setInterval(load, REFRESH_MS);
    return () => {
      clearInterval(timer);
      abort.abort();
    };
  }, [query]);

  const pageNumber = Math.max(1, Number(params.get("page")) || 1);
  const pages = page ? Math.max(1, Math.ceil(page.count / PAGE_SIZE)) : 1;
  // Past a capped count the pages go on while they come back full.
  const capped = page?.count_capped ?? false;
  const more = capped ? (page?.data.length ?? 0) === PAGE_SIZE : pageNumber < pages;
  const plus = capped ? "+" : "";
  const now = Date.now();
  return (
    <main id="jobs-view">
      <h1>Jobs</h1>
      <Filters params={params} admin={admin} />
      <div class="compare-bar">
        <button type="button" id="compare-button" disabled={selected.length < 2} onClick={() => (location.hash = compareHash(selected))}>
          Compare{selected.length ? ` ${selected.length} jobs` : ""}
        </button>
        {selected.length > 0 && (
          <button type="button" class="small" onClick={() => setSelected([])}>
            clear
          </button>
        )}
        <span class="muted">{selected.length < 2 ? "Tick two or more jobs to compare their curves." : ""}</span>
      </div>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <div class="table-scroll" tabIndex={0} role="region" aria-label="Jobs table">
        <table id="jobs-table">
          <thead>
            <tr>
              <th scope="col">
                <span class="visually-hidden">Compare</span>
              </th>
              <SortHeader params={params} column="name" label="Job" />
              {admin && <th scope="col">Owner</th>}
              <SortHeader params={params} column="status" label="Status" />
              <th scope="col">Model</th>
              <th scope="col">GPUs</th>
              <th scope="col">Progress</th>
              <th scope="col">ETA</th>
              <th scope="col">Speed</th>
              <th scope="col">Hyperparameters</th>
              <SortHeader params={params} column="created_at" label="Age" />
            </tr>
          </thead>
          <tbody>
            {page?.data.map((job) => (
              <Row key={job.id} job={job} admin={admin} now={now} selected={selected.includes(job.id)} onSelect={select} />
            ))}
          </tbody>
        </table>
      </div>
      {page && !page.data.length && <p class="empty">No jobs match.</p>}
      <nav class="pager" aria-label="Pages">
        <button type="button" disabled={pageNumber <= 1} onClick={() => navigate(params, { page: String(pageNumber - 1) })}>
          Previous
        </button>
        <span id="jobs-count">
          {page ? `page ${pageNumber} of ${pages}${plus} · ${page.count}${plus} jobs` : "loading…"}
        </span>
        <button type="button" disabled={!more} onClick={() => navigate(params, { page: String(pageNumber + 1) })}>
          Next
        </button>
      </nav>
    </main>
  );
}
