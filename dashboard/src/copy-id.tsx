// A job's short id (its first 8 characters) with a button that copies the whole id.

import { useState } from "preact/hooks";
import { shortId } from "./format";

async function copyText(text: string): Promise<void> {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  // Plain http on another host has no clipboard API: the old way still works there.
  const area = document.createElement("textarea");
  area.value = text;
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

export function CopyId({ id }: { id: string }) {
  const [copied, setCopied] = useState(false);
  const copy = () =>
    copyText(id).then(
      () => {
        setCopied(true);
        setTimeout(() => setCopied(false), 1500);
      },
      () => setCopied(false),
    );
  return (
    <span class="copy-id">
      <code title={id}>{shortId(id)}</code>
      <button type="button" class="small" onClick={copy} aria-label={`Copy job id ${id}`}>
        {copied ? "copied" : "copy"}
      </button>
    </span>
  );
}
