// tuneq's dashboard: the jobs list and a page per job, chosen by the URL's hash (route.ts).
// Every call goes to the same HTTP API any client uses; no CDN, so it works offline.

import "uplot/dist/uPlot.min.css";
import "./app.css";
import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { onUnauthorized, storedKey, storeKey } from "./api";
import { JobPage } from "./job-page";
import { JobsList } from "./jobs-list";
import { parseHash, type Route } from "./route";

function KeyForm({ onSaved }: { onSaved: () => void }) {
  const [key, setKey] = useState(storedKey() ?? "");
  const save = (event: Event) => {
    event.preventDefault();
    storeKey(key.trim());
    onSaved();
  };
  return (
    <form id="key-form" onSubmit={save}>
      <label for="api-key">This API needs a key</label>
      <input id="api-key" type="password" autocomplete="off" placeholder="API key" value={key} onInput={(e) => setKey(e.currentTarget.value)} />
      <button type="submit">Save</button>
    </form>
  );
}

function App() {
  const [route, setRoute] = useState<Route>(parseHash(location.hash));
  const [needsKey, setNeedsKey] = useState(false);
  const [attempt, setAttempt] = useState(0); // bumped to retry the view with a new key
  useEffect(() => {
    const changed = () => setRoute(parseHash(location.hash));
    window.addEventListener("hashchange", changed);
    const unsubscribe = onUnauthorized(() => setNeedsKey(true));
    return () => {
      window.removeEventListener("hashchange", changed);
      unsubscribe();
    };
  }, []);
  useEffect(() => {
    document.title = route.view === "job" ? `tuneq · job ${route.id.slice(0, 8)}` : "tuneq · jobs";
  }, [route]);
  return (
    <>
      <header class="top">
        <a href="#/jobs" class="brand">
          tuneq
        </a>
        <nav aria-label="Views">
          <a href="#/jobs" aria-current={route.view === "jobs" ? "page" : undefined}>
            Jobs
          </a>
          <a href="/docs">API</a>
        </nav>
      </header>
      {needsKey && (
        <KeyForm
          onSaved={() => {
            setNeedsKey(false);
            setAttempt((n) => n + 1);
          }}
        />
      )}
      {route.view === "job" ? (
        <JobPage key={`${route.id}/${attempt}`} id={route.id} />
      ) : (
        <JobsList key={attempt} params={route.params} />
      )}
    </>
  );
}

render(<App />, document.getElementById("app")!);
