// A new job (#/submit): a model (a base model the deployment offers, or a path), a dataset (a
// path or URI, or a file uploaded through POST /v1/files), training options and an optional
// DeepSpeed config. "Plan" first (POST /jobs/plan: steps, memory, the resolved config), then
// "Submit" (POST /jobs), then the job's page. A 422's problems are shown beside their fields.

import type { ComponentChildren } from "preact";
import { useEffect, useState } from "preact/hooks";
import { api, fieldProblems, isQuiet, message } from "./api";
import { bytes, num } from "./format";
import { jobHash } from "./route";
import type { Job, JobPlan } from "./types";

// The form's fields by the place in the body (a 422's loc, "body" dropped) their problems name.
const FIELDS = {
  name: "submit-name",
  model: "submit-model",
  dataset: "submit-dataset",
  num_gpus: "submit-num-gpus",
  "training.method": "submit-method",
  "training.epochs": "submit-epochs",
  "training.max_steps": "submit-max-steps",
  "training.learning_rate": "submit-learning-rate",
  "training.max_seq_length": "submit-max-seq-length",
  "training.lora": "submit-lora",
  "training.validation_split": "submit-validation-split",
  deepspeed_config: "submit-deepspeed",
} as const;
type FieldName = keyof typeof FIELDS;
type Values = Record<FieldName, string>;
type Problems = { fields: Partial<Record<FieldName, string[]>>; other: string[] };

const START: Values = {
  name: "",
  model: "",
  dataset: "",
  num_gpus: "1",
  "training.method": "sft",
  "training.epochs": "1",
  "training.max_steps": "",
  "training.learning_rate": "",
  "training.max_seq_length": "",
  "training.lora": "",
  "training.validation_split": "",
  deepspeed_config: "",
};
const NO_PROBLEMS: Problems = { fields: {}, other: [] };

/** A number as typed, or the text itself (the server's 422 then names the field). */
function numberOrText(text: string): number | string {
  const value = Number(text);
  return text.trim() !== "" && Number.isFinite(value) ? value : text;
}

/** The body of POST /jobs and /jobs/plan; a DeepSpeed config that is not JSON is a problem here. */
function jobBody(values: Values): { body: Record<string, unknown> } | { problems: Problems } {
  const training: Record<string, unknown> = { method: values["training.method"] };
  for (const name of ["epochs", "max_steps", "learning_rate", "max_seq_length", "validation_split"]) {
    const text = values[`training.${name}` as FieldName].trim();
    if (text) training[name] = numberOrText(text);
  }
  if (values["training.lora"]) training.lora = {};
  const body: Record<string, unknown> = { model: values.model.trim(), dataset: values.dataset.trim(), training };
  if (values.name.trim()) body.name = values.name.trim();
  if (values.num_gpus.trim()) body.num_gpus = numberOrText(values.num_gpus.trim());
  if (values.deepspeed_config.trim()) {
    try {
      body.deepspeed_config = JSON.parse(values.deepspeed_config);
    } catch (e) {
      return { problems: { fields: { deepspeed_config: [`not JSON: ${message(e)}`] }, other: [] } };
    }
  }
  return { body };
}

/** A 422's problems, each by the field its loc names (the longest that matches), else "other". */
function problemsOf(error: unknown): Problems {
  const found = fieldProblems(error);
  if (!found.length) return { fields: {}, other: [message(error)] };
  const problems: Problems = { fields: {}, other: [] };
  const names = (Object.keys(FIELDS) as FieldName[]).sort((a, b) => b.length - a.length);
  for (const problem of found) {
    const path = problem.loc.filter((part, i) => !(i === 0 && part === "body")).join(".");
    const field = names.find((name) => path === name || path.startsWith(`${name}.`));
    const where = field && path !== field ? `${path}: ` : "";
    if (field) (problems.fields[field] ??= []).push(`${where}${problem.msg}`);
    else problems.other.push(path ? `${path}: ${problem.msg}` : problem.msg);
  }
  return problems;
}

function useBaseModels(): string[] {
  const [models, setModels] = useState<string[]>([]);
  useEffect(() => {
    const abort = new AbortController();
    api<{ data: { id: string; owned_by: string }[] }>("/v1/models", { signal: abort.signal }).then(
      (answer) => setModels(answer.data.filter((m) => m.owned_by === "system").map((m) => m.id)),
      () => undefined, // no list: the field still takes a path
    );
    return () => abort.abort();
  }, []);
  return models;
}

interface FieldProps {
  name: FieldName;
  label: string;
  hint?: string;
  problems: Problems;
  children: (describedBy: string | undefined, invalid: boolean) => ComponentChildren;
}

