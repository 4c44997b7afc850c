// The job's files in the artifact store, a group per checkpoint (and the model, the log), each
// file a download link through GET /jobs/<id>/artifacts/<path>.

import { downloadThroughLink, storedKey } from "./api";
import { bytes } from "./format";
import type { Artifact } from "./types";

function group(artifacts: Artifact[]): [string, Artifact[]][] {
  const groups = new Map<string, Artifact[]>();
  for (const artifact of artifacts) {
    const name = artifact.kind === "log" ? "log" : `${artifact.kind} · step ${artifact.step ?? "?"}`;
    groups.set(name, [...(groups.get(name) ?? []), artifact]);
  }
  return [...groups.entries()];
}

export function artifactUrl(jobId: string, path: string): string {
  return `/jobs/${jobId}/artifacts/${path.split("/").map(encodeURIComponent).join("/")}`;
}

function FileLink({ jobId, artifact }: { jobId: string; artifact: Artifact }) {
  const href = artifactUrl(jobId, artifact.path);
  const name = artifact.path.split("/").pop() ?? artifact.path;
  // With auth on, a plain link cannot send the key: the browser follows a short-lived link instead.
  const click = (event: MouseEvent) => {
    if (!storedKey()) return;
    event.preventDefault();
    void downloadThroughLink(jobId, artifact.path, name);
  };
  return (
    <a href={href} download={name} onClick={click}>
      {artifact.path}
    </a>
  );
}

export function Artifacts({ jobId, artifacts }: { jobId: string; artifacts: Artifact[] }) {
  return (
    <section aria-labelledby="artifacts-title">
      <h2 id="artifacts-title">Checkpoints and files</h2>
      {!artifacts.length && <p class="empty">No files yet.</p>}
      <ul id="artifacts" class="artifacts">
        {group(artifacts).map(([name, files]) => (
          <li data-group={name}>
            <details>
              <summary>
                {name} · {bytes(files.reduce((n, f) => n + f.size, 0))} · {files.length} files
              </summary>
              <ul>
                {files.map((artifact) => (
                  <li>
                    <FileLink jobId={jobId} artifact={artifact} /> <span class="muted">{bytes(artifact.size)}</span>
                  </li>
                ))}
              </ul>
            </details>
          </li>
        ))}
      </ul>
    </section>
  );
}
