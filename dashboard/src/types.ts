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

/** GET /me: who the dashboard's key is. An admin's key sees every owner's jobs. */
export interface Caller {
  owner: string;
  admin: boolean;
}

export interface JobsPage {
  data: Job[];
  count: number;
  /** A model or name filter's count stops at 1,000: more match. */
  count_capped: boolean;
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

// GET /workers and GET /queues (api/workers_service.py).
export interface WorkerInfo {
  id: string;
  hostname: string;
  accelerator: string;
  device_count: number;
  device_memory_bytes: number | null;
  bf16_supported: boolean | null;
  queue: string | null;
  state: "idle" | "busy" | "unavailable" | "stopped";
  unavailable_reason: string | null;
  job_id: string | null; // only for the caller's own job
  held_for_gang: boolean;
  started_at: string;
  last_seen_at: string;
  stopped_at: string | null;
}

export interface Workers {
  data: WorkerInfo[];
  seen_seconds: number;
}

export interface Queues {
  data: { name: string | null; queued: number; oldest_wait_seconds: number | null; workers: number }[];
  gangs: { job_id: string | null; num_nodes: number; num_gpus: number; held_workers: number; wait_seconds: number }[];
}

// POST /jobs/plan (shared/jobs/plan.py JobPlan), the parts the submit form shows.
export interface JobPlan {
  world_size: number;
  resolved_deepspeed_config: Record<string, unknown>;
  deepspeed_config_chosen: boolean;
  train_batch_size: number;
  micro_batch_per_gpu: number;
  gradient_accumulation_steps: number;
  dataset_stats: Record<string, unknown>;
  steps_per_epoch: number;
  total_steps: number;
  parameters: number;
  trainable_parameters: number;
  memory: { zero_stage: number; offload_optimizer: boolean; offload_param: boolean; per_device_bytes: number; per_host_cpu_bytes: number; method: string; note: string };
}