function Field({ name, label, hint, problems, children }: FieldProps) {
  const id = FIELDS[name];
  const errors = problems.fields[name] ?? [];
  const described = [hint && `${id}-hint`, errors.length && `${id}-error`].filter(Boolean).join(" ") || undefined;
  return (
    <div class={`field${errors.length ? " invalid" : ""}`} data-field={name}>
      <label for={id}>{label}</label>
      {children(described, errors.length > 0)}
      {hint && (
        <small class="hint" id={`${id}-hint`}>
          {hint}
        </small>
      )}
      {errors.length > 0 && (
        <p class="field-error" id={`${id}-error`}>
          {errors.join("; ")}
        </p>
      )}
    </div>
  );
}

function PlanView({ plan }: { plan: JobPlan }) {
  const memory = plan.memory;
  const facts: [string, string][] = [
    ["Steps", `${plan.total_steps} (${plan.steps_per_epoch} per epoch)`],
    ["World size", String(plan.world_size)],
    ["Batch", `${plan.train_batch_size} (${plan.micro_batch_per_gpu} a rank × ${plan.gradient_accumulation_steps} accumulated × ${plan.world_size} ranks)`],
    ["Parameters", `${num(plan.parameters)} (${num(plan.trainable_parameters)} trained)`],
    ["Memory per device", bytes(memory.per_device_bytes)],
    ["Host memory", bytes(memory.per_host_cpu_bytes)],
    ["ZeRO", `stage ${memory.zero_stage}${memory.offload_optimizer ? ", optimizer offloaded" : ""}${memory.offload_param ? ", parameters offloaded" : ""}`],
  ];
  return (
    <section id="plan" aria-labelledby="plan-title">
      <h2 id="plan-title">Plan</h2>
      <dl class="facts">
        {facts.map(([name, value]) => (
          <div>
            <dt>{name}</dt>
            <dd>{value}</dd>
          </div>
        ))}
      </dl>
      <p class="muted">{memory.note}</p>
      <details open>
        <summary>DeepSpeed config{plan.deepspeed_config_chosen ? " (chosen by tuneq)" : ""}, resolved</summary>
        <pre class="json" tabIndex={0}>
          {JSON.stringify(plan.resolved_deepspeed_config, null, 2)}
        </pre>
      </details>
      <details>
        <summary>Dataset</summary>
        <pre class="json" tabIndex={0}>
          {JSON.stringify(plan.dataset_stats, null, 2)}
        </pre>
      </details>
    </section>
  );
}

/** POST /v1/files: the uploaded file's id, which a job's dataset may name. */
async function upload(file: File): Promise<string> {
  const form = new FormData();
  form.append("purpose", "fine-tune");
  form.append("file", file);
  return (await api<{ id: string }>("/v1/files", { method: "POST", body: form })).id;
}

