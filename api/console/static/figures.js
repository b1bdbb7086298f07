// Live figures: polls /console/figures.json (the numbers of GET /metrics) and redraws the
// table and a small chart per figure, without reloading the page. No library, no network
// beyond this origin.
"use strict";

const EVERY_MS = 5000;
const KEEP = 60; // points per chart: five minutes at one every five seconds
const CHARTS = [
  ["Messages in queue", (s) => pick(s, "orderly_messages", { state: "IN_QUEUE" })],
  ["Messages processing", (s) => pick(s, "orderly_messages", { state: "PROCESSING" })],
  ["Messages OK", (s) => pick(s, "orderly_messages", { state: "OK" })],
  ["Messages FAILED", (s) => pick(s, "orderly_messages", { state: "FAILED" })],
  ["Conversations open", (s) => pick(s, "orderly_conversations_open", {})],
  ["Conversations blocked", (s) => pick(s, "orderly_conversations_blocked", {})],
  ["Broker tasks waiting", (s) => pick(s, "orderly_queue_depth", {})],
  ["Deliveries pending", (s) => pick(s, "orderly_deliveries", { state: "PENDING" })],
  ["Dead letters", (s) => pick(s, "orderly_deliveries_dead_lettered", {})],
  ["Workers alive", (s) => pick(s, "orderly_workers_alive", {})],
];
const history = CHARTS.map(() => []);

// The sum of the samples of that name whose labels include ``labels``; null when none.
function pick(samples, name, labels) {
  let total = null;
  for (const s of samples) {
    if (s.name !== name) continue;
    if (!Object.entries(labels).every(([k, v]) => s.labels[k] === v)) continue;
    total = (total || 0) + s.value;
  }
  return total;
}

function el(tag, attrs, text) {
  const ns = tag === "svg" || tag === "polyline" ? "http://www.w3.org/2000/svg" : null;
  const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawCharts() {
  const box = document.getElementById("charts");
  box.replaceChildren();
  CHARTS.forEach(([title], i) => {
    const points = history[i];
    const now = points.length ? points[points.length - 1] : null;
    const figure = el("figure", { class: "chart" });
    const low = Math.min(...points, 0);
    const high = Math.max(...points, 1);
    const label = now === null ? `${title}: no value` : `${title}: ${now} now, between ${low} and ${high} over the last ${points.length} readings`;
    const svg = el("svg", { viewBox: "0 0 120 36", role: "img", "aria-label": label });
    // The readings so far across the whole width (one reading: a flat line).
    const shown = points.length === 1 ? [points[0], points[0]] : points;
    const coords = shown.map((v, j) => {
      const x = (j * 120) / (shown.length - 1);
      const y = 34 - ((v - low) / (high - low || 1)) * 32;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    if (coords.length) svg.appendChild(el("polyline", { points: coords.join(" "), fill: "none", class: "line" }));
    figure.appendChild(svg);
    figure.appendChild(el("figcaption", {}, `${title}: ${now === null ? "–" : now}`));
    box.appendChild(figure);
  });
}

function drawTable(samples) {
  const body = document.querySelector("#figures tbody");
  body.replaceChildren(
    ...samples.map((s) => {
      const row = el("tr");
      row.appendChild(el("td", {}, s.name));
      row.appendChild(el("td", {}, Object.entries(s.labels).map(([k, v]) => `${k}=${v}`).join(" ")));
      row.appendChild(el("td", { class: "num" }, String(s.value)));
      return row;
    }),
  );
}

async function refresh() {
  const status = document.getElementById("updated");
  const trouble = document.getElementById("trouble"); // announced: only failures
  try {
    const answer = await fetch("/console/figures.json", { credentials: "same-origin", cache: "no-store" });
    if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
    const { samples } = await answer.json();
    CHARTS.forEach(([, read], i) => {
      const v = read(samples);
      if (v === null) return;
      history[i].push(v);
      if (history[i].length > KEEP) history[i].shift();
    });
    drawTable(samples);
    drawCharts();
    status.textContent = `Updated ${new Date().toLocaleTimeString()}.`;
    trouble.textContent = "";
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  } catch (err) {
    trouble.textContent = `Could not update: ${err.message}.`;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("every").textContent = String(EVERY_MS / 1000);
  refresh();
  setInterval(refresh, EVERY_MS);
});
