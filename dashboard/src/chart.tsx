// A uPlot line chart over steps: a live legend with the values under the cursor, drag to zoom
// (double-click to zoom out), and a log-scale switch for measures that span decades.

import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import uPlot from "uplot";
import { num } from "./format";
import type { Metric } from "./types";

export interface SeriesSpec {
  key: string; // the metric's name as GET /jobs/<id>/metrics answers it (TRL's for DPO: rewards/chosen)
  label: string;
  color?: string; // default: the chart's palette, by the series' place
}

const COLORS = ["#1e88e5", "#e53935", "#43a047", "#fb8c00", "#8e24aa"];
const HEIGHT = 220;

/** The page's color scheme, following the system's as it changes. */
export function useDarkMode(): boolean {
  const query = useMemo(() => window.matchMedia("(prefers-color-scheme: dark)"), []);
  const [dark, setDark] = useState(query.matches);
  useEffect(() => {
    const changed = () => setDark(query.matches);
    query.addEventListener("change", changed);
    return () => query.removeEventListener("change", changed);
  }, [query]);
  return dark;
}

function cssColor(name: string): string {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

function columns(rows: Metric[], series: SeriesSpec[], log: boolean): (number | null)[][] {
  return series.map((s) =>
    rows.map((row) => {
      const value = row[s.key];
      if (typeof value !== "number" || !Number.isFinite(value)) return null;
      return log && value <= 0 ? null : value; // a log axis has no place for zero or less
    }),
  );
}

function options(series: SeriesSpec[], width: number, log: boolean, onZoom: () => void): uPlot.Options {
  const text = cssColor("--muted");
  const grid = cssColor("--grid");
  const axis: uPlot.Axis = { stroke: text, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 } };
  return {
    width,
    height: HEIGHT,
    scales: { x: { time: false }, y: { distr: log ? 3 : 1 } },
    axes: [
      { ...axis, label: "step", labelSize: 18, size: 32 },
      { ...axis, size: 64, values: (_u, ticks) => ticks.map((tick) => num(tick)) },
    ],
    series: [
      { label: "step", value: (_u, v) => (v === null || v === undefined ? "–" : String(v)) },
      ...series.map((s, i) => ({
        label: s.label,
        stroke: s.color ?? COLORS[i % COLORS.length],
        width: 1.5,
        spanGaps: true, // an eval measure is reported every few steps only
        value: (_u: uPlot, v: number | null) => num(v),
      })),
    ],
    cursor: { drag: { x: true, y: false, setScale: true } },
    legend: { live: true },
    hooks: { setSelect: [(u) => u.select.width > 0 && onZoom()] },
  };
}

interface ChartProps {
  id: string;
  title: string;
  rows: Metric[];
  series: SeriesSpec[];
  logOption?: boolean;
}

export function Chart({ id, title, rows, series, logOption = false }: ChartProps) {
  const holder = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const zoomed = useRef(false);
  const [log, setLog] = useState(false);
  const dark = useDarkMode();
  const values = useMemo(() => columns(rows, series, log), [rows, series, log]);
  const data = useMemo((): uPlot.AlignedData => [rows.map((row) => row.step), ...values], [rows, values]);
  const points = values.reduce((n, column) => n + column.filter((v) => v !== null).length, 0);

  // (Re)made when the scale or the color scheme changes; fed new data below.
  useEffect(() => {
    const element = holder.current;
    if (!element) return;
    zoomed.current = false;
    const chart = new uPlot(options(series, element.clientWidth || 400, log, () => (zoomed.current = true)), data, element);
    plot.current = chart;
    const unzoom = () => (zoomed.current = false);
    chart.over.addEventListener("dblclick", unzoom);
    const resize = new ResizeObserver(() => chart.setSize({ width: element.clientWidth, height: HEIGHT }));
    resize.observe(element);
    return () => {
      resize.disconnect();
      chart.destroy();
      plot.current = null;
    };
    // eslint-disable-next-line react-hooks/exhaustive-deps -- data arrives through setData
  }, [series, log, dark]);

  useEffect(() => {
    plot.current?.setData(data, !zoomed.current); // a zoomed-in view stays where the user put it
  }, [data]);

  const latest = series.map((s, i) => `${s.label} ${num(values[i].findLast((v) => v !== null))}`).join(", ");
  return (
    <figure class="chart" id={id} data-points={points} aria-label={`${title}: ${points ? latest : "no points yet"}`}>
      <figcaption>
        <span>{title}</span>
        {logOption && (
          <label class="log-toggle">
            <input type="checkbox" checked={log} onChange={(e) => setLog(e.currentTarget.checked)} /> log scale
          </label>
        )}
      </figcaption>
      <div class="plot" ref={holder} />
      {!points && <p class="empty">No points yet.</p>}
    </figure>
  );
}
