// Live lists: a page with a "Live" button refreshes its [data-live] parts (each with an id)
// every few seconds from the same address, without a reload; the button pauses and resumes.
// A refresh is skipped while a form field of the page has the focus (nothing typed is lost)
// or the tab is hidden. No library, no network beyond this origin.
"use strict";

function liveParts(doc) {
  return [...doc.querySelectorAll("[data-live][id]")];
}

async function refresh(status) {
  const answer = await fetch(window.location.href, { credentials: "same-origin", headers: { "X-Orderly-Live": "1" } });
  if (!answer.ok) {
    status.textContent = `not refreshed: the console answered ${answer.status}`;
    return;
  }
  const fresh = new DOMParser().parseFromString(await answer.text(), "text/html");
  for (const part of liveParts(document)) {
    const found = fresh.getElementById(part.id);
    // only what changed is replaced: a part as it was keeps its elements (and the focus)
    if (found && found.innerHTML !== part.innerHTML) part.replaceChildren(...found.childNodes);
  }
  status.textContent = `refreshed at ${new Date().toLocaleTimeString()}`;
}

function start() {
  const button = document.querySelector("button.live-toggle");
  const status = document.querySelector(".live-status");
  if (!button || !status || !liveParts(document).length) return;
  const every = Number(button.dataset.everyMs) || 5000;
  let timer = null;
  const tick = async () => {
    const typing = document.activeElement && document.activeElement.matches("input, select, textarea");
    if (!document.hidden && !typing) {
      try {
        await refresh(status);
      } catch (err) {
        status.textContent = `not refreshed: ${err}`;
      }
    }
  };
  const set = (on) => {
    button.setAttribute("aria-pressed", on ? "true" : "false");
    button.textContent = on ? "Live: on" : "Live: paused";
    if (timer) clearInterval(timer);
    timer = on ? setInterval(tick, every) : null;
  };
  button.addEventListener("click", () => set(button.getAttribute("aria-pressed") !== "true"));
  set(true);
}

document.addEventListener("DOMContentLoaded", start);
