// Each view has a URL (a hash route, so the API's own paths stay free):
//   #/jobs?status=running&sort=-created_at&page=2   the jobs list, its filters and page
//   #/jobs/<id>                                       one job
//   #/compare?jobs=<id>,<id>,...                      several jobs' curves on one chart per measure
//   #/workers                                         the workers, the queues and the waiting gangs
//   #/submit                                          a form for a new job: plan it, then submit it

export type Route =
  | { view: "jobs"; params: URLSearchParams }
  | { view: "job"; id: string }
  | { view: "compare"; ids: string[] }
  | { view: "workers" }
  | { view: "submit" };

export function parseHash(hash: string): Route {
  const [path, query = ""] = hash.replace(/^#/, "").split("?", 2);
  const job = path.match(/^\/jobs\/([^/]+)$/);
  if (job) return { view: "job", id: decodeURIComponent(job[1]) };
  if (path === "/compare") return { view: "compare", ids: compareIds(new URLSearchParams(query)) };
  if (path === "/workers") return { view: "workers" };
  if (path === "/submit") return { view: "submit" };
  return { view: "jobs", params: new URLSearchParams(query) };
}

function compareIds(params: URLSearchParams): string[] {
  const ids = (params.get("jobs") ?? "").split(",").map((id) => id.trim());
  return [...new Set(ids.filter(Boolean))];
}

export function jobsHash(params: URLSearchParams): string {
  const query = params.toString();
  return query ? `#/jobs?${query}` : "#/jobs";
}

export function jobHash(id: string): string {
  return `#/jobs/${id}`;
}

export function compareHash(ids: string[]): string {
  return `#/compare?jobs=${ids.map(encodeURIComponent).join(",")}`;
}

export const UUID_PATTERN = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
