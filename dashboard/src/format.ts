// How numbers, sizes and times read on the page.

import type { Job } from "./types";

export function duration(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

/** How long ago `iso` was, in its largest unit: "5m", "3h", "2d". */
export function age(iso: string, now = Date.now()): string {
  const seconds = Math.max(0, (now - Date.parse(iso)) / 1000);
  if (seconds < 60) return `${Math.floor(seconds)}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)}h`;
  return `${Math.floor(seconds / 86400)}d`;
}

export function elapsed(job: Job, now = Date.now()): number | null {
  if (!job.started_at) return null;
  const end = job.finished_at ? Date.parse(job.finished_at) : now;
  return (end - Date.parse(job.started_at)) / 1000;
}

export function bytes(n: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let i = 0;
  while (value >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return `${value.toFixed(i ? 1 : 0)} ${units[i]}`;
}

/** A measure with 4 significant digits, or a dash for none. */
export function num(value: unknown): string {
  if (typeof value !== "number" || !Number.isFinite(value)) return "–";
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e6)) return value.toExponential(2);
  return String(Number(value.toPrecision(4)));
}

export function shortId(id: string): string {
  return id.slice(0, 8);
}

export function progressText(job: Job): string {
  if (job.total_steps) return `${job.step}/${job.total_steps}`;
  return job.step ? `step ${job.step}` : "–";
}

export function progressShare(job: Job): number | null {
  if (job.status === "succeeded") return 1;
  return job.total_steps ? Math.min(1, job.step / job.total_steps) : null;
}

export function gpus(job: Job): string {
  return job.num_nodes > 1 ? `${job.num_nodes}×${job.num_gpus}` : String(job.num_gpus);
}

function path(value: unknown, ...keys: string[]): unknown {
  let current = value;
  for (const key of keys) {
    if (current === null || typeof current !== "object") return undefined;
    current = (current as Record<string, unknown>)[key];
  }
  return current;
}

/** The hyperparameters a list row shows: what differs most between runs. */
export function hyperparameters(job: Job): [string, string][] {
  const config = job.resolved_deepspeed_config ?? job.deepspeed_config;
  const training = job.training;
  const shown: [string, unknown][] = [
    ["method", training.method],
    ["lr", path(config, "optimizer", "params", "lr")],
    ["batch", config.train_batch_size],
    [training.max_steps ? "steps" : "epochs", training.max_steps ?? training.epochs],
    ["seq", training.max_seq_length],
    ["lora r", path(training, "lora", "r")],
    ["zero", path(config, "zero_optimization", "stage")],
  ];
  return shown
    .filter(([, value]) => value !== undefined && value !== null && value !== "auto")
    .map(([name, value]) => [name, typeof value === "number" ? num(value) : String(value)]);
}
