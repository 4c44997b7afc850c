// The workers and the queues (#/workers): each worker's hardware, state and last heartbeat, the
// job it runs (its id when it is the caller's), each queue's waiting jobs, the gangs waiting for
// nodes. Read from GET /workers and GET /queues every few seconds.

import { useEffect, useState } from "preact/hooks";
import { api, isQuiet, message } from "./api";
import { CopyId } from "./copy-id";
import { age, bytes, duration } from "./format";
import { jobHash } from "./route";
import type { Queues, WorkerInfo, Workers } from "./types";

const REFRESH_MS = 3000;

function hardware(worker: WorkerInfo): string {
  const devices = worker.accelerator === "cuda" ? `${worker.device_count} GPU${worker.device_count === 1 ? "" : "s"}` : `${worker.device_count} CPU cores`;
  const memory = worker.device_memory_bytes ? `, ${bytes(worker.device_memory_bytes)}${worker.accelerator === "cuda" ? " each" : ""}` : "";
  return `${devices}${memory}${worker.bf16_supported ? ", bf16" : ""}`;
}

function State({ worker }: { worker: WorkerInfo }) {
  return (
    <>
      <span class={`worker-state state-${worker.state}`}>{worker.state}</span>
      {worker.held_for_gang && <span class="muted"> (held for a multi-node job)</span>}
      {worker.unavailable_reason && <div class="reason">{worker.unavailable_reason}</div>}
    </>
  );
}

function CurrentJob({ worker }: { worker: WorkerInfo }) {
  if (worker.job_id) {
    return (
      <span class="job-link">
        <a href={jobHash(worker.job_id)}>your job</a> <CopyId id={worker.job_id} />
      </span>
    );
  }
  return <span class="muted">{worker.state === "busy" ? "busy" : "–"}</span>;
}

function WorkersTable({ workers, now }: { workers: WorkerInfo[]; now: number }) {
  return (
    <div class="table-scroll" tabIndex={0} role="region" aria-label="Workers table">
      <table id="workers-table">
        <thead>
          <tr>
            <th scope="col">Worker</th>
            <th scope="col">Hardware</th>
            <th scope="col">Queue</th>
            <th scope="col">State</th>
            <th scope="col">Job</th>
            <th scope="col">Heartbeat</th>
          </tr>
        </thead>
        <tbody>
          {workers.map((w) => (
            <tr data-worker-id={w.id}>
              <td class="worker-id">
                <span class="name">{w.hostname}</span>
                <div class="muted">{w.id}</div>
              </td>
              <td>{hardware(w)}</td>
              <td>{w.queue ?? "–"}</td>
              <td class="state">
                <State worker={w} />
              </td>
              <td class="current-job">
                <CurrentJob worker={w} />
              </td>
              <td class="heartbeat" title={w.last_seen_at}>
                {age(w.last_seen_at, now)} ago
              </td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

function QueuesTable({ queues }: { queues: Queues }) {
  return (
    <div class="table-scroll" tabIndex={0} role="region" aria-label="Queues table">
      <table id="queues-table">
        <thead>
          <tr>
            <th scope="col">Queue</th>
            <th scope="col">Queued jobs</th>
            <th scope="col">Oldest waits</th>
            <th scope="col">Live workers</th>
          </tr>
        </thead>
        <tbody>
          {queues.data.map((q) => (
            <tr data-queue={q.name ?? ""}>
              <td>{q.name ?? <span class="muted">none yet: no live worker fits these jobs</span>}</td>
              <td class="queued">{q.queued}</td>
              <td>{q.oldest_wait_seconds === null ? "–" : duration(q.oldest_wait_seconds)}</td>
              <td>{q.workers}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

function Gangs({ queues }: { queues: Queues }) {
  if (!queues.gangs.length) return <p class="empty" id="gangs-empty">No multi-node job waits for nodes.</p>;
  return (
    <ul id="gangs">
      {queues.gangs.map((g) => (
        <li>
          {g.job_id ? <a href={jobHash(g.job_id)}>your job {g.job_id.slice(0, 8)}</a> : "a job"}: {g.num_nodes} nodes of {g.num_gpus}{" "}
          devices, {g.held_workers} worker{g.held_workers === 1 ? "" : "s"} held, waiting {duration(g.wait_seconds)}
        </li>
      ))}
    </ul>
  );
}

export function WorkersView() {
  const [workers, setWorkers] = useState<Workers | null>(null);
  const [queues, setQueues] = useState<Queues | null>(null);
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    const abort = new AbortController();
    const load = () =>
      Promise.all([api<Workers>("/workers", { signal: abort.signal }), api<Queues>("/queues", { signal: abort.signal })]).then(
        ([w, q]) => {
          setWorkers(w);
          setQueues(q);
          setError(null);
        },
        (e) => isQuiet(e) || setError(message(e)),
      );
    void load();
    const timer = setInterval(load, REFRESH_MS);
    return () => {
      clearInterval(timer);
      abort.abort();
    };
  }, []);
  const now = Date.now();
  return (
    <main id="workers-view">
      <h1>Workers and queues</h1>
      {error && (
        <p class="error" role="alert">
          {error}
        </p>
      )}
      <section aria-labelledby="workers-title">
        <h2 id="workers-title">Workers</h2>
        {workers && (
          <>
            <WorkersTable workers={workers.data} now={now} />
            {!workers.data.length && <p class="empty">No worker has started yet (`tuneq worker`).</p>}
            <p class="muted">A worker without a heartbeat for {workers.seen_seconds} s is unavailable (TUNEQ_WORKER_SEEN_SECONDS).</p>
          </>
        )}
      </section>
      <section aria-labelledby="queues-title">
        <h2 id="queues-title">Queues</h2>
        {queues && <QueuesTable queues={queues} />}
        {queues && !queues.data.length && <p class="empty">No queue has a worker or a waiting job.</p>}
      </section>
      <section aria-labelledby="gangs-title">
        <h2 id="gangs-title">Gangs waiting for nodes</h2>
        {queues && <Gangs queues={queues} />}
      </section>
      {!workers && !error && <p role="status">Loading…</p>}
    </main>
  );
}
