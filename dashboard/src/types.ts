// The parts of the API's answers the dashboard reads (shared/db/models.py has them whole).

export type JobStatus =
  | "queued"
  | "running"
  | "pausing"
  | "paused"
  | "cancelling"
  | "succeeded"
  | "failed"
  | "cancelled";

export const STATUSES: JobStatus[] = ["queued", "running", "pausing", "paused", "cancelling", "succeeded", "failed", "cancelled"];
export const TERMINAL = new Set<string>(["succeeded", "failed", "cancelled"]);

export interface JobNode {
  node_rank: number;
  worker_id: string | null;
  address: string | null;
  ranks: [number, number];
  state: string;
  error_message: string | null;
}

export interface Job {
  id: string;
  owner: string;
  name: string | null;
  status: JobStatus;
  model: string;
  dataset: string;
  validation_dataset: string | null;
  dataset_stats: Record<string, unknown> | null;
  deepspeed_config: Record<string, unknown>;
  deepspeed_config_chosen: boolean;
  resolved_deepspeed_config: Record<string, unknown> | null;
  num_gpus: number;
  num_nodes: number;
  nodes: JobNode[];
  training: Record<string, unknown>;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  step: number;
  total_steps: number | null;
  epoch: number | null;
  tokens_seen: number;
  eta_seconds: number | null;
  phase: { name: string; done: number; total: number; cached: boolean } | null;
  latest_metrics: Record<string, number | null> | null;
  error: { code: string; message: string } | null;
  attempts: number;
  pauses: number;
  handbacks: number;
  max_restarts: number;
}

export interface JobsPage {
  data: Job[];
  count: number;
}

export type Metric = Record<string, number | null> & { step: number };

export interface MetricsPage {
  data: Metric[];
  has_more: boolean;
  next_after: number | null;
  event_cursor: number;
}

export interface Artifact {
  path: string;
  kind: string;
  step: number | null;
  size: number;
  sha256: string;
  created_at: string;
}
