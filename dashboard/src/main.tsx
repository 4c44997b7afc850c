// tuneq's dashboard: the jobs list, a page per job, a comparison of jobs, the workers and queues,
// and a form for a new job, chosen by the URL's hash (route.ts).
// Every call goes to the same HTTP API any client uses; no CDN, so it works offline.

import "uplot/dist/uPlot.min.css";
import "./app.css";
import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { onUnauthorized, storedKey, storeKey } from "./api";
import { Compare } from "./compare";
import { JobPage } from "./job-page";
import { JobsList } from "./jobs-list";
import { parseHash, type Route } from "./route";
import { SubmitView } from "./submit";
import { WorkersView } from "./workers";

const TITLES = { jobs: "jobs", compare: "compare", workers: "workers and queues", submit: "new job" } as const;

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

function View({ route, attempt }: { route: Route; attempt: number }) {
  switch (route.view) {
    case "job":
      return <JobPage key={`${route.id}/${attempt}`} id={route.id} />;
    case "compare":
      return <Compare key={`${route.ids.join(",")}/${attempt}`} ids={route.ids} />;
    case "workers":
      return <WorkersView key={attempt} />;
    case "submit":
      return <SubmitView key={attempt} />;
    default:
      return <JobsList key={attempt} params={route.params} />;
  }
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
    document.title = route.view === "job" ? `tuneq · job ${route.id.slice(0, 8)}` : `tuneq · ${TITLES[route.view]}`;
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
          <a href="#/workers" aria-current={route.view === "workers" ? "page" : undefined}>
            Workers
          </a>
          <a href="#/submit" aria-current={route.view === "submit" ? "page" : undefined}>
            New job
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
      <View route={route} attempt={attempt} />
    </>
  );
}

render(<App />, document.getElementById("app")!);