function postJson(body: Record<string, unknown>): RequestInit {
  return { method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" } };
}

function DatasetField({ values, set, problems, setProblems }: FormPart & { setProblems: (p: Problems) => void }) {
  const [uploading, setUploading] = useState(false);
  const chosen = async (input: HTMLInputElement) => {
    const file = input.files?.[0];
    if (!file) return;
    setUploading(true);
    try {
      set("dataset", await upload(file));
      setProblems(NO_PROBLEMS);
    } catch (e) {
      if (!isQuiet(e)) setProblems({ fields: { dataset: [`the upload of ${file.name} was refused: ${message(e)}`] }, other: [] });
    } finally {
      setUploading(false);
      input.value = "";
    }
  };
  return (
    <Field name="dataset" label="Dataset" hint="A path or URI (s3://, https://, hf://), or upload a JSONL file in OpenAI's chat or DPO format." problems={problems}>
      {(describedBy, invalid) => (
        <div class="dataset-inputs">
          <input id={FIELDS.dataset} type="text" value={values.dataset} onInput={(e) => set("dataset", e.currentTarget.value)} aria-describedby={describedBy} aria-invalid={invalid} placeholder="/data/train.jsonl or file-…" />
          <label class="upload">
            {uploading ? "uploading…" : "Upload a file"}
            <input id="submit-upload" type="file" accept=".jsonl,.json" disabled={uploading} onChange={(e) => void chosen(e.currentTarget)} />
          </label>
        </div>
      )}
    </Field>
  );
}

interface FormPart {
  values: Values;
  set: (name: FieldName, value: string) => void;
  problems: Problems;
}

function TextField({ name, label, hint, values, set, problems, ...input }: FormPart & { name: FieldName; label: string; hint?: string; inputMode?: "numeric" | "decimal"; placeholder?: string; list?: string }) {
  return (
    <Field name={name} label={label} hint={hint} problems={problems}>
      {(describedBy, invalid) => (
        <input id={FIELDS[name]} type="text" value={values[name]} onInput={(e) => set(name, e.currentTarget.value)} aria-describedby={describedBy} aria-invalid={invalid} {...input} />
      )}
    </Field>
  );
}

function TrainingFields(part: FormPart) {
  const { values, set, problems } = part;
  return (
    <fieldset>
      <legend>Training</legend>
      <Field name="training.method" label="Method" problems={problems}>
        {(describedBy, invalid) => (
          <select id={FIELDS["training.method"]} value={values["training.method"]} onChange={(e) => set("training.method", e.currentTarget.value)} aria-describedby={describedBy} aria-invalid={invalid}>
            <option value="sft">sft (supervised)</option>
            <option value="dpo">dpo (preference pairs)</option>
          </select>
        )}
      </Field>
      <TextField {...part} name="training.epochs" label="Epochs" inputMode="numeric" />
      <TextField {...part} name="training.max_steps" label="Max steps" hint="Overrides epochs." inputMode="numeric" placeholder="none" />
      <TextField {...part} name="training.learning_rate" label="Learning rate" inputMode="decimal" placeholder="5e-5" />
      <TextField {...part} name="training.max_seq_length" label="Max sequence length" inputMode="numeric" placeholder="the model's" />
      <TextField {...part} name="training.validation_split" label="Validation split" hint="A share held out for eval_loss, e.g. 0.1." inputMode="decimal" placeholder="none" />
      <Field name="training.lora" label="LoRA adapters (r 8) instead of every weight" problems={problems}>
        {(describedBy, invalid) => (
          <input id={FIELDS["training.lora"]} type="checkbox" checked={values["training.lora"] === "on"} onChange={(e) => set("training.lora", e.currentTarget.checked ? "on" : "")} aria-describedby={describedBy} aria-invalid={invalid} />
        )}
      </Field>
    </fieldset>
  );
}

export function SubmitView() {
  const models = useBaseModels();
  const [values, setValues] = useState<Values>(START);
  const [problems, setProblems] = useState<Problems>(NO_PROBLEMS);
  const [plan, setPlan] = useState<{ plan: JobPlan; body: string } | null>(null);
  const [busy, setBusy] = useState(false);
  const set = (name: FieldName, value: string) => setValues((old) => ({ ...old, [name]: value }));
  const built = jobBody(values);
  const current = "body" in built ? JSON.stringify(built.body) : null;
  const planned = plan !== null && plan.body === current; // a change since the plan asks for a new one

  const send = async (path: string): Promise<unknown> => {
    if (!("body" in built)) {
      setProblems(built.problems);
      return undefined;
    }
    setBusy(true);
    try {
      const answer = await api<unknown>(path, postJson(built.body));
      setProblems(NO_PROBLEMS);
      return answer;
    } catch (e) {
      if (!isQuiet(e)) setProblems(problemsOf(e));
      return undefined;
    } finally {
      setBusy(false);
    }
  };
  const planJob = async (event: Event) => {
    event.preventDefault();
    setPlan(null);
    const answer = (await send("/jobs/plan")) as JobPlan | undefined;
    if (answer && current) setPlan({ plan: answer, body: current });
  };
  const submitJob = async () => {
    const job = (await send("/jobs")) as Job | undefined;
    if (job) location.hash = jobHash(job.id);
  };
  const part = { values, set, problems };
  return (
    <main id="submit-view">
      <h1>New job</h1>
      <form id="submit-form" onSubmit={planJob} noValidate>
        <TextField {...part} name="name" label="Name" placeholder="optional" />
        <TextField {...part} name="model" label="Model" hint="A base model this deployment offers, a model directory's path, a hub id or job:<id>." list="base-models" placeholder={models[0] ?? "/models/…"} />
        <datalist id="base-models">
          {models.map((m) => (
            <option value={m} />
          ))}
        </datalist>
        <DatasetField {...part} setProblems={setProblems} />
        <TextField {...part} name="num_gpus" label="GPUs (or CPU ranks) per node" inputMode="numeric" />
        <TrainingFields {...part} />
        <Field name="deepspeed_config" label="DeepSpeed config (JSON, optional)" hint="Left empty, tuneq chooses one for the model and the workers." problems={problems}>
          {(describedBy, invalid) => (
            <textarea id={FIELDS.deepspeed_config} rows={6} spellcheck={false} value={values.deepspeed_config} onInput={(e) => set("deepspeed_config", e.currentTarget.value)} aria-describedby={describedBy} aria-invalid={invalid} placeholder='{"zero_optimization": {"stage": 2}, …}' />
          )}
        </Field>
        {problems.other.length > 0 && (
          <ul class="error" id="submit-problems" role="alert">
            {problems.other.map((p) => (
              <li>{p}</li>
            ))}
          </ul>
        )}
        {Object.keys(problems.fields).length > 0 && (
          <p class="error" role="alert" id="submit-field-alert">
            Fix the fields marked below their inputs.
          </p>
        )}
        <div class="controls">
          <button type="submit" id="plan-button" disabled={busy}>
            Plan
          </button>
          <button type="button" id="submit-button" disabled={busy || !planned} onClick={() => void submitJob()}>
            Submit
          </button>
          <span class="muted">{planned ? "Planned: submit it, or change it and plan again." : "Plan the job first: nothing runs yet."}</span>
        </div>
      </form>
      {plan && planned && <PlanView plan={plan.plan} />}
    </main>
  );
}
