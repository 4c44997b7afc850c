// Every call the dashboard makes goes to the same HTTP API any client uses. With auth on, a 401
// asks the page for a key (kept in localStorage, sent as "Authorization: Bearer <key>").

const KEY_STORAGE = "tuneq.apiKey";

export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly detail: unknown = null, // the body's `detail` as sent: a 422's list of {loc, msg}
  ) {
    super(message);
  }
}

/** One problem of a 422 (FastAPI's and tuneq's shape): where in the body, and what to fix. */
export interface FieldProblem {
  loc: (string | number)[];
  msg: string;
}

export function fieldProblems(error: unknown): FieldProblem[] {
  if (!(error instanceof ApiError) || !Array.isArray(error.detail)) return [];
  return (error.detail as unknown[]).filter(
    (p): p is FieldProblem => typeof p === "object" && p !== null && Array.isArray((p as FieldProblem).loc),
  );
}

type Listener = () => void;
const unauthorizedListeners = new Set<Listener>();

/** Calls `listener` whenever the API answers 401; returns the unsubscribe function. */
export function onUnauthorized(listener: Listener): () => void {
  unauthorizedListeners.add(listener);
  return () => unauthorizedListeners.delete(listener);
}

export function storedKey(): string | null {
  return localStorage.getItem(KEY_STORAGE);
}

export function storeKey(key: string): void {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export function authHeaders(): Record<string, string> {
  const key = storedKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorOf(response: Response): Promise<ApiError> {
  let message = response.statusText;
  let detail: unknown = null;
  try {
    // tuneq's routes answer {detail}; /v1's OpenAI's envelope, {error: {message}}.
    const body = (await response.json()) as { detail?: unknown; error?: { message?: unknown } };
    detail = body.detail ?? null;
    if (typeof body.error?.message === "string") message = body.error.message;
    else message = typeof detail === "string" ? detail : JSON.stringify(detail);
  } catch {
    // not JSON: keep the status text
  }
  if (response.status === 401) unauthorizedListeners.forEach((listener) => listener());
  return new ApiError(response.status, message, detail);
}

export async function api<T>(path: string, init: RequestInit = {}): Promise<T> {
  const response = await fetch(path, {
    ...init,
    headers: { Accept: "application/json", ...authHeaders(), ...(init.headers as Record<string, string>) },
  });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()) as T;
}

/** An abort, or an error the page has already handled (a 401 shows the key form). */
export function isQuiet(error: unknown): boolean {
  return (error instanceof DOMException && error.name === "AbortError") || (error instanceof ApiError && error.status === 401);
}

export function message(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

async function openStream(path: string, accept: string, signal: AbortSignal): Promise<ReadableStreamDefaultReader<string>> {
  const response = await fetch(path, { headers: { Accept: accept, ...authHeaders() }, signal });
  if (!response.ok || !response.body) throw await errorOf(response);
  return response.body.pipeThrough(new TextDecoderStream()).getReader();
}

export interface JobEvent {
  id: number;
  type: string;
  data: Record<string, unknown>;
  created_at: string;
}

/**
 * Reads /jobs/<id>/events/stream (Server-Sent Events) with fetch, which can send the
 * Authorization header that EventSource cannot, and calls onEvent with each event until the
 * server ends the stream (after the job's terminal status) or `signal` aborts. Returns the last
 * event id seen, from which a caller resumes a cut stream.
 */
export async function readEvents(
  jobId: string,
  after: number,
  signal: AbortSignal,
  onEvent: (event: JobEvent) => void,
): Promise<number> {
  const reader = await openStream(`/jobs/${jobId}/events/stream?after=${after}`, "text/event-stream", signal);
  let buffer = "";
  let cursor = after;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return cursor;
    buffer += value.replace(/\r\n?/g, "\n"); // sse-starlette ends lines with \r\n
    let end: number;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (!data) continue; // a ": ping" keeps the connection open
      const event = JSON.parse(data) as JobEvent;
      cursor = event.id;
      onEvent(event);
    }
  }
}

/** Reads a text/plain stream (GET /jobs/<id>/logs?follow=true) a line at a time until it ends. */
export async function readLines(path: string, signal: AbortSignal, onLines: (lines: string[]) => void): Promise<void> {
  const reader = await openStream(path, "text/plain", signal);
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) {
      if (buffer) onLines([buffer]);
      return;
    }
    buffer += value;
    const lines = buffer.split("\n");
    buffer = lines.pop() ?? "";
    if (lines.length) onLines(lines);
  }
}

function clickDownload(href: string, filename: string): void {
  const link = document.createElement("a");
  link.href = href;
  link.download = filename;
  link.click();
}

/** Downloads one of a job's files where the key must not be left out: through a 10-minute link
 * (POST /jobs/{id}/downloads) the browser follows itself, straight to disk, however large. */
export async function downloadThroughLink(jobId: string, path: string, filename: string): Promise<void> {
  const link = await api<{ url: string }>(`/jobs/${jobId}/downloads`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ path }),
  });
  clickDownload(link.url, filename);
}

export function saveBlob(blob: Blob, filename: string): void {
  const url = URL.createObjectURL(blob);
  clickDownload(url, filename);
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
