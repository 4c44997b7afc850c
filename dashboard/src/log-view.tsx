// The job's log: its tail, then each new line as the worker records it (GET .../logs?follow=true),
// filtered by a search, and downloadable whole.

import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import { api, downloadThroughLink, isQuiet, message, readLines, saveBlob } from "./api";
import type { Artifact } from "./types";

const TAIL = 1000; // lines read at first
const KEEP = 20_000; // lines kept in the page
const WHOLE = 10_000; // the server's TUNEQ_MAX_LOG_TAIL default: the most a download without the log file gets

export function LogView({ jobId, logArtifact }: { jobId: string; logArtifact: Artifact | undefined }) {
  const [lines, setLines] = useState<string[]>([]);
  const [search, setSearch] = useState("");
  const [error, setError] = useState<string | null>(null);
  const box = useRef<HTMLPreElement>(null);
  const follow = useRef(true);

  useEffect(() => {
    const abort = new AbortController();
    setLines([]);
    readLines(`/jobs/${jobId}/logs?tail=${TAIL}&follow=true`, abort.signal, (more) =>
      setLines((old) => [...old, ...more].slice(-KEEP)),
    ).catch((e) => isQuiet(e) || setError(message(e)));
    return () => abort.abort();
  }, [jobId]);

  const shown = useMemo(() => {
    const needle = search.trim().toLowerCase();
    return needle ? lines.filter((line) => line.toLowerCase().includes(needle)) : lines;
  }, [lines, search]);

  useEffect(() => {
    const element = box.current;
    if (element && follow.current) element.scrollTop = element.scrollHeight; // follow unless scrolled up
  }, [shown]);

  const onScroll = () => {
    const element = box.current;
    if (element) follow.current = element.scrollTop + element.clientHeight >= element.scrollHeight - 8;
  };

  const download = async () => {
    try {
      if (logArtifact) return await downloadThroughLink(jobId, logArtifact.path, `${jobId}.log`);
      const answer = await api<{ lines: string[] }>(`/jobs/${jobId}/logs?tail=${WHOLE}`);
      saveBlob(new Blob([answer.lines.join("\n") + "\n"], { type: "text/plain" }), `${jobId}.log`);
    } catch (e) {
      setError(message(e));
    }
  };

  return (
    <section aria-labelledby="log-title">
      <h2 id="log-title">Log</h2>
      <div class="log-tools">
        <label>
          Search <input id="log-search" type="search" value={search} onInput={(e) => setSearch(e.currentTarget.value)} />
        </label>
        <span class="muted" id="log-count">
          {search ? `${shown.length} of ${lines.length} lines` : `${lines.length} lines`}
        </span>
        <button type="button" id="log-download" onClick={download}>
          Download
        </button>
      </div>
      {error && <p class="error">{error}</p>}
      <pre id="log" class="log" role="log" ref={box} onScroll={onScroll} tabIndex={0} aria-label="Job log">
        {shown.join("\n")}
      </pre>
    </section>
  );
}
