// Bundles src/ into the files the API serves (api/dashboard/static/ unless --outdir says):
// app.js and app.css from src/main.tsx (uPlot's styles included), and public/ copied as is.
// The output is committed, so neither a running service nor `pip install` needs Node; the
// test tests/api/test_dashboard_build.py rebuilds it and checks it matches.
import { build } from "esbuild";
import { cpSync, mkdirSync, rmSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const flag = process.argv.indexOf("--outdir");
const outdir = flag >= 0 ? resolve(process.argv[flag + 1]) : resolve(here, "../api/dashboard/static");

rmSync(outdir, { recursive: true, force: true });
mkdirSync(outdir, { recursive: true });
await build({
  entryPoints: { app: resolve(here, "src/main.tsx") },
  outdir,
  bundle: true,
  minify: true,
  format: "iife",
  target: ["es2022", "chrome110", "firefox115", "safari16"],
  jsx: "automatic",
  jsxImportSource: "preact",
  legalComments: "eof", // uPlot's and Preact's MIT notices stay with their code
  charset: "utf8",
  logLevel: "warning",
});
cpSync(resolve(here, "public"), outdir, { recursive: true });
