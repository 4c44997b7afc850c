// Each view has a URL (a hash route, so the API's own paths stay free):
//   #/jobs?status=running&sort=-created_at&page=2   the jobs list, its filters and page
//   #/jobs/<id>                                       one job

export type Route = { view: "jobs"; params: URLSearchParams } | { view: "job"; id: string };

export function parseHash(hash: string): Route {
  const [path, query = ""] = hash.replace(/^#/, "").split("?", 2);
  const job = path.match(/^\/jobs\/([^/]+)$/);
  if (job) return { view: "job", id: decodeURIComponent(job[1]) };
  return { view: "jobs", params: new URLSearchParams(query) };
}

export function jobsHash(params: URLSearchParams): string {
  const query = params.toString();
  return query ? `#/jobs?${query}` : "#/jobs";
}

export function jobHash(id: string): string {
  return `#/jobs/${id}`;
}

export const UUID_PATTERN = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;
