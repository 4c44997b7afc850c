// A job's events, oldest first, as a timeline: status changes (queued, claimed, paused, resumed,
// failed...), the plan, checkpoints, warnings, and the progress of phases and downloads.

import type { JobEvent } from "./api";
import { bytes, num } from "./format";

// Shown events; metric and log events have their own views (the charts, the log).
export const TIMELINE_TYPES = new Set(["status", "plan", "checkpoint", "warning", "resumed", "phase", "download", "artifact"]);

function describe(event: JobEvent): string {
  const d = event.data;
  switch (event.type) {
    case "status": {
      const parts = [String(d.status)];
      if (d.status === "running" && d.worker_id) parts.push(`claimed by ${d.worker_id}${d.attempt ? ` (attempt ${d.attempt})` : ""}`);
      if (d.step !== undefined) parts.push(`at step ${d.step}`);
      const error = d.error as { code?: string; message?: string } | undefined;
      if (error && typeof error === "object") parts.push(`${error.code ?? ""}: ${error.message ?? ""}`);
      return parts.join(" · ");
    }
    case "plan":
      return `plan: ${d.total_steps} steps, ${d.steps_per_epoch} per epoch, ${d.num_samples} samples`;
    case "checkpoint":
      return `checkpoint at step ${d.step} (${d.kind}, ${bytes(Number(d.bytes) || 0)})`;
    case "warning":
      return `warning: ${d.message}`;
    case "resumed":
      return `resumed from step ${d.step ?? "?"}`;
    case "phase":
      return `${d.name}: ${d.done}/${d.total}${d.cached ? " (cached)" : ""}`;
    case "download":
      return `download ${num(d.done ?? d.bytes)}${d.total ? ` of ${num(d.total)}` : ""}`;
    case "artifact":
      return `artifact store: ${d.message ?? d.state ?? JSON.stringify(d)}`;
    default:
      return `${event.type}: ${JSON.stringify(d)}`;
  }
}

/** Progress events (a phase's, a download's) of one kind in a row keep only their latest. */
export function addToTimeline(events: JobEvent[], event: JobEvent): JobEvent[] {
  if (!TIMELINE_TYPES.has(event.type)) return events;
  const last = events[events.length - 1];
  const progress = event.type === "phase" || event.type === "download";
  if (progress && last && last.type === event.type && last.data.name === event.data.name) {
    return [...events.slice(0, -1), event];
  }
  return [...events, event];
}

export function Timeline({ events, truncated }: { events: JobEvent[]; truncated: boolean }) {
  return (
    <section aria-labelledby="timeline-title">
      <h2 id="timeline-title">Events</h2>
      {truncated && <p class="muted">Older events are left out: the job has too many to list.</p>}
      <ol id="timeline" class="timeline" tabIndex={0} aria-label="Events, oldest first">
        {events.map((event) => (
          <li key={event.id} class={`event event-${event.type} ${event.type === "status" ? `status-${event.data.status}` : ""}`}>
            <time dateTime={event.created_at}>{new Date(event.created_at).toLocaleString()}</time>
            <span>{describe(event)}</span>
          </li>
        ))}
      </ol>
      {!events.length && <p class="empty">No events yet.</p>}
    </section>
  );
}
